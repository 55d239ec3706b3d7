"""The shared error hierarchy and every error code the project emits.

Every error that crosses a boundary (HTTP, NATS, a stage's events, the CLI) carries a stable
machine code, an :class:`ErrorCode`, and a human message; nothing else of an error crosses.
HTTP handlers map ``http_status``; the CLI prints ``message`` and exits with ``exit_code``.

Three modules hold every error class: this one (the shared core and the CLI),
``leader/errors.py`` and ``agent/errors.py``; each imports only this one.

Codes received from another process (a leader's error body, a fellow's ack) are decoded with
:func:`received_code`: a peer of another version, or a stranger, may send a code this version
does not know, and the receiver keeps that string as it came instead of failing on it.

Standard library only: ``agent/pipe`` imports it.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Every code on the wire. The values are public (clients, the Ops UI and scripts compare
    them): a member's value never changes, and no two members share one."""

    # --- the shared core and the CLI ---------------------------------------------------------
    SWARM_ERROR = "SWARM_ERROR"
    CONFIG_INVALID = "CONFIG_INVALID"
    NOT_FOUND = "NOT_FOUND"
    CONFLICT = "CONFLICT"
    PORT_IN_USE = "PORT_IN_USE"
    PROTOCOL_ERROR = "PROTOCOL_ERROR"
    ILLEGAL_TRANSITION = "ILLEGAL_TRANSITION"
    INVALID_FIELD = "INVALID_FIELD"
    JOB_INVALID = "JOB_INVALID"
    MANIFEST_INVALID = "MANIFEST_INVALID"
    NATS_SERVER_FAILED = "NATS_SERVER_FAILED"
    NATS_STORE_IN_USE = "NATS_STORE_IN_USE"
    NATS_AUTH_UNAVAILABLE = "NATS_AUTH_UNAVAILABLE"
    LEADER_UNREACHABLE = "LEADER_UNREACHABLE"
    LEADER_RESPONSE_INVALID = "LEADER_RESPONSE_INVALID"  # an answer this client cannot decode
    CLUSTER_FAILED = "CLUSTER_FAILED"
    CLUSTER_MANIFEST_DAMAGED = "CLUSTER_MANIFEST_DAMAGED"
    CLUSTER_NOT_RUNNING = "CLUSTER_NOT_RUNNING"
    CLUSTER_RECORD_LOST = "CLUSTER_RECORD_LOST"
    CLUSTER_NOT_STOPPED = "CLUSTER_NOT_STOPPED"
    JOB_NOT_COMPLETED = "JOB_NOT_COMPLETED"
    EXPORT_MISSING = "EXPORT_MISSING"
    SWEEP_REFUSED = "SWEEP_REFUSED"
    EXTRA_MISSING = "EXTRA_MISSING"  # an optional dependency (an extra) is not installed

    # --- the leader's HTTP answers -----------------------------------------------------------
    BAD_REQUEST = "BAD_REQUEST"
    VALIDATION_ERROR = "VALIDATION_ERROR"
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
    HTTP_ERROR = "HTTP_ERROR"  # an HTTP status that has no code of its own
    INTERNAL = "INTERNAL"
    UNAUTHORIZED = "UNAUTHORIZED"
    FORBIDDEN = "FORBIDDEN"
    TICKET_EXPIRED = "TICKET_EXPIRED"
    LEADER_NOT_READY = "LEADER_NOT_READY"
    STORAGE_UNAVAILABLE = "STORAGE_UNAVAILABLE"
    JETSTREAM_STORE_TOO_SMALL = "JETSTREAM_STORE_TOO_SMALL"
    STATE_UNREADABLE = "STATE_UNREADABLE"
    JOB_TERMINAL = "JOB_TERMINAL"
    JOB_NOT_RUNNING = "JOB_NOT_RUNNING"
    FELLOW_BUSY = "FELLOW_BUSY"  # also a fellow's refusal of START
    FELLOW_NAME_KNOWN = "FELLOW_NAME_KNOWN"
    FELLOW_NAME_RESERVED = "FELLOW_NAME_RESERVED"
    FELLOW_NAME_MISSING = "FELLOW_NAME_MISSING"
    FELLOW_ID_IN_USE = "FELLOW_ID_IN_USE"  # also a register reply
    ENROLL_DISABLED = "ENROLL_DISABLED"
    ENROLL_REFUSED = "ENROLL_REFUSED"
    JOIN_TOKEN_INVALID = "JOIN_TOKEN_INVALID"
    JOIN_SESSION_GONE = "JOIN_SESSION_GONE"
    PACKAGE_UNAVAILABLE = "PACKAGE_UNAVAILABLE"
    SHARD_TOKEN_INVALID = "SHARD_TOKEN_INVALID"
    ACCOUNT_FORBIDDEN = "ACCOUNT_FORBIDDEN"  # the account's role or ownership does not allow it
    ACCOUNT_EXISTS = "ACCOUNT_EXISTS"
    TOKEN_REVOKED = "TOKEN_REVOKED"
    POOL_FORBIDDEN = "POOL_FORBIDDEN"  # the account may not submit to that pool

    # --- the leader's register replies and signal records -------------------------------------
    SUBJECT_MISMATCH = "SUBJECT_MISMATCH"
    INSTANCE_MISMATCH = "INSTANCE_MISMATCH"
    INSTANCE_SECRET_INVALID = "INSTANCE_SECRET_INVALID"
    RELEASED = "RELEASED"
    PURGE_PENDING = "PURGE_PENDING"
    NO_ANSWER = "NO_ANSWER"  # no try of a signal was answered

    # --- a fellow's signal acks (refusals) ----------------------------------------------------
    AGENT_STOPPING = "AGENT_STOPPING"
    PLAN_INVALID = "PLAN_INVALID"
    START_INVALID = "START_INVALID"
    CHECKPOINT_INVALID = "CHECKPOINT_INVALID"
    STOP_INVALID = "STOP_INVALID"
    UPDATE_INVALID = "UPDATE_INVALID"
    PURGE_INVALID = "PURGE_INVALID"
    RING_INVALID = "RING_INVALID"
    PROBE_INVALID = "PROBE_INVALID"
    PROBE_REFUSED = "PROBE_REFUSED"  # a fellow that runs a stage (or probes) measures no link
    START_STALE = "START_STALE"
    START_FAILED = "START_FAILED"
    NOT_TRAINING = "NOT_TRAINING"
    RUNTIME_GONE = "RUNTIME_GONE"
    SIGNAL_FAILED = "SIGNAL_FAILED"

    # --- the agent and the stage runtime (error events, logs, exit lines) ---------------------
    UPDATE_FAILED = "UPDATE_FAILED"
    SHARD_PUSH_FAILED = "SHARD_PUSH_FAILED"
    SHARD_FETCH_FAILED = "SHARD_FETCH_FAILED"
    STAGE_FAILED = "STAGE_FAILED"  # also a stage's failure that has no code of its own
    # the kernel's out-of-memory killer ended a stage runtime (its fellow's cgroup or host)
    STAGE_OUT_OF_MEMORY = "STAGE_OUT_OF_MEMORY"
    DONOR_REFUSED = "DONOR_REFUSED"  # a ring member refused the donor's state (far, not finite)
    # a ring member refused the donor's state as its predecessor forwarded it at a ring change
    # (malformed, of the wrong shape, unsigned or signed by another than the donor)
    FORWARD_REFUSED = "FORWARD_REFUSED"
    # a ring member's successor took none of the state it handed on at a ring change for the
    # timeout (it granted no credit)
    SUCCESSOR_STALLED = "SUCCESSOR_STALLED"
    LINK_FAILED = "LINK_FAILED"
    PEER_TIMEOUT = "PEER_TIMEOUT"
    RELAY_GAP = "RELAY_GAP"
    HANDSHAKE_REFUSED = "HANDSHAKE_REFUSED"
    FRAME_INVALID = "FRAME_INVALID"
    DATA_INVALID = "DATA_INVALID"
    CHECKPOINT_FAILED = "CHECKPOINT_FAILED"
    CHECKPOINT_WRITE_FAILED = "CHECKPOINT_WRITE_FAILED"
    GENERATE_INVALID = "GENERATE_INVALID"
    GLUE_INVALID = "GLUE_INVALID"
    GLUE_MISMATCH = "GLUE_MISMATCH"
    COMPLETION_INVALID = "COMPLETION_INVALID"
    SERVER_BUSY = "SERVER_BUSY"
    SERVE_INVALID = "SERVE_INVALID"


