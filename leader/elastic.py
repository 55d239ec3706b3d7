"""Elastic membership of a job's replicas: the leader's decisions, pure.

A job with replicas no longer stops when it loses one: the replica that lost a stage is
dropped (its other stages are stopped) and every stage's ring goes on with the replicas
left; when enough fellows are ready, a replacement pipeline is placed in the lost slot,
starts as *joining* (its stages build their models and open their own boundaries, then
wait), and joins the rings at a sync boundary, taking the current weights from a donor.
Each change of a ring is one :class:`~silentswarm.plan.RingChange` per member, all naming
the same ``epoch`` and ``at_step``: every member switches before it trains that step.

- :func:`replica_to_drop`: for a lost stage, the replica to drop, or None when the job
  cannot go on without it (no replicas, or no full replica would be left).
- :func:`switch_step`: the step a ring change takes effect, a little ahead of the furthest
  stage (so every member hears it before it gets there), after an outer sync under
  DiLoCo; None when the run ends first. One stage's report far from all the others' does
  not move it (:func:`vouched_max`).
- :func:`ring_changes`: the members' changes, one ring per segment of the members' splits
  (:mod:`silentswarm.rings`), with fresh CURVE keys and relay tokens for every link of
  every new ring (a member left out knows none of them).
- :func:`replacement`: a pipeline for a lost slot on the ready fellows, with the job's
  layer split, or why there is none.
- :func:`joiner_plans`: the plans of a replacement's stages (``joining``).
- :func:`digest_verdict`: after a ring change, the members whose state digest (each reports
  the sha256 of what it took, per ring) the majority of a ring outvoted, and the rings with
  no majority.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from silentswarm.errors import ErrorCode
from silentswarm.jobspec import PlacedStage, Placement, seats, stage_plans
from silentswarm.leader.placement import (
    DEFAULTS,
    Candidate,
    PlacementDefaults,
    Unplaceable,
    place,
    stages_per_machine,
)
from silentswarm.leader.refill import joined_rings
from silentswarm.leader.replica_groups import range_sync_bits, rounds_per_step
from silentswarm.plan import RingChange, StagePlan, Transport
from silentswarm.rings import build_rings, fellow_ports, next_member, ports_needed, prev_member
from silentswarm.types.jobs import JobRecord
from silentswarm.types.links import MeasuredLink
from silentswarm.types.views import StageProgress

# A ring change takes effect this many seconds of steps ahead of the furthest stage, and at
# least MIN_AHEAD steps ahead: the RING signals must reach every member before it gets there.
LEAD_S = 3.0
MIN_AHEAD = 2
MIN_STEP_S = 1e-3  # the shortest step time a fellow's figure counts as
# Honest members report steps and step times close together: the rings hold a stage's
# replicas in step, the pipeline its stages (a record per step; DiLoCo's replicas drift up to
# sync_every steps apart between syncs), and a synchronous pipeline's stages share one pace.
# A report further than this from every other member's is not believed (vouched_max).
STEP_SPREAD = 4  # steps, plus the stages and, under DiLoCo, sync_every
TIME_SPREAD = 2.0  # times the step time another member reports
Num = TypeVar("Num", int, float)


def joining_replicas(job: JobRecord) -> set[int]:
    """The replicas whose stages are still joining (placed, not yet in the rings)."""
    return {p.replica for p in job.progress if p.joining}


def replica_to_drop(job: JobRecord, fellow_id: str) -> int | None:
    """The replica to drop because the stage on ``fellow_id`` was lost, or None when the job
    cannot go on without it: it has no replicas, the fellow is not placed, or no other
    replica that trains (not joining) would be left."""
    placement = job.placement
    if placement is None or placement.n_replicas < 2:
        return None
    placed = placement.stage_of(fellow_id)
    if placed is None:
        return None
    joining = joining_replicas(job)
    others = [r for r in placement.live_replicas if r != placed.replica and r not in joining]
    return placed.replica if others else None


def switch_step(job: JobRecord, *, lead_s: float = LEAD_S, after_loss: bool = False) -> int | None:
    """The step (0-based: the first trained with the new rings) a ring change takes effect:
    ``lead_s`` seconds of the slowest step time ahead of the furthest training stage (the
    slowest and the furthest another stage vouches for: :func:`vouched_max`), at least
    MIN_AHEAD steps; under DiLoCo the next multiple of ``sync_every`` from there (right
    after an outer sync, when the replicas hold the same weights). None when that is not
    before the run's last step.

    ``after_loss``: a member was lost, so until the switch every round waits
    ``sync_timeout_s`` for it: the steps reported before the loss are no measure of the
    steps to come, which take at least that long."""
    training = [p for p in job.progress if not p.joining]
    train = job.spec.train_config()
    spread = STEP_SPREAD + (job.placement.n_stages if job.placement else 1)
    if train.sync == "diloco":
        spread += train.sync_every
    steps = [p.step for p in training] or [0]
    furthest = vouched_max(steps, lambda other, s: other >= s - spread)
    floor = train.sync_timeout_s if after_loss else 0.0
    times = [max(p.step_time_s, floor) for p in training if p.step_time_s] or [floor]
    slowest = vouched_max(times, lambda other, t: other >= t / TIME_SPREAD)
    ahead = max(MIN_AHEAD, steps_ahead(lead_s, slowest)) if slowest > 0 else MIN_AHEAD
    at = furthest + ahead
    if train.sync == "diloco":
        every = train.sync_every
        at = -(-at // every) * every
    return at if at < job.spec.steps else None


def steps_ahead(lead_s: float, step_s: float) -> int:
    """The steps that take ``lead_s`` seconds at ``step_s`` seconds a step (a fellow's
    figure: one below :data:`MIN_STEP_S` counts as that, so the count stays finite)."""
    return math.ceil(lead_s / max(step_s, MIN_STEP_S))


def vouched_max(values: Sequence[Num], close: Callable[[Num, Num], bool]) -> Num:
    """The largest of ``values``, unless the next below it is not close to it
    (``close(other, value)``, which holds the more the larger ``other`` is): then that next.

    Each value is one placed stage's report, a stranger's word: a stage reporting a step far
    ahead of the others' (or a step time far slower) would put a ring change off to the
    run's end, or too soon for the others to hear of it. Where three or more report, one
    report far from all the others is passed over (the next below it is close to the
    largest); with two, neither outvotes the other (the furthest holds: a stuck member's
    old report must not pull the change back)."""
    ordered = sorted(values, reverse=True)
    if len(ordered) < 3 or close(ordered[1], ordered[0]):
        return ordered[0]
    return ordered[1]


def ring_changes(
    job: JobRecord,
    *,
    members: list[int],
    epoch: int,
    at_step: int,
    joining: Iterable[int] = (),
) -> dict[str, RingChange]:
    """Each member stage's change (by fellow id) to rings over the placed replicas
    ``members``: one ring per segment of their splits (:func:`silentswarm.rings.build_rings`)
    over the same members, in replica order, the donor the lowest that is not ``joining``,
    fresh secrets for every link. The lead replica's members get its checkpoint duty (a
    lead that took over from a lost replica 0 starts pushing)."""
    placement = job.placement
    assert placement is not None
    members = sorted(members)
    new = sorted(set(joining))
    donor = min(r for r in members if r not in new)
    transport = placement.transport
    rings = build_rings(
        seats(placement, members),
        curve=transport != Transport.TUNNEL,
        relay=transport != Transport.P2P,
    )
    spec = job.spec
    every = spec.shard_push_interval_steps if spec.shard_push_to_leader else 0
    out: dict[str, RingChange] = {}
    for r in members:
        lead = r == placement.lead
        for placed in placement.pipeline(r):
            out[placed.fellow_id] = RingChange(
                epoch=epoch,
                at_step=at_step,
                members=members,
                donor=donor,
                joining=new,
                rings=rings[(r, placed.stage)],
                checkpoint_every=every if lead else 0,
                checkpoint_at_end=lead,
            )
    return out


def accused_replica(job: JobRecord, replica: int, code: str | None) -> int | None:
    """The replica that ``replica``'s refusal at a ring change accuses, which the leader
    drops with ``replica``'s (it cannot tell which of the two lies): the donor of the
    current rings for DONOR_REFUSED (their state was refused), the member before
    ``replica`` in them for FORWARD_REFUSED (what it forwarded as that state was), the
    member after it for SUCCESSOR_STALLED (it took no more of the state). None for any other
    outcome, a member not in the current rings, or one accusing itself."""
    if code == ErrorCode.DONOR_REFUSED:
        accused = job.ring_donor
    elif code == ErrorCode.FORWARD_REFUSED and replica in job.ring_members:
        accused = prev_member(job.ring_members, replica)
    elif code == ErrorCode.SUCCESSOR_STALLED and replica in job.ring_members:
        accused = next_member(job.ring_members, replica)
        if accused == job.ring_donor:  # the member before the donor hands nothing on
            return None
    else:
        return None
    return None if accused == replica else accused


def free_slot(job: JobRecord) -> int | None:
    """The lowest replica slot no pipeline holds, or None when every slot is placed."""
    placement = job.placement
    if placement is None:
        return None
    free = set(range(placement.n_replicas)) - set(placement.live_replicas)
    return min(free) if free else None


def replacement(
    job: JobRecord,
    candidates: list[Candidate],
    defaults: PlacementDefaults = DEFAULTS,
    *,
    version: str | None = None,
    links: Mapping[tuple[str, str], MeasuredLink] | None = None,
) -> list[PlacedStage] | Unplaceable | None:
    """A pipeline for the job's lowest free replica slot on some of ``candidates`` (the ready
    fellows), with the layer split of the job's other replicas; None when no slot is free.
    ``version``: the one the job's fellows run, which the replacement's must run too (its
    ring speaks theirs); None: any. A ``balanced`` job's replacement takes the fellows and
    order predicted fastest (:mod:`silentswarm.leader.refill`) by their measured speeds
    and ``links`` (fellow pair -> its measured link), its pipeline's and those to the
    other replicas' fellows in the rings it joins, and its stages share their hosts' cores
    with the live replicas' stages there.

    Fellows that ran a stage of a replica this attempt lost are not taken again: a late
    report of their old run could not be told from the new one's, and a fellow that just
    failed is the last one to trust with a slot. Under transport ``p2p`` every member needs
    a data and a sync address. The job's transport stays the replacement's."""
    slot, placement = free_slot(job), job.placement
    if slot is None or placement is None:
        return None
    lost = {p.fellow_id for p in job.dropped}
    usable = [
        c
        for c in candidates
        if c.fellow_id not in lost and (version is None or c.version == version)
    ]
    ranges = placement.split(placement.lead)
    if placement.transport == Transport.P2P:
        # One port per ring it will be in: the rings of the lead's stages among the others'.
        live = placement.live_replicas
        needed = ports_needed([placement.split(r) for r in live])[live.index(placement.lead)]
        ports = max(needed)
        usable = [
            c for c in usable if c.data_address and len(fellow_ports(c.sync_address)) >= ports
        ]
    spec = msgspec.structs.replace(job.spec, replicas=1)
    rings = joined_rings(
        placement, slot, range_sync_bits(job.spec, ranges), rounds_per_step(job.spec)
    )
    running = stages_per_machine(
        [s for replica in placement.live_replicas for s in placement.pipeline(replica)]
    )
    one = place(spec, usable, defaults, ranges=ranges, links=links, joining=rings, beside=running)
    if isinstance(one, Unplaceable):
        return one
    by_id = {c.fellow_id: c for c in usable}
    return [
        msgspec.structs.replace(s, replica=slot, sync_address=by_id[s.fellow_id].sync_address)
        for s in one.stages
    ]


def joiner_plans(
    job: JobRecord, stages: list[PlacedStage], *, subject_prefix: str
) -> list[StagePlan]:
    """The plans of a replacement pipeline (:func:`replacement`'s stages): its own
    boundaries with fresh secrets, ``joining`` (its ring comes later, by RING), and no
    checkpoint duty (its lead is the job's lead)."""
    placement = job.placement
    assert placement is not None and stages
    alone = Placement(
        stages=[msgspec.structs.replace(s, replica=0) for s in stages],
        transport=placement.transport,
    )
    plans = stage_plans(
        job_id=job.job_id,
        attempt=job.attempt,
        spec=job.spec,
        placement=alone,
        subject_prefix=subject_prefix,
    )
    return [
        msgspec.structs.replace(
            plan,
            replica=placed.replica,
            n_replicas=placement.n_replicas,
            sync_ports=fellow_ports(placed.sync_address),
            joining=True,
            checkpoint_every=0,
            checkpoint_at_end=False,
        )
        for plan, placed in zip(plans, stages, strict=True)
    ]


@dataclass(frozen=True)
class DigestVerdict:
    """What the members' state digests after a ring change say: the fellows whose digest the
    majority of a ring's members outvoted, and the rings (segments, by first layer) with no
    majority."""

    outvoted: list[str]
    undecided: list[int]


def digest_verdict(
    progress: Iterable[StageProgress],
    *,
    epoch: int,
    segments_of: Mapping[str, Sequence[int]],
    donor: int | None,
) -> DigestVerdict:
    """Each member reports the sha256 of the state it took at ring change ``epoch`` in each
    of its rings (``segments_of``: the segments each member stage holds; what it reports for
    another is ignored); once every member of a ring has (those that train, and
    replacements joining with it), the digest of a strict majority wins and the others are
    outvoted.

    The state goes around the ring from the ``donor`` replica, signed by it in a ring of
    three or more (a forwarder cannot alter it unnoticed: its successor fails the switch), so
    a digest that differs is its reporter's own. In a ring of two that disagree the donor
    stays and the other goes: the job keeps the replica it already trusted. A ring of more
    with no majority is undecided: nobody can tell who lies."""
    by_segment: dict[int, list[tuple[int, str, str | None]]] = {}
    for p in progress:
        if p.joining not in (None, "switching"):
            continue
        reported = p.state_digests if p.sync_epoch == epoch else {}
        for segment in segments_of.get(p.fellow_id, ()):
            by_segment.setdefault(segment, []).append(
                (p.replica, p.fellow_id, reported.get(segment))
            )
    outvoted: list[str] = []
    undecided: list[int] = []
    for segment, members in sorted(by_segment.items()):
        if len(members) < 2 or any(digest is None for *_, digest in members):
            continue
        lost = _ring_verdict(sorted(members), donor)  # ring order: replica order
        if lost is None:
            undecided.append(segment)
        outvoted += [f for f in lost or () if f not in outvoted]
    return DigestVerdict(outvoted=outvoted, undecided=undecided)


def _ring_verdict(
    members: list[tuple[int, str, str | None]], donor: int | None
) -> list[str] | None:
    """One ring's :func:`digest_verdict`: ``members`` as ``(replica, fellow, digest)`` in
    ring order; the fellows outvoted, or None when undecided."""
    counts = Counter(digest for *_, digest in members)
    digest, votes = counts.most_common(1)[0]
    if votes == len(members):
        return []
    if votes * 2 > len(members):
        return [fellow_id for _, fellow_id, got in members if got != digest]
    if len(members) == 2 and donor in (members[0][0], members[1][0]):
        return [next(f for r, f, _ in members if r != donor)]
    return None


__all__ = [
    "LEAD_S",
    "MIN_AHEAD",
    "DigestVerdict",
    "digest_verdict",
    "free_slot",
    "joiner_plans",
    "joining_replicas",
    "replacement",
    "replica_to_drop",
    "ring_changes",
    "switch_step",
    "vouched_max",
]
