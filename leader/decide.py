"""The job loop's decisions, pure: what the orchestrator does on a tick, given what it knows.

Each function takes plain data (job and fellow records, the loop's own bookkeeping, ``now``)
and returns what to do; :mod:`silentswarm.leader.orchestrator` gathers the data, applies the
decisions and does the I/O. The decisions about one job's record (placing, reconciling,
resuming) are :mod:`silentswarm.leader.jobs`'s; these are the loop's:

- which fellows may be placed now (:func:`idle_candidates`), and what a START round's acks
  mean (:func:`judge_start`);
- what the fellows of a running job say about it (:func:`judge_running`: a stage ended, or
  the job lost a stage), and which stages of an ended job still need a STOP
  (:func:`stages_to_stop`);
- which stages run an attempt the leader does not run (any more): orphans to STOP
  (:func:`orphan_stops`, at most every ``ORPHAN_STOP_EVERY_S`` per stage);
- which START rounds a restarted leader must undo (:func:`abandoned_starts`);
- which pending purges are due for (re)delivery (:func:`purges_due`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from silentswarm.leader.jobs import FellowState, JobRecord, SignalRecord, reconcile
from silentswarm.leader.placement import Candidate
from silentswarm.leader.purges import PendingPurge
from silentswarm.leader.registry import FellowRecord
from silentswarm.protocol import FellowStatus, JobState, StageOutcome
from silentswarm.telemetry import offered_ram, usable_gpus

# A fellow that refused or did not answer START is not placed again for this long.
START_COOLDOWN_S = 10.0
# A stage of an attempt the leader no longer runs gets STOP again at most this often.
ORPHAN_STOP_EVERY_S = 5.0
# A STOP to a stage is remembered this long; then a stage still running gets STOP again.
STOP_MEMORY_S = 12 * ORPHAN_STOP_EVERY_S
# A pending purge for a fellow that is not back is tried again this often.
PURGE_RETRY_S = 5.0
# How often a released agent that is still heard is told again to exit.
RELEASED_STOP_EVERY_S = 10.0
# The least share of its threads' time placement credits a quota-bound fellow with: its
# stage's time is divided by the share, which must stay a number.
MIN_CPU_SHARE = 0.01

# (fellow id, job id, attempt): one stage of one attempt.
StageKey = tuple[str, str, int]

_RUNNING_STATUSES = (FellowStatus.TRAINING, FellowStatus.CHECKPOINTING)


# --- placing and starting -----------------------------------------------------------------


def candidate(record: FellowRecord) -> Candidate:
    """What the fellow offers: GPUs TensorFlow can use, memory within the operator's caps."""
    hw = record.hardware
    return Candidate(
        fellow_id=record.fellow_id,
        hostname=record.hostname,
        data_address=record.data_address,
        sync_address=record.sync_address,
        cpu_cores=hw.cpu_cores,
        host_cpu_cores=hw.host_cpu_cores or hw.cpu_cores,
        machine_id=hw.machine_id,
        ram_available_bytes=offered_ram(hw),
        gpus=tuple(usable_gpus(hw)),
        pool=record.pool,
        labels=record.labels,
        compute_speed=record.measured_speed or hw.compute_speed,
        cpu_share=cpu_share(hw.cpu_cores, hw.cpu_quota),
        version=record.version,
    )


def cpu_share(cores: int, quota: float | None) -> float:
    """The share of its threads' time a fellow's CPU quota lets it run: 1 without one, at
    least :data:`MIN_CPU_SHARE` (both figures come from the fellow)."""
    if quota is None or cores < 1 or not math.isfinite(quota):
        return 1.0
    return min(1.0, max(MIN_CPU_SHARE, quota / cores))


