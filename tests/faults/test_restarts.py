"""Faults: the leader or the NATS server dies mid-training; the job completes, and what the
leader keeps (state, metrics history, logs) is intact beyond the outage."""

from __future__ import annotations

import signal

import pytest

from tests.conftest import start_agent
from tests.helpers import wait_for
from tests.integration.test_jobs import agents, tiny, wait_ready, wait_steps

pytestmark = pytest.mark.timeout(300)


def test_leader_restart_mid_job_keeps_the_job_which_completes(
    procs, nats_server, restartable_leader
):
    client = restartable_leader.client
    restartable_leader.start()
    agents(procs, nats_server, "r1", "r2")
    wait_ready(client, "r1", "r2")
    job_id = client.submit(**tiny(name="survivor", steps=250, stages=2))["job_id"]
    client.wait_job(job_id, "RUNNING", timeout=20)
    wait_steps(client, job_id, 5)
    before = client.job(job_id)
    restartable_leader.kill()
    restartable_leader.start()
    after = client.job(job_id)
    assert after["state"] == "RUNNING"
    for key in ("job_id", "attempt", "created_at", "started_at", "placement", "spec"):
        assert after[key] == before[key], key
    assert set(client.workers()) == {"r1", "r2"}
    done = client.wait_job(job_id, "COMPLETED", timeout=150)
    assert done["attempt"] == 1 and done["final_loss"] is not None
    assert [h["to_state"] for h in done["history"]] == ["PENDING", "RUNNING", "COMPLETED"]


def test_a_released_agent_stays_released_across_a_leader_restart_and_is_told_to_exit(
    procs, nats_server, restartable_leader
):
    """An agent that was frozen when an operator released it (its STOP went nowhere) wakes
    after the leader restarted: the restarted leader still knows that instance was released
    (the release is stored), ignores its heartbeats instead of taking the fellow back, and
    tells it to exit."""
    client = restartable_leader.client
    restartable_leader.start()
    agent = start_agent(procs, nats_server.url, "frozen")
    wait_ready(client, "frozen")
    agent.send_signal(signal.SIGSTOP)
    client.wait_status("frozen", "offline", timeout=15)
    released = client.request("POST", "/api/v1/workers/frozen/release", json={})
    assert released.status_code == 200, released.text
    assert "agent_stopped" not in released.json(), "offline: no STOP was sent"

    restartable_leader.kill()
    restartable_leader.start()
    agent.send_signal(signal.SIGCONT)
    assert agent.wait(timeout=30) == 0, "the released agent exits"
    assert "frozen" not in client.workers()


def test_a_nats_restart_mid_training_loses_no_history_and_no_logs(procs, nats_server, leader):
    agents(procs, nats_server, "n1", "n2")
    wait_ready(leader, "n1", "n2")
    job_id = leader.submit(**tiny(name="outage", steps=300, stages=2))["job_id"]
    leader.wait_job(job_id, "RUNNING", timeout=30)
    wait_steps(leader, job_id, 20)

    nats_server.stop()
    # The outage lasts until the leader has noticed it (its health says so).
    wait_for(
        lambda: leader.request("GET", "/health").status_code == 503,
        timeout=15,
        what="the leader to report NATS down",
    )
    nats_server.start()

    job = leader.wait_job(job_id, "COMPLETED", timeout=180)
    assert job["attempt"] == 1 and job["resumes"] == [], "the outage cost no attempt"
    # Progress published while NATS was down was buffered by the fellows and sent on
    # reconnect: the durable history has every step but what was in flight on the socket
    # when the server died, in order.
    steps = [h["step"] for h in leader.get(f"/api/v1/jobs/{job_id}/metrics/history")]
    assert steps == sorted(set(steps)) and steps[0] == 1 and steps[-1] == 300
    missing = sorted(set(range(1, 301)) - set(steps))
    assert len(missing) <= 2, missing
    logs = [r["message"] for r in leader.get("/api/v1/workers/n1/logs?limit=2000")]
    assert any("disconnected from NATS" in m for m in logs)
    assert any("reconnected to NATS" in m for m in logs)
    # Back to ready once their stages have stopped (the job may complete a moment before).
    leader.wait_status("n1", "ready", timeout=30)
    leader.wait_status("n2", "ready", timeout=30)
