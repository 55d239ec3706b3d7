"""The Litestar app factory. The lifespan owns the NATS connection and the staleness sweep."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
from collections.abc import AsyncIterator

from litestar import Litestar
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig

from silentswarm import __version__
from silentswarm.errors import NotFoundError
from silentswarm.jobspec import LastStagePlacement
from silentswarm.leader.accounts import AccountBook, load_forever
from silentswarm.leader.api import CONTROLLERS
from silentswarm.leader.api.error_handlers import EXCEPTION_HANDLERS
from silentswarm.leader.auth import ReadTickets, make_guard
from silentswarm.leader.bootstrap import JoinSessions, find_or_build_wheel
from silentswarm.leader.bus import LeaderBus
from silentswarm.leader.datasets import DatasetStore
from silentswarm.leader.exports import ExportService
from silentswarm.leader.jobs import JobManager
from silentswarm.leader.metrics import LeaderMetrics, SwarmCollector
from silentswarm.leader.observe import Observability
from silentswarm.leader.orchestrator import Orchestrator
from silentswarm.leader.placement import PlacementDefaults
from silentswarm.leader.purges import PurgeBook
from silentswarm.leader.registry import FellowRegistry
from silentswarm.leader.retention import RetentionPolicy
from silentswarm.leader.revocations import UserRevoker
from silentswarm.leader.services.accounts import AccountsService
from silentswarm.leader.services.datasets import DatasetsService
from silentswarm.leader.services.fleet import FleetService
from silentswarm.leader.services.info import InfoService, nats_auth_mode
from silentswarm.leader.services.jobs import JobsService
from silentswarm.leader.services.onboarding import OnboardingService
from silentswarm.leader.services.package import BootstrapPackage
from silentswarm.leader.storage import StorageMonitor
from silentswarm.natsauth import NatsAuthority
from silentswarm.natsconn import NatsAccess
from silentswarm.retrying import Backoff
from silentswarm.sdnotify import watchdog_forever
from silentswarm.settings import Settings

log = logging.getLogger(__name__)
# The history streams are retried forever on any error (JetStream not ready, a store that
# refuses them), after 1 s doubling up to 5 s (no jitter: one leader); shutdown cancels.
OBSERVE_RETRIES = Backoff(wait_initial=1.0, wait_max=5.0)


def create_app(
    settings: Settings,
    *,
    nats: NatsAccess | str,
    token: str | None = None,
    authority: NatsAuthority | None = None,
) -> Litestar:
    """The leader's app. ``token``: the operator token (swarm-leader resolves it with
    :func:`silentswarm.leader.auth.operator_token`); without one, SWARM_API_TOKEN or a random one.
    ``authority``: the keys that mint each joining fellow its own NATS user."""
    if isinstance(nats, str):
        nats = NatsAccess(url=nats)
    token = token or settings.api_token or secrets.token_urlsafe(32)
    # Every part gets what it depends on when it is built, in this order; none is wired
    # up afterwards.
    # Revokes a released fellow's NATS users (at once, or once its purge is delivered).
    revoker = UserRevoker(authority, nats) if authority is not None else None
    jobs = JobManager(retention=RetentionPolicy.from_settings(settings))
    purges = PurgeBook(on_delivered=revoker.revoke_fellow_soon if revoker else None)
    registry = FellowRegistry(
        heartbeat_interval_s=settings.heartbeat_interval_s,
        offline_after_s=settings.offline_after_s,
        leader_version=__version__,
        # A released agent with a pending purge waits for it instead of exiting.
        purge_pending=purges.is_pending,
        # Under the operator token, like shard tokens: deregister secrets outlive restarts.
        instance_key=hmac.new(token.encode(), b"instance-secrets", hashlib.sha256).digest(),
    )
    bus = LeaderBus(nats=nats, prefix=settings.subject_prefix, registry=registry)
    observe = Observability(bus=bus, jobs=jobs, prefix=settings.subject_prefix)
    storage = StorageMonitor(
        prefix=settings.subject_prefix, specs=[observe.progress, observe.logs_stream]
    )
    job_loop_wake = asyncio.Event()  # the export service wakes the job loop on a push
    exports = ExportService(
        bus=bus,
        jobs=jobs,
        prefix=settings.subject_prefix,
        export_root=settings.model_export_root,
        secret=token.encode(),
        public_url=settings.public_url or settings.default_leader_url,
        on_push=job_loop_wake.set,
    )
    dataset_store = DatasetStore(settings.datasets_dir, max_bytes=settings.max_dataset_bytes)
    account_book = AccountBook()
    joins = JoinSessions()
    orchestrator = Orchestrator(
        bus=bus,
        registry=registry,
        jobs=jobs,
        purges=purges,
        prefix=settings.subject_prefix,
        defaults=PlacementDefaults(
            min_gpu_free_gb=settings.placement_min_gpu_free_gb,
            last_stage=LastStagePlacement(settings.pipeline_last_stage_placement),
        ),
        on_progress=observe.on_progress,
        exports=exports,
        datasets=dataset_store,
        authority=authority,
        wake=job_loop_wake,
        account_of=account_book.find,
        revoke_attempt=revoker.revoke_attempt_soon if revoker is not None else None,
        link_probe_every_s=settings.link_probe_every_s,
        link_probes_at_once=settings.link_probes_at_once,
        joins=joins,
    )
    # The domain services the controllers call; each gets the loop as the narrow
    # collaborator its Protocol names (leader.services), never more.
    nats_auth = nats_auth_mode(settings, authority)
    package = BootstrapPackage(settings)
    info = InfoService(
        settings=settings,
        nats_url=nats.url,
        nats_auth=nats_auth,
        bus=bus,
        registry=registry,
        jobs=jobs,
        storage=storage,
        loaded=orchestrator.loaded,
    )
    datasets = DatasetsService(store=dataset_store, jobs=jobs, loop=orchestrator, exports=exports)
    jobs_service = JobsService(
        jobs=jobs,
        loop=orchestrator,
        observe=observe,
        exports=exports,
        export_root=settings.model_export_root,
        pin_datasets=datasets.pin,
        default_transport=settings.pipeline_transport,
    )
    fleet = FleetService(
        registry=registry,
        jobs=jobs,
        purges=purges,
        loop=orchestrator,
        observe=observe,
        storage=storage,
        package=package,
        revoker=revoker,
    )
    onboarding = OnboardingService(
        settings=settings,
        nats_url=nats.url,
        nats_auth=nats_auth,
        authority=authority,
        registry=registry,
        joins=joins,
        package=package,
        stopping=observe.stopping,
        require_loaded=orchestrator.require_loaded,
        save_join=orchestrator.save_join,
        revoker=revoker,
    )
    metrics = LeaderMetrics(
        SwarmCollector(
            info=info,
            bus=bus,
            registry=registry,
            jobs=jobs,
            prober=orchestrator.prober,
            loop_failures=orchestrator.tick_failures,
        )
    )
    tickets = ReadTickets(token, bound_to=account_book.token_of)
    accounts = AccountsService(account_book)

    def owner_of(job_id: str) -> str | None:
        try:
            return jobs.get(job_id).owner
        except NotFoundError:  # the route answers 404 itself
            return None

    @contextlib.asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        await asyncio.to_thread(dataset_store.open)
        await bus.start()
        tasks = [
            asyncio.create_task(_sweep_forever(registry, settings), name="registry-sweep"),
            asyncio.create_task(orchestrator.run(), name="job-loop"),
            asyncio.create_task(_observe(bus, observe, storage), name="observability"),
            asyncio.create_task(
                _watch_storage(storage, bus, orchestrator, observe), name="storage-monitor"
            ),
            asyncio.create_task(watchdog_forever(), name="systemd-watchdog"),
            asyncio.create_task(_package(package, settings), name="bootstrap-package"),
            asyncio.create_task(_accounts(accounts, bus, settings), name="accounts"),
        ]
        if revoker is not None:
            tasks.append(asyncio.create_task(revoker.run(), name="nats-revocations"))
        try:
            yield
        finally:
            observe.stopping.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await orchestrator.close()
            await bus.close()

    return Litestar(
        route_handlers=CONTROLLERS,
        dependencies={
            "info": _provide(info),
            "jobs": _provide(jobs_service),
            "datasets": _provide(datasets),
            "fleet": _provide(fleet),
            "onboarding": _provide(onboarding),
            "accounts": _provide(accounts),
        },
        exception_handlers=EXCEPTION_HANDLERS,
        guards=[
            make_guard(
                token,
                public_reads=settings.reads_public,
                public_reads_via_proxy=settings.api_public_reads is not None,
                tickets=tickets,
                accounts=account_book,
                owner_of=owner_of,
            )
        ],
        lifespan=[lifespan],
        middleware=[metrics.middleware()],
        logging_config=None,  # the process configured logging (swarm.entry)
        openapi_config=OpenAPIConfig(title="SilentSwarm leader", version=__version__),
        # What the process around the app reaches: main.py ends SSE streams on a signal with
        # "stopping"; tests fill "registry" and "jobs" without NATS.
        state={
            "metrics": metrics,
            "tickets": tickets,
            "stopping": observe.stopping,
            "registry": registry,
            "jobs": jobs,
        },
    )


def _provide(service: object) -> Provide:
    """A dependency that is always the one ``service`` this app built."""

    def provide() -> object:
        return service

    return Provide(provide, sync_to_thread=False, use_cache=True)


async def _package(package: BootstrapPackage, settings: Settings) -> None:
    """Find the wheel remote hosts install (cached or shipped); building waits for a join."""
    try:
        found = await asyncio.to_thread(
            find_or_build_wheel,
            settings.state_dir / "bootstrap",
            build=False,
            wheel=settings.bootstrap_wheel,
        )
    except Exception as exc:
        log.error("no package for remote fellows: %s", exc)
        return
    if found is not None:
        package.found(found)


async def _accounts(accounts: AccountsService, bus: LeaderBus, settings: Settings) -> None:
    """Load the accounts (retried while JetStream is not ready); then the service saves."""
    accounts.opened(
        await load_forever(accounts.book, lambda: bus.nc, bus.connected, settings.subject_prefix)
    )


async def _observe(bus: LeaderBus, observe: Observability, storage: StorageMonitor) -> None:
    """Open the history streams (retried with backoff while JetStream is not ready or the
    store refuses them: the storage monitor reports why), then keep the log buffer filled."""
    await bus.connected.wait()
    async for attempt in OBSERVE_RETRIES.context(on=Exception):
        with attempt:
            try:
                await observe.start()
            except Exception as exc:
                storage.streams_failed(exc, attempt.next_wait)
                raise


async def _watch_storage(
    storage: StorageMonitor, bus: LeaderBus, orchestrator: Orchestrator, observe: Observability
) -> None:
    def write_error() -> str | None:
        store = orchestrator.store
        return None if store is None else store.write_error

    await storage.run(lambda: bus.nc, write_error, observe.ready)


async def _sweep_forever(registry: FellowRegistry, settings: Settings) -> None:
    interval = min(0.25, settings.offline_after_s / 8)
    while True:
        registry.sweep()
        await asyncio.sleep(interval)
