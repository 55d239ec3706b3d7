"""The leader's own REST answers: ``/health``, ``/api/v1/info`` (with the JetStream store's
state) and read tickets. The other bodies live with what they describe:
:mod:`silentswarm.types.jobs`, :mod:`silentswarm.types.fleet`, :mod:`silentswarm.types.metrics`,
:mod:`silentswarm.types.onboarding`."""

from __future__ import annotations

from typing import Literal

import msgspec


class Health(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``ok`` (200) or ``degraded`` (503) with its ``reasons`` (left out when ok)."""

    status: Literal["ok", "degraded"]
    nats: Literal["connected", "disconnected"]
    version: str
    reasons: list[str] = msgspec.field(default_factory=list)


class StreamUsage(msgspec.Struct, frozen=True):
    name: str
    max_bytes: int  # -1: no limit; 0: the stream does not exist
    bytes: int
    max_msgs_per_subject: int
    min_bytes: int


class StorageView(msgspec.Struct, frozen=True):
    """What the leader last saw of its store (``/api/v1/info``'s ``storage``)."""

    checks: int
    checked_at: float | None
    capacity_bytes: int | None
    capacity_at_least: bool
    used_bytes: int | None
    streams: list[StreamUsage]
    reasons: list[str]


# How the leader's NATS connections authenticate: ``dev`` (none), ``jwt`` (it mints each
# fellow its own user) or ``credentials`` (it has its own user but cannot mint others).
NatsAuthMode = Literal["dev", "jwt", "credentials"]


class LeaderInfo(msgspec.Struct, kw_only=True):
    """``GET /api/v1/info``: the leader's version, NATS and counts."""

    version: str
    protocol_version: int
    nats_url: str
    nats_connected: bool
    nats_auth: NatsAuthMode
    subject_prefix: str
    started_at: float
    uptime_s: float
    heartbeat_interval_s: float
    offline_after_s: float
    state_loaded: bool
    fellows: dict[str, int]  # by status
    jobs: dict[str, int]  # by state, archived jobs left out (as GET /api/v1/jobs lists them)
    nodes: int
    storage: StorageView
    jobs_archived: int = 0


class ReadTicket(msgspec.Struct, kw_only=True):
    """A short-lived stand-in for the operator token on GET URLs (``?ticket=``)."""

    ticket: str
    expires_at: int
    ttl_s: float
