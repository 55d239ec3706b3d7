"""Choosing the wire codecs and the schedule from what the stages measured. Pure.

``compression: "auto"`` and ``micro_batches: "auto"`` are decided here, by the last stage of
an attempt, from every boundary's measured link (:class:`~silentswarm.types.links.LinkStats`)
and every stage's measured work per step (its step time less the time it waited on its peers,
at each micro-batch count it ran, fitted by :func:`fit_cost`); the decision travels back up
the chain (:mod:`silentswarm.agent.runtime.calibrate`). One model predicts a step's time:
:func:`~silentswarm.agent.runtime.schedule.step_period` with each stage's fitted work per
micro-batch and, per boundary crossing, the one-way delay plus the codec's transfer (under the
``overlap`` schedule, :func:`~silentswarm.agent.runtime.schedule.overlapped_period`).

- **Codecs.** The fewest bytes are not the goal, the least loss that keeps up is: the
  directions the tuner chooses start at the fewest bytes and, in turns, each moves to a less
  lossy codec of :data:`AUTO_CODECS` while the predicted step stays within :data:`NEAR_BEST`
  of the step with the fewest bytes everywhere. A transfer well under the compute hides;
  one near it still costs the step its fill and drain, which the model sees and a bare
  bandwidth budget does not (measured: fp16 at 20 Mbit/s fit "under the compute" and kept
  0.8 of loopback's speed, fixed_int8 0.94).
- **Micro-batches and the forward window** (only under ``micro_batches: "auto"``, whose memory
  estimate holds a whole batch's activations; a spec's own count and window are kept): every
  divisor of the batch, each with the smallest window within :data:`NEAR_BEST` of its best;
  the fewest micro-batches within :data:`NEAR_BEST` of the best win. Until a stage has run two
  counts its fixed cost per micro-batch is unknown and a count is at most doubled. The
  schedule in force is kept unless another is predicted :data:`KEEP_UNLESS` faster: a new
  count costs a compilation of its shape.
- **Deferred weight gradients** (only under ``defer_weight_grads: "auto"``, chosen last, for
  the codecs and schedule chosen): every count from 0 to ``m - 1``; the fewest within
  :data:`DEFER_NEAR` of the best. A deferred micro-batch's input gradient costs
  :data:`INPUT_GRAD_SHARE` of the last stage's whole call, and its weights' pass the whole
  call again, after the step's last backward: worth it where the step waits for the last
  gradient's round trip (a slow link), never on one where it does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from silentswarm.agent.pipe.wire import encoded_nbytes
from silentswarm.agent.runtime.schedule import (
    OpTimes,
    one_f_one_b,
    overlapped_period,
    step_period,
)
from silentswarm.compression import CodecKind, WireCodec
from silentswarm.types.links import LinkStats

# Least lossy first: what compression "auto" picks from.
AUTO_CODECS: tuple[WireCodec, ...] = (
    WireCodec(CodecKind.NONE, 32),
    WireCodec(CodecKind.FP16, 16),
    WireCodec(CodecKind.INT, 8),
    WireCodec(CodecKind.INT, 4),
)
NEAR_BEST = 0.03  # a schedule this close to the best predicted one is as good
KEEP_UNLESS = 0.05  # the schedule in force stays unless another is predicted this much faster
MAX_AUTO_MICRO_BATCHES = 64
BACKWARD_SHARE = 2 / 3  # of a stage's compute per sample, for the model of its ops
# The last stage's call for the input's gradient alone, against its whole call (forward,
# loss, backward, accumulation): 21.2 ms against 31.5 on the speed model (2026-12-05).
INPUT_GRAD_SHARE = 0.67
DEFER_NEAR = 0.005  # a deferral count this close to the best predicted one is as good
MBIT = 1e6 / 8  # bytes per second in one Mbit/s


def undeferred_busy(busy_s: float, micro_batches: int, deferred: int) -> float:
    """A last stage's seconds of work in a step less what its ``deferred`` passes added (one
    input-gradient call each, about :data:`INPUT_GRAD_SHARE` of a micro-batch's whole call):
    the work the model's costs are fitted to, which adds deferral's itself."""
    return busy_s * micro_batches / (micro_batches + INPUT_GRAD_SHARE * deferred)


def wire_bytes_per_sample(codec: WireCodec, seq_len: int, dims: int) -> int:
    """Bytes one sample's boundary tensor takes on the wire (no frame header): a row per
    position, as the frames encode it."""
    return encoded_nbytes(codec, (seq_len, dims))


@dataclass(frozen=True)
class StageCost:
    """A stage's seconds of work per step at ``m`` micro-batches: ``per_step + m * per_micro``.

    ``per_micro`` is each micro-batch's fixed cost (dispatch, framing, small-op
    inefficiency), fitted once the stage has run at two counts; until then it is unknown
    (``explore`` is the count measured) and taken as 0."""

    per_step: float
    per_micro: float = 0.0
    explore: int | None = None

    def micro_s(self, m: int) -> float:
        """Seconds of work per micro-batch at ``m`` micro-batches."""
        return self.per_step / m + self.per_micro


def fit_cost(points: Sequence[tuple[int, float]]) -> StageCost | None:
    """Least squares of ``busy = per_step + m * per_micro`` over (m, busy seconds per step)
    points, both terms kept >= 0; None without a point."""
    if not points:
        return None
    ms = sorted({m for m, _ in points})
    mean_m = sum(m for m, _ in points) / len(points)
    mean_b = sum(b for _, b in points) / len(points)
    if len(ms) == 1:
        return StageCost(per_step=mean_b, explore=ms[0])
    var = sum((m - mean_m) ** 2 for m, _ in points)
    slope = sum((m - mean_m) * (b - mean_b) for m, b in points) / var
    slope = max(0.0, slope)
    intercept = mean_b - slope * mean_m
    if intercept <= 0:  # all overhead: keep the work per micro-batch as measured
        return StageCost(per_step=0.0, per_micro=mean_b / mean_m)
    return StageCost(per_step=intercept, per_micro=slope)


@dataclass(frozen=True)
class Schedule:
    micro_batches: int
    in_flight: int
    predicted_step_s: float
    codecs: tuple[tuple[WireCodec, WireCodec], ...]


@dataclass(frozen=True)
class TuneInput:
    """What the chain measured and what the plan allows. ``busy``: each stage's (m, seconds
    of work per step) points; ``codecs``: each boundary's ``(forward, backward)`` codecs in
    force; ``auto_fwd``/``auto_bwd``: whether a direction's codec is the tuner's to choose;
    ``in_flight_cap``: the spec's window, the most the tuner may use (None: up to the count)."""

    batch_size: int
    seq_len: int
    dims: int  # values per position on the wire
    links: Sequence[LinkStats]
    busy: Sequence[Sequence[tuple[int, float]]]
    codecs: Sequence[tuple[WireCodec, WireCodec]]
    auto_fwd: bool
    auto_bwd: bool
    micro_batches: int
    in_flight: int
    auto_micro_batches: bool
    in_flight_cap: int | None = None
    overlap: bool = False  # the job's schedule is "overlap": steps run into each other
    target_bytes: int = 0  # bytes of one target id: every forward frame carries a position's
    deferred: int = 0  # the last stage's deferred weight-gradient passes in force
    auto_deferred: bool = False  # whether that count is the tuner's to choose


