"""Pipeline schedules as pure functions: which micro-batch a stage runs forward or backward
next. No TensorFlow here, so schedules are unit-tested on their own (including a simulation
proving that every stage's order together never deadlocks)."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from silentswarm.plan import stage_in_flight


class Op(enum.StrEnum):
    FORWARD = "F"
    BACKWARD = "B"


class Step(NamedTuple):
    op: Op
    micro: int


class Slot(NamedTuple):
    """An op of a schedule that runs several steps: ``step`` counts from the first."""

    op: Op
    step: int
    micro: int


def one_f_one_b(
    stage: int, n_stages: int, micro_batches: int, in_flight: int | None = None
) -> list[Step]:
    """1F1B: warm up with forwards, then alternate one forward and one backward, then drain.

    Stage s keeps at most ``n_stages - s`` micro-batches in flight, so activation memory is
    bounded by the pipeline depth rather than by the number of micro-batches (as in GPipe);
    ``in_flight`` raises that (:func:`silentswarm.plan.stage_in_flight`), so that a stage
    keeps computing forwards while the gradients of slow links are on their way.
    """
    if not 0 <= stage < n_stages or micro_batches < 1:
        raise ValueError(f"bad schedule request: stage {stage}/{n_stages}, m={micro_batches}")
    warmup = stage_in_flight(stage, n_stages, micro_batches, in_flight) - 1
    steps = [Step(Op.FORWARD, i) for i in range(warmup)]
    forward, backward = warmup, 0
    while forward < micro_batches:
        steps.append(Step(Op.FORWARD, forward))
        steps.append(Step(Op.BACKWARD, backward))
        forward += 1
        backward += 1
    steps.extend(Step(Op.BACKWARD, b) for b in range(backward, micro_batches))
    return steps


def gpipe(stage: int, n_stages: int, micro_batches: int) -> list[Step]:
    """GPipe: every forward, then every backward."""
    if not 0 <= stage < n_stages or micro_batches < 1:
        raise ValueError(f"bad schedule request: stage {stage}/{n_stages}, m={micro_batches}")
    return [Step(Op.FORWARD, i) for i in range(micro_batches)] + [
        Step(Op.BACKWARD, i) for i in range(micro_batches)
    ]


def ideal_speedup(n_stages: int, micro_batches: int, cores: int) -> float:
    """``min(p, cores) * m / (m + p - 1)``: the bubble-limited speedup over one process."""
    return min(n_stages, cores) * micro_batches / (micro_batches + n_stages - 1)


def bubble_fraction(n_stages: int, micro_batches: int) -> float:
    return (n_stages - 1) / (micro_batches + n_stages - 1)


def max_in_flight(schedule: list[Step]) -> int:
    live, peak = 0, 0
    for step in schedule:
        live += 1 if step.op is Op.FORWARD else -1
        peak = max(peak, live)
    return peak


def simulate(schedules: list[list[Step]]) -> int:
    """Run all stages' schedules against each other with blocking receives.

    Returns the number of time slots taken; raises RuntimeError on a deadlock. A forward of
    micro i on stage s needs stage s-1's forward of i; a backward needs stage s+1's backward
    of i (or, on the last stage, its own forward).
    """
    n = len(schedules)
    position = [0] * n
    done: set[tuple[int, Op, int]] = set()
    slots = 0
    while any(position[s] < len(schedules[s]) for s in range(n)):
        ready = []
        for s in range(n):
            if position[s] >= len(schedules[s]):
                continue
            op, i = schedules[s][position[s]]
            if op is Op.FORWARD:
                ok = s == 0 or (s - 1, Op.FORWARD, i) in done
            else:
                ok = (s, Op.FORWARD, i) in done and (s == n - 1 or (s + 1, Op.BACKWARD, i) in done)
            if ok:
                ready.append((s, op, i))
        if not ready:
            raise RuntimeError(f"deadlock at positions {position}")
        for s, op, i in ready:
            done.add((s, op, i))
            position[s] += 1
        slots += 1
    return slots


def lr_at(step: int, *, base: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to ``base``, then cosine decay to ``base * min_ratio`` at ``total``."""
    if warmup > 0 and step < warmup:
        return base * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class OpTimes(NamedTuple):
    """Seconds one stage spends on each kind of op (measured, e.g. by the pipeline bench).

    ``input_grad``: a backward that computes only the input's gradient, what the last stage
    runs for a micro-batch whose weights' pass it defers (``deferred`` of
    :func:`step_period`); that pass then costs ``forward + backward`` again."""

    forward: float
    backward: float
    apply: float = 0.0
    input_grad: float | None = None


