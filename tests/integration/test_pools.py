"""Pools and labels end to end: a real nats-server, a real leader, real agents in two pools."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.conftest import start_agent
from tests.helpers import Leader, child_env, swarm_cli, wait_for
from tests.integration.test_jobs import TINY, tiny, wait_ready, wait_steps

pytestmark = pytest.mark.timeout(180)


def placed_on(job: dict) -> list[str]:
    return sorted(s["fellow_id"] for s in job["placement"]["stages"])


def test_a_job_pinned_to_a_pool_lands_only_there_and_waits_saying_why_while_it_is_busy(
    procs, nats_server, leader
):
    start_agent(procs, nats_server.url, "a1", SWARM_FELLOW_POOL="a")
    start_agent(procs, nats_server.url, "a2", SWARM_FELLOW_POOL="a", SWARM_FELLOW_LABELS="zone=eu")
    start_agent(procs, nats_server.url, "b1", SWARM_FELLOW_POOL="b", SWARM_FELLOW_LABELS="gpu=x")
    wait_ready(leader, "a1", "a2", "b1")
    workers = leader.workers()
    assert {f: (w["pool"], w["labels"]) for f, w in workers.items()} == {
        "a1": ("a", {}),
        "a2": ("a", {"zone": "eu"}),
        "b1": ("b", {"gpu": "x"}),
    }

    table = swarm_cli(leader, "fellows")
    assert table.returncode == 0, table.stderr
    assert "POOL" in table.stdout and "LABELS" in table.stdout and "gpu=x" in table.stdout

    # Two fellows of pool a are idle, yet the job pinned to b takes b's only fellow.
    first = leader.submit(**tiny(name="first", steps=100_000, pool="b", labels={"gpu": "x"}))
    job = leader.wait_job(first["job_id"], "RUNNING", timeout=30)
    assert placed_on(job) == ["b1"]
    wait_steps(leader, first["job_id"], 1)

    # The second job pinned to b waits, saying why, while a's fellows stay idle.
    second = leader.submit(**tiny(name="second", steps=10, pool="b"))
    reason = wait_for(
        lambda: (r := leader.job(second["job_id"])["reason"]).startswith("waiting for") and r,
        timeout=10,
        what="the second job's waiting reason",
    )
    assert reason == "waiting for 1 ready fellows in pool b; 0 available, 1 busy"
    assert leader.job(second["job_id"])["state"] == "PENDING"
    assert leader.workers()["a1"]["status"] == "ready"

    # Labels pick among a pool's fellows; a job in the default pool finds none and says so.
    labelled = leader.submit(**tiny(name="eu", steps=10, pool="a", labels={"zone": "eu"}))
    stray = leader.submit(**{**TINY, "name": "stray", "steps": 10})
    assert placed_on(leader.wait_job(labelled["job_id"], "COMPLETED", timeout=60)) == ["a2"]
    assert leader.job(stray["job_id"])["reason"] == (
        "waiting for 1 ready fellows; 0 available (no fellow is in pool default; pools: a, b)"
    )

    # The first ends; the second runs on b's fellow as soon as it is free.
    cancelled = leader.request("DELETE", f"/api/v1/jobs/{first['job_id']}")
    assert cancelled.status_code == 200, cancelled.text
    done = leader.wait_job(second["job_id"], "COMPLETED", timeout=60)
    assert placed_on(done) == ["b1"]
    assert leader.job(stray["job_id"])["state"] == "PENDING"


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"SWARM_FELLOW_LABELS": "gpu"}, "SWARM_FELLOW_LABELS: 'gpu' is not key=value"),
        ({"SWARM_FELLOW_POOL": "gpu pool"}, "SWARM_FELLOW_POOL: "),
    ],
)
def test_an_agent_with_a_bad_pool_or_labels_exits_2_naming_the_variable(env, words):
    result = subprocess.run(
        [sys.executable, "-m", "silentswarm.agent.main", "--nats-url", "nats://127.0.0.1:1"],
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result
    assert words in result.stderr and "Traceback" not in result.stderr


def test_a_job_that_lost_a_fellow_resumes_in_its_pool_once_a_fellow_of_it_joins(
    procs, nats_server, leader
):
    started = {
        name: start_agent(procs, nats_server.url, name, SWARM_FELLOW_POOL=pool)
        for name, pool in (("r-a1", "a"), ("r-b1", "b"), ("r-b2", "b"))
    }
    wait_ready(leader, *started)
    spec = tiny(name="pinned", steps=100_000, stages=2, pool="b", resume_from_scratch=True)
    job_id = leader.submit(**spec)["job_id"]
    assert placed_on(leader.wait_job(job_id, "RUNNING", timeout=30)) == ["r-b1", "r-b2"]
    wait_steps(leader, job_id, 1)
    started["r-b2"].send_signal(signal.SIGKILL)

    # Resumed, it waits for pool b: pool a's idle fellow is never taken.
    job = wait_for(
        lambda: (j := leader.job(job_id))["resumes"] and "1 offline" in j["reason"] and j,
        timeout=30,
        what="the resumed job waiting for pool b",
    )
    assert job["state"] == "PENDING", job
    assert job["reason"].startswith("waiting for 2 ready fellows in pool b; "), job["reason"]
    assert leader.workers()["r-a1"]["status"] == "ready"

    start_agent(procs, nats_server.url, "r-b3", SWARM_FELLOW_POOL="b")
    job = wait_for(
        lambda: (j := leader.job(job_id))["state"] == "RUNNING" and j["attempt"] == 2 and j,
        timeout=60,
        what="attempt 2 running",
    )
    assert placed_on(job) == ["r-b1", "r-b3"]


def test_an_accounts_pool_limit_holds_its_second_job_while_others_use_the_pool(
    procs, nats_server, leader
):
    for name in ("l-b1", "l-b2"):
        start_agent(procs, nats_server.url, name, SWARM_FELLOW_POOL="b")
    wait_ready(leader, "l-b1", "l-b2")
    created = leader.request(
        "POST",
        "/api/v1/accounts",
        json={
            "name": "carol",
            "role": "submitter",
            "pools": ["b"],
            "pool_limits": {"b": {"max_jobs": 1}},
        },
    )
    assert created.status_code == 201, created.text
    carol = Leader(leader.url, token=created.json()["token"])
    try:
        first = carol.submit(**tiny(name="c-first", steps=100_000, stages=1, pool="b"))
        assert carol.wait_job(first["job_id"], "RUNNING", timeout=30)["owner"] == "carol"
        second = carol.submit(**tiny(name="c-second", steps=10, stages=1, pool="b"))
        reason = wait_for(
            lambda: (r := leader.job(second["job_id"])["reason"]).startswith("waiting:") and r,
            timeout=10,
            what="the second job's waiting reason",
        )
        assert reason == "waiting: account carol runs 1 job(s) in pool b; its limit is 1 (max_jobs)"

        # The operator is never limited: its job takes the fellow carol's second may not.
        other = leader.submit(**tiny(name="op", steps=10, stages=1, pool="b"))
        assert leader.wait_job(other["job_id"], "COMPLETED", timeout=60)
        assert leader.job(second["job_id"])["state"] == "PENDING"

        assert carol.request("DELETE", f"/api/v1/jobs/{first['job_id']}").status_code == 200
        assert carol.wait_job(second["job_id"], "COMPLETED", timeout=60)
    finally:
        carol.close()
