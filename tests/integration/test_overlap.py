"""The overlap schedule: consecutive steps overlap, each update applied a step late.

Real stage processes over ZeroMQ. Its math must not depend on how the model is split, on the
window or on where the chain stops to validate, and a run resumed from a checkpoint taken
while steps overlapped (an update held back, stage 0 a batch ahead) must go on exactly.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from silentswarm.agent.runtime.launch import done, run_plans, steps
from silentswarm.plan import ModelConfig, TrainConfig, single_process_plan
from tests.integration.test_pipeline import chain, without_data

pytestmark = pytest.mark.integration

MODEL = ModelConfig(n_layers=3, d_model=64, n_heads=4, seq_len=32, dropout=0.0)


def overlap(steps: int, **kw) -> TrainConfig:
    return TrainConfig(
        steps=steps,
        batch_size=8,
        micro_batches=4,
        max_data_bytes=400_000,
        val_batches=2,
        learning_rate=3e-3,
        warmup_steps=3,
        schedule="overlap",
        **kw,
    )


def losses(result) -> list[float]:
    return [s["loss"] for s in steps(result)]


def assert_close(want: list[float], got: list[float], what: str) -> None:
    assert len(want) == len(got), what
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert abs(a - b) <= 1e-4 * abs(a), f"{what}, step {step}: {a} vs {b}"


@pytest.mark.timeout(300)
def test_overlap_trains_the_same_in_one_process_and_two_stages(procs, tmp_path):
    """The delayed update is the same on every stage whatever its ops' order: one process
    and two stages (the 1F1B window), validating every 4 steps (where the chain stops
    overlapping), lose the same step by step; and the math is not the synchronous one's."""
    config = overlap(10, val_every=4)
    sync = msgspec.structs.replace(config, schedule="1f1b")
    (one,) = run_plans([single_process_plan(job_id="o1", model=MODEL, train=config)], tmp_path)
    (one_sync,) = run_plans([single_process_plan(job_id="s1", model=MODEL, train=sync)], tmp_path)
    two = run_plans(chain("o2", 2, config, model=MODEL), tmp_path)
    want = losses(one)
    assert_close(want, losses(two[-1]), "two stages")
    val = [s.get("val_loss") for s in steps(one)]
    assert [v is not None for v in val] == [i in (3, 7) for i in range(10)]
    got = [s.get("val_loss") for s in steps(two[-1])]
    assert [v is None for v in got] == [v is None for v in val]
    for a, b in zip(val, got, strict=True):
        assert a is None or b == pytest.approx(a, rel=1e-4)
    assert abs(done(two[-1])["val_loss"] - done(one)["val_loss"]) < 1e-3
    # Step 0 runs the same weights either way; from step 1 on the update comes a step late.
    plain = losses(one_sync)
    assert want[0] == pytest.approx(plain[0], rel=1e-5)
    assert abs(want[1] - plain[1]) > 1e-3 * abs(plain[1])
    assert want[-1] < want[0] - 0.5, "the loss fell"


@pytest.mark.timeout(300)
def test_overlap_trains_the_same_in_three_stages_with_every_micro_batch_in_flight(procs, tmp_path):
    """A middle stage (both boundaries) and windows deeper than 1F1B's: still the one
    process's losses, and a middle stage passes on exactly what it gets."""
    config = overlap(6, val_every=3, in_flight=4)
    (one,) = run_plans([single_process_plan(job_id="o1", model=MODEL, train=config)], tmp_path)
    three = run_plans(chain("o3", 3, config, model=MODEL), tmp_path)
    assert_close(losses(one), losses(three[-1]), "three stages")
    middle = done(three[1])
    assert middle["up_bytes_received"] == done(three[0])["down_bytes_sent"]
    assert middle["down_bytes_sent"] == done(three[2])["up_bytes_received"]


@pytest.mark.timeout(300)
def test_a_run_resumed_from_an_overlapped_checkpoint_goes_on_exactly(procs, tmp_path):
    """Checkpoints after step 4 (the gradient of step 3 held back, stage 0 already a batch
    into step 5): a run resumed there loses exactly what the uninterrupted run lost."""
    config = overlap(8)
    store = tmp_path / "ckpt"
    plans = [
        msgspec.structs.replace(p, checkpoint_dir=str(store), checkpoint_every=4)
        for p in chain("res", 2, config, model=MODEL)
    ]
    plans[1] = without_data(plans[1], tmp_path / "nowhere")  # stage 1 resumes without data
    whole = run_plans(plans, tmp_path)
    step4 = store / "res" / "attempt-1" / "step-4"
    metas = [json.loads((step4 / f"stage-{s}.json").read_text()) for s in range(2)]
    assert [m["pending"] for m in metas] == [{"step": 3, "micro_batches": 4}] * 2
    assert metas[0]["data"] == {"epoch": 0, "index": 4 * 8}, "stage 0: where step 4 began"
    assert metas[1]["data"] is None, "stage 1 reads no data, so keeps no position"
    resumed = run_plans(
        [
            msgspec.structs.replace(
                p, attempt=2, resume_from=str(step4 / f"stage-{p.stage}.json"), checkpoint_every=0
            )
            for p in plans
        ],
        tmp_path / "again",
    )
    assert_close(losses(whole[-1])[4:], losses(resumed[-1]), "resumed")
    assert [s["step"] for s in steps(resumed[-1])] == [4, 5, 6, 7]
    assert done(resumed[-1])["val_loss"] == pytest.approx(done(whole[-1])["val_loss"], rel=1e-4)


@pytest.mark.parametrize("jit", [True, False])
def test_a_backward_uses_the_weights_its_forward_read_after_an_update(jit):
    """What the overlap schedule rests on: an update applied while a micro-batch's tape is
    held (the previous step's update, before the next step's forwards) changes nothing in
    that micro-batch's gradients, compiled or not."""
    import numpy as np
    import tensorflow as tf

    from silentswarm.agent.runtime.stage_model import StageModel

    plan = chain("tape", 2, overlap(4, jit_compile=jit), model=MODEL)[0]
    model = StageModel(plan)
    x = tf.constant(np.arange(2 * MODEL.seq_len).reshape(2, -1) % 256, tf.int32)
    g = tf.random.stateless_normal((2, MODEL.seq_len, MODEL.d_model), seed=(1, 2))

    def gradients(update: bool) -> list[np.ndarray]:
        tape, out = model.tape_forward(x, input_grad=False)
        if update:
            for v in model.variables:
                v.assign_add(tf.ones_like(v))
        grads = tape.gradient(out, model.variables, output_gradients=g)
        return [tf.convert_to_tensor(grad).numpy() for grad in grads]

    before = [v.numpy() for v in model.variables]
    held = gradients(update=False)
    moved = gradients(update=True)
    for a, b in zip(held, moved, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert not np.array_equal(before[1], model.variables[1].numpy()), "the update happened"
    # A tape taken after the update sees the new weights: the check above can fail.
    after = gradients(update=False)
    assert any(not np.allclose(a, b, rtol=1e-3) for a, b in zip(held, after, strict=True))