@dataclass(frozen=True)
class TuneResult:
    codecs: list[tuple[WireCodec, WireCodec]]
    micro_batches: int
    in_flight: int
    predicted_step_s: float | None
    deferred: int = 0


class _Model:
    """The measured chain: each stage's cost and each boundary's link."""

    def __init__(self, inp: TuneInput, costs: list[StageCost]) -> None:
        self.inp = inp
        self.costs = costs

    def fastest(self) -> list[tuple[WireCodec, WireCodec]]:
        """Every direction the tuner chooses at its fewest bytes, the others as they are."""
        inp, last = self.inp, AUTO_CODECS[-1]
        return [
            (last if inp.auto_fwd else fwd, last if inp.auto_bwd else bwd)
            for fwd, bwd in inp.codecs
        ]

    def codecs(self, m: int, window: int) -> tuple[tuple[WireCodec, WireCodec], ...]:
        """Every direction the tuner chooses starts at the fewest bytes; round after round each
        in turn moves one codec less lossy while the predicted step stays within
        :data:`NEAR_BEST` of that fastest one, so no boundary spends the margin alone."""
        inp = self.inp
        chosen = [list(pair) for pair in self.fastest()]
        limit = self.predict(m, window, self.fastest()) * (1 + NEAR_BEST)
        rank = {codec: i for i, codec in enumerate(AUTO_CODECS)}
        directions = [
            (b, d)
            for b in range(len(chosen))
            for d, auto in ((0, inp.auto_fwd), (1, inp.auto_bwd))
            if auto
        ]
        moved = True
        while moved:
            moved = False
            for b, d in directions:
                level = rank[chosen[b][d]]
                if level == 0:
                    continue
                chosen[b][d] = AUTO_CODECS[level - 1]
                if self.predict(m, window, [(f, k) for f, k in chosen]) <= limit:
                    moved = True
                else:
                    chosen[b][d] = AUTO_CODECS[level]
        return tuple((f, k) for f, k in chosen)

    def predict(
        self,
        m: int,
        window: int,
        codecs: Sequence[tuple[WireCodec, WireCodec]],
        deferred: int = 0,
    ) -> float:
        """Predicted seconds per step (:func:`step_period`)."""
        inp, n = self.inp, len(self.costs)
        mb = inp.batch_size / m
        times = []
        for cost in self.costs:
            t = cost.micro_s(m)
            forward = t * (1 - BACKWARD_SHARE)
            times.append(
                OpTimes(forward, t * BACKWARD_SHARE, input_grad=t * INPUT_GRAD_SHARE - forward)
            )
        links, transfers = [], []
        targets = inp.seq_len * inp.target_bytes
        for link, (fwd, bwd) in zip(inp.links, codecs, strict=True):
            delay = link.rtt_ms / 2000
            f = (wire_bytes_per_sample(fwd, inp.seq_len, inp.dims) + targets) * mb
            b = wire_bytes_per_sample(bwd, inp.seq_len, inp.dims) * mb
            transfer = (f / max(link.fwd_mbit_s * MBIT, 1.0), b / max(link.bwd_mbit_s * MBIT, 1.0))
            transfers.append(transfer)
            links.append((delay + transfer[0], delay + transfer[1]))
        if inp.overlap:
            return overlapped_period(
                n, m, window, times, steps=6, link_s=links, transfer_s=transfers
            )
        schedules = [one_f_one_b(s, n, m, window) for s in range(n)]
        return step_period(
            schedules, times, steps=4, link_s=links, deferred=deferred, transfer_s=transfers
        )

    def deferred(
        self, m: int, window: int, codecs: Sequence[tuple[WireCodec, WireCodec]]
    ) -> tuple[int, float]:
        """The fewest deferred weight-gradient passes within :data:`DEFER_NEAR` of the best
        predicted step for this schedule, and that step's predicted seconds."""
        tried = [(k, self.predict(m, window, codecs, k)) for k in range(m)]
        best = min(t for _, t in tried)
        return next((k, t) for k, t in tried if t <= best * (1 + DEFER_NEAR))

    def best_window(self, m: int, cap: int | None) -> Schedule:
        """The smallest window within :data:`NEAR_BEST` of the best for ``m`` (at the fewest
        bytes), with its codecs."""
        fastest = self.fastest()
        tried = [(k, self.predict(m, k, fastest)) for k in _windows(m, cap)]
        best = min(t for _, t in tried)
        window = next(k for k, t in tried if t <= best * (1 + NEAR_BEST))
        codecs = self.codecs(m, window)
        return Schedule(m, window, self.predict(m, window, codecs), codecs)

    def counts(self) -> list[int]:
        """Micro-batch counts to try: divisors of the batch, at most twice a count measured
        while a stage's fixed cost per micro-batch is still unknown."""
        top = min(self.inp.batch_size, MAX_AUTO_MICRO_BATCHES)
        explored = [c.explore for c in self.costs if c.explore is not None]
        if explored:
            top = min(top, 2 * max(explored))
        return [m for m in range(1, top + 1) if self.inp.batch_size % m == 0]


