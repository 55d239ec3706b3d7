"""Every error the agent and the stage runtime raise, each with its
:class:`~swarm.errors.ErrorCode`.

A stage that fails on one of these reports its code in its ``error`` event; the agent logs
refusals and failures with theirs. Imports only :mod:`silentswarm.errors` (standard library
otherwise), so the pipe, the runtime and the agent can all import it without a cycle and
without TensorFlow.
"""

from __future__ import annotations

from pathlib import Path

from silentswarm.errors import ConfigError, ErrorCode, SwarmError

# --- the data plane (agent/pipe) --------------------------------------------------------------


class LinkError(SwarmError):
    """The link cannot deliver: the message names the boundary and the peer."""

    code = ErrorCode.LINK_FAILED


class PeerTimeoutError(LinkError):
    """Nothing came from the peer, or no peer took a message, within the peer timeout."""

    code = ErrorCode.PEER_TIMEOUT


class RelayGapError(LinkError):
    """The authentic peer's relay chunks skipped a sequence number."""

    code = ErrorCode.RELAY_GAP


class HandshakeError(LinkError):
    """The two ends cannot work together (for example their training data differ)."""

    code = ErrorCode.HANDSHAKE_REFUSED


class FrameError(SwarmError):
    """A frame that cannot be decoded; the message says why."""

    code = ErrorCode.FRAME_INVALID


# --- the stage runtime (agent/runtime) --------------------------------------------------------


class DataError(SwarmError):
    """The requested text cannot be turned into a dataset (no files, not enough text, ...)."""

    code = ErrorCode.DATA_INVALID


class CheckpointError(SwarmError):
    """A checkpoint cannot be written, read or applied (beyond a plain OSError)."""

    code = ErrorCode.CHECKPOINT_FAILED


class CheckpointWriteError(CheckpointError):
    """A checkpoint file or directory could not be written (a full disk, no permission...).

    The message names the path and the OS's reason, ``cannot write PATH: [Errno 28] No space
    left on device``: it travels to the leader as the reason the export is missing, and a
    failed ``write()`` alone names no file."""

    code = ErrorCode.CHECKPOINT_WRITE_FAILED

    def __init__(self, path: Path, exc: OSError) -> None:
        why = f"[Errno {exc.errno}] {exc.strerror}" if exc.errno is not None else str(exc)
        super().__init__(f"cannot write {path}: {why}")
        self.path = path
        self.errno = exc.errno


class RingChangeError(SwarmError):
    """A replica's ring change cannot be taken (elastic membership): it came after its step,
    or a joining stage's never came. The message names the steps or the wait; the leader
    treats the replica as lost."""

    code = ErrorCode.STAGE_FAILED


class DonorRefusedError(RingChangeError):
    """A ring member refused the donor's state: its weights are far from the member's own, or
    something in it is not finite. The leader treats both the member's and the donor's
    replicas as lost (it cannot tell which of the two lies)."""

    code = ErrorCode.DONOR_REFUSED


class ForwardRefusedError(RingChangeError):
    """A ring member refused the frame its predecessor handed on as the donor's state at a
    ring change: it does not decode, is not this change's state, has the wrong shape, or
    lacks the donor's signature. The link is authenticated (CURVE, or the relay's subjects
    of the placed fellows), so the frame came from the predecessor: the leader treats both
    the member's and the predecessor's replicas as lost (it cannot tell which of the two
    lies)."""

    code = ErrorCode.FORWARD_REFUSED


class SlowReceiverError(PeerTimeoutError):
    """The receiver granted credit, but so slowly that a frame ran past its deadline (its
    timeout plus its size at the relay's slowest rate). Not an accusation: an honest sender
    on a slow uplink sees credit come as slowly."""


class SuccessorStalledError(RingChangeError):
    """A ring member could not hand the donor's state on at a ring change: its successor
    took none of it for the timeout (a receiver that grants no credit stalls its sender;
    one that grants it too slowly is a :class:`SlowReceiverError`, no accusation). The
    leader treats both the member's and the successor's replicas as lost (it cannot tell
    which of the two lies)."""

    code = ErrorCode.SUCCESSOR_STALLED


class StageFailedError(SwarmError):
    """A stage started by :mod:`silentswarm.agent.runtime.launch` exited non-zero or did not
    finish."""

    code = ErrorCode.STAGE_FAILED


class ForkServerError(StageFailedError):
    """The fork server that starts stages (agent/runtime/forkserver.py) is gone or refused."""


class GenerateError(ConfigError):
    """A bad argument or model directory: exit 2."""

    code = ErrorCode.GENERATE_INVALID


class GlueError(ConfigError):
    """The export cannot be glued: a bad manifest, a missing or corrupt file, no data."""

    code = ErrorCode.GLUE_INVALID


class GlueMismatchError(SwarmError):
    """The glued model does not compute what the pipeline computed."""

    code = ErrorCode.GLUE_MISMATCH
    exit_code = 1


class ServeError(ConfigError):
    """``swarm serve`` cannot start: a bad argument, model directory or missing token."""

    code = ErrorCode.SERVE_INVALID


class CompletionError(SwarmError):
    """A completion request the server cannot take (400): ``param`` names its field."""

    code = ErrorCode.COMPLETION_INVALID
    http_status = 400

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ServeAuthError(SwarmError):
    """A request to the completion server without its API token, or with another (401)."""

    code = ErrorCode.UNAUTHORIZED
    http_status = 401


class ServeBusyError(SwarmError):
    """Too many requests wait for a slot (429)."""

    code = ErrorCode.SERVER_BUSY
    http_status = 429


# --- the agent --------------------------------------------------------------------------------


class UpdateError(SwarmError):
    """An UPDATE's package could not be downloaded, verified or installed."""

    code = ErrorCode.UPDATE_FAILED


class NotRegisteredError(SwarmError):
    """The leader did not accept this fellow's registration, or did not answer: the message
    says why. The agent asks again until it is accepted (agent/runner.py)."""

    code = ErrorCode.LEADER_UNREACHABLE


class PushError(SwarmError):
    """A shard could not be pushed; the message names the file and the cause."""

    code = ErrorCode.SHARD_PUSH_FAILED


class FetchError(SwarmError):
    """A resumed stage's shard could not be downloaded or does not match its sha256."""

    code = ErrorCode.SHARD_FETCH_FAILED
