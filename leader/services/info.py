"""What the leader says about itself: ``/api/v1/info`` and ``/health``."""

from __future__ import annotations

import asyncio
import time

from silentswarm import __version__
from silentswarm.leader.bus import LeaderBus
from silentswarm.leader.jobs import JobManager
from silentswarm.leader.registry import FellowRegistry
from silentswarm.leader.storage import StorageMonitor
from silentswarm.natsauth import NatsAuthority
from silentswarm.protocol import PROTOCOL_VERSION
from silentswarm.settings import Settings
from silentswarm.types.api import Health, LeaderInfo, NatsAuthMode


def nats_auth_mode(settings: Settings, authority: NatsAuthority | None) -> NatsAuthMode:
    """``dev`` (no authentication), ``jwt`` (this leader mints each fellow its own NATS
    user) or ``credentials`` (it has its own user but cannot mint others)."""
    if settings.dev:
        return "dev"
    return "jwt" if authority is not None else "credentials"


def health_body(connected: bool, storage_reasons: list[str]) -> tuple[Health, int]:
    """``ok`` (200) or ``degraded`` (503) with its ``reasons``: NATS unreachable, or the
    JetStream store short of room (leader.storage). Pure."""
    reasons = ([] if connected else ["the leader is not connected to NATS"]) + storage_reasons
    body = Health(
        status="degraded" if reasons else "ok",
        nats="connected" if connected else "disconnected",
        version=__version__,
        reasons=reasons,
    )
    return body, 503 if reasons else 200


class InfoService:
    def __init__(
        self,
        *,
        settings: Settings,
        nats_url: str,
        nats_auth: NatsAuthMode,
        bus: LeaderBus,
        registry: FellowRegistry,
        jobs: JobManager,
        storage: StorageMonitor,
        loaded: asyncio.Event,
        started_at: float | None = None,
    ) -> None:
        """``loaded``: set by the job loop once it has loaded the durable state."""
        self.settings = settings
        self.nats_url = nats_url
        self.nats_auth = nats_auth
        self.bus = bus
        self.registry = registry
        self.jobs = jobs
        self.storage = storage
        self.loaded = loaded
        self.started_at = time.time() if started_at is None else started_at

    def info(self) -> LeaderInfo:
        return LeaderInfo(
            version=__version__,
            protocol_version=PROTOCOL_VERSION,
            nats_url=self.nats_url,
            nats_connected=self.bus.is_connected,
            nats_auth=self.nats_auth,
            subject_prefix=self.settings.subject_prefix,
            started_at=self.started_at,
            uptime_s=round(time.time() - self.started_at, 3),
            heartbeat_interval_s=self.settings.heartbeat_interval_s,
            offline_after_s=self.settings.offline_after_s,
            state_loaded=self.loaded.is_set(),
            fellows=self.registry.counts(),
            jobs=self.jobs.counts(),
            jobs_archived=self.jobs.archived_count(),
            nodes=self.registry.host_count(),
            storage=self.storage.view(),
        )

    def health(self) -> tuple[Health, int]:
        """The health body and its status code (see :func:`health_body`)."""
        return health_body(self.bus.is_connected, self.storage.reasons)
