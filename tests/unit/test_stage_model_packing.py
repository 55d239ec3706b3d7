"""A stage's packed gradients (TensorFlow, one compiled call) are laid out exactly as the
replicas' ring lays out a contribution (numpy, agent/runtime/replicas.pack): the ring's int8
rows and the averaging rely on it. Real TensorFlow on the CPU, a tiny model, XLA on and off."""

from __future__ import annotations

import numpy as np
import pytest

from silentswarm.agent.runtime.replicas import ROW, layout_rows, pack, unpack
from silentswarm.plan import ModelConfig, TrainConfig, single_process_plan

# d_model 24: most variables' sizes (24, 24*24*3, ...) are not whole rows of ROW values.
MODEL = ModelConfig(vocab_size=259, seq_len=8, n_layers=2, d_model=24, n_heads=2)


@pytest.mark.parametrize("jit", [True, False], ids=["xla", "graph"])
def test_the_packed_gradients_are_replicas_pack_layout(jit):
    from silentswarm.agent.runtime.stage_model import StageModel

    train = TrainConfig(steps=1, batch_size=2, micro_batches=1, jit_compile=jit)
    model = StageModel(single_process_plan(job_id="j", model=MODEL, train=train))
    shapes = [tuple(a.shape) for a in model.accumulators]
    assert any(int(np.prod(s)) % ROW for s in shapes), "the test needs padded variables"
    rng = np.random.default_rng(0)
    values = [rng.normal(size=s).astype(np.float32) for s in shapes]
    for acc, value in zip(model.accumulators, values, strict=True):
        acc.assign(value)

    packed = model.accumulated_packed(0.5)
    assert packed.shape == (layout_rows(shapes), ROW) and packed.dtype == np.float32
    np.testing.assert_array_equal(packed, pack([0.5 * v for v in values]))

    averaged = rng.normal(size=packed.shape).astype(np.float32)
    model.set_accumulated_packed(averaged)
    for acc, want in zip(model.accumulators, unpack(averaged, shapes), strict=True):
        np.testing.assert_array_equal(acc.numpy(), want)