def received_code(value: str) -> ErrorCode | str:
    """A code another process sent: its member when this version knows it, else the string
    as it came (a newer peer or a stranger may send any code; that is no reason to fail)."""
    try:
        return ErrorCode(value)
    except ValueError:
        return value


class SwarmError(Exception):
    """Base of every error SilentSwarm raises on purpose."""

    code: ErrorCode = ErrorCode.SWARM_ERROR
    http_status: int = 500
    exit_code: int = 1

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, str]:
        return {"code": str(self.code), "message": self.message}


class ConfigError(SwarmError):
    """A setting, flag or config file is wrong; the message names it."""

    code = ErrorCode.CONFIG_INVALID
    http_status = 400
    exit_code = 2


class NotFoundError(SwarmError):
    code = ErrorCode.NOT_FOUND
    http_status = 404


class ConflictError(SwarmError):
    code = ErrorCode.CONFLICT
    http_status = 409


class PortInUseError(ConfigError):
    """A port we must listen on is taken; the message names the port and the setting."""

    code = ErrorCode.PORT_IN_USE


class NatsServerError(SwarmError):
    """The nats-server binary is missing or did not come up."""

    code = ErrorCode.NATS_SERVER_FAILED


class StoreInUseError(NatsServerError):
    """Another nats-server already runs on this JetStream store: one store, one server. The
    message names that server and who started it."""

    code = ErrorCode.NATS_STORE_IN_USE