def step_period(
    schedules: list[list[Step]],
    times: list[OpTimes],
    steps: int = 6,
    link_s: float | Sequence[tuple[float, float]] = 0.0,
    deferred: int = 0,
    transfer_s: Sequence[tuple[float, float]] | None = None,
) -> float:
    """Seconds per step of a synchronous pipeline whose stages take ``times``, steady state.

    Every stage runs its schedule in order, each op as soon as the stage is free and the op's
    input exists: a forward of micro i on stage s needs stage s-1's forward of i, a backward
    needs stage s+1's backward of i (on the last stage, its own forward). After its schedule a
    stage applies its optimizer step and starts the next step's schedule, so consecutive steps
    overlap where the schedule allows. The result is the mean of the last ``steps - 1`` step
    intervals (a step ends when every stage has applied). With ``link_s`` 0 there is no
    waiting on links: the ceiling that the schedule's bubble and the stages' own compute
    allow; otherwise every frame takes ``link_s`` seconds (one-way delay plus transfer) to
    cross a boundary, so a schedule's tolerance of slow links can be compared. ``link_s`` may
    also give each boundary its own ``(forward, backward)`` seconds, boundary ``b`` being
    the one between stages ``b`` and ``b + 1``. ``transfer_s``, per boundary and direction
    too, is the part of a crossing that occupies the link (the bytes at its rate; the rest is
    delay): frames in one direction queue behind each other for it, so a link that carries
    less than the stages produce sets the pace (None: frames never queue).

    ``deferred``: the last stage's backwards of a step's last ``deferred`` micro-batches
    compute only the input's gradient (``input_grad`` seconds), and their weights' passes
    (``forward + backward`` each) run after the step's last backward, before the apply.
    """
    n = len(schedules)
    if n != len(times) or n == 0 or steps < 2:
        raise ValueError("one OpTimes per schedule, and at least two steps")
    if deferred and times[-1].input_grad is None:
        raise ValueError("deferred weight gradients need the last stage's input_grad time")
    flat = [[Slot(op, k, i) for k in range(steps) for op, i in schedule] for schedule in schedules]
    return _period(
        flat,
        times,
        steps,
        _links(link_s, transfer_s, n),
        overlap=False,
        deferred=deferred,
    )


