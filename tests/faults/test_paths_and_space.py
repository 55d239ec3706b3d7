"""Faults on the way: the direct path between two fellows is unreachable (the link falls back
to the NATS relay and the job completes), and the leader's disk refuses the export (the job
reports a clear export error; what was stored before stays intact)."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import psutil
import pytest

from silentswarm.procs import free_port
from tests.conftest import start_agent
from tests.helpers import Leader, wait_for
from tests.integration.test_jobs import tiny, wait_ready

pytestmark = pytest.mark.timeout(300)


def test_an_unreachable_direct_path_falls_back_to_the_relay(procs, nats_server, leader):
    # Each fellow advertises a loopback port nothing listens on; its stage binds another.
    for name in ("u1", "u2"):
        start_agent(
            procs,
            nats_server.url,
            name,
            SWARM_DATA_ADDRESS=f"tcp://127.0.0.1:{free_port()}",
            SWARM_DATA_BIND=f"tcp://127.0.0.1:{free_port()}",
        )
    wait_ready(leader, "u1", "u2")
    job_id = leader.submit(**tiny(name="detour", steps=40, stages=2, transport="auto"))["job_id"]
    # Every placed boundary is listed from the start; its transport once a step reports it.
    [boundary] = wait_for(
        lambda: [
            b
            for b in leader.get(f"/api/v1/jobs/{job_id}/metrics")["boundaries"]
            if b["transport"] is not None
        ],
        timeout=90,
        what="the boundary to report its transport",
    )
    assert boundary["transport"] == "relay"
    job = leader.wait_job(job_id, "COMPLETED", timeout=120)
    assert job["placement"]["transport"] == "auto" and job["final_loss"] is not None


def _limit_file_size(pid: int, limit: int) -> None:
    psutil.Process(pid).rlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_full_disk_while_exporting_is_a_clear_error_and_keeps_earlier_shards(
    procs, nats_server, leader: Leader, tmp_path: Path
):
    for name in ("d1", "d2"):
        start_agent(procs, nats_server.url, name)
    wait_ready(leader, "d1", "d2")
    # Inside the leader's export root (the default, <state>/model_exports): one outside it
    # is refused at submit.
    export = tmp_path / "leader-state" / "model_exports" / "full-disk"
    spec = tiny(
        name="full-disk",
        steps=400,
        stages=2,
        shard_push_to_leader=True,
        shard_push_interval_steps=20,
        artifact_paths={"model_export_dir": str(export)},
    )
    job_id = leader.submit(**spec)["job_id"]
    first = wait_for(lambda: leader.job(job_id)["pushed_step"], timeout=90, what="a complete push")
    before = json.loads((export / "run_manifest.json").read_text())
    kept = {p: p.read_bytes() for p in (export / "shards" / f"step-{first}").iterdir()}
    # From now on the leader cannot write a file past 1 KiB (as if its disk were full); its
    # own log goes to a file too, so leave it room for that.
    leader_pid = next(
        p.pid
        for p in procs.started
        if "silentswarm.leader.main" in " ".join(psutil.Process(p.pid).cmdline())
    )
    log_size = max(p.stat().st_size for p in procs.log_dir.glob("leader*"))
    npz_size = min(len(data) for p, data in kept.items() if p.suffix == ".npz")
    assert npz_size > log_size + 100_000, (npz_size, log_size)
    _limit_file_size(leader_pid, (npz_size + log_size) // 2)

    job = leader.wait_job(job_id, "COMPLETED", timeout=200)
    assert job["export_error"] is not None and "File too large" in job["export_error"]
    assert "stage-" in job["export_error"] and str(export) in job["export_error"]
    # What was stored before is intact and still described by the manifest.
    for path, data in kept.items():
        assert path.read_bytes() == data, path
    manifest = json.loads((export / "run_manifest.json").read_text())
    assert manifest["step"] >= before["step"] and job["pushed_step"] == manifest["step"]
    assert job["pushed_step"] < 400
