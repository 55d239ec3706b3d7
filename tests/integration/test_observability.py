"""Metrics history, SSE streams, shipped logs and `swarm watch`, on a real cluster."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from silentswarm.cli import sse
from tests.conftest import start_agent
from tests.helpers import REPO, child_env, swarm_cli, wait_for
from tests.integration.test_jobs import tiny, wait_ready, wait_steps

pytestmark = pytest.mark.timeout(240)


def read_events(
    url: str, path: str, *, last_event_id: str | None = None, limit: int = 10**6, idle_s=30.0
):
    """Events of one connection (no reconnect): up to ``limit``, the server's end, or
    ``idle_s`` without a byte (keep-alives come every 15 s)."""
    headers = {"last-event-id": last_event_id} if last_event_id else {}
    events = []
    timeout = httpx.Timeout(10.0, read=idle_s)
    with (
        httpx.Client(base_url=url, timeout=timeout) as http,
        http.stream("GET", path, headers=headers) as response,
    ):
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        try:
            for event in sse.events(response):
                events.append(event)
                if len(events) >= limit or event.event == "end":
                    break
        except httpx.ReadTimeout:
            pass
    return events


def test_history_sse_and_watch_of_a_finished_job_survive_a_leader_restart(
    procs, nats_server, restartable_leader
):
    client = restartable_leader.client
    restartable_leader.start()
    for name in ("h1", "h2"):
        start_agent(procs, nats_server.url, name)
    wait_ready(client, "h1", "h2")
    spec = tiny(name="curve", steps=30, stages=2, compression="auto", micro_batches="auto")
    job_id = client.submit(**spec)["job_id"]
    watched = swarm_cli(client, "watch", job_id)
    assert watched.returncode == 0, watched.stdout + watched.stderr
    assert "COMPLETED" in watched.stdout and "30/30 100%" in watched.stdout
    assert "stage 0" in watched.stdout and "stage 1" in watched.stdout
    # The boundary as its ends measured it, and the schedule "auto" chose, on screen and in
    # the job's record.
    assert "link 0 h" in watched.stdout and "rtt " in watched.stdout, watched.stdout
    assert "(auto) since step" in watched.stdout
    record = client.job(job_id)
    first = next(p for p in record["progress"] if p["stage"] == 0)
    assert first["link"]["rtt_ms"] > 0 and first["link"]["fwd_mbit_s"] > 0
    assert first["link"]["fwd_codec"] in ("none", "fp16", "fixed_int8", "fixed_int4")
    assert all(p["tuning"]["auto"] for p in record["progress"])
    assert 8 % first["tuning"]["micro_batches"] == 0

    curve = client.get(f"/api/v1/jobs/{job_id}/metrics/history")
    assert [p["step"] for p in curve] == list(range(1, 31)), "every step, in order"
    assert all(p["loss"] is not None and p["tokens_per_s"] for p in curve)
    assert curve[-1]["loss"] < curve[0]["loss"]
    assert curve[-1]["bytes_sent"] > curve[0]["bytes_sent"] > 0

    # The SSE stream replays from an id in order and ends with the terminal state.
    events = read_events(client.url, f"/api/v1/jobs/{job_id}/metrics/stream", last_event_id="0")
    metrics = [e for e in events if e.event == "metrics"]
    ids = [int(e.id) for e in metrics]
    assert ids == sorted(ids) and len(set(ids)) == len(ids) and len(ids) >= 60
    assert json.loads(metrics[-1].data)["step"] == 30
    assert events[-1].event == "end" and json.loads(events[-1].data)["state"] == "COMPLETED"
    live = client.get(f"/api/v1/jobs/{job_id}/metrics")
    assert live["step"] == 30 and live["loss"] == curve[-1]["loss"]

    restartable_leader.kill()
    restartable_leader.start()
    # Loaded state comes before the history streams: until they are bound, 503 "try again".
    replayed = wait_for(
        lambda: client.get(f"/api/v1/jobs/{job_id}/metrics/history"),
        timeout=30,
        what="the restarted leader's history",
    )
    assert replayed == curve


def test_logs_resume_from_last_event_id_without_gaps_or_duplicates(procs, nats_server, leader):
    start_agent(procs, nats_server.url, "l1")
    wait_ready(leader, "l1")
    job_id = leader.submit(**tiny(name="chatty", steps=5, stages=1))["job_id"]
    leader.wait_job(job_id, "COMPLETED", timeout=90)
    path = "/api/v1/workers/l1/logs/stream"
    # The agent says the job ended in its last batch; then everything is in the stream.
    wait_for(
        lambda: any("completed" in r["message"] for r in leader.get("/api/v1/workers/l1/logs")),
        timeout=20,
        what="the agent's log of the job's end",
    )
    everything = read_events(leader.url, path, idle_s=3.0)
    ids = [int(e.id) for e in everything]
    # Start-up, START, the runtime's output and the end come in at least two batches.
    assert len(ids) >= 2 and ids == sorted(ids) and len(set(ids)) == len(ids)
    first = read_events(leader.url, path, limit=len(ids) // 2)
    rest = read_events(leader.url, path, last_event_id=first[-1].id, idle_s=3.0)
    assert [e.id for e in first + rest] == [e.id for e in everything]
    assert [e.data for e in first + rest] == [e.data for e in everything]
    records = [r for e in everything for r in json.loads(e.data)]
    assert {r["fellow_id"] for r in records} == {"l1"}
    assert any(r["logger"] == "stage.stderr" for r in records), "the runtime's stderr is shipped"
    snapshot = leader.get("/api/v1/workers/l1/logs?limit=5")
    assert len(snapshot) == 5 and all(r["fellow_id"] == "l1" for r in snapshot)
    assert leader.request("GET", "/api/v1/workers/l1/logs?limit=0").status_code == 400
    bad = leader.request("GET", path, headers={"last-event-id": "yesterday"})
    assert bad.status_code == 400 and bad.json()["field"] == "Last-Event-ID"
    printed = swarm_cli(leader, "logs", "l1", "--limit", "3", timeout=30)
    assert printed.returncode == 0 and len(printed.stdout.strip().splitlines()) == 3


def test_watch_exits_non_zero_on_a_cancelled_job(procs, nats_server, leader):
    start_agent(procs, nats_server.url, "x1")
    wait_ready(leader, "x1")
    job_id = leader.submit(**tiny(name="endless", steps=100_000, stages=1))["job_id"]
    leader.wait_job(job_id, "RUNNING", timeout=20)
    wait_steps(leader, job_id, 2)
    watcher = subprocess.Popen(
        [sys.executable, "-m", "silentswarm.cli.app", "--leader-url", leader.url, "watch", job_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(SWARM_API_TOKEN=leader.token or ""),
        cwd=REPO,
    )
    try:
        # The watcher is connected once it has printed a view of the job.
        assert watcher.stdout.readline().startswith(job_id)
        assert leader.request("DELETE", f"/api/v1/jobs/{job_id}").status_code == 200
        out, err = watcher.communicate(timeout=30)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    assert watcher.returncode == 1, out + err
    assert "CANCELLED" in err
