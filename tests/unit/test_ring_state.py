"""A ring's share of a replicated stage's state (agent/runtime/ring_state.py) on a real
StageModel: what a donor hands over, and which of it a member checks as AdamW's moments
and DiLoCo's anchors (agent/runtime/replicas.donor_refusal relies on the positions).
Real TensorFlow on the CPU, a tiny model, no XLA."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from silentswarm.plan import ModelConfig, TrainConfig, replicated_chain_plans

MODEL = ModelConfig(vocab_size=259, seq_len=8, n_layers=2, d_model=16, n_heads=2)


@pytest.mark.parametrize("sync", ["allreduce", "diloco"])
def test_a_rings_state_names_its_second_moments_and_anchors(sync):
    from silentswarm.agent.runtime.ring_state import ring_states
    from silentswarm.agent.runtime.stage_model import StageModel

    train = TrainConfig(steps=1, batch_size=2, micro_batches=1, jit_compile=False, sync=sync)
    plans = replicated_chain_plans(
        job_id="j",
        model=MODEL,
        train=train,
        addresses=[[None], [None]],
        sync_addresses=[["tcp://127.0.0.1:1"], ["tcp://127.0.0.1:2"]],
    )
    model = StageModel(plans[0][0])
    (state,) = ring_states(model, plans[0][0].sync_rings)
    optimizer = model.optimizer
    pairs = {(id(state.variables[m]), id(state.variables[v])) for m, v in state.moments}
    want = {
        (id(m), id(v)) for m, v in zip(optimizer._momentums, optimizer._velocities, strict=True)
    }
    assert pairs == want and len(pairs) == len(model.variables)
    assert [id(v) for v in state.variables[: state.n_weights]] == [id(v) for v in model.variables]
    if sync == "diloco":
        pairs = {(id(state.variables[a]), id(state.variables[w])) for a, w in state.anchors}
        want = {(id(a), id(v)) for a, v in zip(model.anchor, model.variables, strict=True)}
        assert pairs == want
    else:
        assert state.anchors == ()


def test_a_rings_step_count_is_the_optimizers_not_a_dropout_seeds():
    """With dropout, a ring's integer state holds each Dropout's seed state too (a seed and
    a count of calls, far above any step count): only the optimizer's iterations is the
    count a donor's state is bounded by."""
    from silentswarm.agent.runtime.replicas import donor_refusal
    from silentswarm.agent.runtime.ring_state import ring_states
    from silentswarm.agent.runtime.stage_model import StageModel

    train = TrainConfig(steps=1, batch_size=2, micro_batches=1, jit_compile=False)
    plans = replicated_chain_plans(
        job_id="j",
        model=msgspec.structs.replace(MODEL, dropout=0.1),
        train=train,
        addresses=[[None], [None]],
        sync_addresses=[["tcp://127.0.0.1:1"], ["tcp://127.0.0.1:2"]],
    )
    model = StageModel(plans[0][0])
    (state,) = ring_states(model, plans[0][0].sync_rings)
    (count,) = state.counts
    assert state.variables[count] is model.optimizer.iterations
    arrays = [np.asarray(v.numpy()) for v in state.variables]
    seeds = [a for i, a in enumerate(arrays) if a.dtype.kind in "iu" and i != count]
    assert seeds and max(int(a.max()) for a in seeds) > 0, "a dropout seed state is there"
    for own in (None, arrays):
        why = donor_refusal(
            arrays, own, n_weights=state.n_weights, counts=state.counts, steps_done=0
        )
        assert why is None, why