def idle_candidates(
    fellows: Iterable[FellowRecord],
    *,
    busy: Collection[str],
    reserved: Collection[str],
    cooldown: Mapping[str, float],
    purging: Collection[str],
    now: float,
) -> list[Candidate]:
    """The fellows a pending job may be placed on now: ready, in no running or starting job
    (``busy``), not being signalled by an operator action (``reserved``), not cooling down
    after a refused START (``cooldown``: fellow -> the monotonic time it may be placed
    again, inclusive) and without a pending purge (``purging``)."""
    return [
        candidate(r)
        for r in fellows
        if r.status is FellowStatus.READY
        and r.fellow_id not in busy
        and r.fellow_id not in reserved
        and cooldown.get(r.fellow_id, 0.0) <= now
        and r.fellow_id not in purging
    ]


@dataclass(frozen=True)
class StartVerdict:
    """What a START round's acks mean: ``ok``, or the reason it failed and until when each
    fellow that refused (or stayed silent) is not placed again."""

    ok: bool
    reason: str = ""
    cooldown: Mapping[str, float] = field(default_factory=dict)


def judge_start(records: Iterable[SignalRecord], *, now: float) -> StartVerdict:
    """Every placed fellow must acknowledge START; ``now`` is the monotonic clock."""
    refused = [r for r in records if not r.ok]
    if not refused:
        return StartVerdict(ok=True)
    until = now + START_COOLDOWN_S
    return StartVerdict(
        ok=False,
        reason="; ".join(f"{r.fellow_id}: {r.code}: {r.message}" for r in refused),
        cooldown={r.fellow_id: until for r in refused},
    )


def abandoned_starts(jobs: Iterable[JobRecord]) -> list[JobRecord]:
    """Jobs loaded PENDING with a placement: the leader stopped half way through their
    START round, so it must STOP those fellows and place the job again."""
    return [j for j in jobs if j.state is JobState.PENDING and j.placement is not None]


# --- running jobs -------------------------------------------------------------------------


def fellow_state(record: FellowRecord) -> FellowState:
    """What the decisions read of a fellow's registry record."""
    return FellowState(
        fellow_id=record.fellow_id,
        status=record.status,
        job_id=record.job_id,
        attempt=record.attempt,
        outcome=record.outcome,
        last_heartbeat_at=record.last_heartbeat_at,
        offline_reason=record.offline_reason,
    )


@dataclass(frozen=True)
class StageEnded:
    """A fellow's heartbeat says how its stage of this attempt ended: record it."""

    fellow_id: str
    outcome: StageOutcome


@dataclass(frozen=True)
class StageLost:
    """The job lost a stage (its fellow is gone, offline or runs something else)."""

    fellow_id: str
    reason: str  # the job's reason: names the fellow and its stage


def judge_running(
    job: JobRecord, fellows: Mapping[str, FellowState], *, now: float
) -> list[StageEnded | StageLost]:
    """What the fellows of a running job say about it (``now``: wall time), in placement
    order; applied in order, until the job has ended."""
    out: list[StageEnded | StageLost] = []
    for fid, finding in reconcile(job, fellows, now=now):
        if isinstance(finding, StageOutcome):
            out.append(StageEnded(fid, finding))
            continue
        stage = job.placement.stage_of(fid) if job.placement else None
        where = f" (stage {stage.stage})" if stage else ""
        out.append(StageLost(fid, f"fellow {fid}{where} {finding}"))
    return out


def stages_to_stop(job: JobRecord) -> list[str]:
    """The fellows of an ended job whose stage has not ended: a failed or cancelled job
    stops them; a completed one has none left."""
    if job.placement is None or job.state is JobState.COMPLETED:
        return []
    return [p.fellow_id for p in job.progress if p.result is None]


# --- orphans ------------------------------------------------------------------------------


@dataclass(frozen=True)
class OrphanStop:
    """STOP a stage that runs an attempt the leader does not run; ``why`` is for the log."""

    fellow_id: str
    job_id: str
    attempt: int
    why: str


