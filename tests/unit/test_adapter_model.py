"""LoRA adapters in the model: what a block with one computes, what it trains, what the spec
allows. Real TensorFlow on the CPU, a tiny model."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from silentswarm.jobspec import JobSpec
from silentswarm.plan import AdapterConfig, ModelConfig, TrainConfig, single_process_plan

GPT2 = ModelConfig(vocab_size=64, seq_len=8, n_layers=2, d_model=16, n_heads=2)
LLAMA = ModelConfig(
    family="llama", vocab_size=64, seq_len=8, n_layers=2, d_model=16, n_heads=4, n_kv_heads=2
)


@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_a_block_with_an_adapter_is_its_base_with_the_adapter_merged(cfg):
    from silentswarm.agent.runtime.model import block

    adapter = AdapterConfig(rank=3, alpha=6.0)
    plain = block(cfg, 1, 0, "block_0")
    adapted = block(cfg, 1, 0, "block_0", adapter=adapter)
    base = [v.path for v in adapted.variables if "/lora_" not in v.path]
    assert base == [v.path for v in plain.variables]  # in their order, with their values
    x = np.random.default_rng(0).normal(size=(2, 8, 16)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(adapted(x)), np.asarray(plain(x)))  # B = 0
    rng = np.random.default_rng(1)
    for _, b in adapted.lora.values():
        b.assign(rng.normal(size=b.shape).astype(np.float32))
    assert set(adapted.lora) == set(adapter.target_names(cfg.family))
    for name, (a, b) in adapted.lora.items():
        weight = getattr(plain, name)
        weight.assign(weight + (np.asarray(a) @ np.asarray(b)) * adapter.scale)
    np.testing.assert_allclose(np.asarray(adapted(x)), np.asarray(plain(x)), atol=1e-4)


def test_a_stage_with_an_adapter_trains_and_checkpoints_the_adapter_only():
    from silentswarm.agent.runtime.checkpoint import stage_arrays
    from silentswarm.agent.runtime.stage_model import StageModel

    train = TrainConfig(
        steps=2, batch_size=2, micro_batches=1, init_from="job:x", adapter=AdapterConfig(rank=2)
    )
    cfg = msgspec.structs.replace(GPT2, vocab_size=256)
    model = StageModel(single_process_plan(job_id="j", model=cfg, train=train))
    names = [v.path for v in model.variables]
    assert names and all("/lora_" in n for n in names)
    assert len(names) == 2 * 4 * GPT2.n_layers  # A and B of 4 projections per block
    arrays = stage_arrays(model)
    assert all("lora_" in n for n in arrays if n.startswith("model/"))


def test_an_adapter_needs_an_export_and_known_targets():
    assert JobSpec(name="a", init_from="job:x", adapter=AdapterConfig()).problems() == []
    problems = JobSpec(name="a", adapter=AdapterConfig(targets=["w_q"])).problems()
    assert any("adapter needs init_from" in p for p in problems)
    assert any("'w_q' not projections of a gpt2 block" in p for p in problems)
    assert AdapterConfig(rank=4, alpha=8).scale == 2.0
