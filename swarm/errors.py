"""The one error hierarchy.

Every error that crosses a boundary (HTTP, NATS, the CLI) carries a stable machine code and
a human message. HTTP handlers map ``http_status``; the CLI prints ``message`` and exits
with ``exit_code``.
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base of every error SilentSwarm raises on purpose."""

    code: str = "SWARM_ERROR"
    http_status: int = 500
    exit_code: int = 1

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class ConfigError(SwarmError):
    """A setting, flag or config file is wrong; the message names it."""

    code = "CONFIG_INVALID"
    http_status = 400
    exit_code = 2


class NotFoundError(SwarmError):
    code = "NOT_FOUND"
    http_status = 404


class ConflictError(SwarmError):
    code = "CONFLICT"
    http_status = 409


class PortInUseError(ConfigError):
    """A port we must listen on is taken; the message names the port and the setting."""

    code = "PORT_IN_USE"


class NatsServerError(SwarmError):
    """The nats-server binary is missing or did not come up."""

    code = "NATS_SERVER_FAILED"


class StoreInUseError(NatsServerError):
    """Another nats-server already runs on this JetStream store: one store, one server. The
    message names that server and who started it."""

    code = "NATS_STORE_IN_USE"


class LeaderUnreachableError(SwarmError):
    code = "LEADER_UNREACHABLE"
    exit_code = 3


class LeaderResponseError(SwarmError):
    """The leader answered with an error body; code and message are the leader's."""

    exit_code = 1


class ClusterError(SwarmError):
    """start-cluster / stop-cluster could not do what was asked."""

    code = "CLUSTER_FAILED"


class ProtocolError(SwarmError):
    """A peer's message could not be decoded or does not fit its subject."""

    code = "PROTOCOL_ERROR"
    http_status = 400