class NatsAuthError(SwarmError):
    """The NATS authority is missing or cannot do what was asked."""

    code = ErrorCode.NATS_AUTH_UNAVAILABLE
    http_status = 409


class ProtocolError(SwarmError):
    """A peer's message could not be decoded or does not fit its subject."""

    code = ErrorCode.PROTOCOL_ERROR
    http_status = 400


class IllegalTransitionError(SwarmError):
    """A lifecycle table has no edge for this state and event."""

    code = ErrorCode.ILLEGAL_TRANSITION
    http_status = 409


class FieldError(ConfigError):
    """One field of a submitted document is unknown or has the wrong type."""

    code = ErrorCode.INVALID_FIELD

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field

    def to_dict(self) -> dict[str, str]:
        return {**super().to_dict(), "field": self.field}


class JobSpecError(ConfigError):
    """The spec decodes but describes a job that cannot run."""

    code = ErrorCode.JOB_INVALID


class ManifestError(ConfigError):
    """A manifest that cannot be read: the message names the file and the field."""

    code = ErrorCode.MANIFEST_INVALID


# --- the CLI ----------------------------------------------------------------------------------


class LeaderUnreachableError(SwarmError):
    code = ErrorCode.LEADER_UNREACHABLE
    exit_code = 3


class LeaderResponseError(SwarmError):
    """The leader answered with an error body; code and message are the leader's.

    ``code`` is the leader's as :func:`received_code` reads it: a member, or the string as
    it came when this version does not know it.
    """

    code: ErrorCode | str
    exit_code = 1

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = received_code(code)


class ClusterError(SwarmError):
    """start-cluster / stop-cluster could not do what was asked."""

    code = ErrorCode.CLUSTER_FAILED


class JobEndedBadlyError(SwarmError):
    """The watched job ended other than COMPLETED."""

    code = ErrorCode.JOB_NOT_COMPLETED
    exit_code = 1


class ExportMissingError(SwarmError):
    """The job COMPLETED (its training finished) but its final model is not in the export:
    the record's ``export_error`` says which stage, fellow, path and cause. Its own exit code,
    so that scripts can tell "no model" from "the job failed" (1)."""

    code = ErrorCode.EXPORT_MISSING
    exit_code = 4


class SweepRefusedError(SwarmError):
    """The swarm cannot run the sweep as it is (the message says what is missing)."""

    code = ErrorCode.SWEEP_REFUSED
    exit_code = 1


class ExtraMissingError(SwarmError):
    """What was asked needs an optional dependency that is not installed; the message names
    the extra that brings it (``pip install 'silentswarm[plots]'``)."""

    code = ErrorCode.EXTRA_MISSING
    exit_code = 1
