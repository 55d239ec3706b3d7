"""A fellow in a container's CPU quota or pinned to a core reports the cores it may use, and
its stages run that many threads: real agents in a real cgroup v1 quota and affinity mask."""

from __future__ import annotations

import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import start_agent
from tests.helpers import Leader, bench_module, swarm_cli, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MODEL = {"vocab_size": 256, "seq_len": 32, "n_layers": 2, "d_model": 32, "n_heads": 2}


def quota_gauges(leader: Leader) -> dict[str, float]:
    text = leader.http.get("/api/v1/metrics").text
    return {
        sample.labels["fellow"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "swarm_fellow_cpu_quota_cores"
        for sample in family.samples
    }


def test_a_quota_and_an_affinity_mask_set_a_fellows_cores_and_threads(
    procs, nats_server, leader: Leader
):
    host = os.cpu_count() or 1
    if host < 2 or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores to tell a fellow's budget from the host's")
    why: list[str] = []
    with bench_module("cpuquota").cpu_quota(0.5, why=why) as quota:
        if quota is None:
            pytest.skip(why[0])
        try:
            start_agent(procs, nats_server.url, "boxed", prefix=quota)
            start_agent(procs, nats_server.url, "pinned", prefix=["taskset", "-c", "0"])
            for name in ("boxed", "pinned"):
                leader.wait_status(name, "ready", timeout=30)
            hardware = {name: w["hardware"] for name, w in leader.workers().items()}
            assert (hardware["boxed"]["cpu_cores"], hardware["boxed"]["cpu_quota"]) == (1, 0.5)
            assert (hardware["pinned"]["cpu_cores"], hardware["pinned"]["cpu_quota"]) == (1, None)
            assert wait_for(
                lambda: quota_gauges(leader) or None, timeout=10, what="the quota gauge"
            ) == {"boxed": 0.5}
            table = swarm_cli(leader, "fellows")
            assert table.returncode == 0, table.stderr
            rows = {line.split()[0]: line for line in table.stdout.splitlines()[1:] if line.strip()}
            assert "1 (quota 0.5)" in rows["boxed"] and "quota" not in rows["pinned"]
            # One stage on one of them: the host's count would have given it `host` threads.
            job_id = leader.submit(
                name="budget", model=MODEL, stages=1, max_data_bytes=100_000, batch_size=4, steps=4
            )["job_id"]
            job = leader.wait_job(job_id, "COMPLETED", timeout=120)
            assert [s["intra_op_threads"] for s in job["placement"]["stages"]] == [1]
        finally:
            procs.cleanup()  # the quota's group goes only once its processes have
