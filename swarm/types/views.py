"""Derived views of a job, computed once: the pipeline's step and loss, and the job view.

One rule, wherever a job's numbers are shown (the leader's job records and Prometheus
metrics, the live metrics aggregator, ``run_manifest.json``, the CLI, sweeps and suites, and
the Ops UI, which reads the ``view`` the leader serves with every job record):

- the pipeline's **step** is the slowest stage's: a step is done once every stage has done it;
- its **loss** (and validation loss, learning rate, step time, tokens/s) is the **last
  stage's**, the only one that sees the targets; once the job completed, its final loss.

A job with replicas (``replicas`` > 1: k copies of the pipeline, each stage's ``replica``
saying which) is k pipelines by the same rule, each with its own step, loss and rate
(:class:`ReplicaView`), and as a job: the **step** is the slowest stage's of all (the
slowest replica's), the **loss** and validation loss the **mean** of the replicas' last
stages' (each replica trains on its own slice of every step's data: the mean is the loss of
the whole batch), **tokens/s** the **sum** of the replicas' rates (each pipeline's, its last
stage's), the step time the slowest replica's, the learning rate replica 0's. With one
replica every number is what it was without replicas.

Pure functions over anything with a stage's numbers (:class:`StageProgress`, the leader's
record of a stage and what a client decodes from a job record's JSON; the aggregator's
``FellowMetrics``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

import msgspec

from silentswarm.protocol import StageResult
from silentswarm.types.links import LinkStats, Tuning


class StageNumbers(Protocol):
    """What the step and loss rules read of one stage."""

    @property
    def stage(self) -> int: ...

    @property
    def step(self) -> int: ...


class StageReport(StageNumbers, Protocol):
    """What a job view reads of one stage's progress."""

    @property
    def fellow_id(self) -> str: ...

    @property
    def total_steps(self) -> int | None: ...

    @property
    def loss(self) -> float | None: ...

    @property
    def val_loss(self) -> float | None: ...

    @property
    def lr(self) -> float | None: ...

    @property
    def step_time_s(self) -> float | None: ...

    @property
    def tokens_per_s(self) -> float | None: ...

    @property
    def bytes_sent(self) -> int: ...

    @property
    def bytes_received(self) -> int: ...


S = TypeVar("S", bound=StageNumbers)


def replica_of(stage: object) -> int:
    """The replica (pipeline) a stage is of; 0 for what knows no replicas."""
    return getattr(stage, "replica", 0) or 0


def by_replica(stages: Iterable[S]) -> dict[int, list[S]]:
    """The stages of each replica, in replica order, each replica's in stage order."""
    out: dict[int, list[S]] = {}
    for stage in sorted(stages, key=lambda s: (replica_of(s), s.stage)):
        out.setdefault(replica_of(stage), []).append(stage)
    return out


def replica_lasts(stages: Iterable[S]) -> list[S]:
    """Each replica's last stage (the head of each pipeline), in replica order."""
    return [group[-1] for group in by_replica(stages).values()]


