"""The fleet service: fellows and their hosts, releasing and updating them, pending purges,
fellows' logs, and the cluster's capacity."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Protocol

from litestar.response import ServerSentEventMessage

from silentswarm.errors import ConflictError, ErrorCode, FieldError, NotFoundError
from silentswarm.leader.errors import PackageUnavailableError, StorageUnavailableError
from silentswarm.leader.jobs import JobManager
from silentswarm.leader.observe import Observability
from silentswarm.leader.purges import PurgeBook
from silentswarm.leader.registry import FellowRegistry
from silentswarm.leader.services.package import BootstrapPackage
from silentswarm.leader.signals import SignalHub
from silentswarm.leader.storage import StorageMonitor
from silentswarm.protocol import FellowStatus
from silentswarm.subjects import TOKEN_RE
from silentswarm.types.fleet import (
    FellowRecord,
    LogEntry,
    NodeView,
    PendingPurge,
    PurgeDelivery,
    ReleaseResult,
)
from silentswarm.types.jobs import SignalRecord
from silentswarm.types.metrics import ClusterView, RunningJob
from silentswarm.types.signals import PackageRef, StopArgs, UpdateArgs

log = logging.getLogger(__name__)


class FleetLoop(Protocol):
    """What the fleet service asks of the job loop
    (:class:`silentswarm.leader.orchestrator.Orchestrator`)."""

    def signal_hub(self) -> SignalHub:
        """The hub that signals fellows (NotReadyError before NATS is up)."""
        ...

    def reserve(self, fellow_ids: Iterable[str]) -> contextlib.AbstractContextManager[None]:
        """Keep these fellows out of placement while an action signals them."""
        ...

    async def deliver_purge(self, fellow_id: str, *, deadline_s: float = 8.0) -> bool:
        """One PURGE delivery per fellow at a time (the loop retries pending ones too)."""
        ...

    async def flush(self) -> None:
        """Save every changed record now."""
        ...


class UserRevocation(Protocol):
    """What the fleet service asks of the leader's NATS user revoker
    (:class:`silentswarm.leader.revocations.UserRevoker`)."""

    async def revoke_fellow(self, fellow_id: str, *, timeout: float = 5.0) -> bool:
        """Revoke the fellow's NATS users; True once nats-server has them disconnected."""
        ...


