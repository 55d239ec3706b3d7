"""JobManager: every job's record and the decisions about it.

Pure state with an injected clock, like the registry: which pending job goes next and onto
which fellows (:func:`plan_schedule`), what a progress report or a stage outcome does to a
job, and what the fellows' heartbeats say about the jobs they should be running
(:func:`reconcile`). The I/O (signals, NATS, JetStream) lives in
:mod:`silentswarm.leader.orchestrator`.

Every state change goes through :func:`silentswarm.lifecycle.next_job_state`; an illegal one is
logged and raised, never applied (callers check the state first, so one is a bug). Changed
jobs are marked dirty for the store to write.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from silentswarm.errors import ConflictError, ErrorCode, IllegalTransitionError, NotFoundError
from silentswarm.jobspec import JobSpec, PlacedStage, Placement, new_job_id
from silentswarm.leader import elastic
from silentswarm.leader.admission import Admission, admit_progress
from silentswarm.leader.placement import (
    DEFAULTS,
    Candidate,
    PlacementDefaults,
    Unplaceable,
    by_version,
    fellows_needed,
    place,
    versions_note,
)
from silentswarm.leader.pools import (
    AccountLookup,
    Held,
    account_limit,
    by_pool,
    fleet_note,
    no_accounts,
)
from silentswarm.leader.progress import apply_outcome, apply_step
from silentswarm.leader.retention import RetentionPolicy, retired_job_ids
from silentswarm.lifecycle import JobEvent, next_job_state
from silentswarm.plan import layers_overlap
from silentswarm.protocol import (
    EXPORT_ERROR_CHARS,
    FellowStatus,
    JobState,
    Progress,
    ProgressEvent,
    StageOutcome,
    StageResult,
)
from silentswarm.types.fleet import FellowRecord
from silentswarm.types.jobs import (
    CheckpointRecord,
    InitSource,
    JobRecord,
    JobTransition,
    MembershipChange,
    ResumeRecord,
    ShardReceipt,
    SignalRecord,
)
from silentswarm.types.links import MeasuredLink
from silentswarm.types.views import StageProgress, mean_of, replica_lasts

log = logging.getLogger(__name__)
HISTORY_LEN = 50
SIGNAL_LOG_LEN = 100
CHECKPOINT_LOG_LEN = 20
PUSH_LOG_LEN = 50
MEMBERSHIP_LOG_LEN = 50
DROPPED_LEN = 64  # progress entries of lost replicas' stages a record keeps
OUT_OF_MEMORY_LEN = 64  # fellows a record remembers its stages ran out of memory on
# After START, a fellow's heartbeats may still describe the moment before it: only judge
# "not running the job" on heartbeats received this long after the job started.
START_GRACE_S = 3.0
# A job whose START round failed waits 2, 4, 8, ... seconds (at most this) before the next.
START_RETRY_MAX_S = 30.0
# A job's export_error, all stages' reasons together, is cut to this many characters.
JOB_EXPORT_ERROR_CHARS = 4096
# Of a fellow's words on how its stage ended or why its checkpoint failed, what the job keeps.
STAGE_MESSAGE_CHARS = 1024
# What a fellow says is shown to operators (terminals, the UI): control characters go.
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]+")


@dataclass(frozen=True)
class Assignment:
    job_id: str
    placement: Placement


@dataclass(frozen=True)
class FellowState:
    """What reconcile needs of one fellow, from the registry."""

    fellow_id: str
    status: FellowStatus
    job_id: str | None
    attempt: int | None
    outcome: StageOutcome | None
    last_heartbeat_at: float | None
    offline_reason: str | None = None


def plan_schedule(
    pending: list[JobRecord],
    idle: list[Candidate],
    defaults: PlacementDefaults = DEFAULTS,
    *,
    fleet: Iterable[FellowRecord] = (),
    held: Mapping[tuple[str, str], Held] | None = None,
    account_of: AccountLookup = no_accounts,
    links: Mapping[tuple[str, str], MeasuredLink] | None = None,
    leader_version: str = "",
) -> tuple[list[Assignment], dict[str, str]]:
    """Place pending jobs, oldest first, on idle fellows of their pool with their labels,
    all of one version (the leader's if they can hold the job: :func:`by_version`).

    A job that does not fit keeps waiting (with the reason) and does not block younger
    jobs that fit on what is left. ``fleet`` (every known fellow) explains a pool too few
    fellows fit; ``held`` is what each owner's placed jobs hold per pool and ``account_of``
    its account, whose pool limits a job must stay within (:mod:`silentswarm.leader.pools`);
    ``links`` (fellow pair -> its measured link) orders ``balanced`` jobs' stages.
    """
    pools = by_pool(fleet)
    held = dict(held or {})
    free = list(idle)
    assignments, waiting = [], {}
    for job in sorted(pending, key=lambda j: (j.created_at, j.job_id)):
        key = (job.owner, job.spec.run_pool)
        # A resumed job keeps its number of stages; replicas multiply the fellows.
        needed = fellows_needed(job.spec, job.layer_ranges or None)
        allowance = account_limit(
            account_of(job.owner), job.spec, held.get(key, Held()), needed=needed
        )
        if allowance.reason:
            waiting[job.job_id] = f"waiting: {allowance.reason}"
            continue
        groups = by_version(offered_to(job, free), leader_version)
        result: Placement | Unplaceable | None = None
        try:
            for group in groups or [[]]:
                tried = place(
                    job.spec,
                    group,
                    defaults,
                    ranges=job.layer_ranges,
                    max_stages=allowance.max_stages,
                    links=links,
                )
                if not isinstance(tried, Unplaceable):
                    result = tried
                    break
                if result is None:  # the reason to give: the first group's (the leader's)
                    result = tried
        except (ValueError, ArithmeticError) as exc:
            # Figures that came from fellows and slipped past their bounds must not stop
            # the placement of every other job (this runs on every tick).
            waiting[job.job_id] = f"waiting: placement failed on the fellows' figures ({exc})"
            continue
        assert result is not None
        if isinstance(result, Unplaceable):
            note = ""
            if result.too_few and pools:
                note = fleet_note(job.spec, pools, free={c.fellow_id for c in free})
            note += versions_note(groups)
            waiting[job.job_id] = result.reason + note + out_of_memory_note(job)
            continue
        assignments.append(Assignment(job.job_id, result))
        held[key] = held.get(key, Held()).plus(len(result.stages))
        taken = set(result.fellow_ids)
        free = [c for c in free if c.fellow_id not in taken]
    return assignments, waiting


def offered_to(job: JobRecord, free: list[Candidate]) -> list[Candidate]:
    """The idle fellows as ``job`` may use them: a fellow on which a stage of the job ran out
    of memory offers it less than that stage's estimate (placement's estimate fell short
    there, so the same stage must not go back to it): its RAM, or its GPUs' free VRAM scaled
    down together."""
    if not job.out_of_memory:
        return free
    return [
        _offering_less(c, job.out_of_memory[c.fellow_id]) if c.fellow_id in job.out_of_memory else c
        for c in free
    ]


def _offering_less(c: Candidate, estimate: int) -> Candidate:
    below = max(0, estimate - 1)
    free_vram = sum(g.memory_free_bytes for g in c.gpus)
    gpus = c.gpus
    if free_vram > below:
        gpus = tuple(
            msgspec.structs.replace(g, memory_free_bytes=g.memory_free_bytes * below // free_vram)
            for g in c.gpus
        )
    return msgspec.structs.replace(
        c, ram_available_bytes=min(c.ram_available_bytes, below), gpus=gpus
    )


def out_of_memory_note(job: JobRecord) -> str:
    """What a waiting job's reason adds when fellows offer it less since a stage of it ran
    out of memory there (:func:`offered_to`)."""
    if not job.out_of_memory:
        return ""
    fellows = ", ".join(sorted(job.out_of_memory))
    return (
        f"; a stage of this job ran out of memory on {fellows}: they get only smaller stages of it"
    )


def note_out_of_memory(job: JobRecord, fellow_id: str, estimate: int) -> None:
    """``fellow_id`` ran a stage of ``job`` estimated at ``estimate`` out of memory: keep the
    smallest such estimate per fellow (for the last :data:`OUT_OF_MEMORY_LEN` fellows)."""
    known = job.out_of_memory.get(fellow_id)
    job.out_of_memory[fellow_id] = estimate if known is None else min(known, estimate)
    while len(job.out_of_memory) > OUT_OF_MEMORY_LEN:
        job.out_of_memory.pop(next(iter(job.out_of_memory)))


def resume_from(job: JobRecord) -> int | str:
    """Where a running job that lost a fellow resumes (a step), or why it cannot (a reason).

    From the newest step every stage pushed; with no push at all, from step 0 only if the
    spec allows it; and at most ``max_resumes`` times.
    """
    if len(job.resumes) >= job.spec.max_resumes:
        return f"gave up after {len(job.resumes)} resume(s) (max_resumes {job.spec.max_resumes})"
    if job.pushed_step is not None:
        return job.pushed_step
    if job.spec.resume_from_scratch:
        return 0
    return "no shard push to resume from (set shard_push_to_leader, or resume_from_scratch)"


def clean_report(text: str, limit: int) -> str:
    """A fellow's words made fit to show: control and bidi characters become one space, at
    most ``limit`` characters (fellows are untrusted; their text reaches terminals)."""
    cleaned = _UNPRINTABLE.sub(" ", text).strip()
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 3] + "..."


def final_export_error(job: JobRecord) -> str | None:
    """What the record of a job that just COMPLETED says about its export: None when every
    stage's shard of the last step is there, else why the final model is missing.

    Every stage plan checkpoints at the end and its fellow pushes that checkpoint, so a job
    that completed has its final model in the export unless something failed: the leader's
    own storing (``job.export_error`` while running), a stage's fellow (what it reported in
    its outcome), or, when nobody said why, that is said too. With replicas the export is
    lead replica's (0, or the one that took over from it): the others push nothing, and are
    not asked for."""
    final = job.spec.steps
    if job.pushed_step == final:
        return job.export_error  # the shards are there; perhaps the manifest is not
    arrived = {
        r.stage for r in job.latest_shard_pushes if r.step == final and r.attempt == job.attempt
    }
    reasons = [] if job.export_error is None else [f"the leader: {job.export_error}"]
    lead = job.placement.lead if job.placement is not None else 0
    for stage in sorted(job.progress, key=lambda p: p.stage):
        if stage.replica != lead:
            continue  # only the lead replica pushes shards
        if stage.stage in arrived:
            continue  # whatever its fellow says: the leader has that shard
        where = f"stage {stage.stage} on fellow {stage.fellow_id}"
        if stage.export_error is not None:
            reasons.append(f"{where}: {stage.export_error}")
        elif job.export_error is None:
            reasons.append(f"{where}: no final shard arrived and the fellow did not say why")
    if not reasons:
        reasons.append("every stage's final shard arrived, but the step is not complete")
    text = f"the final model (step {final}) is not in the export: " + "; ".join(reasons)
    return clean_report(text, JOB_EXPORT_ERROR_CHARS)


def reconcile(
    job: JobRecord, fellows: dict[str, FellowState], *, now: float
) -> list[tuple[str, StageOutcome | str]]:
    """What the fellows of a running job say about it, as (fellow, outcome or loss reason).

    An outcome for this job and attempt (carried by every heartbeat until the next START)
    is returned as is; a fellow that is gone, offline, or that reports running something
    else is returned with the reason the job lost it.
    """
    if job.state is not JobState.RUNNING or job.placement is None:
        return []
    out: list[tuple[str, StageOutcome | str]] = []
    for fid in job.placement.fellow_ids:
        progress = job.stage_progress(fid)
        if progress is not None and progress.result is not None:
            continue
        fellow = fellows.get(fid)
        if fellow is None:
            out.append((fid, "was removed from the registry"))
            continue
        outcome = fellow.outcome
        if outcome is not None and (outcome.job_id, outcome.attempt) == (job.job_id, job.attempt):
            out.append((fid, outcome))
        elif fellow.status is FellowStatus.OFFLINE:
            out.append((fid, f"went offline ({fellow.offline_reason or 'no heartbeat'})"))
        elif (fellow.job_id, fellow.attempt) != (job.job_id, job.attempt):
            heard = fellow.last_heartbeat_at
            started = job.started_at or job.updated_at
            if progress is not None and progress.joining is not None:  # placed mid-run
                started = max(started, progress.updated_at or started)
            if heard is not None and heard > started + START_GRACE_S:
                doing = f"job {fellow.job_id}" if fellow.job_id else "no job"
                out.append(
                    (fid, f"is no longer running the job (reports {fellow.status}, {doing})")
                )
    return out


class JobManager:
    def __init__(
        self, *, wall: Callable[[], float] = time.time, retention: RetentionPolicy | None = None
    ) -> None:
        """``retention``: how long finished jobs stay in the metrics, the list and at all
        (:mod:`silentswarm.leader.retention`; the job loop applies it)."""
        self._wall = wall
        self.retention = retention or RetentionPolicy()
        self._jobs: dict[str, JobRecord] = {}
        # Jobs whose START round is in flight: placed, but not yet RUNNING.
        self.starting: dict[str, Placement] = {}
        # Job id -> (failed START rounds in a row, wall time before which it is not placed).
        self._retry: dict[str, tuple[int, float]] = {}
        # Jobs just resumed -> (the attempt that failed, its fellows still running): the
        # orchestrator stops those stages.
        self.resumed: dict[str, tuple[int, list[str]]] = {}
        # Elastic membership, for the orchestrator: the stages of lost replicas still to STOP
        # (job -> fellows), and the jobs whose rings must change (a replica lost, or a
        # replacement ready to join).
        self.drops: dict[str, list[str]] = {}
        # (fellow, job, attempt) whose NATS user of that attempt the orchestrator revokes:
        # the fellows of a dropped replica that hold no stage of the job any more.
        self.revokes: list[tuple[str, str, int]] = []
        self.ring_due: set[str] = set()
        self.after_loss: set[str] = set()  # of ring_due: a member was lost since the last
        self.dirty: set[str] = set()

    # --- reads -----------------------------------------------------------------------------

    def get(self, job_id: str) -> JobRecord:
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFoundError(f"no job {job_id!r}")
        return job

    def list(self) -> list[JobRecord]:
        return sorted(self._jobs.values(), key=lambda j: (j.created_at, j.job_id))

    def listed(self, *, archived: bool = False) -> list[JobRecord]:
        """What ``GET /api/v1/jobs`` lists: the jobs not archived, or (``archived``) all."""
        return [j for j in self.list() if archived or not j.archived]

    def retired(self) -> set[str]:
        """Jobs whose series the metrics no longer export (now, by the retention policy)."""
        return retired_job_ids(
            self._jobs.values(), now=self._wall(), retention_s=self.retention.metrics_retention_s
        )

    def pending(self) -> list[JobRecord]:
        """PENDING jobs that may be placed now (not starting, not backing off)."""
        now = self._wall()
        return [
            j
            for j in self.list()
            if j.state is JobState.PENDING
            and j.job_id not in self.starting
            and self._retry.get(j.job_id, (0, 0.0))[1] <= now
        ]

    def running(self) -> list[JobRecord]:
        return [j for j in self.list() if j.state is JobState.RUNNING]

    def busy_fellows(self) -> dict[str, str]:
        """Fellow id -> the job it is (being) placed in."""
        busy = {fid: job_id for job_id, p in self.starting.items() for fid in p.fellow_ids}
        for job in self.running():
            if job.placement is not None:
                busy.update(dict.fromkeys(job.placement.fellow_ids, job.job_id))
        return busy

    def counts(self) -> dict[str, int]:
        """Jobs by state, as ``GET /api/v1/jobs`` lists them: archived ones not counted."""
        counts = {s.value: 0 for s in JobState}
        for job in self._jobs.values():
            if not job.archived:
                counts[job.state.value] += 1
        return counts

    def archived_count(self) -> int:
        return sum(1 for job in self._jobs.values() if job.archived)

    # --- changes ---------------------------------------------------------------------------

    def restore(self, records: Iterable[JobRecord]) -> None:
        """Jobs loaded from the store at start-up (a running job that lost a replica, or whose
        replacement was ready to join, when the leader stopped gets its ring change now, and
        its dropped fellows' NATS users of the attempt are revoked again)."""
        for record in records:
            record.refresh_view()
            self._jobs[record.job_id] = record
            if record.state is not JobState.RUNNING:
                continue
            unsent = [
                m
                for m in record.membership
                if m.attempt == record.attempt and m.kind == "lost" and m.epoch is None
            ]
            if unsent:  # a loss whose ring change never went out
                self.ring_due.add(record.job_id)
                self.after_loss.add(record.job_id)
            if self.ready_to_join(record):
                self.ring_due.add(record.job_id)
            # Revocations are not stored: a leader that stopped between a drop and its
            # revocation revokes again what the attempt dropped (revoking twice is harmless).
            placed = set() if record.placement is None else set(record.placement.fellow_ids)
            for fellow_id in dict.fromkeys(p.fellow_id for p in record.dropped):
                if fellow_id not in placed:
                    self.revokes.append((fellow_id, record.job_id, record.attempt))

    def submit(self, spec: JobSpec, init_source: InitSource | None = None) -> JobRecord:
        """A new PENDING job; ``init_source``: the export ``init_from`` resolved to."""
        now = self._wall()
        job_id = new_job_id(spec.name)
        while job_id in self._jobs:
            job_id = new_job_id(spec.name)
        job = JobRecord(
            job_id=job_id,
            name=spec.name,
            spec=spec,
            state=JobState.PENDING,
            created_at=now,
            updated_at=now,
            reason="waiting to be placed",
            init_source=init_source,
            history=[
                JobTransition(
                    at=now, from_state=None, to_state=JobState.PENDING, reason="submitted"
                )
            ],
        )
        job.refresh_view()
        self._jobs[job_id] = job
        self.dirty.add(job_id)
        log.info("job %s submitted (%s)", job_id, spec.name)
        return job

    def archive(self, job_id: str) -> bool:
        """Hide a finished job from the list and the metrics (saved like any change); False,
        and nothing done, for an unknown or live job (the decision never names one)."""
        job = self._jobs.get(job_id)
        if job is None or not job.terminal:
            return False
        job.archived = True
        self.dirty.add(job_id)  # not _touch: its updated_at stays the job's own last change
        return True

    def forget(self, job_id: str) -> None:
        """Drop a deleted job's record (the store's copy is the caller's to delete)."""
        self._jobs.pop(job_id, None)
        self.dirty.discard(job_id)
        self._retry.pop(job_id, None)

    def set_waiting(self, reasons: dict[str, str]) -> None:
        for job_id, reason in reasons.items():
            job = self._jobs[job_id]
            if job.reason != reason:
                job.reason = reason
                self._touch(job)

    def begin_start(self, job_id: str, placement: Placement) -> JobRecord:
        """A START round for this placement is about to go out: the next attempt."""
        job = self.get(job_id)
        job.attempt += 1
        job.placement = placement
        job.ring_epoch, job.ring_donor, job.dropped = 0, None, []  # a new attempt's rings
        job.progress = [
            StageProgress(
                stage=s.stage, fellow_id=s.fellow_id, replica=s.replica, total_steps=job.spec.steps
            )
            for s in placement.stages
        ]
        job.reason = f"starting attempt {job.attempt} on {', '.join(placement.fellow_ids)}"
        self.starting[job_id] = placement
        self._touch(job)
        return job

    def start_succeeded(self, job_id: str) -> JobRecord | None:
        """Every fellow acknowledged START: RUNNING. None if the job was cancelled meanwhile."""
        self.starting.pop(job_id, None)
        self._retry.pop(job_id, None)
        job = self.get(job_id)
        if job.state is not JobState.PENDING:
            return None
        job.started_at = self._wall()
        job.reason = ""
        self._transition(job, JobEvent.STARTED, f"running on {', '.join(job.placement.fellow_ids)}")
        return job

    def start_failed(self, job_id: str, reason: str) -> None:
        """Some fellow refused or did not answer START: back to waiting, placement dropped."""
        self.starting.pop(job_id, None)
        job = self.get(job_id)
        if job.state is JobState.PENDING:
            failures = self._retry.get(job_id, (0, 0.0))[0] + 1
            delay = min(START_RETRY_MAX_S, 2.0**failures)
            self._retry[job_id] = (failures, self._wall() + delay)
            job.placement = None
            job.progress = []
            job.reason = f"attempt {job.attempt} did not start: {reason}; retrying in {delay:.0f}s"
            self._touch(job)

    def cannot_start(self, job_id: str, reason: str) -> None:
        """What the job starts from is gone (its ``init_from`` export): FAILED, not retried."""
        self.starting.pop(job_id, None)
        job = self.get(job_id)
        if job.state is JobState.PENDING:
            job.placement = None
            job.progress = []
            job.reason = reason
            self._finish(job, JobEvent.FAILED, reason)

    def cancel(self, job_id: str, reason: str = "cancelled by the operator") -> JobRecord:
        job = self.get(job_id)
        if job.terminal:
            raise ConflictError(
                f"job {job_id} is already {job.state.value}", code=ErrorCode.JOB_TERMINAL
            )
        job.reason = reason
        self._finish(job, JobEvent.CANCELLED, reason)
        return job

    def admit_progress(self, msg: Progress) -> Admission:
        """Whether the fellow placed at that stage of the job's current attempt sent it."""
        job = self._jobs.get(msg.job_id)
        if job is None:
            return admit_progress(None, None, msg)
        return admit_progress(job.attempt, job.placement, msg)

    def record_progress(self, msg: Progress) -> JobRecord | None:
        """Apply a progress report of the current attempt; None when it was not."""
        job = self._jobs.get(msg.job_id)
        if job is None or msg.attempt != job.attempt or job.state is not JobState.RUNNING:
            return None
        stage = job.stage_progress(msg.fellow_id)
        if stage is None or stage.replica != msg.replica:
            return None  # each fellow reports for the replica it was placed in, only
        now = self._wall()
        if msg.event is ProgressEvent.STEP:
            apply_step(stage, msg, now=now)
            if stage.joining is not None:  # it trains: the job's figures count it
                stage.joining = None
                self._touch(job)
            if msg.state_digests:
                self._check_digests(job)
            job.refresh_view()
        elif msg.event is ProgressEvent.JOINING:
            if stage.joining == "starting":
                stage.joining = "ready"
                self.ring_due.add(job.job_id)
                self._touch(job)
        elif msg.event is ProgressEvent.CHECKPOINT:
            self._checkpoint_written(job, msg)
        elif msg.event is ProgressEvent.ENDED and msg.outcome is not None:
            self.record_outcome(msg.fellow_id, msg.outcome)
        return job

    def record_outcome(self, fellow_id: str, outcome: StageOutcome) -> JobRecord | None:
        """A stage run ended: the job completes when every stage has, fails when one fails."""
        job = self._jobs.get(outcome.job_id)
        if job is None or outcome.attempt != job.attempt or job.state is not JobState.RUNNING:
            return None
        stage = job.stage_progress(fellow_id)
        if stage is None or stage.result is not None:
            return None
        apply_outcome(stage, outcome, now=self._wall())
        stage.message = clean_report(stage.message, STAGE_MESSAGE_CHARS)
        if outcome.export_error is not None:
            stage.export_error = clean_report(outcome.export_error, EXPORT_ERROR_CHARS)
        self._touch(job)
        if outcome.result is StageResult.COMPLETED:
            self._complete_if_done(job)
            return job
        placed = None if job.placement is None else job.placement.stage_of(fellow_id)
        estimate = placed.memory_estimate_bytes if placed is not None else None
        if outcome.code == ErrorCode.STAGE_OUT_OF_MEMORY and estimate:
            # It needed more than placement's estimate (RAM, or VRAM on GPUs) on this fellow.
            note_out_of_memory(job, fellow_id, estimate)
        what = stage.message or outcome.result.value
        reason = f"fellow {fellow_id} (stage {stage.stage}) {outcome.result.value}: {what}"
        # A member refuses its donor's state (or what its predecessor forwarded as such)
        # while it switches, before it trains in the new rings: a refusal from one that
        # already trained in them is no refusal, and takes nobody along.
        switching = job.ring_epoch > 0 and (stage.sync_epoch or 0) < job.ring_epoch
        accused = elastic.accused_replica(job, stage.replica, outcome.code) if switching else None
        other = None if accused is None else self._fellow_of(job, accused, fellow_id)
        self.lose_stage(job.job_id, fellow_id, reason)
        if other is not None and job.state is JobState.RUNNING:
            # One of the two lies about the state handed over: neither is kept.
            why = (
                "it took no more of the state handed to it"
                if outcome.code == ErrorCode.SUCCESSOR_STALLED
                else "the state it sent was refused"
            )
            self.lose_stage(job.job_id, other, f"{reason} ({why})")
        return job

    def record_late_outcome(self, fellow_id: str, outcome: StageOutcome) -> None:
        """An outcome of an attempt already given up (its fellow's heartbeats repeat it until
        its next START). One that says its stage ran out of memory is noted against the
        fellow when it was placed in that attempt, and said in that attempt's resume record:
        a fellow whose group thrashed at its limit misses heartbeats, is taken for offline,
        and says why only after the job has resumed."""
        job = self._jobs.get(outcome.job_id)
        if job is None or job.terminal or outcome.code != ErrorCode.STAGE_OUT_OF_MEMORY:
            return
        gave_up = next((r for r in job.resumes if r.failed_attempt == outcome.attempt), None)
        if gave_up is None or fellow_id not in gave_up.memory_estimates:
            return
        estimate = gave_up.memory_estimates[fellow_id]
        if job.out_of_memory.get(fellow_id, estimate + 1) <= estimate:
            return  # noted already: when it ended in time, or at an earlier heartbeat
        note_out_of_memory(job, fellow_id, estimate)
        message = clean_report(outcome.message, STAGE_MESSAGE_CHARS)
        gave_up.reason = f"{gave_up.reason}; its stage said later: {message}"
        self._touch(job)

    def _complete_if_done(self, job: JobRecord) -> None:
        """COMPLETED once every stage that trains has; a replacement still joining then has
        nothing left to join, and is dropped (its stages stopped)."""
        trained = [p for p in job.progress if p.joining is None]
        if not trained or any(p.result is not StageResult.COMPLETED for p in trained):
            return
        joining = sorted({p.replica for p in job.progress if p.joining is not None})
        if joining:  # each drop comes back here: the last one completes the job
            self._drop_replica(job, joining[0], "the run ended before it could join")
            return
        # The last stage's losses; with replicas the mean of the replicas' last stages'
        # (swarm/types/views.py).
        lasts = replica_lasts(job.progress)
        job.final_loss = mean_of(s.loss for s in lasts)
        job.final_val_loss = mean_of(s.val_loss for s in lasts)
        # Decided with the state itself: whoever sees COMPLETED sees the export's fate.
        job.export_error = final_export_error(job)
        if job.export_error is not None:
            log.error("job %s completed without its final model: %s", job.job_id, job.export_error)
        self._finish(job, JobEvent.COMPLETED, "every stage completed")

    def _fellow_of(self, job: JobRecord, replica: int, fellow_id: str) -> str | None:
        """The fellow of ``replica`` that handed the stage on ``fellow_id`` its state in the
        current rings: its stage holding that stage's first layers (replicas may split the
        layers differently); None where the replica is placed no more."""
        refusing = None if job.placement is None else job.placement.stage_of(fellow_id)
        if job.placement is None or refusing is None:
            return None
        senders = [s for s in job.placement.pipeline(replica) if layers_overlap(s, refusing)]
        return senders[0].fellow_id if senders else None

    # --- elastic membership ---------------------------------------------------------------

    def lose_stage(
        self, job_id: str, fellow_id: str, reason: str, *, attempt: int | None = None
    ) -> JobRecord | None:
        """A running job lost the stage on ``fellow_id``: with replicas, drop that stage's
        replica and go on with the others (:func:`elastic.replica_to_drop`); else, or when no
        replica would be left, :meth:`fail` (resume or FAILED). ``attempt``: the attempt the
        loss was seen in (an answer that comes after a resume is not the new attempt's)."""
        job = self._jobs.get(job_id)
        if job is None or job.state is not JobState.RUNNING or job.placement is None:
            return None
        if attempt is not None and attempt != job.attempt:
            return None
        if job.placement.stage_of(fellow_id) is None:
            return job  # its replica was dropped already (a second stage of it lost)
        replica = elastic.replica_to_drop(job, fellow_id)
        if replica is None:
            return self.fail(job_id, reason)
        self._drop_replica(job, replica, reason)
        return job

    def _drop_replica(self, job: JobRecord, replica: int, reason: str) -> None:
        placement = job.placement
        assert placement is not None
        stages = [p for p in job.progress if p.replica == replica]
        # A replacement whose ring change went out is in the others' new ring: it needs one.
        joining = all(p.joining in ("starting", "ready") for p in stages)
        placement.replica_slots = placement.n_replicas
        placement.stages = [s for s in placement.stages if s.replica != replica]
        gone = [p for p in job.progress if p.replica == replica]
        job.progress = [p for p in job.progress if p.replica != replica]
        job.dropped = [*job.dropped, *gone][-DROPPED_LEN:]
        if placement.lead == replica:
            trained = [r for r in placement.live_replicas if r not in elastic.joining_replicas(job)]
            placement.lead = min(trained, default=placement.lead)
        running = [p.fellow_id for p in gone if p.result is None]
        if running:
            self.drops.setdefault(job.job_id, []).extend(running)
        still = {s.fellow_id for s in placement.stages}
        for fellow_id in dict.fromkeys(p.fellow_id for p in gone if p.fellow_id not in still):
            self.revokes.append((fellow_id, job.job_id, job.attempt))
        # A replacement that had not joined yet changes no ring.
        if not joining:
            self.ring_due.add(job.job_id)
            self.after_loss.add(job.job_id)
        kind = "refused" if joining else "lost"
        self._log_membership(job, kind, replica, [p.fellow_id for p in gone], reason)
        log.warning(
            "job %s: replica %d %s (%s); replicas %s go on",
            job.job_id,
            replica,
            "could not join" if joining else "lost",
            reason,
            placement.live_replicas,
        )
        self._complete_if_done(job)
        if job.state is JobState.RUNNING and not joining:
            # A member that had not reported its digest yet no longer holds the vote up.
            self._check_digests(job)

    def place_replacement(self, job_id: str, stages: list[PlacedStage]) -> JobRecord | None:
        """A replacement pipeline placed in a free slot of a running job: its stages join
        the placement and the progress as ``starting``."""
        job = self._jobs.get(job_id)
        if job is None or job.state is not JobState.RUNNING or job.placement is None:
            return None
        placement = job.placement
        placement.replica_slots = placement.n_replicas
        placement.stages = sorted([*placement.stages, *stages], key=lambda s: (s.replica, s.stage))
        replica = stages[0].replica
        job.progress.extend(
            StageProgress(
                stage=s.stage,
                fellow_id=s.fellow_id,
                replica=replica,
                total_steps=job.spec.steps,
                joining="starting",
                updated_at=self._wall(),
            )
            for s in stages
        )
        self._log_membership(job, "placed", replica, [s.fellow_id for s in stages])
        log.info(
            "job %s: replacement for replica %d placed on %s",
            job_id,
            replica,
            [s.fellow_id for s in stages],
        )
        return job

    def ring_changed(
        self,
        job_id: str,
        epoch: int,
        at_step: int,
        donor: int,
        *,
        members: Sequence[int],
        joined: list[int],
    ) -> None:
        """The orchestrator is sending ring ``epoch`` (from step ``at_step``, state from
        ``donor``, over the replicas ``members``) to every member: the stages of the
        ``joined`` replicas switch with it."""
        job = self._jobs.get(job_id)
        if job is None:
            return
        job.ring_epoch, job.ring_donor, job.ring_members = epoch, donor, sorted(members)
        self.after_loss.discard(job_id)
        for p in job.progress:
            if p.replica in joined:
                p.joining = "switching"
        for change in job.membership:  # the losses this ring goes on without
            if change.attempt == job.attempt and change.kind == "lost" and change.epoch is None:
                change.epoch, change.at_step = epoch, at_step
        for replica in joined:
            fellows = [p.fellow_id for p in job.progress if p.replica == replica]
            self._log_membership(job, "joined", replica, fellows, epoch=epoch, at_step=at_step)
        self._touch(job)

    def ready_to_join(self, job: JobRecord) -> list[int]:
        """The joining replicas all of whose stages are ready for their ring."""
        waiting: dict[int, bool] = {}
        for p in job.progress:
            if p.joining is not None:
                waiting[p.replica] = waiting.get(p.replica, True) and p.joining == "ready"
        return sorted(r for r, ready in waiting.items() if ready)

    def _log_membership(
        self,
        job: JobRecord,
        kind: str,
        replica: int,
        fellows: list[str],
        reason: str = "",
        *,
        epoch: int | None = None,
        at_step: int | None = None,
    ) -> None:
        job.membership.append(
            MembershipChange(
                at=self._wall(),
                attempt=job.attempt,
                kind=kind,
                replica=replica,
                fellows=fellows,
                reason=clean_report(reason, EXPORT_ERROR_CHARS),
                epoch=epoch,
                at_step=at_step,
            )
        )
        del job.membership[:-MEMBERSHIP_LOG_LEN]
        self._touch(job)

    def _check_digests(self, job: JobRecord) -> None:
        """Members whose state after the current ring change is not what the others took:
        lost; with no majority either way, nobody can be trusted: the attempt fails (and
        resumes, where it can)."""
        if job.ring_epoch == 0:
            return
        placement = job.placement
        if placement is None:
            return
        # The rings of the current epoch are over its members' splits: a replacement still
        # waiting to join (its ring change not sent: not a member) cuts none of them.
        waiting = {p.replica for p in job.progress if p.joining not in (None, "switching")}
        members = [r for r in placement.live_replicas if r not in waiting]
        segments_of = {
            s.fellow_id: placement.sync_segments(s, members)
            for s in placement.stages
            if s.replica in members
        }
        verdict = elastic.digest_verdict(
            job.progress, epoch=job.ring_epoch, segments_of=segments_of, donor=job.ring_donor
        )
        why = f"the state taken at ring change {job.ring_epoch} differs between replicas"
        if verdict.undecided:
            where = ", ".join(f"layers from {s}" for s in verdict.undecided)
            self.fail(job.job_id, f"{why}, with no majority (rings of {where})")
            return
        for fid in verdict.outvoted:
            self.lose_stage(job.job_id, fid, f"fellow {fid}: {why}; its sha256 is outvoted")

    def fail(self, job_id: str, reason: str) -> JobRecord | None:
        """A running job lost a stage: resume it when it can (back to PENDING, keeping its
        layer ranges), else FAILED with the reason and every earlier resume's."""
        job = self._jobs.get(job_id)
        if job is None or job.state is not JobState.RUNNING:
            return None
        step = resume_from(job)
        if isinstance(step, int):
            self._resume(job, reason, step)
            return job
        if job.resumes:
            earlier = "; ".join(f"attempt {r.failed_attempt}: {r.reason}" for r in job.resumes)
            reason = f"{reason}; not resumed: {step} (earlier: {earlier})"
        elif job.spec.max_resumes:
            reason = f"{reason}; not resumed: {step}"
        job.reason = reason
        self._finish(job, JobEvent.FAILED, reason)
        log.warning("job %s failed: %s", job_id, reason)
        return job

    def expire_resumes(self) -> list[JobRecord]:
        """Resumed jobs still waiting for fellows after their spec's resume_wait_s: FAILED."""
        now, expired = self._wall(), []
        for job in self.list():
            if job.state is not JobState.PENDING or not job.resumes or job.job_id in self.starting:
                continue
            last = job.resumes[-1]
            if now - last.at > job.spec.resume_wait_s:
                reason = (
                    f"could not resume within {job.spec.resume_wait_s:.0f}s ({job.reason}); "
                    f"attempt {last.failed_attempt}: {last.reason}"
                )
                job.reason = reason
                self._finish(job, JobEvent.FAILED, reason)
                log.warning("job %s failed: %s", job.job_id, reason)
                expired.append(job)
        return expired

    def _resume(self, job: JobRecord, reason: str, step: int) -> None:
        assert job.placement is not None
        now = self._wall()
        estimates = {
            s.fellow_id: s.memory_estimate_bytes
            for s in job.placement.stages
            if s.memory_estimate_bytes
        }
        job.resumes.append(
            ResumeRecord(
                at=now,
                failed_attempt=job.attempt,
                reason=reason,
                from_step=step,
                memory_estimates=estimates,
            )
        )
        job.resume_step = step
        # One pipeline's ranges: those of the shards it resumes from (the lead replica's when
        # they were pushed), else the lead's.
        job.layer_ranges = job.pushed_ranges or job.placement.split(job.placement.lead)
        self.resumed[job.job_id] = (
            job.attempt,
            [p.fellow_id for p in job.progress if p.result is None],
        )
        why = f"attempt {job.attempt} lost a fellow ({reason}); resuming from step {step}"
        self._transition(job, JobEvent.RESUMED, why)
        job.reason = why
        log.warning("job %s: %s", job.job_id, why)

    def record_push(self, job_id: str, receipt: ShardReceipt, complete_step: int | None) -> None:
        """A stage's shard arrived; ``complete_step``: the newest step every stage has."""
        job = self._jobs.get(job_id)
        if job is None:
            return
        job.latest_shard_pushes.append(receipt)
        del job.latest_shard_pushes[:-PUSH_LOG_LEN]
        if complete_step is not None:
            job.pushed_step = complete_step
            if job.placement is not None:  # only the lead replica pushes
                job.pushed_ranges = job.placement.split(job.placement.lead)
        self._touch(job)

    def add_signal(self, job_id: str, record: SignalRecord) -> None:
        job = self._jobs.get(job_id)
        if job is not None:
            job.signals.append(record)
            del job.signals[:-SIGNAL_LOG_LEN]
            self._touch(job)

    def checkpoint_target(self, job_id: str, *, lead_s: float = 2.0) -> tuple[JobRecord, int]:
        """The step at which every stage of a running job should checkpoint.

        A little ahead of the furthest stage, so the request reaches every stage before it
        gets there and all stages write the same step; never past the last step.
        """
        job = self.get(job_id)
        if job.state is not JobState.RUNNING:
            raise ConflictError(
                f"job {job_id} is {job.state.value}; only a RUNNING job can checkpoint",
                code=ErrorCode.JOB_NOT_RUNNING,
            )
        step = max((p.step for p in job.progress), default=0)
        times = [p.step_time_s for p in job.progress if p.step_time_s]
        ahead = max(2, elastic.steps_ahead(lead_s, max(times))) if times else 2
        return job, min(step + ahead, job.spec.steps)

    def add_checkpoint(self, job_id: str, record: CheckpointRecord) -> None:
        job = self.get(job_id)
        job.checkpoints.append(record)
        del job.checkpoints[:-CHECKPOINT_LOG_LEN]
        self._touch(job)

    # --- internals -------------------------------------------------------------------------

    def _checkpoint_written(self, job: JobRecord, msg: Progress) -> None:
        for record in reversed(job.checkpoints):
            if record.attempt != msg.attempt:
                continue
            if msg.checkpoint_id is not None and record.checkpoint_id != msg.checkpoint_id:
                continue
            for stage in record.stages:
                if stage.fellow_id == msg.fellow_id and stage.ok is None:
                    stage.ok, stage.step = msg.ok, msg.step
                    stage.message = clean_report(msg.message, STAGE_MESSAGE_CHARS)
                    path = msg.checkpoint_path
                    stage.path = None if path is None else clean_report(path, STAGE_MESSAGE_CHARS)
                    self._touch(job)
                    return

    def _finish(self, job: JobRecord, event: JobEvent, reason: str) -> None:
        # A job cancelled mid-START stays in ``starting`` (its fellows stay reserved) until
        # the round ends and stops them.
        self._retry.pop(job.job_id, None)
        job.finished_at = self._wall()
        self._transition(job, event, reason)

    def _transition(self, job: JobRecord, event: JobEvent, reason: str) -> None:
        try:
            state = next_job_state(job.state, event)
        except IllegalTransitionError as exc:
            log.error("job %s: %s (ignored)", job.job_id, exc.message)
            raise
        job.history.append(
            JobTransition(at=self._wall(), from_state=job.state, to_state=state, reason=reason)
        )
        del job.history[:-HISTORY_LEN]
        job.state = state
        self._touch(job)
        log.info("job %s -> %s (%s)", job.job_id, state.value, reason)

    def _touch(self, job: JobRecord) -> None:
        job.updated_at = self._wall()
        job.refresh_view()
        self.dirty.add(job.job_id)