def orphan_stops(
    fellows: Iterable[FellowState],
    jobs: Mapping[str, JobRecord],
    *,
    starting: Collection[str],
    stopped: Mapping[StageKey, float],
    now: float,
) -> list[OrphanStop]:
    """The stages to STOP now: whatever a fellow reports running must be the current
    attempt of a running (or starting) job it is placed in.

    A STOP can be lost (the fellow was cut off for longer than the signal's deadline), and
    a leader can die between a START round and its end. Left alone: fellows that run no
    job, jobs this leader never knew, a run whose end the fellow (outcome) or the job's
    record (a stage result from progress) already reports, and a stage that got a STOP
    less than ``ORPHAN_STOP_EVERY_S`` ago (``stopped``: key -> monotonic time of the last
    STOP; ``now`` the same clock).
    """
    out = []
    for fellow in fellows:
        if fellow.job_id is None or fellow.status not in _RUNNING_STATUSES:
            continue
        job = jobs.get(fellow.job_id)
        if job is None:
            continue
        why = _orphaned(fellow, job, starting=starting)
        if why is None:
            continue
        key = (fellow.fellow_id, fellow.job_id, fellow.attempt or 0)
        if now - stopped.get(key, float("-inf")) < ORPHAN_STOP_EVERY_S:
            continue
        out.append(OrphanStop(*key, why=why))
    return out


def _orphaned(fellow: FellowState, job: JobRecord, *, starting: Collection[str]) -> str | None:
    """Why the fellow's run of ``job`` is an orphan, or None when it is not."""
    ended = fellow.outcome
    if ended is not None and (ended.job_id, ended.attempt) == (fellow.job_id, fellow.attempt or 0):
        return None  # it says that run has ended: its next heartbeat says it is idle
    placed = job.placement is not None and fellow.fellow_id in job.placement.fellow_ids
    current = placed and fellow.attempt == job.attempt
    if not current:
        return "not its current attempt"
    if job.state is JobState.RUNNING or job.job_id in starting:
        return None
    stage = job.stage_progress(fellow.fellow_id)
    if stage is not None and stage.result is not None:
        return None  # its end reached us (progress) before its idle heartbeat did
    return job.state.value


def forget_old_stops(stopped: Mapping[StageKey, float], *, now: float) -> dict[StageKey, float]:
    """The STOPs still remembered: those sent at most ``STOP_MEMORY_S`` ago."""
    return {key: at for key, at in stopped.items() if now - at <= STOP_MEMORY_S}


# --- purges -------------------------------------------------------------------------------


def released_to_stop(
    heard: Collection[str],
    *,
    purge_pending: Collection[str],
    told: Mapping[str, float],
    now: float,
) -> list[str]:
    """The released agents to tell (again) to exit, of those ``heard`` since the last tick:
    each at most every ``RELEASED_STOP_EVERY_S`` (``told``: when each was last told,
    monotonic like ``now``), never one whose purge is pending (it waits for its PURGE, which
    the purge delivery sends)."""
    return sorted(
        fid
        for fid in heard
        if fid not in purge_pending
        and now - told.get(fid, -RELEASED_STOP_EVERY_S) >= RELEASED_STOP_EVERY_S
    )


def purges_due(
    pending: Iterable[PendingPurge],
    *,
    online: Collection[str],
    busy: Collection[str],
    in_flight: Collection[str],
    now: float,
) -> list[str]:
    """The fellows whose pending purge to try now: at once for a fellow that is back
    (``online``), else ``PURGE_RETRY_S`` after the last try (``now``: wall time, like the
    book's), however many tries failed before. Never while a delivery to that fellow is in
    flight, nor while the fellow is placed in a job."""
    due = []
    for purge in pending:
        fid = purge.fellow_id
        if fid in in_flight or fid in busy:
            continue
        last = purge.last_attempt_at
        if fid in online or last is None or now - last >= PURGE_RETRY_S:
            due.append(fid)
    return due