class FleetService:
    def __init__(
        self,
        *,
        registry: FellowRegistry,
        jobs: JobManager,
        purges: PurgeBook,
        loop: FleetLoop,
        observe: Observability,
        storage: StorageMonitor,
        package: BootstrapPackage,
        revoker: UserRevocation | None = None,
    ) -> None:
        """``package``: what UPDATE tells fellows installed by fellow.sh to reinstall.
        ``revoker``: revokes a released fellow's NATS users (None: no NATS users)."""
        self.revoker = revoker
        self.registry = registry
        self.jobs = jobs
        self.purges = purges
        self.loop = loop
        self.observe = observe
        self.storage = storage
        self.package = package

    # --- reads -------------------------------------------------------------------------------

    def fellows(self) -> list[FellowRecord]:
        return self.registry.list()

    def fellow(self, fellow_id: str) -> FellowRecord:
        record = self.registry.get(fellow_id)
        if record is None:
            raise NotFoundError(f"no fellow {fellow_id!r} is registered")
        return record

    def nodes(self) -> list[NodeView]:
        return self.registry.nodes()

    def cluster(self) -> ClusterView:
        """What the swarm has online (per host, so fellows sharing a host count it once) and
        how its running jobs perform."""
        hosts = [n for n in self.registry.nodes() if n.online]
        gpus = [g for n in hosts for g in n.gpus]
        return ClusterView(
            fellows=self.registry.counts(),
            hosts=len(hosts),
            cpu_cores=sum(n.cpu_cores for n in hosts),
            ram_total_bytes=sum(n.ram_total_bytes for n in hosts),
            ram_available_bytes=sum(n.ram_available_bytes for n in hosts),
            gpus=len(gpus),
            vram_total_bytes=sum(g.memory_total_bytes for g in gpus),
            vram_free_bytes=sum(g.memory_free_bytes for g in gpus),
            net_sent_bytes_per_s=round(sum(n.net_sent_bytes_per_s for n in hosts), 1),
            net_recv_bytes_per_s=round(sum(n.net_recv_bytes_per_s for n in hosts), 1),
            running_jobs=self._running_jobs(),
        )

    def _running_jobs(self) -> list[RunningJob]:
        running = []
        for job in self.jobs.running():
            view = self.observe.metrics(job.job_id)
            running.append(
                RunningJob(
                    job_id=job.job_id,
                    name=job.name,
                    step=view.step,
                    total_steps=view.total_steps,
                    loss=view.loss,
                    step_time_s=view.step_time_s,
                    steps_per_min=view.steps_per_min,
                    tokens_per_s=view.tokens_per_s,
                    boundaries=view.boundaries,
                    placement=job.placement,
                )
            )
        return running

    # --- operator actions --------------------------------------------------------------------

    async def release(self, fellow_id: str, *, purge_install: bool) -> ReleaseResult:
        """Forget a fellow that runs no job; its agent exits (STOP with ``release``) or, with
        ``purge_install``, wipes its install (PURGE, pending until the fellow takes it).
        Its NATS users are revoked at once, or once its purge is delivered (the fellow
        hears PURGE as its own user)."""
        record = self.fellow(fellow_id)
        hub = self.loop.signal_hub()
        job_id = self.jobs.busy_fellows().get(fellow_id)
        if job_id is not None:
            raise ConflictError(
                f"fellow {fellow_id} is running job {job_id}; cancel the job first "
                f"(swarm cancel {job_id})",
                code=ErrorCode.FELLOW_BUSY,
            )
        online = record.status is not FellowStatus.OFFLINE
        result = ReleaseResult(fellow_id=fellow_id, released=True, purge=None)
        with self.loop.reserve([fellow_id]):
            if purge_install:
                self.purges.add(fellow_id)
                result.purge = "pending"
                if online and await self.loop.deliver_purge(fellow_id):
                    result.purge = "delivered"
            elif online:
                ack = await hub.send(fellow_id, StopArgs(release=True, reason="released"))
                result.agent_stopped = ack.ok
            if self.registry.get(fellow_id) is not None:
                self.registry.release(fellow_id)
        if self.revoker is not None and not self.purges.is_pending(fellow_id):
            result.nats_user_revoked = await self.revoker.revoke_fellow(fellow_id)
        await self.loop.flush()
        return result

    async def update(self, fellow_id: str | None, request_base: str) -> list[SignalRecord]:
        """UPDATE one fellow or every online one: fellows that fellow.sh installed reinstall
        from this leader's package (checked against its sha256), then restart; others
        restart from their install. Idle ones are kept out of placement meanwhile."""
        args = await self._update_args(request_base)
        hub = self.loop.signal_hub()
        if fellow_id is not None:
            targets = [self.fellow(fellow_id)]
        else:
            targets = [r for r in self.registry.list() if r.status is not FellowStatus.OFFLINE]
        idle = {r.fellow_id for r in targets} - set(self.jobs.busy_fellows())
        with self.loop.reserve(idle):
            return list(await asyncio.gather(*(hub.send(r.fellow_id, args) for r in targets)))

    async def _update_args(self, request_base: str) -> UpdateArgs:
        try:
            package = await self.package.ensure()
        except PackageUnavailableError as exc:
            log.warning("update without a package (fellows restart as installed): %s", exc)
            return UpdateArgs()
        ref = PackageRef(
            file=package.file, sha256=package.sha256, url=self.package.source_url(request_base)
        )
        return UpdateArgs(package=ref)

    def pending_purges(self) -> list[PendingPurge]:
        return self.purges.list()

    async def retry_purges(self, fellow_id: str | None) -> list[PurgeDelivery]:
        """Try to deliver pending purges now (one fellow's, or all)."""
        self.loop.signal_hub()
        if fellow_id is not None and self.purges.get(fellow_id) is None:
            raise NotFoundError(f"no pending purge for {fellow_id!r}")
        targets = [fellow_id] if fellow_id else [p.fellow_id for p in self.purges.list()]
        delivered = await asyncio.gather(
            *(self.loop.deliver_purge(fid, deadline_s=2.0) for fid in targets)
        )
        results = []
        for fid, ok in zip(targets, delivered, strict=True):
            pending = self.purges.get(fid)
            error = "" if pending is None else pending.last_error
            results.append(PurgeDelivery(fellow_id=fid, delivered=ok, error=error))
        await self.loop.flush()
        return results

    # --- logs --------------------------------------------------------------------------------

    def log_snapshot(self, fellow_id: str, limit: int) -> list[LogEntry]:
        _check_fellow_id(fellow_id)
        return self.observe.log_snapshot(fellow_id, limit)

    def log_stream(
        self, fellow_id: str, last_event_id: int | None
    ) -> AsyncIterator[ServerSentEventMessage]:
        """The SSE events of the fellow's logs; what would not be a 200 raises first."""
        _check_fellow_id(fellow_id)
        if not self.observe.ready.is_set() and self.storage.create_error:
            raise StorageUnavailableError(
                f"the log stream could not be created: {self.storage.create_error}"
            )
        self.observe.check_stream()
        return self.observe.log_events(fellow_id, last_event_id)


def _check_fellow_id(fellow_id: str) -> None:
    if not TOKEN_RE.match(fellow_id):
        raise FieldError(f"fellow_id: {fellow_id!r} is not a fellow id", field="fellow_id")
