"""A job as the leader records and serves it: ``GET /api/v1/jobs`` and the routes that
answer with a job, a checkpoint round or a signal (and the leader's KV store keeps it so).

The leader's :mod:`silentswarm.leader.jobs` owns the logic; these are the records, here so that the
CLI, sweeps and suites decode the REST JSON into the same types the leader encodes.
"""

from __future__ import annotations

import msgspec

from silentswarm.jobspec import JobSpec, Placement
from silentswarm.lifecycle import TERMINAL_JOB_STATES
from silentswarm.plan import Transport
from silentswarm.protocol import JobState
from silentswarm.types.views import JobView, StageProgress, job_view


class JobTransition(msgspec.Struct, kw_only=True):
    at: float
    from_state: JobState | None
    to_state: JobState
    reason: str


class SignalRecord(msgspec.Struct, kw_only=True):
    """One signal the leader sent and how it ended: the fellow's ack, or ``NO_ANSWER``.

    The leader writes it (not a fellow's :class:`SignalAck` as sent): the ids are the signal's
    and its target's, the words the fellow's, cleaned."""

    signal_id: str
    fellow_id: str
    ok: bool
    code: str | None = None
    message: str = ""
    duplicate: bool = False
    kind: str
    sent_at: float
    attempts: int


class CheckpointStage(msgspec.Struct, kw_only=True):
    fellow_id: str
    acknowledged: bool = False
    ok: bool | None = None  # None until the fellow reports the checkpoint written
    step: int | None = None
    path: str | None = None
    message: str = ""


class CheckpointRecord(msgspec.Struct, kw_only=True):
    checkpoint_id: str
    requested_at: float
    attempt: int
    at_step: int | None
    stages: list[CheckpointStage]


class ResumeRecord(msgspec.Struct, kw_only=True):
    at: float
    failed_attempt: int
    reason: str
    from_step: int
    # The memory placement estimated for each fellow's stage in the failed attempt: a stage
    # of it that reports running out of memory only after the attempt was given up (its
    # fellow stalled while the kernel reclaimed, and was taken for offline) is still noted
    # against that fellow (JobRecord.out_of_memory).
    memory_estimates: dict[str, int] = msgspec.field(default_factory=dict)


class ShardReceipt(msgspec.Struct, kw_only=True):
    """A stage's shard arrived whole and verified."""

    fellow_id: str
    stage: int
    step: int
    attempt: int
    size: int  # both files
    sha256: str  # of the arrays (.npz)
    at: float


class MembershipChange(msgspec.Struct, kw_only=True):
    """Elastic membership: a replica of a running attempt was lost (``lost``: its stages were
    stopped, the others went on without it), a replacement was placed for its slot
    (``placed``), or joined the ring (``joined``); ``epoch`` and ``at_step``: the ring the
    members switched to and the step they did (None when no switch was sent: the run was
    about to end, or the replacement is still starting)."""

    at: float
    attempt: int
    kind: str  # lost, placed, joined, refused
    replica: int
    fellows: list[str]
    reason: str = ""
    epoch: int | None = None
    at_step: int | None = None


class InitSource(msgspec.Struct, kw_only=True, frozen=True):
    """What a job's ``init_from: "job:ID"`` or ``"export:DIR"`` resolved to when it was
    submitted: the export directory, the step its manifest holds, the manifest's sha256
    (every later download is checked against what was resolved), the source job's id."""

    directory: str
    step: int
    manifest_sha256: str
    job_id: str
    # The account the manifest says wrote it (None: not said): the owner once the source
    # job's record is deleted.
    owner: str | None = None


