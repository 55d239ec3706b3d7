"""Trained models out, and jobs that survive losing a fellow: real leader, agents and stages.

Shards are pushed to the leader every N steps and at the end; the leader keeps them in the
job's export directory with run_manifest.json; a fellow SIGKILLed mid-job is replaced and the
job resumes from the newest step every stage pushed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import start_agent
from tests.helpers import Leader, run_swarm, swarm_cli, wait_for
from tests.integration.nats_client import stored_job
from tests.integration.test_jobs import tiny, wait_ready

pytestmark = pytest.mark.timeout(300)


def pushed(leader: Leader, job_id: str, step: int) -> bool:
    job = leader.job(job_id)
    return (job["pushed_step"] or 0) >= step


def saved_pushes(nats_url: str, job_id: str) -> set[tuple[int, int]]:
    """The (stage, step) receipts of the job as the leader saved them in JetStream KV."""
    record = stored_job(nats_url, job_id)
    return {(r["stage"], r["step"]) for r in record.get("latest_shard_pushes") or []}


def check_manifest(directory: Path, n_stages: int) -> dict:
    """The job's final manifest, its files checked. A job turns terminal a moment before its
    final manifest (with the final losses) replaces the last push's: it is awaited."""
    path = directory / "run_manifest.json"
    wait_for(
        lambda: json.loads(path.read_text())["state"] == "COMPLETED",
        timeout=15,
        what="the final manifest",
    )
    manifest = json.loads(path.read_text())
    assert manifest["format"] == 1 and len(manifest["stages"]) == n_stages
    for stage in manifest["stages"]:
        for key in ("weights", "checkpoint"):
            data = (directory / stage[key]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == stage[f"{key}_sha256"], stage[key]
    return manifest


def check_weights_npz(directory: Path, manifest: dict) -> None:
    """stage-<i>/weights.npz (the name earlier exports used): the manifest's shard of each
    stage, the same file (a hard link), loading with numpy with the stage's model arrays."""
    for stage in manifest["stages"]:
        weights = directory / f"stage-{stage['stage']}" / "weights.npz"
        shard = directory / stage["weights"]
        assert weights.samefile(shard), weights
        with np.load(weights, allow_pickle=False) as arrays, np.load(shard) as expected:
            assert arrays.files == expected.files
            assert any(name.startswith("model/") for name in arrays.files)
            for name in expected.files:
                np.testing.assert_array_equal(arrays[name], expected[name])


def test_shards_are_pushed_every_n_steps_survive_a_leader_restart_and_make_the_export(
    procs, nats_server, restartable_leader, tmp_path
):
    # An export directory must be inside the leader's export root (SWARM_EXPORT_ROOT).
    restartable_leader.env["SWARM_EXPORT_ROOT"] = str(tmp_path / "exports")
    restartable_leader.start()
    leader = restartable_leader.client
    for name in ("e1", "e2"):
        start_agent(procs, nats_server.url, name)
    wait_ready(leader, "e1", "e2")
    export = tmp_path / "exports" / "run-1"
    spec = tiny(
        name="exported",
        steps=150,
        stages=2,
        shard_push_to_leader=True,
        shard_push_interval_steps=10,
        artifact_paths={"model_export_dir": str(export)},
    )
    job_id = leader.submit(**spec)["job_id"]
    wait_for(lambda: pushed(leader, job_id, 10), timeout=90, what="the first complete push")
    # Killed once the receipts are saved (a receipt the leader acked but had not written yet
    # is gone with it, and the fellow does not send an acked piece again).
    wait_for(
        lambda: {(0, 10), (1, 10)} <= saved_pushes(nats_server.url, job_id),
        timeout=10,
        what="the first receipts to be saved",
    )
    restartable_leader.kill()  # pushes in flight are retried against the new leader
    restartable_leader.start()
    job = leader.wait_job(job_id, "COMPLETED", timeout=150)

    assert job["export_dir"] == str(export.resolve())
    assert job["pushed_step"] == 150
    steps = {(r["stage"], r["step"]) for r in job["latest_shard_pushes"]}
    assert {(0, 10), (1, 10), (0, 150), (1, 150)} <= steps
    # Every N steps (a push still waiting when a newer one is ready is skipped: never stale).
    periodic = {s for _, s in steps if s < 150}
    assert all(s % 10 == 0 for s in periodic) and 10 in periodic
    manifest = check_manifest(export, 2)
    assert manifest["step"] == 150 and manifest["job_id"] == job_id
    assert manifest["val_loss"] == pytest.approx(job["final_val_loss"])
    assert [s["layer_end"] for s in manifest["stages"]] == [
        s["layer_end"] for s in job["placement"]["stages"]
    ]
    # Older steps are pruned: the newest two complete ones stay.
    kept = sorted(int(p.name[5:]) for p in (export / "shards").iterdir())
    assert kept[-1] == 150 and len(kept) <= 3
    check_weights_npz(export, manifest)
    # The receipts are also config.latest_shard_pushes, in the API and `swarm job --json`.
    assert job["config"]["latest_shard_pushes"] == job["latest_shard_pushes"]
    shown = swarm_cli(leader, "job", job_id, "--json")
    assert shown.returncode == 0, shown.stderr
    config = json.loads(shown.stdout)["config"]
    assert config["latest_shard_pushes"] == job["latest_shard_pushes"]
    assert config["pushed_step"] == 150 and config["model_export_dir"] == job["export_dir"]

    # Glue: one model whose validation loss is the pipeline's; it generates text.
    glued = run_swarm("glue", str(export), timeout=240)
    assert glued.returncode == 0, glued.stdout + glued.stderr
    inference = json.loads((export / "full_model" / "inference_manifest.json").read_text())
    assert inference["val_loss"] == pytest.approx(job["final_val_loss"], rel=0.01)
    text = run_swarm(
        "generate",
        "--model-dir",
        str(export / "full_model"),
        "--prompt",
        "def ",
        "--max-new-tokens",
        "40",
        timeout=120,
    )
    assert text.returncode == 0 and text.stdout.strip(), text.stderr

    # A corrupt shard: glue refuses and names the file.
    broken = tmp_path / "broken"
    shutil.copytree(export, broken, ignore=shutil.ignore_patterns("full_model"))
    weights = broken / manifest["stages"][1]["weights"]
    weights.write_bytes(weights.read_bytes()[:-10] + b"0123456789")
    refused = run_swarm("glue", str(broken), timeout=240)
    assert refused.returncode == 2 and manifest["stages"][1]["weights"] in refused.stderr
    assert not (broken / "full_model").exists()
