"""A job with replicas, seen everywhere (issue 23 item 4), end to end: a real leader and two
real fellows train two replicas of a one-stage pipeline; the job's record keeps each
replica's stage with its sync, Prometheus has the per replica series while it runs, the
export is replica 0's, and ``swarm watch`` shows a line per replica."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from silentswarm.procs import free_port
from tests.conftest import start_agent
from tests.helpers import swarm_cli
from tests.integration.test_jobs import tiny, wait_ready, wait_steps

pytestmark = pytest.mark.timeout(240)


def test_a_job_with_replicas_is_seen_per_replica(procs, nats_server, leader):
    for name in ("rs-1", "rs-2"):
        address = f"tcp://127.0.0.1:{free_port()}"
        start_agent(procs, nats_server.url, name, SWARM_SYNC_ADDRESS=address)
    wait_ready(leader, "rs-1", "rs-2")
    job_id = leader.submit(
        **tiny(name="replicas-seen", steps=40, stages=1, replicas=2, transport="p2p")
    )["job_id"]
    leader.wait_job(job_id, "RUNNING", timeout=30)
    wait_steps(leader, job_id, 3)

    job = leader.job(job_id)
    by_replica = {p["replica"]: p for p in job["progress"]}
    assert sorted(by_replica) == [0, 1]
    placed = {s["fellow_id"]: s["replica"] for s in job["placement"]["stages"]}
    assert {p["fellow_id"]: p["replica"] for p in job["progress"]} == placed
    for p in by_replica.values():  # allreduce: every step syncs
        assert p["sync_bytes_sent"] > 0 and p["sync_bytes_received"] > 0, p
        assert p["sync_s"] is not None, p
    view = job["view"]
    assert [r["replica"] for r in view["replicas"]] == [0, 1]
    assert view["tokens_per_s"] == pytest.approx(
        sum(r["tokens_per_s"] for r in view["replicas"]), rel=1e-6
    )
    assert view["sync_bytes_sent"] >= sum(p["sync_bytes_sent"] for p in by_replica.values())

    metrics = leader.request("GET", "/api/v1/metrics").text
    for replica in ("0", "1"):
        labels = f'job_id="{job_id}",replica="{replica}"'
        assert f"swarm_job_replica_tokens_per_second{{{labels}}}" in metrics
        assert f"swarm_job_replica_sync_sent_bytes_total{{{labels}}}" in metrics
    assert "swarm_job_stage_sync_seconds{" in metrics

    done = leader.wait_job(job_id, "COMPLETED", timeout=180)
    assert done["export_error"] is None, done["export_error"]
    finals = [p["loss"] for p in done["progress"]]
    assert done["final_loss"] == pytest.approx(sum(finals) / len(finals))
    export = Path(done["export_dir"])
    manifest = json.loads((export / "run_manifest.json").read_text())
    replica0 = next(f for f, r in placed.items() if r == 0)
    assert [s["fellow_id"] for s in manifest["stages"]] == [replica0]
    assert [s["fellow_id"] for s in manifest["placement"]["stages"]] == [replica0]
    pushers = {r["fellow_id"] for r in done["latest_shard_pushes"]}
    assert pushers == {replica0}

    # The follow view of the finished job (replayed from the stream): a line per replica.
    watched = swarm_cli(leader, "watch", job_id, timeout=60)
    assert watched.returncode == 0, watched.stderr
    for replica in (0, 1):
        assert f"replica {replica} stage 0" in watched.stdout, watched.stdout
    assert " sync " in watched.stdout
