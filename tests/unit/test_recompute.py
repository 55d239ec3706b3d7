"""``recompute``: a stage before the last keeps no tape, and its backward (the forward again,
the backward and the accumulation in one compiled call) gives the tape's gradients. Real
TensorFlow on the CPU, a tiny model, the first and a middle stage of three, XLA on and off;
and what a spec may not combine it with."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from silentswarm.jobspec import decode_job_spec
from silentswarm.plan import ModelConfig, TrainConfig, Transport, chain_plans

MODEL = ModelConfig(vocab_size=256, seq_len=8, n_layers=3, d_model=24, n_heads=2)


def stage_model(stage: int, *, recompute: bool, jit: bool):
    from silentswarm.agent.runtime.stage_model import StageModel

    train = TrainConfig(
        steps=1, batch_size=4, micro_batches=2, jit_compile=jit, recompute=recompute
    )
    plans = chain_plans(
        job_id="j",
        model=MODEL,
        train=train,
        addresses=[None, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"],
        transport=Transport.P2P,
        intra_op_threads=1,
    )
    return StageModel(plans[stage])


@pytest.mark.parametrize("jit", [True, False], ids=["xla", "graph"])
@pytest.mark.parametrize("stage", [0, 1], ids=["first", "middle"])
def test_a_recomputed_backward_gives_the_tapes_gradients(stage, jit):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    if stage == 0:
        inputs = [rng.integers(0, 256, (2, 8)).astype(np.int32) for _ in range(2)]
    else:
        inputs = [rng.normal(size=(2, 8, 24)).astype(np.float32) for _ in range(2)]
    received = [rng.normal(size=(2, 8, 24)).astype(np.float32) for _ in range(2)]
    results = {}
    for recompute in (False, True):
        model = stage_model(stage, recompute=recompute, jit=jit)
        held = []
        for x in inputs:  # two forwards in flight, then their backwards
            x = tf.constant(x)
            tape, out = model.tape_forward(x, input_grad=stage > 0)
            assert (tape is None) is recompute
            held.append((tape, x, out))
        dxs = [
            model.tape_backward(tape, x, out, tf.constant(g), input_grad=stage > 0)
            for (tape, x, out), g in zip(held, received, strict=True)
        ]
        results[recompute] = (
            [out.numpy() for _, _, out in held],
            [a.numpy() for a in model.accumulators],
            [dx.numpy() for dx in dxs] if stage > 0 else dxs,
        )
    (outs, accs, dxs), (r_outs, r_accs, r_dxs) = results[False], results[True]
    for want, got in zip(outs + accs, r_outs + r_accs, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert any(np.abs(a).sum() > 0 for a in accs), "gradients were accumulated"
    if stage == 0:
        assert dxs == r_dxs == [None, None]
    else:
        for want, got in zip(dxs, r_dxs, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def spec_json(**fields) -> bytes:
    return msgspec.json.encode({"name": "r", "model": {"n_layers": 2}, **fields})


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"recompute": True}, None),
        ({"recompute": True, "in_flight": 4, "micro_batches": 4}, None),
        ({"recompute": True, "schedule": "overlap"}, 'recompute needs schedule "1f1b"'),
        (
            {"recompute": True, "model": {"n_layers": 2, "dropout": 0.1}},
            "recompute needs model.dropout 0",
        ),
        ({"model": {"n_layers": 2, "dropout": 0.1}}, None),
    ],
    ids=["alone", "with-a-window", "overlap", "dropout", "dropout-without"],
)
def test_what_recompute_may_not_be_combined_with(fields, problem):
    from silentswarm.errors import ConfigError

    if problem is None:
        decode_job_spec(spec_json(**fields))
        return
    with pytest.raises(ConfigError, match=problem):
        decode_job_spec(spec_json(**fields))
