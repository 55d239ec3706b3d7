"""Fault: a fellow is SIGKILLed mid-training (real leader, agents and stage processes).

With shard pushes and a spare fellow the job resumes from the newest complete push and
completes; with nothing pushed, or no fellow to take over, it fails with the reason, and no
stage is left running.
"""

from __future__ import annotations

import signal

import pytest

from tests.conftest import start_agent
from tests.helpers import Leader, stage_processes, wait_for
from tests.hostile.test_shard_tokens import signer
from tests.integration.test_jobs import agents, tiny, wait_ready, wait_steps

pytestmark = pytest.mark.timeout(300)


def pushed(leader: Leader, job_id: str, step: int) -> bool:
    return (leader.job(job_id)["pushed_step"] or 0) >= step


def test_killing_a_fellow_fails_the_job_quickly_and_leaves_no_stage_running(
    procs, nats_server, leader
):
    started = agents(procs, nats_server, "k1", "k2")
    wait_ready(leader, "k1", "k2")
    job_id = leader.submit(**tiny(name="doomed", steps=100_000, stages=2))["job_id"]
    leader.wait_job(job_id, "RUNNING", timeout=20)
    wait_steps(leader, job_id, 2)
    assert len(stage_processes(job_id)) == 2
    started["k2"].send_signal(signal.SIGKILL)
    job = wait_for(
        lambda: (j := leader.job(job_id))["state"] == "FAILED" and j,
        timeout=10,
        what="the job to fail",
    )
    assert "k2" in job["reason"], job["reason"]
    wait_for(lambda: stage_processes(job_id) == [], timeout=10, what="every stage to exit")
    leader.wait_status("k1", "ready", timeout=10)


def test_a_lost_fellow_is_replaced_and_the_job_resumes_from_its_last_push(
    procs, nats_server, leader, tmp_path
):
    agents = {name: start_agent(procs, nats_server.url, name) for name in ("r1", "r2")}
    wait_ready(leader, "r1", "r2")
    spec = tiny(
        name="resumed",
        steps=400,
        stages=2,
        shard_push_to_leader=True,
        shard_push_interval_steps=20,
        val_every=0,
    )
    job_id = leader.submit(**spec)["job_id"]
    wait_for(lambda: pushed(leader, job_id, 40), timeout=120, what="two complete pushes")
    # A spare joins while the job runs; then one of the placed fellows dies.
    start_agent(procs, nats_server.url, "spare")
    wait_ready(leader, "spare")
    before = leader.job(job_id)
    ranges = [(s["layer_start"], s["layer_end"]) for s in before["placement"]["stages"]]
    victim = before["placement"]["stages"][1]["fellow_id"]
    agents[victim].send_signal(signal.SIGKILL)

    job = leader.wait_job(job_id, "COMPLETED", timeout=200)
    assert job["attempt"] == 2 and len(job["resumes"]) == 1
    resume = job["resumes"][0]
    assert resume["failed_attempt"] == 1 and victim in resume["reason"]
    assert resume["from_step"] >= 40 and resume["from_step"] % 20 == 0
    assert job["resume_step"] == resume["from_step"]
    placed = job["placement"]["stages"]
    assert [(s["layer_start"], s["layer_end"]) for s in placed] == ranges
    assert victim not in [s["fellow_id"] for s in placed] and "spare" in [
        s["fellow_id"] for s in placed
    ]
    # The curve goes on from the resumed step: no jump back to an untrained loss.
    history = leader.get(f"/api/v1/jobs/{job_id}/metrics/history")
    assert history[0]["step"] == resume["from_step"] + 1
    assert history[-1]["step"] == 400
    assert history[0]["loss"] < 4.0, history[0]  # an untrained byte model starts near 5.5
    assert any("resuming from step" in h["reason"] for h in job["history"])
    # The resumed stages downloaded their shards with header tokens: no log line shipped to
    # the leader (served to anyone who asks) holds one, nor any token= in a URL.
    tokens = [signer(leader).token(job_id, job["attempt"], s["stage"]) for s in placed]
    for fid in [s["fellow_id"] for s in placed]:
        lines = [r["message"] for r in leader.get(f"/api/v1/workers/{fid}/logs?limit=2000")]
        assert lines and not [m for m in lines if "token=" in m or any(t in m for t in tokens)]


def test_without_a_spare_the_resumed_job_fails_with_the_reason(procs, nats_server, leader):
    started = agents(procs, nats_server, "s1", "s2")
    wait_ready(leader, "s1", "s2")
    spec = tiny(
        name="alone",
        steps=100_000,
        stages=2,
        shard_push_to_leader=True,
        shard_push_interval_steps=10,
        resume_wait_s=4,
    )
    job_id = leader.submit(**spec)["job_id"]
    wait_for(lambda: pushed(leader, job_id, 10), timeout=90, what="a complete push")
    started["s1"].send_signal(signal.SIGKILL)
    job = leader.wait_job(job_id, "FAILED", timeout=60)
    assert "could not resume within 4s" in job["reason"] and "s1" in job["reason"]
    assert "waiting for 2 ready fellows; 1 available" in job["reason"]
    assert len(job["resumes"]) == 1
    wait_for(lambda: stage_processes(job_id) == [], timeout=15, what="every stage to exit")
    leader.wait_status("s2", "ready", timeout=15)