def mean_of(values: Iterable[float | None]) -> float | None:
    """The mean of the known values (None if none is); one value is itself, exactly."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def pipeline_step(stages: Iterable[StageNumbers]) -> int | None:
    """The step every stage has finished (the slowest stage's); None without stages."""
    return min((s.step for s in stages), default=None)


def last_stage(stages: Iterable[S]) -> S | None:
    """The stage with the highest index: the head, whose loss is the pipeline's."""
    return max(stages, key=lambda s: s.stage, default=None)


def is_last_stage(stage: int | None, stages: Iterable[StageNumbers]) -> bool:
    """Whether ``stage`` is (so far) the last of ``stages``: no known stage comes after it."""
    return stage is not None and all(stage >= s.stage for s in stages)


def pipeline_loss(stages: Iterable[StageReport], final_loss: float | None = None) -> float | None:
    """The job's loss: its final loss once there is one, else the last stage's latest (with
    replicas, the mean of the replicas' last stages' latest)."""
    if final_loss is not None:
        return final_loss
    return mean_of(s.loss for s in replica_lasts(stages))


class ReplicaView(msgspec.Struct, frozen=True, kw_only=True):
    """One replica of a job with replicas, as a pipeline of its own (the rule of one
    pipeline over its stages), with its stages' sync with the other replicas."""

    replica: int
    step: int | None = None  # its slowest stage's
    loss: float | None = None  # its last stage's, like val_loss, step_time_s and tokens_per_s
    val_loss: float | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    # Its stages' latest step's sync seconds (the longest), and their bytes over the rings.
    sync_s: float | None = None
    sync_bytes_sent: int = 0
    sync_bytes_received: int = 0
    fellows: list[str] = msgspec.field(default_factory=list)  # in stage order


def replica_view(replica: int, stages: list[StageReport]) -> ReplicaView:
    """The view of one replica from its stages' progress."""
    last = last_stage(stages)
    return ReplicaView(
        replica=replica,
        step=pipeline_step(stages),
        loss=None if last is None else last.loss,
        val_loss=None if last is None else last.val_loss,
        step_time_s=None if last is None else last.step_time_s,
        tokens_per_s=None if last is None else last.tokens_per_s,
        sync_s=max(
            (v for s in stages if (v := getattr(s, "sync_s", None)) is not None), default=None
        ),
        sync_bytes_sent=sum(getattr(s, "sync_bytes_sent", 0) for s in stages),
        sync_bytes_received=sum(getattr(s, "sync_bytes_received", 0) for s in stages),
        fellows=[s.fellow_id for s in sorted(stages, key=lambda s: s.stage)],
    )


class JobView(msgspec.Struct, frozen=True, kw_only=True):
    """A job's numbers as one pipeline: what the leader serves as a job record's ``view``.

    With replicas: the step the slowest replica's, the losses the mean of the replicas'
    last stages', tokens/s their sum, the step time the slowest replica's, ``replicas``
    each replica's own view (empty for a job of one pipeline)."""

    step: int | None = None  # the pipeline's step (None before any stage was placed)
    total_steps: int | None = None
    loss: float | None = None  # the final loss once completed, else the last stage's latest
    val_loss: float | None = None
    lr: float | None = None  # the last stage's, like step_time_s and tokens_per_s
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    bytes_sent: int = 0  # every stage's together (each counts both its boundaries)
    bytes_received: int = 0
    fellows: list[str] = msgspec.field(default_factory=list)  # in (replica, stage) order
    # Replicas: every stage's bytes over the replicas' rings (each counts both its links),
    # and each replica as a pipeline of its own.
    sync_bytes_sent: int = 0
    sync_bytes_received: int = 0
    replicas: list[ReplicaView] = msgspec.field(default_factory=list)


def job_view(
    progress: Iterable[StageReport],
    *,
    total_steps: int | None = None,
    final_loss: float | None = None,
    final_val_loss: float | None = None,
) -> JobView:
    """The view of a job from its stages' progress; ``total_steps``: the spec's steps (the
    stages' own count, when they reported one, wins).

    With replicas the job's tokens/s is the sum over the replicas of each pipeline's rate,
    its loss and validation loss the mean of the replicas' last stages', its step time the
    slowest replica's; one replica gives the numbers of one pipeline, exactly."""
    groups = by_replica(progress)
    stages = [s for group in groups.values() for s in group]
    lasts = [group[-1] for group in groups.values()]
    head = lasts[0] if lasts else None  # replica 0's (the only one's) last stage
    val_loss = final_val_loss
    if val_loss is None:
        val_loss = mean_of(s.val_loss for s in lasts)
    rates = [s.tokens_per_s for s in lasts if s.tokens_per_s is not None]
    times = [s.step_time_s for s in lasts if s.step_time_s is not None]
    replicated = len(groups) > 1
    return JobView(
        step=pipeline_step(stages),
        total_steps=(head.total_steps if head is not None else None) or total_steps,
        loss=pipeline_loss(stages, final_loss),
        val_loss=val_loss,
        lr=None if head is None else head.lr,
        step_time_s=max(times) if times else None,
        tokens_per_s=sum(rates) if rates else None,
        bytes_sent=sum(s.bytes_sent for s in stages),
        bytes_received=sum(s.bytes_received for s in stages),
        fellows=[s.fellow_id for s in stages],
        sync_bytes_sent=sum(getattr(s, "sync_bytes_sent", 0) for s in stages),
        sync_bytes_received=sum(getattr(s, "sync_bytes_received", 0) for s in stages),
        replicas=[replica_view(r, group) for r, group in groups.items()] if replicated else [],
    )


class StageProgress(msgspec.Struct, kw_only=True):
    """One stage of a job as the leader records and serves it (a job record's ``progress``):
    the leader's own record and what a client decodes from the REST JSON."""

    stage: int
    fellow_id: str
    replica: int = 0  # the pipeline the stage is of (a job with replicas)
    step: int = 0
    total_steps: int | None = None
    loss: float | None = None
    val_loss: float | None = None
    lr: float | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    # Its downstream boundary as last measured (with the codecs in use), and the schedule
    # the stages then agreed on: the latest calibration's.
    link: LinkStats | None = None
    tuning: Tuning | None = None
    result: StageResult | None = None
    message: str = ""
    # Why the stage's final shard is not on the leader, as its fellow told (cleaned).
    export_error: str | None = None
    updated_at: float | None = None
    # Replicas: the latest step's seconds of sync with the stage's other replicas, the bytes
    # over their ring, and the contributions clipped and replicas left out so far.
    sync_s: float | None = None
    sync_bytes_sent: int = 0
    sync_bytes_received: int = 0
    sync_clipped: int = 0
    sync_missed: int = 0
    # Elastic membership: where a stage of a replica joining the running job stands
    # ("starting", "ready": waiting for its ring, "switching": its ring change is sent; None
    # once it trains, and for every other stage: a joining stage counts in no figure of the
    # job), the ring epoch it is in, and the sha256 of the state it took from the donor
    # in each of its rings (by segment: the first layer) when those rings formed.
    joining: str | None = None
    sync_epoch: int = 0
    state_digests: dict[int, str] = msgspec.field(default_factory=dict)
