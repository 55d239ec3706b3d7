"""The fellow and job lifecycles as pure transition tables.

The agent drives its own status with the fellow table; the leader mirrors what each fellow
reports and uses the table only for the transitions it owns (a stale fellow goes offline, an
offline one that speaks again goes back through registering). The leader's JobManager
drives every job through the job table.
"""

from __future__ import annotations

import enum

from silentswarm.errors import IllegalTransitionError
from silentswarm.protocol import FellowStatus as S
from silentswarm.protocol import JobState as J


class FellowEvent(enum.StrEnum):
    REGISTERED = "registered"  # the leader accepted the register request
    START = "start"  # START signal
    CHECKPOINT = "checkpoint"  # CHECKPOINT signal
    CHECKPOINT_WRITTEN = "checkpoint_written"  # the job goes on
    FINAL_CHECKPOINT_WRITTEN = "final_checkpoint_written"
    JOB_TERMINAL = "job_terminal"  # completed, cancelled or failed elsewhere
    UPDATE = "update"  # UPDATE signal: re-bootstrap, then register again
    HEARTBEAT_STALE = "heartbeat_stale"
    FAILURE = "failure"  # exception or peer timeout in the runtime
    RECOVERED = "recovered"  # failure reported, runtime cleaned up
    RECONNECT = "reconnect"  # process restart or NATS reconnect


TRANSITIONS: dict[tuple[S, FellowEvent], S] = {
    (S.REGISTERING, FellowEvent.REGISTERED): S.READY,
    (S.READY, FellowEvent.START): S.TRAINING,
    (S.TRAINING, FellowEvent.CHECKPOINT): S.CHECKPOINTING,
    (S.CHECKPOINTING, FellowEvent.CHECKPOINT_WRITTEN): S.TRAINING,
    (S.CHECKPOINTING, FellowEvent.FINAL_CHECKPOINT_WRITTEN): S.READY,
    (S.TRAINING, FellowEvent.JOB_TERMINAL): S.READY,
    (S.READY, FellowEvent.UPDATE): S.REGISTERING,
    # ARCHITECTURE.md names ready and training; a fellow that dies while registering,
    # checkpointing or failed is just as gone, so every live status can go stale.
    (S.REGISTERING, FellowEvent.HEARTBEAT_STALE): S.OFFLINE,
    (S.READY, FellowEvent.HEARTBEAT_STALE): S.OFFLINE,
    (S.TRAINING, FellowEvent.HEARTBEAT_STALE): S.OFFLINE,
    (S.CHECKPOINTING, FellowEvent.HEARTBEAT_STALE): S.OFFLINE,
    (S.FAILED, FellowEvent.HEARTBEAT_STALE): S.OFFLINE,
    (S.TRAINING, FellowEvent.FAILURE): S.FAILED,
    # A job can end (cancelled, a peer failed) or the runtime can fail while a checkpoint is
    # being written, so checkpointing leaves the same two ways training does.
    (S.CHECKPOINTING, FellowEvent.JOB_TERMINAL): S.READY,
    (S.CHECKPOINTING, FellowEvent.FAILURE): S.FAILED,
    (S.FAILED, FellowEvent.RECOVERED): S.READY,
    (S.OFFLINE, FellowEvent.RECONNECT): S.REGISTERING,
}


def next_status(status: S, event: FellowEvent) -> S:
    """The status after ``event``; IllegalTransitionError when the table has no such edge."""
    try:
        return TRANSITIONS[(status, event)]
    except KeyError:
        raise IllegalTransitionError(
            f"fellow in {status.value!r} cannot take event {event.value!r}"
        ) from None


def can_go_offline(status: S) -> bool:
    return (status, FellowEvent.HEARTBEAT_STALE) in TRANSITIONS


# --- jobs -----------------------------------------------------------------------------------


class JobEvent(enum.StrEnum):
    STARTED = "started"  # every placed fellow acknowledged START
    COMPLETED = "completed"  # every stage reported completion
    FAILED = "failed"  # a stage failed, or its fellow went offline
    CANCELLED = "cancelled"  # DELETE /api/v1/jobs/{job_id}
    RESUMED = "resumed"  # a fellow was lost; the job waits to start its next attempt


JOB_TRANSITIONS: dict[tuple[J, JobEvent], J] = {
    (J.PENDING, JobEvent.STARTED): J.RUNNING,
    (J.RUNNING, JobEvent.COMPLETED): J.COMPLETED,
    (J.RUNNING, JobEvent.FAILED): J.FAILED,
    (J.RUNNING, JobEvent.RESUMED): J.PENDING,
    (J.PENDING, JobEvent.FAILED): J.FAILED,  # a resumed job found no fellows in time
    (J.PENDING, JobEvent.CANCELLED): J.CANCELLED,
    (J.RUNNING, JobEvent.CANCELLED): J.CANCELLED,
}

TERMINAL_JOB_STATES = frozenset({J.COMPLETED, J.FAILED, J.CANCELLED})


def next_job_state(state: J, event: JobEvent) -> J:
    """The job state after ``event``; IllegalTransitionError when the table has no such edge."""
    try:
        return JOB_TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransitionError(
            f"job in {state.value} cannot take event {event.value!r}"
        ) from None
