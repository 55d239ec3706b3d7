"""What a pipeline boundary measured of its link, and the schedule the stages chose from it.

A stage reports them in its ``links`` events (:mod:`silentswarm.types.stage`); the agent
passes them on in every step's progress record (:class:`silentswarm.protocol.Progress`); the
leader keeps the latest in the job's record and its live metrics, where ``swarm watch`` shows
them. They come from a fellow, so every number is bounded: a value outside its bounds fails
decoding and the record is refused.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

StageIndex = Annotated[int, msgspec.Meta(ge=0, le=4096)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
Millis = Annotated[float, msgspec.Meta(ge=0.0, le=3_600_000.0)]
MbitPerS = Annotated[float, msgspec.Meta(ge=0.0, le=10_000_000.0)]  # 10 Pbit/s
# A wire codec's name (none, fp16, fixed_int8, ...): a word, shown as it is in ``swarm watch``.
CodecName = Annotated[str, msgspec.Meta(max_length=32, pattern=r"^[a-z0-9_]{1,32}$")]
MicroBatches = Annotated[int, msgspec.Meta(ge=1, le=2**16)]
Deferred = Annotated[int, msgspec.Meta(ge=0, le=2**16)]
StepSeconds = Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]


class LinkStats(msgspec.Struct, frozen=True, kw_only=True):
    """One boundary's link, measured by its two ends before training step ``step``.

    ``rtt_ms``: the median round trip of small messages; ``fwd_mbit_s`` (activations,
    upstream to downstream) and ``bwd_mbit_s`` (gradients, back): the rate at which the
    receiving end took in a burst, timed from its first to its last piece, so neither
    delay nor the sender's start counts. ``fwd_codec`` and ``bwd_codec``: the wire codecs
    each direction uses from that step on.
    """

    boundary: StageIndex
    step: Count
    rtt_ms: Millis
    fwd_mbit_s: MbitPerS
    bwd_mbit_s: MbitPerS
    fwd_codec: CodecName = "none"
    bwd_codec: CodecName = "none"


# How long a measured link stays current: then an idle probe measures it again, and a job's
# report may raise a link a probe agreed on (silentswarm.leader.linkprobes, .registry).
LINK_CURRENT_S = 86_400.0
# A job's boundary report this far below what an idle probe agreed on (under this share of
# its rate, or over its round trip divided by it, and by more than the floors below: a LAN's
# fraction of a millisecond doubles with any jitter) has the next idle probe measure it again.
RECHECK_BELOW = 0.5
RECHECK_MBIT_S_FLOOR = 0.5
RECHECK_RTT_MS_FLOOR = 1.0


class MeasuredLink(msgspec.Struct, frozen=True, kw_only=True):
    """What the leader keeps of a measured boundary between two fellows, for placing the
    next ``balanced`` job along fast links: the slower direction's rate and the round trip.
    Kept on the upstream fellow's record (:class:`silentswarm.types.fleet.FellowRecord`), so
    it outlives a leader restart. ``measured_at``: when the leader last recorded other
    figures for the pair (wall clock; None in records older than it), so that an idle probe
    measures a link again once it is old (:mod:`silentswarm.leader.linkprobes`); ``probed``:
    both ends of an idle probe agreed on it (a job's boundary report is its upstream stage's
    word alone); ``agreed_mbit_s`` and ``agreed_rtt_ms``: what that probe agreed on, kept
    while jobs' reports lower the link; ``recheck``: a job's report is far below them
    (:meth:`far_below`), so the next idle probe of the pair measures the link again: the drop
    stands if the link really is that slow, and a passing one (or a stage's word) does not
    hold the pair down for a day."""

    mbit_s: MbitPerS
    rtt_ms: Millis
    measured_at: float | None = None
    probed: bool = False
    agreed_mbit_s: MbitPerS | None = None
    agreed_rtt_ms: Millis | None = None
    recheck: bool = False

    def far_below(self, mbit_s: float, rtt_ms: float) -> bool:
        """Whether these figures are far worse than ``mbit_s`` and ``rtt_ms``: under
        :data:`RECHECK_BELOW` of the rate, or over the round trip divided by it, and by more
        than :data:`RECHECK_MBIT_S_FLOOR` or :data:`RECHECK_RTT_MS_FLOOR`."""
        slower = (
            self.mbit_s < mbit_s * RECHECK_BELOW and mbit_s - self.mbit_s > RECHECK_MBIT_S_FLOOR
        )
        longer = (
            self.rtt_ms * RECHECK_BELOW > rtt_ms and self.rtt_ms - rtt_ms > RECHECK_RTT_MS_FLOOR
        )
        return slower or longer

    def same_figures(self, other: MeasuredLink | None) -> bool:
        return other is not None and (self.mbit_s, self.rtt_ms) == (other.mbit_s, other.rtt_ms)

    def current(self, now: float, within: float = LINK_CURRENT_S) -> bool:
        """Recorded less than ``within`` seconds before ``now`` (the wall clock); a link of
        unknown age (recorded before the leader kept times) counts as current."""
        return self.measured_at is None or now - self.measured_at < within


class MeasuredPair(msgspec.Struct, frozen=True, kw_only=True):
    """One measured link as ``swarm links`` shows it: the fellow that connects (the upstream
    end of a boundary, or of an idle probe), the one it reached, and what was kept."""

    upstream: str
    downstream: str
    mbit_s: MbitPerS
    rtt_ms: Millis
    measured_at: float | None = None


class DeferralVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """What the last stage measured before keeping a count of deferred weight-gradient
    passes (``defer_weight_grads: "auto"``): the median seconds of its steps with the count
    it kept and with the other one it ran, and the step from which the kept count runs."""

    step: Count
    kept: Deferred
    kept_step_s: StepSeconds
    other: Deferred
    other_step_s: StepSeconds


class Tuning(msgspec.Struct, frozen=True, kw_only=True):
    """The schedule every stage of an attempt runs from step ``step`` on: ``micro_batches``
    and the forward window ``in_flight`` (:func:`silentswarm.plan.stage_in_flight`).
    ``auto``: chosen from measurements (``micro_batches: "auto"``), not given by the spec;
    ``overlap``: consecutive steps overlap (the job's ``schedule: "overlap"``);
    ``predicted_step_s``: the step time the choice was predicted to take, where measured;
    ``deferred``: how many of a step's last micro-batches the last stage runs the weights'
    gradient pass of after the step's last input gradient left (``defer_weight_grads``),
    always below ``micro_batches``; ``deferral``: the measurement that decided ``deferred``
    under "auto", once there is one."""

    step: Count
    micro_batches: MicroBatches
    in_flight: MicroBatches
    auto: bool = False
    overlap: bool = False
    deferred: Deferred = 0
    predicted_step_s: StepSeconds | None = None
    deferral: DeferralVerdict | None = None


__all__ = ["DeferralVerdict", "LinkStats", "Tuning"]
