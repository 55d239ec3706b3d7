"""Fakes the unit tests share: one of each, here, instead of a copy per test file."""

from __future__ import annotations

from typing import Any

import msgspec

from silentswarm.leader.placement import Candidate
from silentswarm.types.fleet import FellowRecord, NodeView
from silentswarm.types.jobs import JobRecord

GIB = 1 << 30


class Clock:
    """A clock that moves only when a test moves it: pass it where the code takes a
    ``clock``/``wall`` callable, then set or advance :attr:`now`."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move the clock on by ``seconds``; the new time."""
        self.now += seconds
        return self.now


# --- what the leader answers, as the CLI decodes it ------------------------------------------
# Tests name only the fields they care about; the rest gets a plain default, and the result
# goes through msgspec.convert, so it is exactly what the client would decode.


def job_record(**fields: Any) -> JobRecord:
    """A job record (``GET /api/v1/jobs/{id}``) with ``fields`` set."""
    body = {"job_id": "j", "name": "j", "spec": {}, "state": "RUNNING"}
    return msgspec.convert({**body, "created_at": 0.0, "updated_at": 0.0, **fields}, JobRecord)


def placed_stage(stage: int, **fields: Any) -> dict[str, Any]:
    """One stage of a placement, as JSON."""
    return {
        "stage": stage,
        "fellow_id": f"f{stage}",
        "hostname": "h",
        "layer_start": stage,
        "layer_end": stage + 1,
        **fields,
    }


def gpu(index: int, *, free_bytes: int = 0, **fields: Any) -> dict[str, Any]:
    """One GPU of a hardware snapshot, as JSON."""
    return {
        "index": index,
        "uuid": f"GPU-{index}",
        "name": "gpu",
        "memory_total_bytes": max(free_bytes, 1),
        "memory_free_bytes": free_bytes,
        "memory_used_bytes": 0,
        **fields,
    }


def fellow_record(fellow_id: str, **fields: Any) -> FellowRecord:
    """A fellow (``GET /api/v1/workers``) with ``fields`` set; ``gpus`` (JSON) goes into its
    hardware."""
    gpus = fields.pop("gpus", [])
    hostname = fields.get("hostname", "h")
    hardware = {"hostname": hostname, "cpu_cores": 1, "ram_total_bytes": 1}
    body = {
        "fellow_id": fellow_id,
        "instance_id": "i",
        "hostname": hostname,
        "version": "0",
        "pid": 1,
        "data_address": None,
        "status": "ready",
        "registered_at": 0.0,
        "hardware": {**hardware, "ram_available_bytes": 1, "gpus": gpus},
    }
    return msgspec.convert({**body, **fields}, FellowRecord)


def node_view(hostname: str = "h", **fields: Any) -> NodeView:
    """A host (``GET /api/v1/nodes``) with ``fields`` set."""
    body = {"hostname": hostname, "online": True, "fellows": [], "cpu_cores": 1}
    body |= {"cpu_load_pct": 0.0, "ram_total_bytes": 1, "ram_available_bytes": 1}
    return msgspec.convert({**body, "gpus": [], "nvml_error": None, **fields}, NodeView)


# --- what placement weighs -------------------------------------------------------------------


def cpu_candidate(fid: str, ram_gib: float, speed: float | None = None, **kw: Any) -> Candidate:
    """A CPU-only ready fellow named ``fid`` on its own host, with data and sync addresses,
    ``ram_gib`` of RAM and a measured ``speed`` (None: never measured)."""
    return Candidate(
        fellow_id=fid,
        hostname=fid,
        data_address=f"tcp://{fid}:1",
        sync_address=f"tcp://{fid}:2",
        cpu_cores=8,
        ram_available_bytes=int(ram_gib * GIB),
        compute_speed=speed,
        **kw,
    )


def offline_orchestrator(registry: Any, jobs: Any) -> Any:
    """A leader's Orchestrator over ``registry`` and ``jobs`` with no NATS behind it (its
    bus points at a closed port): for tests that drive its steps by hand."""
    from silentswarm.leader.bus import LeaderBus
    from silentswarm.leader.orchestrator import Orchestrator
    from silentswarm.leader.purges import PurgeBook
    from silentswarm.natsconn import NatsAccess

    return Orchestrator(
        bus=LeaderBus(nats=NatsAccess(url="nats://127.0.0.1:1"), prefix="s", registry=registry),
        registry=registry,
        jobs=jobs,
        purges=PurgeBook(),
        prefix="s",
    )
