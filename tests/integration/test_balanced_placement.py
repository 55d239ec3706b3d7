"""Throughput-aware placement end to end: real agents with different speeds, a real leader."""

from __future__ import annotations

import pytest

from tests.conftest import start_agent
from tests.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MODEL = {"vocab_size": 256, "seq_len": 32, "n_layers": 6, "d_model": 32, "n_heads": 2}


def layers_of(job: dict) -> dict[str, int]:
    return {s["fellow_id"]: s["layer_end"] - s["layer_start"] for s in job["placement"]["stages"]}


def test_a_balanced_job_gives_the_faster_fellow_more_layers_and_trains(
    procs, nats_server, restartable_leader
):
    restartable_leader.start()
    leader = restartable_leader.client
    # Same machine: the declared speeds (SWARM_FELLOW_COMPUTE_SPEED) differ. Three fellows
    # for a 2-stage job: the slowest, which offers the most memory (the others are capped),
    # is left out.
    capped = {"SWARM_FELLOW_MAX_MEMORY_GB": "4"}
    start_agent(procs, nats_server.url, "slow", SWARM_FELLOW_COMPUTE_SPEED="1", **capped)
    start_agent(procs, nats_server.url, "fast", SWARM_FELLOW_COMPUTE_SPEED="3", **capped)
    start_agent(procs, nats_server.url, "slowest", SWARM_FELLOW_COMPUTE_SPEED="0.5")
    for name in ("slow", "fast", "slowest"):
        leader.wait_status(name, "ready", timeout=20)
    workers = leader.workers()
    assert workers["fast"]["hardware"]["compute_speed"] == 3.0
    assert workers["slow"]["hardware"]["compute_speed"] == 1.0
    job_id = leader.submit(
        name="balanced",
        model=MODEL,
        partition="balanced",
        stages=2,
        max_data_bytes=300_000,
        batch_size=8,
        micro_batches=2,
        steps=12,
        jit_compile=False,  # placement is tested here, not XLA (test_jobs' TINY says why)
    )["job_id"]
    job = leader.wait_job(job_id, "COMPLETED", timeout=180)
    # 3x the speed: 5 of the 6 layers (5/3 against the slow one's 1 layer and the head).
    assert layers_of(job) == {"fast": 5, "slow": 1}
    assert job["final_loss"] is not None
    # The stages' step times told the leader each fellow's speed (their work, waits left
    # out), which the next balanced placement prefers to the declared one.
    measured = {name: w["measured_speed"] for name, w in leader.workers().items()}
    assert all(measured[name] is not None and measured[name] > 0 for name in ("fast", "slow"))
    assert measured["slowest"] is None, measured
    # Its stages measured the boundary; the upstream fellow's record keeps it (the next
    # balanced job is ordered along it), through a restart of the leader.
    upstream, downstream = (s["fellow_id"] for s in job["placement"]["stages"])
    links = {name: w["links"] for name, w in leader.workers().items()}
    assert set(links[upstream]) == {downstream} and links[downstream] == {}, links
    assert links[upstream][downstream]["mbit_s"] > 0 and links[upstream][downstream]["rtt_ms"] > 0
    restartable_leader.kill()
    restartable_leader.start()
    assert {name: w["links"] for name, w in leader.workers().items()} == links
    for name in ("slow", "fast"):
        leader.wait_status(name, "ready", timeout=30)
    equal = leader.submit(
        name="equal",
        model=MODEL,
        stages=2,
        max_data_bytes=300_000,
        batch_size=8,
        micro_batches=2,
        steps=2,
        jit_compile=False,
    )["job_id"]
    assert sorted(layers_of(leader.wait_job(equal, "COMPLETED", timeout=120)).values()) == [3, 3]


def test_an_agent_probes_its_compute_speed_when_none_is_declared(procs, nats_server, leader):
    start_agent(procs, nats_server.url, "probed", SWARM_FELLOW_COMPUTE_SPEED="")
    leader.wait_status("probed", "ready", timeout=20)
    speed = wait_for(
        lambda: leader.workers()["probed"]["hardware"].get("compute_speed"),
        timeout=150,
        what="the agent's compute speed probe to report",
    )
    assert 0 < speed <= 1e6
