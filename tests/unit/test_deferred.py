"""Deferred weight gradients (``defer_weight_grads``): the last stage sends a micro-batch's
input gradient from a call that computes only that, and runs the weights' pass later. The
same gradients and loss as the whole call (real TensorFlow on the CPU, XLA on and off); the
step it predicts; the memory it holds; what a spec may not combine it with."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from silentswarm.agent.runtime.schedule import OpTimes, one_f_one_b, step_period
from silentswarm.jobspec import decode_job_spec
from silentswarm.leader.memory import stage_memory
from silentswarm.plan import ModelConfig, TrainConfig, Transport, chain_plans

MODEL = ModelConfig(vocab_size=256, seq_len=8, n_layers=2, d_model=24, n_heads=2)


def last_stage(jit: bool):
    from silentswarm.agent.runtime.stage_model import StageModel

    train = TrainConfig(steps=1, batch_size=4, micro_batches=2, jit_compile=jit)
    plans = chain_plans(
        job_id="j",
        model=MODEL,
        train=train,
        addresses=[None, "tcp://127.0.0.1:1"],
        transport=Transport.P2P,
        intra_op_threads=1,
    )
    return StageModel(plans[1])


@pytest.mark.parametrize("jit", [True, False], ids=["xla", "graph"])
def test_a_deferred_weights_pass_gives_the_whole_calls_gradients_and_loss(jit):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    xs = [tf.constant(rng.normal(size=(2, 8, 24)).astype(np.float32)) for _ in range(2)]
    ts = [tf.constant(rng.integers(0, 256, (2, 8)).astype(np.int32)) for _ in range(2)]
    whole, deferred = last_stage(jit), last_stage(jit)
    want_dx = [whole.last_micro(x, t).numpy() for x, t in zip(xs, ts, strict=True)]
    got_dx = [deferred.input_grad(x, t).numpy() for x, t in zip(xs, ts, strict=True)]
    # The input's gradient alone neither accumulates nor counts the loss.
    assert all(not np.any(a.numpy()) for a in deferred.accumulators)
    assert float(deferred.loss_sum.numpy()) == 0.0
    for x, t in zip(xs, ts, strict=True):
        deferred.last_micro(x, t)
    for want, got in zip(want_dx, got_dx, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        assert np.abs(got).sum() > 0
    for want, got in zip(whole.accumulators, deferred.accumulators, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert deferred.take_loss() == whole.take_loss()


def times(stage0: float, last: float) -> list[OpTimes]:
    """Seconds of work per micro-batch, a third forward; the last stage's input gradient
    alone 0.67 of its whole call (measured on the speed model)."""
    return [
        OpTimes(stage0 / 3, 2 * stage0 / 3, 0.005),
        OpTimes(last / 3, 2 * last / 3, 0.005, input_grad=0.67 * last - last / 3),
    ]


@pytest.mark.parametrize(
    ("link_ms", "deferred", "faster"),
    [
        (0.0, 3, False),  # nothing waits for a round trip: nothing to gain
        (30.0, 1, True),
        (30.0, 3, True),
        (30.0, 7, False),  # the last stage's extra work outgrows its wait
    ],
)
def test_deferring_the_last_stages_weight_passes_hides_the_last_round_trip(
    link_ms, deferred, faster
):
    schedules = [one_f_one_b(s, 2, 8, 8) for s in range(2)]
    t = times(0.045, 0.035)
    plain = step_period(schedules, t, link_s=link_ms / 1000)
    got = step_period(schedules, t, link_s=link_ms / 1000, deferred=deferred)
    assert (got < plain * 0.99) is faster, (plain, got)


def test_a_deferral_without_the_input_gradients_time_is_refused():
    schedules = [one_f_one_b(s, 2, 4) for s in range(2)]
    with pytest.raises(ValueError, match="input_grad"):
        step_period(schedules, [OpTimes(0.01, 0.02)] * 2, deferred=1)


def test_the_last_stage_keeps_each_deferred_micro_batchs_input():
    m = ModelConfig(n_layers=4, d_model=128, n_heads=4, seq_len=64, vocab_size=256)
    kw = {"batch_size": 8, "micro_batches": 4, "n_stages": 2, "layers": 2}
    plain = stage_memory(m, stage=1, **kw)
    one_input = 4 * 2 * 64 * 128  # float32, 2 rows of 64 positions of 128
    assert stage_memory(m, stage=1, deferred=0, **kw) == plain
    assert stage_memory(m, stage=1, deferred=2, **kw).total == plain.total + 2 * one_input
    assert stage_memory(m, stage=1, deferred=9, **kw).total == plain.total + 3 * one_input
    assert stage_memory(m, stage=1, deferred=None, **kw).total == plain.total + 4 * one_input
    assert stage_memory(m, stage=0, deferred=None, **kw) == stage_memory(m, stage=0, **kw)


def spec_json(**fields) -> bytes:
    return msgspec.json.encode({"name": "d", "model": {"n_layers": 2}, **fields})


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({}, None),  # "auto"
        ({"defer_weight_grads": 3, "micro_batches": 4}, None),
        ({"defer_weight_grads": 0, "model": {"n_layers": 2, "dropout": 0.1}}, None),
        ({"model": {"n_layers": 2, "dropout": 0.1}}, None),  # "auto" then defers nothing
        ({"defer_weight_grads": 3, "micro_batches": "auto", "batch_size": 8}, None),
        (
            {"defer_weight_grads": 4, "micro_batches": 4},
            r"defer_weight_grads \(4\) must be below micro_batches \(4\)",
        ),
        ({"defer_weight_grads": 1, "schedule": "overlap"}, 'needs schedule "1f1b"'),
        (
            {"defer_weight_grads": 1, "model": {"n_layers": 2, "dropout": 0.1}},
            "defer_weight_grads needs model.dropout 0",
        ),
        ({"defer_weight_grads": -1}, "defer_weight_grads"),
        ({"defer_weight_grads": "some"}, "defer_weight_grads"),
    ],
    ids=[
        "auto",
        "three-of-four",
        "zero-with-dropout",
        "auto-with-dropout",
        "auto-count",
        "all-of-them",
        "overlap",
        "dropout",
        "negative",
        "a-word",
    ],
)
def test_what_a_deferral_may_not_be_combined_with(fields, problem):
    from silentswarm.errors import ConfigError

    if problem is None:
        spec = decode_job_spec(spec_json(**fields))
        assert spec.train_config().defer_weight_grads == fields.get("defer_weight_grads", "auto")
        return
    with pytest.raises(ConfigError, match=problem):
        decode_job_spec(spec_json(**fields))
