"""Derived views of a job, computed once: the pipeline's step and loss, and the job view.

One rule, wherever a job's numbers are shown (the leader's job records and Prometheus
metrics, the live metrics aggregator, ``run_manifest.json``, the CLI, sweeps and suites, and
the Ops UI, which reads the ``view`` the leader serves with every job record):

- the pipeline's **step** is the slowest stage's: a step is done once every stage has done it;
- its **loss** (and validation loss, learning rate, step time, tokens/s) is the **last
  stage's**, the only one that sees the targets; once the job completed, its final loss.

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
    """The job's loss: its final loss once there is one, else the last stage's latest."""
    if final_loss is not None:
        return final_loss
    last = last_stage(stages)
    return None if last is None else last.loss


class JobView(msgspec.Struct, frozen=True, kw_only=True):
    """A job's numbers as one pipeline: what the leader serves as a job record's ``view``."""

    step: int | None = None  # the pipeline's step (None before any stage was placed)
    total_steps: int | None = None
    loss: float | None = None  # the final loss once completed, else the last stage's latest
    val_loss: float | None = None
    lr: float | None = None  # the last stage's, like step_time_s and tokens_per_s
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    bytes_sent: int = 0  # every stage's together (each counts both its boundaries)
    bytes_received: int = 0
    fellows: list[str] = msgspec.field(default_factory=list)  # in stage order


def job_view(
    progress: Iterable[StageReport],
    *,
    total_steps: int | None = None,
    final_loss: float | None = None,
    final_val_loss: float | None = None,
) -> JobView:
    """The view of a job from its stages' progress; ``total_steps``: the spec's steps (the
    stages' own count, when they reported one, wins)."""
    stages = sorted(progress, key=lambda s: s.stage)
    last = last_stage(stages)
    val_loss = final_val_loss
    if val_loss is None and last is not None:
        val_loss = last.val_loss
    return JobView(
        step=pipeline_step(stages),
        total_steps=(last.total_steps if last is not None else None) or total_steps,
        loss=pipeline_loss(stages, final_loss),
        val_loss=val_loss,
        lr=None if last is None else last.lr,
        step_time_s=None if last is None else last.step_time_s,
        tokens_per_s=None if last is None else last.tokens_per_s,
        bytes_sent=sum(s.bytes_sent for s in stages),
        bytes_received=sum(s.bytes_received for s in stages),
        fellows=[s.fellow_id for s in stages],
    )


class StageProgress(msgspec.Struct, kw_only=True):
    """One stage of a job as the leader records and serves it (a job record's ``progress``):
    the leader's own record and what a client decodes from the REST JSON."""

    stage: int
    fellow_id: str
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
