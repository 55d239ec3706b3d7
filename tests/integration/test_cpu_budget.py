"""A fellow in a container's CPU quota or pinned to a core reports the cores it may use, its
stages run that many threads and report the seconds the quota held them back: real agents
and stages in a real cgroup v1 quota and affinity mask."""

from __future__ import annotations

import os

import pytest

from silentswarm.agent.runtime.launch import run_plans
from silentswarm.plan import ModelConfig, TrainConfig, single_process_plan
from tests.conftest import start_agent
from tests.helpers import Leader, bench_module, fellow_gauges, swarm_cli, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MODEL = {"vocab_size": 256, "seq_len": 32, "n_layers": 2, "d_model": 32, "n_heads": 2}


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
            start_agent(
                procs,
                nats_server.url,
                "pinned",
                prefix=["taskset", "-c", "0"],
                SWARM_FELLOW_POOL="pinned",
            )
            for name in ("boxed", "pinned"):
                leader.wait_status(name, "ready", timeout=30)
            hardware = {name: w["hardware"] for name, w in leader.workers().items()}
            assert (hardware["boxed"]["cpu_cores"], hardware["boxed"]["cpu_quota"]) == (1, 0.5)
            assert (hardware["pinned"]["cpu_cores"], hardware["pinned"]["cpu_quota"]) == (1, None)
            quotas = wait_for(
                lambda: fellow_gauges(leader.http, "swarm_fellow_cpu_quota_cores") or None,
                timeout=10,
                what="the quota gauge",
            )
            assert quotas == {"boxed": 0.5}
            table = swarm_cli(leader, "fellows")
            assert table.returncode == 0, table.stderr
            rows = {line.split()[0]: line for line in table.stdout.splitlines()[1:] if line.strip()}
            assert "1 (quota 0.5)" in rows["boxed"] and "quota" not in rows["pinned"]
            # One stage on the pinned one (its own pool: the boxed one would start TensorFlow
            # at half a core's pace): the host's count would have given it `host` threads.
            job_id = leader.submit(
                name="budget",
                model=MODEL,
                pool="pinned",
                stages=1,
                max_data_bytes=100_000,
                batch_size=4,
                steps=4,
            )["job_id"]
            job = leader.wait_job(job_id, "COMPLETED", timeout=120)
            assert [s["intra_op_threads"] for s in job["placement"]["stages"]] == [1]
        finally:
            procs.cleanup()  # the quota's group goes only once its processes have


def test_a_stage_under_a_quota_reports_the_seconds_it_was_held_back(tmp_path):
    """A real stage process in a real cgroup: at full speed while TensorFlow starts and
    compiles, then held to a tenth of a core; its step records from then on carry the seconds
    the kernel held its group back, which the leader leaves out of the fellow's speed. (A tenth,
    not a half: on a machine busy with other work a stage gets less than half a core from the
    scheduler anyway, and the kernel holds back only what wants more than its quota.)"""
    why: list[str] = []
    # "Full speed" is a quota above every core the machine has: a quota of exactly its cores
    # still throttles now and then (the kernel hands quota out to each core in slices).
    full = float(os.cpu_count() or 1) + 1.0
    with bench_module("cpuquota").cpu_group(full, why=why) as group:
        if group is None:
            pytest.skip(why[0])
        held_from: list[int] = []
        released_after: list[int] = []

        out = tmp_path / "stage-held-0.out"  # run_plans writes the stage's events there

        def hold(event: dict) -> None:
            if event["event"] != "step":
                return
            if event["step"] >= 2 and not held_from:
                # This callback follows the stage's output file and may run far behind it on
                # a busy machine: held are the steps after the newest one written before the
                # quota falls (and after the one in flight, which it may catch halfway). Read
                # first: a step written after the fall was held, and must not count as free.
                lines = out.read_text().splitlines()
                held_from.append(sum('"event":"step"' in line for line in lines) + 1)
                group.set_share(0.1)
            elif held_from and event["step"] >= held_from[0] + 12 and not released_after:
                group.set_share(full)  # the rest of the run (its save, its end) at full speed
                released_after.append(event["step"])

        # Steps of a few ms once compiled: 400 leave the callback seconds of slack to see
        # step 2 and still hold a dozen steps after it.
        plan = single_process_plan(
            job_id="held",
            model=ModelConfig(**MODEL),
            train=TrainConfig(steps=400, batch_size=8, val_every=0, max_data_bytes=100_000),
        )
        (events,) = run_plans([plan], tmp_path, command_prefixes={0: group.prefix}, on_event=hold)
    steps = [e for e in events if e["event"] == "step"]
    # Two steps may straddle the switch: the one in flight when the file was read
    # (held_from - 1) and one that began between the read and the fall (held_from).
    free = [e for e in steps if 0 < e["step"] < held_from[0] - 1]
    records = [e for e in steps if held_from[0] < e["step"] <= released_after[0]]
    assert all(0 <= e["throttled_s"] <= e["step_time_s"] - e["wait_s"] + 1e-4 for e in steps)
    # Free steps are not held back, or next to nothing of their time (under 2%, where held
    # ones below lose over a quarter).
    free_time = sum(e["step_time_s"] for e in free)
    assert sum(e["throttled_s"] for e in free) < max(0.05, 0.02 * free_time), free
    held = sum(e["throttled_s"] for e in records)
    total = sum(e["step_time_s"] for e in records)
    # Busy all the time in a tenth of a core: held back for most of it.
    assert held > 0.25 * total, (held, total)