class JobRecord(msgspec.Struct, kw_only=True):
    job_id: str
    name: str
    spec: JobSpec
    state: JobState
    created_at: float
    updated_at: float
    attempt: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    # PENDING: why it waits; FAILED: which fellow failed and how; CANCELLED: by whom.
    reason: str = ""
    placement: Placement | None = None
    progress: list[StageProgress] = msgspec.field(default_factory=list)
    final_loss: float | None = None
    final_val_loss: float | None = None
    checkpoints: list[CheckpointRecord] = msgspec.field(default_factory=list)
    signals: list[SignalRecord] = msgspec.field(default_factory=list)
    history: list[JobTransition] = msgspec.field(default_factory=list)
    # Exports: where the shards go, the newest step every stage pushed, the latest pushes.
    export_dir: str | None = None
    # While running: why the leader could not store the export (a full disk...), cleared by
    # the next complete step. Once COMPLETED: why the final model is not in the export
    # (final_export_error), naming the stage, fellow, path and cause; None: it is there.
    export_error: str | None = None
    pushed_step: int | None = None
    # The layer ranges of the pipeline that pushed ``pushed_step`` (the lead replica's then:
    # with replicas that split the layers differently, a lead that took over later may split
    # them otherwise): what a resume and the export's manifest use.
    pushed_ranges: list[tuple[int, int]] | None = None
    latest_shard_pushes: list[ShardReceipt] = msgspec.field(default_factory=list)
    # Automatic resume: each one, the step the current attempt started from, and the layer
    # ranges every attempt keeps (learned bottlenecks stay where they were trained).
    resumes: list[ResumeRecord] = msgspec.field(default_factory=list)
    resume_step: int | None = None
    # init_from "job:"/"export:": the export the job starts from (None: random or a preset).
    init_source: InitSource | None = None
    layer_ranges: list[tuple[int, int]] | None = None
    # The job's numbers as one pipeline (swarm/types/views.py), derived from ``progress``
    # and the final losses whenever they change: what the Ops UI shows.
    view: JobView = msgspec.field(default_factory=JobView)
    # Hidden from ``GET /api/v1/jobs`` and the metrics (still served by id and with
    # ``?all=true``): a finished job beyond SWARM_JOBS_KEEP_FINISHED or
    # SWARM_JOBS_ARCHIVE_AFTER_S (leader.retention). A default, so older records decode.
    archived: bool = False
    # The account that submitted the job (swarm.types.accounts); records written before
    # accounts existed belong to the operator.
    owner: str = "operator"
    # Elastic membership: the replicas' ring epoch in force (0: the placement's), the
    # progress of the stages of replicas lost in this attempt (they left ``progress``), and
    # the changes, newest last (the last MEMBERSHIP_LOG_LEN).
    ring_epoch: int = 0
    ring_donor: int | None = None  # the replica whose state the current ring took
    ring_members: list[int] = msgspec.field(default_factory=list)  # its replicas, in order
    dropped: list[StageProgress] = msgspec.field(default_factory=list)
    membership: list[MembershipChange] = msgspec.field(default_factory=list)
    # Fellows on which a stage of this job ran out of memory (STAGE_OUT_OF_MEMORY), with the
    # memory placement estimated that stage needed (RAM, or VRAM on GPUs): it needed more, so
    # the job's later attempts give such a fellow only stages estimated below that
    # (leader.jobs.offered_to).
    out_of_memory: dict[str, int] = msgspec.field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_JOB_STATES

    def stage_progress(self, fellow_id: str) -> StageProgress | None:
        return next((p for p in self.progress if p.fellow_id == fellow_id), None)

    def stages(self) -> list[StageProgress]:
        """The stages' progress in stage order."""
        return sorted(self.progress, key=lambda s: s.stage)

    def current_view(self) -> JobView:
        """The view from the record as it is now (``view`` is this, as of the last change).

        Clients compute it too, rather than trust ``view``: a leader from before the view
        served none."""
        return job_view(
            [p for p in self.progress if not p.joining],
            total_steps=self.spec.steps,
            final_loss=self.final_loss,
            final_val_loss=self.final_val_loss,
        )

    def refresh_view(self) -> None:
        self.view = self.current_view()


class JobConfig(msgspec.Struct, kw_only=True):
    """What a job runs with, in one place: the settings its spec (and the leader's defaults)
    gave it and its latest shard pushes. Derived from the record whenever a job is served
    (``config`` of :class:`ServedJob`), never stored: the record's own fields stay the truth."""

    # The transport in use: the placement's (auto may have fallen back to the relay), else
    # the spec's (the leader's SWARM_PIPELINE_TRANSPORT when the job named none).
    transport: Transport | None
    compression: str
    shard_push_interval_steps: int
    shard_push_to_leader: bool
    # The export directory on the leader (once chosen), else the spec's.
    model_export_dir: str | None
    pushed_step: int | None
    # The record's ``latest_shard_pushes``: the newest receipts, oldest first.
    latest_shard_pushes: list[ShardReceipt]

    @classmethod
    def of(cls, job: JobRecord) -> JobConfig:
        spec = job.spec
        return cls(
            transport=job.placement.transport if job.placement is not None else spec.transport,
            compression=spec.compression,
            shard_push_interval_steps=spec.shard_push_interval_steps,
            shard_push_to_leader=spec.shard_push_to_leader,
            model_export_dir=job.export_dir or spec.artifact_paths.model_export_dir,
            pushed_step=job.pushed_step,
            latest_shard_pushes=job.latest_shard_pushes,
        )


class ServedJob(JobRecord, kw_only=True):
    """A job as the REST API serves it: the record and its ``config``
    (``config.latest_shard_pushes`` among it). The leader stores :class:`JobRecord`."""

    # None only from a leader that served no config.
    config: JobConfig | None = None

    @classmethod
    def of(cls, job: JobRecord) -> ServedJob:
        fields = {name: getattr(job, name) for name in job.__struct_fields__}
        return cls(**fields, config=JobConfig.of(job))


class JobEnd(msgspec.Struct, kw_only=True):
    """The ``end`` event of a job's metrics stream (SSE): how the job ended."""

    job_id: str
    state: JobState
    reason: str
    final_loss: float | None
    final_val_loss: float | None
