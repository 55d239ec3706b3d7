"""The leader's domain services against a fake job loop: what they ask of it, and when.

No NATS: the loop is the Protocol the services declare (``FleetLoop``, ``JobLoop``), with a
signal hub that acknowledges everything and records which fellows were reserved at each
send."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from silentswarm.errors import ConflictError, ErrorCode, FieldError
from silentswarm.jobspec import ArtifactPaths, JobSpec, PlacedStage, Placement
from silentswarm.leader.jobs import JobManager
from silentswarm.leader.observe import Observability
from silentswarm.leader.purges import PurgeBook
from silentswarm.leader.registry import FellowRegistry
from silentswarm.leader.services.fleet import FleetService
from silentswarm.leader.services.jobs import JobsService
from silentswarm.leader.services.package import BootstrapPackage
from silentswarm.leader.storage import StorageMonitor
from silentswarm.plan import Transport
from silentswarm.protocol import FellowIdentity, HardwareSnapshot, JobState, RegisterRequest
from silentswarm.settings import Settings
from silentswarm.types.jobs import JobRecord, SignalRecord
from silentswarm.types.signals import SignalArgs, StopArgs, UpdateArgs


class FakeHub:
    def __init__(self, loop: FakeLoop) -> None:
        self.loop = loop
        self.sent: list[tuple[str, SignalArgs, frozenset[str]]] = []

    async def send(self, fellow_id: str, args: SignalArgs, **_: object) -> SignalRecord:
        self.sent.append((fellow_id, args, frozenset(self.loop.reserved)))
        return SignalRecord(
            signal_id="s", fellow_id=fellow_id, ok=True, kind="x", sent_at=0.0, attempts=1
        )


class FakeLoop:
    def __init__(self) -> None:
        self.reserved: set[str] = set()
        self.hub = FakeHub(self)
        self.calls: list[str] = []

    def require_loaded(self) -> None:
        self.calls.append("require_loaded")

    def signal_hub(self) -> FakeHub:
        return self.hub

    @contextlib.contextmanager
    def reserve(self, fellow_ids: Iterable[str]) -> Iterator[None]:
        ids = set(fellow_ids)
        self.reserved |= ids
        try:
            yield
        finally:
            self.reserved -= ids

    async def deliver_purge(self, fellow_id: str, *, deadline_s: float = 8.0) -> bool:
        self.calls.append(f"purge {fellow_id}")
        return True

    async def flush(self) -> None:
        self.calls.append("flush")

    def wake(self) -> None:
        self.calls.append("wake")

    def job_ended(self, job: JobRecord) -> None:
        self.calls.append(f"ended {job.job_id}")

    async def final_exports(self) -> None:
        self.calls.append("final exports")


def _register(registry: FellowRegistry, fellow_id: str) -> None:
    identity = FellowIdentity(
        fellow_id=fellow_id, instance_id="i-1", hostname="h", version="t", pid=1
    )
    hardware = HardwareSnapshot(
        hostname="h", cpu_cores=1, ram_total_bytes=1, ram_available_bytes=1, gpus=[]
    )
    registry.register(RegisterRequest(fellow=identity, hardware=hardware))


def _running(jobs: JobManager, fellow_id: str) -> str:
    job = jobs.submit(JobSpec(name="demo", steps=10))
    placement = Placement(
        stages=[
            PlacedStage(stage=0, fellow_id=fellow_id, hostname="h", layer_start=0, layer_end=2)
        ],
        transport=Transport.AUTO,
    )
    jobs.begin_start(job.job_id, placement)
    jobs.start_succeeded(job.job_id)
    return job.job_id


@pytest.fixture
def parts() -> tuple[FleetService, FellowRegistry, JobManager, FakeLoop]:
    registry = FellowRegistry(heartbeat_interval_s=1, offline_after_s=3, leader_version="t")
    jobs, loop = JobManager(), FakeLoop()
    fleet = FleetService(
        registry=registry,
        jobs=jobs,
        purges=PurgeBook(),
        loop=loop,
        observe=Observability(bus=None, jobs=jobs, prefix="swarm"),  # type: ignore[arg-type]
        storage=StorageMonitor(prefix="swarm", specs=[]),
        package=BootstrapPackage(Settings()),
    )
    for fid in ("a", "b"):
        _register(registry, fid)
    return fleet, registry, jobs, loop


def test_release_refuses_a_placed_fellow_and_signals_nothing(parts) -> None:
    fleet, _, jobs, loop = parts
    job_id = _running(jobs, "a")
    with pytest.raises(ConflictError) as refused:
        asyncio.run(fleet.release("a", purge_install=False))
    assert refused.value.code == ErrorCode.FELLOW_BUSY
    assert job_id in str(refused.value)
    assert loop.hub.sent == []


def test_release_stops_the_agent_while_the_fellow_is_reserved(parts) -> None:
    fleet, registry, _, loop = parts
    result = asyncio.run(fleet.release("b", purge_install=False))
    assert result.released and result.agent_stopped
    [(fid, args, reserved)] = loop.hub.sent
    assert (fid, reserved) == ("b", frozenset({"b"}))
    assert isinstance(args, StopArgs) and args.release
    assert registry.get("b") is None and loop.reserved == set()
    assert loop.calls == ["flush"]


def test_release_with_purge_goes_through_the_loops_single_delivery(parts) -> None:
    fleet, _, _, loop = parts
    result = asyncio.run(fleet.release("b", purge_install=True))
    assert result.purge == "delivered"
    assert loop.calls == ["purge b", "flush"] and loop.hub.sent == []


def test_update_reserves_only_the_idle_fellows(parts) -> None:
    fleet, _, jobs, loop = parts
    _running(jobs, "a")
    fleet.package.package = None
    records = asyncio.run(fleet.update(None, "http://leader"))
    assert [r.fellow_id for r in records] == ["a", "b"]
    assert {fid: reserved for fid, _, reserved in loop.hub.sent} == {
        "a": frozenset({"b"}),
        "b": frozenset({"b"}),
    }
    assert all(isinstance(args, UpdateArgs) for _, args, _ in loop.hub.sent)
    assert loop.reserved == set()


def _jobs_service(tmp_path: Path) -> tuple[JobsService, FakeLoop]:
    jobs, loop = JobManager(), FakeLoop()
    service = JobsService(
        jobs=jobs,
        loop=loop,
        observe=Observability(bus=None, jobs=jobs, prefix="swarm"),  # type: ignore[arg-type]
        exports=None,  # type: ignore[arg-type]
        export_root=tmp_path,
        pin_datasets=lambda spec, principal: spec,
    )
    return service, loop


def test_submit_saves_before_it_answers_and_wakes_the_loop(tmp_path: Path) -> None:
    service, loop = _jobs_service(tmp_path)
    job = asyncio.run(service.submit(JobSpec(name="demo", steps=10)))
    assert job.state is JobState.PENDING
    assert loop.calls == ["require_loaded", "flush", "wake"]


def test_submit_records_the_leaders_default_transport_and_serves_the_config(
    tmp_path: Path,
) -> None:
    service, _ = _jobs_service(tmp_path)
    service.default_transport = Transport.P2P  # SWARM_PIPELINE_TRANSPORT=p2p
    unset = asyncio.run(service.submit(JobSpec(name="demo", steps=10)))
    named = asyncio.run(service.submit(JobSpec(name="demo", steps=10, transport=Transport.AUTO)))
    assert service.get(unset.job_id).spec.transport is Transport.P2P
    assert service.get(named.job_id).spec.transport is Transport.AUTO
    served = service.get(unset.job_id)
    assert served.config is not None and served.config.transport is Transport.P2P
    assert served.config.latest_shard_pushes is service.jobs.get(unset.job_id).latest_shard_pushes
    assert [j.config is not None for j in service.list()] == [True, True]


def test_submit_refuses_an_export_dir_outside_the_root(tmp_path: Path) -> None:
    service, loop = _jobs_service(tmp_path)
    spec = JobSpec(name="demo", steps=10, artifact_paths=ArtifactPaths(model_export_dir="/etc"))
    with pytest.raises(FieldError, match="model_export_dir"):
        asyncio.run(service.submit(spec))
    assert loop.calls == []


def test_a_job_from_another_jobs_export_waits_for_its_final_manifest_first(tmp_path: Path) -> None:
    # The source turns COMPLETED before its final manifest is written: a job submitted at once
    # would pin the manifest about to be replaced, and fail to start.
    service, loop = _jobs_service(tmp_path)
    with pytest.raises(FieldError, match="init_from: there is no job 'gone'"):
        asyncio.run(service.submit(JobSpec(name="warm", steps=10, init_from="job:gone")))
    assert loop.calls == ["require_loaded", "final exports"]


def test_cancel_ends_the_job_through_the_loop(tmp_path: Path) -> None:
    service, loop = _jobs_service(tmp_path)
    job = asyncio.run(service.submit(JobSpec(name="demo", steps=10)))
    loop.calls.clear()
    cancelled = asyncio.run(service.cancel(job.job_id))
    assert cancelled.state is JobState.CANCELLED
    assert loop.calls == ["require_loaded", f"ended {job.job_id}", "flush", "wake"]
