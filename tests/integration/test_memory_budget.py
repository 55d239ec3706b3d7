"""A fellow in a container's memory limit offers what the limit leaves, not its host's RAM,
and a stage the kernel's out-of-memory killer ends says so: real agents and stages in a real
cgroup v1 memory group, a real out-of-memory kill."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import leader_process, start_agent
from tests.helpers import Leader, bench_module, fellow_gauges, swarm_cli, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

GIB = 1 << 30
MIB = 1 << 20
TINY = {"vocab_size": 256, "seq_len": 32, "n_layers": 2, "d_model": 32, "n_heads": 2}
# ~1.3 GiB by placement's estimate (leader/memory.py), TensorFlow's runtime included.
LARGER = {"vocab_size": 256, "seq_len": 32, "n_layers": 8, "d_model": 512, "n_heads": 2}


def test_a_fellow_offers_what_its_memory_limit_leaves_and_follows_a_changed_limit(
    procs, nats_server, leader: Leader
):
    why: list[str] = []
    with bench_module("cpuquota").memory_group(GIB, why=why) as group:
        if group is None:
            pytest.skip(why[0])
        try:
            start_agent(procs, nats_server.url, "boxed", prefix=group.prefix)
            leader.wait_status("boxed", "ready", timeout=30)
            hardware = leader.workers()["boxed"]["hardware"]
            host = psutil.virtual_memory().total
            assert hardware["ram_limit_bytes"] == GIB
            assert hardware["ram_total_bytes"] == GIB
            assert hardware["host_ram_total_bytes"] == host
            # The agent's own working set is in the group: it offers the room under the limit.
            assert 0.5 * GIB < hardware["ram_available_bytes"] < GIB
            assert fellow_gauges(leader.http, "swarm_fellow_ram_limit_bytes") == {"boxed": GIB}
            table = swarm_cli(leader, "fellows")
            assert table.returncode == 0, table.stderr
            assert "(limit 1.0G)" in table.stdout, table.stdout
            nodes = leader.get("/api/v1/nodes")
            assert [n["ram_total_bytes"] for n in nodes] == [host], "the host view is the host's"

            # The host's RAM would take this job; the limit does not.
            job_id = leader.submit(
                name="larger", model=LARGER, stages=1, steps=4, batch_size=4, max_data_bytes=100_000
            )["job_id"]

            def waiting_for_ram() -> str | None:
                reason = leader.job(job_id)["reason"] or ""
                return reason if "of RAM" in reason else None

            reason = wait_for(waiting_for_ram, timeout=30, what="the job to wait for RAM")
            found = re.search(r"needs ~([\d.]+) GiB of RAM, best fellow has ([\d.]+) GiB", reason)
            assert found and float(found[2]) <= 1.0 < float(found[1]), reason
            assert leader.job(job_id)["state"] == "PENDING"
            # `docker update --memory`: the next heartbeat offers the new room, and it is placed.
            group.set_limit(3 * GIB)
            leader.wait_job(job_id, "RUNNING", "COMPLETED", timeout=60)
            assert leader.workers()["boxed"]["hardware"]["ram_limit_bytes"] == 3 * GIB
        finally:
            procs.cleanup()  # the group goes only once its processes have


def training(leader: Leader, **spec) -> str:
    """A one-stage job of the tiny model, as long as the test wants it, once it trains."""
    job_id = leader.submit(
        model=TINY, stages=1, steps=100_000, batch_size=4, max_data_bytes=100_000, **spec
    )["job_id"]
    wait_for(
        lambda: any(p["step"] >= 2 for p in leader.job(job_id)["progress"]),
        timeout=90,
        what="the stage to train",
    )
    return job_id


def out_of_memory(group, shm: Path) -> None:
    """Fill ``group`` past its limit with memory the kernel cannot drop (tmpfs, no swap):
    past what the limit leaves even with every file page dropped (less, and the kernel
    thrashes the stage's code pages for seconds before it gives up). The out-of-memory
    killer ends the stage first (its runtime raised its oom_score_adj to 500); dd (300: below
    the stage, above the agent) may go next: the stage's memory leaves the group a few ms
    after it died, and dd's pages keep coming meanwhile. What is left then fits: the stage's
    own memory is far above the 64 MiB over. (The fellow unit also lowers the agent's score;
    this sandbox cannot: no CAP_SYS_RESOURCE.)"""
    limit = int((group.path / "memory.limit_in_bytes").read_text())
    over = (limit - group.unreclaimable() + 64 * MIB) // MIB
    fill = ["dd", "if=/dev/zero", f"of={shm}", "bs=1M", f"count={over}"]
    subprocess.run(
        [*group.prefix, "choom", "-n", "300", "--", *fill], capture_output=True, timeout=60
    )


@pytest.fixture
def patient_leader(procs, nats_server, tmp_path) -> Iterator[Leader]:
    """A leader that waits 20 s for a heartbeat: a group at its limit stalls the agent too
    while the kernel reclaims, and this test is about what the stage's end says."""
    yield from leader_process(procs, nats_server, tmp_path, SWARM_OFFLINE_AFTER_S="20")


def test_a_stage_the_out_of_memory_killer_ends_says_so_and_the_fellow_stays(
    procs, nats_server, patient_leader: Leader, tmp_path
):
    leader = patient_leader
    why: list[str] = []
    shm = Path("/dev/shm") / f"swarm-oom-{tmp_path.name}"
    with bench_module("cpuquota").memory_group(3 * GIB // 2, why=why) as group:
        if group is None:
            pytest.skip(why[0])
        try:
            agent = start_agent(procs, nats_server.url, "boxed", prefix=group.prefix)
            leader.wait_status("boxed", "ready", timeout=30)
            job_id = training(leader, name="oom", max_resumes=0)
            out_of_memory(group, shm)
            job = leader.wait_job(job_id, "FAILED", timeout=60)
            reason = job["reason"]
            assert "the kernel's out-of-memory killer ended the stage runtime" in reason, reason
            assert "memory cgroup reached its limit of 1.5 GiB" in reason, reason
            assert "(exit -9)" in reason, reason
            # The leader remembers: this job's later attempts give the fellow a smaller stage.
            estimate = job["placement"]["stages"][0]["memory_estimate_bytes"]
            assert job["out_of_memory"] == {"boxed": estimate}
            assert agent.poll() is None, "the agent outlives its stage"
            leader.wait_status("boxed", "ready", timeout=30)
        finally:
            shm.unlink(missing_ok=True)
            procs.cleanup()


def test_an_out_of_memory_death_said_after_its_fellow_was_taken_for_offline_is_noted(
    procs, nats_server, leader: Leader, tmp_path
):
    """A group at its limit stalls its agent while the kernel reclaims: the leader takes the
    fellow for offline and resumes the job before the stage's end is said. (The stall is a
    SIGSTOP here, the out-of-memory kill real.) The fellow says it when it runs again, and
    the resumed job neither puts the same stage on it nor hides why."""
    why: list[str] = []
    shm = Path("/dev/shm") / f"swarm-oom-{tmp_path.name}"
    with bench_module("cpuquota").memory_group(3 * GIB // 2, why=why) as group:
        if group is None:
            pytest.skip(why[0])
        agent = None
        try:
            agent = start_agent(procs, nats_server.url, "boxed", prefix=group.prefix)
            leader.wait_status("boxed", "ready", timeout=30)
            job_id = training(leader, name="late", max_resumes=2, resume_from_scratch=True)
            os.kill(agent.pid, signal.SIGSTOP)
            resumed = wait_for(
                lambda: leader.job(job_id)["resumes"] or None,
                timeout=30,
                what="the job to resume without the silent fellow",
            )
            assert "went offline" in resumed[0]["reason"], resumed
            estimate = resumed[0]["memory_estimates"]["boxed"]
            out_of_memory(group, shm)
            os.kill(agent.pid, signal.SIGCONT)

            def noted() -> dict | None:
                job = leader.job(job_id)
                return job if job["out_of_memory"] else None

            job = wait_for(noted, timeout=60, what="the late out-of-memory death to be noted")
            assert job["out_of_memory"] == {"boxed": estimate}
            said = job["resumes"][0]["reason"]
            assert "; its stage said later: the kernel's out-of-memory killer" in said, said
            waiting = wait_for(
                lambda: (
                    "ran out of memory on boxed" in leader.job(job_id)["reason"]
                    and leader.job(job_id)
                ),
                timeout=30,
                what="the waiting reason to say why boxed will not do",
            )
            assert waiting["state"] == "PENDING", waiting["reason"]
        finally:
            if agent is not None and agent.poll() is None:
                os.kill(agent.pid, signal.SIGCONT)
            shm.unlink(missing_ok=True)
            procs.cleanup()