def overlapped(
    stage: int, n_stages: int, micro_batches: int, steps: int, in_flight: int | None = None
) -> list[Slot]:
    """The ``overlap`` schedule of ``steps`` consecutive steps: 1F1B without a break at the
    step boundaries, so a stage runs the next step's forwards while the gradients of this
    one are still on their way. The window is the step's (:func:`one_f_one_b`'s). A step's
    update is applied a step late, before the forwards of the step after next (see
    :class:`DelayedUpdates`), which is what lets the forwards go on."""
    if steps < 1:
        raise ValueError(f"bad schedule request: {steps} steps")
    window = stage_in_flight(stage, n_stages, micro_batches, in_flight)
    total = micro_batches * steps
    flat = [Step(Op.FORWARD, t) for t in range(min(window - 1, total))]
    for t in range(total):
        if t + window - 1 < total:
            flat.append(Step(Op.FORWARD, t + window - 1))
        flat.append(Step(Op.BACKWARD, t))
    return [Slot(op, t // micro_batches, t % micro_batches) for op, t in flat]


def overlapped_period(
    n_stages: int,
    micro_batches: int,
    in_flight: int | None,
    times: list[OpTimes],
    steps: int = 8,
    link_s: float | Sequence[tuple[float, float]] = 0.0,
    transfer_s: Sequence[tuple[float, float]] | None = None,
) -> float:
    """:func:`step_period` of the :func:`overlapped` schedule: each stage applies an update
    before the first forward of every step from the third on, and a step ends when every
    stage has run the last backward of its last micro-batch."""
    if n_stages != len(times) or n_stages == 0 or steps < 3:
        raise ValueError("one OpTimes per stage, and at least three steps")
    flat = [overlapped(s, n_stages, micro_batches, steps, in_flight) for s in range(n_stages)]
    return _period(flat, times, steps, _links(link_s, transfer_s, n_stages), overlap=True)


def _period(
    flat: list[list[Slot]],
    times: list[OpTimes],
    steps: int,
    links: list[_Link],
    *,
    overlap: bool,
    deferred: int = 0,
) -> float:
    """Run every stage's ops of ``steps`` steps (:class:`Slot` lists) as early as their inputs
    and the stage allow; the mean interval between the ends of consecutive steps."""
    n = len(flat)
    sent: dict[tuple[int, int, Op, int], float] = {}  # a frame's arrival at its receiver
    last_micro = max(slot.micro for slot in flat[0])
    tail = times[-1]
    weights_pass = deferred * (tail.forward + tail.backward)  # the deferred micro-batches'
    finish: dict[tuple[int, int, Op, int], float] = {}
    clock = [0.0] * n
    position = [0] * n
    step_end = [0.0] * steps
    while any(position[s] < len(flat[s]) for s in range(n)):
        progressed = False
        for s in range(n):
            if position[s] >= len(flat[s]):
                continue
            op, k, i = flat[s][position[s]]
            needs = _needs(op, k, s, i, n)
            cost = times[s].forward if op is Op.FORWARD else times[s].backward
            if op is Op.BACKWARD and s == n - 1 and i > last_micro - deferred:
                cost = tail.input_grad or 0.0
            if any(need not in finish for need in needs):
                continue
            if overlap and op is Op.FORWARD and i == 0 and k >= 2:
                clock[s] += times[s].apply  # the update of step k - 2
            arrivals = (finish[need] if need[1] == s else sent[need] for need in needs)
            start = max([clock[s], *arrivals])
            clock[s] = finish[(k, s, op, i)] = start + cost
            _send(links, sent, (k, s, op, i), n, clock[s])
            if op is Op.BACKWARD and i == last_micro:
                if s == n - 1:
                    clock[s] += weights_pass
                if not overlap:
                    clock[s] += times[s].apply
                step_end[k] = max(step_end[k], clock[s])
            position[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"deadlock at positions {position}")
    return (step_end[-1] - step_end[0]) / (steps - 1)


def _needs(op: Op, step: int, s: int, i: int, n: int) -> list[tuple[int, int, Op, int]]:
    """The ops whose results op ``op`` of micro ``i`` on stage ``s`` of ``n`` waits for: a
    forward, the stage before's forward; a backward, its own forward and the stage after's
    backward."""
    if op is Op.FORWARD:
        return [] if s == 0 else [(step, s - 1, Op.FORWARD, i)]
    needs = [(step, s, Op.FORWARD, i)]
    if s < n - 1:
        needs.append((step, s + 1, Op.BACKWARD, i))
    return needs


class PendingUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """A gradient set aside for a delayed update (the overlap schedule): the step it is of and
    how many micro-batch gradients it sums (what its mean divides by)."""

    step: int
    micro_batches: int


class DelayedUpdates:
    """When the ``overlap`` schedule applies each step's update, and what a stage keeps.

    Step ``k``'s micro-batches all run with the weights that hold every update up to step
    ``k - 2``'s (PipeDream-2BW's one-step delay: ``W[k+1] = W[k] - update(grad at W[k-1])``).
    A stage accumulates step ``k``'s gradient; when its last backward is done the gradient is
    set aside (:meth:`step_done`); it is applied before the first forward of step ``k + 2``
    (:meth:`before_forward`), or at the end of step ``k + 1`` on a stage that reaches that
    first (the last stage, whose window is one micro-batch). Every stage so applies the same
    updates before the same forwards, whichever order its ops run in, and a stage holds at
    most one gradient set aside. :meth:`flush` applies what is set aside (the end of a run).

    ``pending`` (the gradient set aside, or None) is what a checkpoint records, so that a
    resumed run applies it where this one would have. Pure bookkeeping, no TensorFlow.
    """

    def __init__(self, pending: PendingUpdate | None = None) -> None:
        self.pending = pending

    def before_forward(self, step: int) -> PendingUpdate | None:
        """The update to apply before step ``step``'s first forward, if any."""
        if self.pending is not None and self.pending.step <= step - 2:
            due, self.pending = self.pending, None
            return due
        return None

    def step_done(self, step: int, micro_batches: int) -> PendingUpdate | None:
        """Step ``step``'s last backward is done and its gradient (``micro_batches`` summed) is
        set aside: the update to apply before that (if any)."""
        due, self.pending = self.pending, PendingUpdate(step=step, micro_batches=micro_batches)
        return due

    def flush(self) -> PendingUpdate | None:
        """The update still to apply (None: nothing set aside)."""
        due, self.pending = self.pending, None
        return due


class _Link:
    """One boundary in the model: each direction's crossing seconds, the part of them that
    occupies the link, and when the link is next free that way."""

    def __init__(self, crossing: tuple[float, float], transfer: tuple[float, float]) -> None:
        self.crossing = crossing
        self.transfer = transfer
        self.free = [0.0, 0.0]

    def arrival(self, direction: int, ready: float) -> float:
        """When a frame ready to leave at ``ready`` arrives, after those before it."""
        start = max(ready, self.free[direction])
        self.free[direction] = start + self.transfer[direction]
        return start + self.crossing[direction]


def _links(
    link_s: float | Sequence[tuple[float, float]],
    transfer_s: Sequence[tuple[float, float]] | None,
    n_stages: int,
) -> list[_Link]:
    """Each boundary's model, from one crossing figure for all or one pair each."""
    boundaries = max(0, n_stages - 1)
    if isinstance(link_s, int | float):
        crossing = [(float(link_s), float(link_s))] * boundaries
    else:
        crossing = [(float(f), float(b)) for f, b in link_s]
    transfer = [(0.0, 0.0)] * boundaries if transfer_s is None else list(transfer_s)
    if len(crossing) != boundaries or len(transfer) != boundaries:
        raise ValueError(
            f"{n_stages} stages have {boundaries} boundaries, got {len(crossing)} link times "
            f"and {len(transfer)} transfer times"
        )
    return [
        _Link(c, (min(t[0], c[0]), min(t[1], c[1])))
        for c, t in zip(crossing, transfer, strict=True)
    ]


def _send(
    links: list[_Link],
    sent: dict[tuple[int, int, Op, int], float],
    op: tuple[int, int, Op, int],
    n: int,
    done: float,
) -> None:
    """The frame op ``op`` (step, stage, kind, micro) sends when it is done, if any: a
    forward downstream (not from the last stage), a backward upstream (not from the first)."""
    _, s, kind, _ = op
    if kind is Op.FORWARD and s < n - 1:
        sent[op] = links[s].arrival(0, done)
    elif kind is Op.BACKWARD and s > 0:
        sent[op] = links[s - 1].arrival(1, done)
