"""LoRA adapters: a job that adapts a finished job's export on new data, a real cluster.

Job A trains a tiny model; job L trains a LoRA adapter on A's export (``init_from`` +
``adapter``) on other text, pipeline-parallel. L's validation loss on that text ends below
A's, its export holds the adapter alone (a small fraction of A's bytes) and names A's export
as its base; the adapter merged into A's glued model computes what L's stages compute, glue
merges it (with its base only), generate and serve apply it and refuse it on another base,
naming the base it was trained on.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from silentswarm.procs import free_port
from tests.helpers import REPO, child_env, wait_for
from tests.integration.test_init_from import NEW_DATA
from tests.integration.test_jobs import agents, tiny, wait_ready

pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]


def shard_bytes(export: Path) -> int:
    manifest = json.loads((export / "run_manifest.json").read_text())
    return sum(stage["bytes"] for stage in manifest["stages"])


def tool(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=180,
        env=child_env(TF_CPP_MIN_LOG_LEVEL="3", SWARM_SERVE_TOKEN="t"),
    )


def adapter_chain_logits(base: Path, adapter: Path, tokens: np.ndarray, work: Path) -> np.ndarray:
    """The adapter job's stages, as they ran: the base's weights, then the adapter's."""
    from silentswarm.agent.runtime.checkpoint import load_checkpoint, restore_into
    from silentswarm.agent.runtime.glue import plans_for, read_run_manifest
    from silentswarm.agent.runtime.stage_model import StageModel
    from silentswarm.agent.runtime.warmstart import ExportStart

    flat = work / "base-files"  # as a fellow fetches them: the manifest and the shards
    flat.mkdir()
    shutil.copy(base / "run_manifest.json", flat)
    for path in base.glob("shards/step-*/stage-*"):
        shutil.copy(path, flat)
    start = ExportStart(flat)
    export = read_run_manifest(adapter)
    models = []
    for plan, files in zip(plans_for(export), export.stages, strict=True):
        model = StageModel(plan)
        start.load_into(model)
        restore_into(model, None, load_checkpoint(files.checkpoint))
        models.append(model)
    x = tokens
    for model in models[:-1]:
        x = model.forward(x, training=False)
    for piece in models[-1].pieces:
        x = (
            piece.layer(x, training=False)
            if piece.layer.name.startswith("block_")
            else piece.layer(x)
        )
    return np.asarray(x)


def serve_text(procs, base: Path, adapter: Path, body: dict) -> str:
    """One completion from ``swarm serve``'s process with the adapter."""
    port = free_port()
    proc = procs.python(
        "serve",
        "silentswarm.agent.serve",
        "--model-dir",
        str(base),
        "--adapter",
        str(adapter),
        "--port",
        str(port),
        env=child_env(SWARM_SERVE_TOKEN="t", TF_CPP_MIN_LOG_LEVEL="3"),
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, procs.log(proc)
        return httpx.get(f"{url}/health", timeout=2).status_code == 200

    wait_for(up, timeout=90, what="the server with the adapter")
    response = httpx.post(
        f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer t"}, timeout=60
    )
    assert response.status_code == 200, response.text
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    return response.json()["choices"][0]["text"]


def test_a_lora_job_adapts_an_export_and_its_adapter_applies_to_that_base_only(
    procs, nats_server, leader, tmp_path, glued_model
):
    from silentswarm.agent.runtime.glue import glue

    other = glued_model.parent  # another job's export (glued): the wrong base; read-only
    agents(procs, nats_server, "l1", "l2")
    wait_ready(leader, "l1", "l2")
    a = leader.submit(**tiny(name="base", steps=60, stages=2))["job_id"]
    base_job = leader.wait_job(a, "COMPLETED", timeout=150)

    spec = tiny(
        name="lora",
        steps=100,
        stages=2,
        data=NEW_DATA,
        init_from=f"job:{a}",
        adapter={"kind": "lora", "rank": 2},
    )
    lora = leader.submit(**spec)["job_id"]
    lora_job = leader.wait_job(lora, "COMPLETED", timeout=150)

    base, adapter = Path(base_job["export_dir"]), Path(lora_job["export_dir"])
    manifest = json.loads((adapter / "run_manifest.json").read_text())
    digest = hashlib.sha256((base / "run_manifest.json").read_bytes()).hexdigest()
    assert manifest["base"] == {"job_id": a, "step": 60, "manifest_sha256": digest}
    assert shard_bytes(adapter) < 0.10 * shard_bytes(base), (
        shard_bytes(adapter),
        shard_bytes(base),
    )
    with np.load(next(adapter.glob("shards/step-*/stage-0.npz"))) as arrays:
        assert arrays.files and all(
            "lora_" in n or n.startswith("optimizer/") for n in arrays.files
        )

    glue(base, data=NEW_DATA)  # the glue command line is tested below, with --base
    # It learned the new text: its validation loss there (the same held-out windows) against
    # the base's before it.
    before = json.loads((base / "full_model" / "inference_manifest.json").read_text())["val_loss"]
    assert lora_job["final_val_loss"] < before - 0.05, (before, lora_job["final_val_loss"])

    from silentswarm.agent.runtime.generate import load_model

    tokens = np.random.default_rng(3).integers(0, 256, (2, 32)).astype(np.int32)
    plain = np.asarray(load_model(base).model(tokens))
    merged = np.asarray(load_model(base, adapter).model(tokens))
    assert np.max(np.abs(merged - plain)) > 1e-3  # the adapter changes the model
    chain = adapter_chain_logits(base, adapter, tokens, tmp_path)
    np.testing.assert_allclose(merged, chain, atol=1e-4, rtol=0)

    # glue takes the adapter with its base: the base with the adapter merged in, checked
    # against the adapter job's stages; without the base, or on another, it refuses.
    glued = tool(
        "silentswarm.agent.runtime.glue", "--export-dir", str(adapter), "--base", str(base)
    )
    assert glued.returncode == 0, glued.stderr
    np.testing.assert_allclose(
        np.asarray(load_model(adapter).model(tokens)), merged, atol=1e-4, rtol=0
    )
    no_base = tool("silentswarm.agent.runtime.glue", "--export-dir", str(adapter), "--out", "x")
    assert no_base.returncode == 2 and "give that export with --base" in no_base.stderr
    wrong = tool(
        "silentswarm.agent.runtime.glue",
        "--export-dir",
        str(adapter),
        "--base",
        str(other),
        "--out",
        str(tmp_path / "wrong"),
    )
    assert wrong.returncode == 2 and f"trained on job {a}'s export" in wrong.stderr
    assert not (tmp_path / "wrong").exists()

    good = tool(
        "silentswarm.agent.runtime.generate",
        "--model-dir",
        str(base),
        "--adapter",
        str(adapter),
        "--prompt",
        "def ",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
    )
    assert good.returncode == 0, good.stderr
    served = serve_text(procs, base, adapter, {"prompt": "def ", "max_tokens": 8, "temperature": 0})
    assert served == good.stdout.removesuffix("\n")  # the server applies it as generate does
    for module, extra in (
        ("silentswarm.agent.runtime.generate", ["--prompt", "x"]),
        ("silentswarm.agent.serve", ["--port", "0"]),
    ):
        refused = tool(module, "--model-dir", str(other), "--adapter", str(adapter), *extra)
        assert refused.returncode == 2, refused.stderr
        assert f"was trained on job {a}'s export" in refused.stderr
        assert "Traceback" not in refused.stderr
