"""One stage's progress, folded from what its fellow reports. Pure.

The one rule by which a :class:`~swarm.types.views.StageProgress` takes a progress record
or a stage outcome. The job's record (:class:`silentswarm.leader.jobs.JobManager`) folds live
reports with it; the metrics replays of the progress stream (:mod:`silentswarm.leader.aggregate`:
the SSE metrics stream, the loss curve) fold stored records with it. So a job's step and loss read
from its record and from a replay of its stream are the same numbers.
"""

from __future__ import annotations

from silentswarm.protocol import Progress, StageOutcome
from silentswarm.types.views import StageProgress

# The numbers a step record carries that a stage keeps until a record says otherwise.
_STEP_NUMBERS = ("loss", "val_loss", "lr", "step_time_s", "tokens_per_s", "sync_s")
# Counters the fellow keeps since its run began: the latest record's are the stage's.
_STEP_COUNTERS = (
    "bytes_sent",
    "bytes_received",
    "sync_bytes_sent",
    "sync_bytes_received",
    "sync_clipped",
    "sync_missed",
)


def apply_step(stage: StageProgress, msg: Progress, *, now: float) -> None:
    """A ``step`` record: the stage's step only grows, numbers a record leaves out stay,
    byte and sync counters are the fellow's latest. ``now``: when the record was taken.

    The stage's ``replica`` is the record's (a stage the leader placed has it from its
    placement already, and the fellow's record says the same)."""
    stage.step = max(stage.step, msg.step)
    stage.total_steps = msg.total_steps or stage.total_steps
    stage.replica = msg.replica
    for name in _STEP_NUMBERS:
        value = getattr(msg, name)
        if value is not None:
            setattr(stage, name, value)
    for name in _STEP_COUNTERS:
        setattr(stage, name, getattr(msg, name))
    stage.sync_epoch = msg.sync_epoch
    if msg.state_digests:
        stage.state_digests = dict(msg.state_digests)
    stage.link = msg.down_link or stage.link
    stage.tuning = msg.tuning or stage.tuning
    stage.updated_at = now


def apply_outcome(stage: StageProgress, outcome: StageOutcome, *, now: float) -> None:
    """How the stage's run ended: its result, and the step and losses it ended with.

    A fellow's ``export_error`` is left to the caller: the job's record cleans and keeps it,
    a metrics replay has no use for it."""
    stage.result, stage.message = outcome.result, outcome.message
    if outcome.step is not None:
        stage.step = max(stage.step, outcome.step)
    if outcome.loss is not None:
        stage.loss = outcome.loss
    if outcome.val_loss is not None:
        stage.val_loss = outcome.val_loss
    stage.updated_at = now
