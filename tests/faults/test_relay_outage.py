"""Faults: the NATS server is SIGKILLed and restarted under a job whose boundary is the
relay (transport ``tunnel``): the relay repairs what the outage lost inside the attempt."""

from __future__ import annotations

import time

import pytest

from tests.conftest import agent_state_dir
from tests.helpers import wait_for
from tests.integration.test_jobs import agents, tiny, wait_ready
from tests.integration.test_links import kill_nats

pytestmark = pytest.mark.timeout(300)

STEPS = 300
OUTAGES_S = (6.0, 2.0, 6.0)  # how long each outage lasts, as in issue 20 (~6 s)


def test_a_tunnel_job_rides_out_three_nats_kills_in_its_first_attempt(procs, nats_server, leader):
    """Three times in one job, the server dies (SIGKILL: what it had in flight is lost, the
    stages' relay chunks and grants among it) and comes back on its port a few seconds later.
    The job completes in attempt 1 with no resume, over the relay, and its metrics history
    misses at most the 2 steps per outage that the NATS-restart guarantee allows."""
    agents(procs, nats_server, "o1", "o2")
    wait_ready(leader, "o1", "o2")
    spec = tiny(name="tunnel-outage", steps=STEPS, stages=2, transport="tunnel")
    job_id = leader.submit(**spec)["job_id"]
    job = leader.wait_job(job_id, "RUNNING", timeout=30)
    assert job["placement"]["transport"] == "tunnel"
    step = 10
    for outage_s in OUTAGES_S:
        # Generous: two TensorFlow stages start on two shared cores before the first steps.
        wait_for(
            lambda step=step: min(p["step"] for p in leader.job(job_id)["progress"]) >= step,
            timeout=120,
            what=f"{step} training steps",
        )
        assert leader.job(job_id)["state"] == "RUNNING", "the job outlived the outages"
        kill_nats(nats_server)
        killed_at = time.monotonic()
        wait_for(
            lambda: leader.request("GET", "/health").status_code == 503,
            timeout=15,
            what="the leader to report NATS down",
        )
        # The outage's length is the fault itself, not a wait for anything.
        time.sleep(max(0.0, outage_s - (time.monotonic() - killed_at)))
        nats_server.start()
        step = min(p["step"] for p in leader.job(job_id)["progress"]) + 30
    try:
        job = leader.wait_job(job_id, "COMPLETED", timeout=180)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{stage_errors(procs)}") from None
    assert job["attempt"] == 1 and job["resumes"] == [], "the outages cost no attempt"
    assert [h["to_state"] for h in job["history"]] == ["PENDING", "RUNNING", "COMPLETED"]
    steps = [h["step"] for h in leader.get(f"/api/v1/jobs/{job_id}/metrics/history")]
    assert steps == sorted(set(steps)) and steps[0] == 1 and steps[-1] == STEPS
    missing = sorted(set(range(1, STEPS + 1)) - set(steps))
    assert len(missing) <= 2 * len(OUTAGES_S), missing
    # Back to ready once their stages have stopped (the job may complete a moment before).
    leader.wait_status("o1", "ready", timeout=30)
    leader.wait_status("o2", "ready", timeout=30)


def stage_errors(procs) -> str:
    """The tails of the stages' stderr, for a failure's message."""
    out = []
    for path in sorted(agent_state_dir(procs).rglob("stage.err")):
        lines = path.read_text(errors="replace").splitlines()
        out.append(f"--- {path}\n" + "\n".join(line for line in lines if "relay" in line)[-4000:])
    return "\n".join(out)
