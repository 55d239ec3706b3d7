"""Fault: the documented sweep commands failed (real leader, agents and ``swarm sweep``).

``--partition`` on a config with a partition axis exited 2; the bundled GPU sweeps queued
on CPU fellows forever; Ctrl-C on a sweep left its running job going. Now ``--partition``
narrows the axis (and says so), a GPU-only sweep on a swarm without GPUs is refused at once
with the reason, and SIGINT cancels the job the sweep started.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, child_env, stage_processes, swarm_cli, wait_for
from tests.integration.test_jobs import TINY, agents, wait_ready

pytestmark = pytest.mark.timeout(180)

REFUSED = re.compile(r"swarm: error: sweep (?P<id>\S+) needs GPUs \((?P<n>\d+) of (?P=n) point")


def test_the_documented_gpu_sweeps_are_refused_at_once_on_cpu_fellows(
    procs, nats_server, leader, tmp_path
):
    agents(procs, nats_server, "c1", "c2")
    wait_ready(leader, "c1", "c2")
    # As README.md runs them (the default --out is under the checkout: nothing is written).
    large = swarm_cli(
        leader,
        "sweep",
        "--config",
        "exp/configs/exp_large_unlimited_compute_v1.json",
        "--partition",
        "weighted",
        timeout=60,
    )
    assert large.returncode == 1, large.stdout + large.stderr
    assert (
        "--partition weighted overrides the grid's partition axis (equal, weighted): "
        "36 of 72 points"
    ) in large.stdout
    refused = REFUSED.search(large.stderr)
    assert refused and refused["n"] == "36", large.stderr
    assert "the swarm has 1 online host(s) with 2 fellow(s) and no GPU" in large.stderr
    assert not (REPO / "exp" / "runs" / "sweeps" / refused["id"]).exists()

    full = swarm_cli(
        leader, "sweep", "--config", "exp/configs/exp_full_sweep_unlimited_v1.json", timeout=60
    )
    assert full.returncode == 1, full.stdout + full.stderr
    refused = REFUSED.search(full.stderr)
    assert refused and refused["n"] == "64", full.stderr
    assert leader.get("/api/v1/jobs") == [], "nothing was submitted"

    plan = swarm_cli(
        leader,
        "sweep",
        "--config",
        "exp/configs/exp_large_unlimited_compute_v1.json",
        "--partition",
        "equal",
        "--out",
        str(tmp_path / "sweeps"),
        "--dry-run",
        timeout=60,
    )
    assert plan.returncode == 1, plan.stdout + plan.stderr
    lines = plan.stdout.splitlines()
    assert re.fullmatch(r"sweep \S+: 36 point\(s\), 36 to run; results in .*", lines[1])
    assert all("partition=equal" in line for line in lines[2:-1]) and len(lines) == 2 + 36 + 1
    assert lines[-1].startswith("refused: sweep ")
    assert not (tmp_path / "sweeps").exists()

    # A CPU sweep of the same shape passes the check (and is not run by --dry-run).
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"name": "cpu", "base": TINY, "grid": {"stages": [1, 2]}}))
    ok = swarm_cli(leader, "sweep", "--config", str(cpu), "--dry-run", timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.splitlines()[-1] == "the swarm can run it"
    assert leader.get("/api/v1/jobs") == []


def test_ctrl_c_on_a_sweep_cancels_the_job_it_started(procs, nats_server, leader, tmp_path):
    agents(procs, nats_server, "i1", "i2")
    wait_ready(leader, "i1", "i2")
    config = tmp_path / "sweep.json"
    config.write_text(
        json.dumps(
            {
                "name": "interrupted",
                "base": {**TINY, "steps": 100_000, "stages": 2},
                "grid": {"partition": ["equal", "weighted"], "compression": ["none", "fp16"]},
            }
        )
    )
    out = tmp_path / "sweeps"
    argv = [sys.executable, "-m", "silentswarm.cli.app", "--leader-url", leader.url, "sweep"]
    argv += ["--config", str(config), "--out", str(out), "--partition", "weighted"]
    sweep = procs.start(
        "sweep",
        [*argv, "--poll", "0.2"],
        env=child_env(SWARM_API_TOKEN=leader.token or "", PYTHONFAULTHANDLER="1"),
    )
    [job] = wait_for(
        lambda: [j for j in leader.get("/api/v1/jobs") if j["state"] == "RUNNING"],
        timeout=60,
        what="the sweep's first job to run",
    )
    assert job["spec"]["partition"] == "weighted" and job["name"].startswith("interrupted-")
    wait_for(lambda: stage_processes(job["job_id"]), timeout=30, what="its stages")

    masks = signal_masks(sweep.pid)
    sweep.send_signal(signal.SIGINT)
    try:
        code = sweep.wait(timeout=30)
    except subprocess.TimeoutExpired:
        # Where it is stuck: faulthandler prints every thread's stack on SIGABRT.
        sweep.send_signal(signal.SIGABRT)
        sweep.wait(timeout=10)
        pytest.fail(
            f"the sweep did not exit 30 s after Ctrl-C (at the signal: {masks}):\n"
            f"{procs.log(sweep)}"
        )
    assert code == 130, procs.log(sweep)
    assert leader.job(job["job_id"])["state"] == "CANCELLED"
    log = procs.log(sweep)
    assert "--partition weighted overrides the grid's partition axis" in log
    assert f"interrupted: cancelled {job['job_id']} (it runs again on resume)" in log
    assert [j["job_id"] for j in leader.get("/api/v1/jobs")] == [job["job_id"]]
    wait_for(lambda: not stage_processes(job["job_id"]), timeout=30, what="its stages to stop")
    [sweep_dir] = out.iterdir()
    assert not (sweep_dir / "results.csv").exists(), "the interrupted point has no row"


def signal_masks(pid: int) -> str:
    """The process's blocked and ignored signals (/proc), for a failure message."""
    status = Path(f"/proc/{pid}/status").read_text()
    return " ".join(line for line in status.splitlines() if line.startswith(("SigBlk", "SigIgn")))
