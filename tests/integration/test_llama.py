"""The llama family in real stage processes: a pipeline of llama stages trains what one process
trains, and a job started from a keras-hub preset computes keras-hub's loss at its first step."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from silentswarm.agent.runtime.data import job_dataset
from silentswarm.agent.runtime.launch import run_plans, steps
from silentswarm.plan import ModelConfig, single_process_plan
from tests.integration.test_pipeline import chain, train

LLAMA = ModelConfig(
    family="llama", n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, seq_len=32, mlp_ratio=3
)


def test_two_llama_stages_reproduce_one_process_and_bfloat16_stays_within_a_percent(
    procs, tmp_path
):
    """Two llama stages lose what one process loses, step by step. In precision "bfloat16" the
    stages compute in bfloat16 (float32 weights, boundaries and loss): not float32's losses,
    but within a percent of them."""
    config = train(6)
    plan = single_process_plan(job_id="llama-ref", model=LLAMA, train=config)
    (reference,) = run_plans([plan], tmp_path)
    results = run_plans(chain("llama2", 2, config, model=LLAMA), tmp_path)
    want = [s["loss"] for s in steps(reference)]
    got = [s["loss"] for s in steps(results[-1])]
    assert len(want) == len(got) == 6 and got[-1] < got[0]
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: single {a} vs pipeline {b}"

    half = msgspec.structs.replace(config, precision="bfloat16")
    bf16 = run_plans(chain("llama-bf16", 2, half, model=LLAMA), tmp_path)
    lower = [s["loss"] for s in steps(bf16[-1])]
    assert len(lower) == 6 and lower[-1] < lower[0] and lower != want
    for step, (a, b) in enumerate(zip(want, lower, strict=True)):
        assert abs(a - b) <= 0.01 * abs(a), f"step {step}: float32 {a} vs bfloat16 {b}"


def test_a_job_from_a_keras_hub_preset_starts_at_keras_hubs_loss(procs, tmp_path):
    keras_hub = pytest.importorskip("keras_hub", reason="pip install --no-deps keras-hub")
    model = msgspec.structs.replace(LLAMA, vocab_size=256, intermediate_dim=96, norm_eps=1e-5)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=256,
        num_layers=model.n_layers,
        num_query_heads=model.n_heads,
        hidden_dim=model.d_model,
        intermediate_dim=96,
        num_key_value_heads=model.kv_heads,
        rope_max_wavelength=model.rope_theta,
        layer_norm_epsilon=1e-5,
    )
    rng = np.random.default_rng(3)
    for variable in backbone.weights:  # far from any initialisation, the norms' too
        base = 1.0 if variable.path.endswith("scale") else 0.0
        variable.assign(base + rng.normal(0, 0.1, tuple(variable.shape)).astype("float32"))
    preset = tmp_path / "preset"
    backbone.save_to_preset(str(preset))

    config = train(1, init_from=f"preset:{preset}")
    results = run_plans(chain("preset2", 2, config, model=model), tmp_path)
    first_loss = steps(results[-1])[0]["loss"]

    # keras-hub's loss on the batch stage 0 read first (the data module is deterministic).
    inputs, targets = job_dataset(config, model.seq_len).next_batch(config.batch_size)
    hidden = backbone({"token_ids": inputs, "padding_mask": np.ones_like(inputs)})
    logits = np.asarray(backbone.token_embedding(hidden, reverse=True), dtype=np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    want = -np.take_along_axis(log_probs, targets[..., None], axis=-1).mean()
    assert first_loss == pytest.approx(want, rel=1e-4)
    assert abs(want - np.log(256)) > 0.05, "a loss that random weights would not give"
