"""Sweeps and benchmark suites against a real local cluster (nats-server, leader, agents)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, child_env, run_swarm, swarm_cli
from tests.integration.test_jobs import TINY, agents, wait_ready

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SUITE = REPO / "exp" / "configs" / "benchmarks" / "multinode_training_v1.json"


def test_a_tiny_sweep_runs_every_point_writes_csv_and_png_and_resumes(
    procs, nats_server, leader, tmp_path
):
    agents(procs, nats_server, "s1", "s2")
    wait_ready(leader, "s1", "s2")
    config = tmp_path / "sweep.json"
    config.write_text(
        json.dumps(
            {
                "name": "tiny-sweep",
                "base": {**TINY, "steps": 6, "stages": 2},
                "grid": {"compression": ["none", "fixed_int8"]},
            }
        )
    )
    out = tmp_path / "sweeps"
    run = swarm_cli(
        leader, "sweep", "--config", str(config), "--out", str(out), "--poll", "0.5", timeout=150
    )
    assert run.returncode == 0, run.stdout + run.stderr
    [sweep_dir] = out.iterdir()
    assert sweep_dir.name.startswith("tiny-sweep-")
    assert "2 to run" in run.stdout and "submitted" in run.stdout
    with (sweep_dir / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["compression"] for r in rows] == ["none", "fixed_int8"]
    for r in rows:
        assert r["state"] == "COMPLETED", r
        assert float(r["final_loss"]) > 0 and float(r["final_val_loss"]) > 0
        assert float(r["tokens_per_s"]) > 0 and float(r["step_time_s"]) > 0
        assert float(r["bytes_per_step_per_boundary"]) > 0
    none, int8 = (float(r["compression_ratio_vs_fp32"]) for r in rows)
    assert int8 > 2 * none, "int8 puts far fewer bytes on the wire than fp32"
    # matplotlib's PNG (800x520), with both points drawn in their groups' colours.
    from matplotlib import image
    from matplotlib.colors import to_rgb

    png = image.imread(sweep_dir / "val_loss_vs_bytes.png")
    assert png.shape[:2] == (520, 800)
    for colour in ("C0", "C1"):  # none, fixed_int8
        assert (abs(png[:, :, :3] - to_rgb(colour)).max(axis=2) < 0.02).sum() > 50, colour
    jobs = leader.get("/api/v1/jobs")
    assert len(jobs) == 2

    again = swarm_cli(leader, "sweep", "--config", str(config), "--out", str(out), timeout=30)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "2 already in" in again.stdout and "0 to run" in again.stdout
    assert len(leader.get("/api/v1/jobs")) == 2, "a rerun submits nothing"
    with (sweep_dir / "results.csv").open() as f:
        assert [r["point_id"] for r in csv.DictReader(f)] == [r["point_id"] for r in rows]


def run_suite(leader, *args: str, suite: Path = SUITE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "exp" / "scripts" / "run_benchmark_suite.py"),
            "--suite",
            str(suite),
            "--leader-url",
            leader.url,
            *args,
        ],
        env=child_env(SWARM_API_TOKEN=leader.token or ""),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_suite_dry_run_says_what_cpu_fellows_lack_a_busy_cluster_refuses_and_a_run_keeps_artifacts(
    procs, nats_server, leader, tmp_path
):
    agents(procs, nats_server, "b1", "b2")
    wait_ready(leader, "b1", "b2")
    dry = run_suite(leader, "--dry-run")
    assert dry.returncode == 1, dry.stdout + dry.stderr
    lines = dry.stdout.splitlines()
    assert lines[0] == (
        "single_gpu_baseline: needs 1 fellow with 1 GPU with >= 20 GiB free; "
        "have 2 fellows (2 ready) on 1 host, 0 GPUs"
    )
    assert any(line.startswith("constrained-network: needs 2 fellows on 2 hosts") for line in lines)
    assert len(lines) == 4

    # A job waiting for a third fellow holds the cluster as a running one would (PENDING
    # counts as busy) and trains nothing meanwhile.
    hog = {**TINY, "name": "hog", "steps": 100_000, "stages": 3}
    job_id = leader.submit(**{**hog, "model": {**TINY["model"], "n_layers": 3}})["job_id"]
    assert leader.job(job_id)["state"] == "PENDING"
    try:
        busy = run_suite(leader, "--out", str(tmp_path / "bench"))
        assert busy.returncode == 1, busy.stdout + busy.stderr
        assert "the cluster is busy" in busy.stderr and job_id in busy.stderr
        assert not (tmp_path / "bench").exists()
    finally:
        leader.request("DELETE", f"/api/v1/jobs/{job_id}")
    wait_ready(leader, "b1", "b2")

    # A CPU-sized suite runs for real: artifacts per scenario and repeat.
    suite = tmp_path / "cpu_suite.json"
    suite.write_text(
        json.dumps(
            {
                "name": "cpu-suite",
                "repeats": 1,
                "base": {**TINY, "steps": 6},
                "job_profiles": {
                    "stress": {"shard_push_to_leader": True, "shard_push_interval_steps": 3}
                },
                "default_job_profile": "stress",
                "infra_profiles": {"two_cpu": {"fellows": 2}},
                "scenarios": [{"name": "two_stage_cpu", "infra": "two_cpu", "job": {"stages": 2}}],
            }
        )
    )
    out = tmp_path / "bench"
    real = run_suite(
        leader, "--out", str(out), "--suite-run-id", "r1", "--poll", "0.5", suite=suite
    )
    assert real.returncode == 0, real.stdout + real.stderr
    repeat = out / "r1" / "two_stage_cpu" / "repeat-1"
    job = json.loads((repeat / "job.json").read_text())
    assert job["state"] == "COMPLETED" and job["spec"]["shard_push_interval_steps"] == 3
    history = json.loads((repeat / "metrics_history.json").read_text())
    assert [h["step"] for h in history][-1] == 6
    results = json.loads((repeat / "results.json").read_text())
    assert results["state"] == "COMPLETED" and results["final_val_loss"] > 0
    assert results["tokens_per_s"] > 0 and results["bytes_per_step_per_boundary"] > 0
    assert (repeat / "model_export" / "run_manifest.json").exists()
    assert not (repeat / "model_export" / ".incoming").exists()
    # The copy keeps the export's hard links: each weights.npz is its shard, not a 2nd copy.
    copied = json.loads((repeat / "model_export" / "run_manifest.json").read_text())
    for stage in copied["stages"]:
        weights = repeat / "model_export" / f"stage-{stage['stage']}" / "weights.npz"
        assert weights.samefile(repeat / "model_export" / stage["weights"])
    assert results["repeat"] == 1
    summary = json.loads((out / "r1" / "summary.json").read_text())
    assert summary["two_stage_cpu"]["completed"] == 1
    assert summary["two_stage_cpu"]["final_val_loss"]["mean"] == results["final_val_loss"]
    assert json.loads((out / "r1" / "suite.json").read_text())["name"] == "cpu-suite"

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "infra_profiles": {}, "scenarios": [{"name": "a"}]}))
    broken = subprocess.run(
        [sys.executable, str(REPO / "exp/scripts/run_benchmark_suite.py"), "--suite", str(bad)],
        env=child_env(SWARM_LEADER_URL=leader.url),
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
    )
    assert broken.returncode == 2
    assert str(bad) in broken.stderr and "`infra`" in broken.stderr


def test_sweep_with_a_missing_or_bad_config_exits_2_naming_it(tmp_path: Path):
    """Checked before the leader is asked anything (none listens on port 9)."""
    cli = ("--leader-url", "http://127.0.0.1:9", "sweep", "--config")
    missing = run_swarm(*cli, str(tmp_path / "nope.json"), timeout=30)
    assert missing.returncode == 2 and "nope.json" in missing.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "b", "base": TINY, "grid": {"model.nheads": [2]}}))
    result = run_swarm(*cli, str(bad), timeout=30)
    assert result.returncode == 2
    assert f"{bad}: point " in result.stderr and "model.nheads: unknown field" in result.stderr