def tune(inp: TuneInput) -> TuneResult:
    """The codecs and schedule to run next; what is in force where nothing was measured."""
    n_stages = len(inp.busy)
    if len(inp.links) != n_stages - 1 or len(inp.codecs) != n_stages - 1:
        raise ValueError(f"{n_stages} stages need {n_stages - 1} links and codec pairs")
    costs = [fit_cost(points) for points in inp.busy]
    if any(c is None for c in costs):
        return TuneResult(list(inp.codecs), inp.micro_batches, inp.in_flight, None, inp.deferred)
    model = _Model(inp, [c for c in costs if c is not None])
    codecs = model.codecs(inp.micro_batches, inp.in_flight)
    schedule = Schedule(
        inp.micro_batches,
        inp.in_flight,
        model.predict(inp.micro_batches, inp.in_flight, codecs),
        codecs,
    )
    if inp.auto_micro_batches:
        per_count = [model.best_window(m, inp.in_flight_cap) for m in model.counts()]
        best = min(s.predicted_step_s for s in per_count)
        chosen = next(s for s in per_count if s.predicted_step_s <= best * (1 + NEAR_BEST))
        if chosen.predicted_step_s < schedule.predicted_step_s * (1 - KEEP_UNLESS):
            schedule = chosen
    m, window = schedule.micro_batches, schedule.in_flight
    if inp.auto_deferred and not inp.overlap:
        deferred, predicted = model.deferred(m, window, schedule.codecs)
    else:
        deferred = min(inp.deferred, m - 1)
        predicted = schedule.predicted_step_s  # the undeferred step's
        if deferred:
            predicted = model.predict(m, window, schedule.codecs, deferred)
    return TuneResult(list(schedule.codecs), m, window, predicted, deferred)


def _windows(micro_batches: int, cap: int | None) -> list[int]:
    """Forward windows worth trying: 1 (1F1B), powers of two, and the micro-batch count."""
    top = micro_batches if cap is None else min(cap, micro_batches)
    out = {1, top}
    k = 2
    while k < top:
        out.add(k)
        k *= 2
    return sorted(out)


__all__ = [
    "AUTO_CODECS",
    "Schedule",
    "StageCost",
    "TuneInput",
    "TuneResult",
    "fit_cost",
    "tune",
    "undeferred_busy",
    "wire_bytes_per_sample",
]
