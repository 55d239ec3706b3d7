"""The replicas' sync (agent/runtime/replicas.py): its pure math, and rings of real links."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest

from silentswarm.agent.errors import FrameError, HandshakeError
from silentswarm.agent.runtime.replicas import (
    ROW,
    ReplicaSync,
    average,
    clip_contributions,
    layout_rows,
    nesterov_step,
    pack,
    unpack,
)
from silentswarm.plan import ModelConfig, StagePlan, TrainConfig, Transport, replicated_chain_plans
from silentswarm.procs import free_port
from silentswarm.subjects import relay_link, sync_link

MODEL = ModelConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16)
FINGERPRINT = b"the same on every replica"


# --- pure math --------------------------------------------------------------------------------


def test_pack_pads_every_variable_to_whole_rows_and_unpacks_exactly():
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=s).astype(np.float32) for s in [(3, 5), (ROW,), (ROW + 1,), (1,)]]
    shapes = [a.shape for a in arrays]
    matrix = pack(arrays)
    assert matrix.shape == (layout_rows(shapes), ROW) == (1 + 1 + 2 + 1, ROW)
    assert matrix.dtype == np.float32
    assert np.all(matrix[0, 15:] == 0) and np.all(matrix[3, 1:] == 0), "padding is zeros"
    for a, b in zip(arrays, unpack(matrix, shapes), strict=True):
        np.testing.assert_array_equal(a, b)


def vec(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


@pytest.mark.parametrize(
    ("norms", "ratio", "want", "clipped"),
    [
        ({0: 1.0, 1: 2.0}, 4.0, {0: 1.0, 1: 2.0}, 0),  # within the ratio both ways
        ({0: 1.0, 1: 100.0}, 4.0, {0: 1.0, 1: 4.0}, 1),  # the big one down to 4 x the other
        ({0: 1.0, 1: 1.5, 2: 100.0}, 4.0, {0: 1.0, 1: 1.5, 2: 5.0}, 1),  # median of 1, 1.5
        ({0: 1.0, 1: 1.0, 2: 1.0, 3: 50.0}, 2.0, {0: 1, 1: 1, 2: 1, 3: 2.0}, 1),
        ({0: 3.0}, 4.0, {0: 3.0}, 0),  # alone: nothing to compare with
        ({0: 0.0, 1: 2.0}, 4.0, {0: 0.0, 1: 0.0}, 1),  # the others' median 0: the bound is 0
    ],
)
def test_a_contribution_far_above_the_others_median_is_scaled_to_the_bound(
    norms, ratio, want, clipped
):
    vectors = {o: vec(n, 0.0) for o, n in norms.items()}  # norm n each
    result = clip_contributions(vectors, ratio)
    assert result.clipped == clipped
    got = {o: float(np.linalg.norm(v)) for o, v in result.kept.items()}
    assert got == pytest.approx(want)


def test_a_non_finite_contribution_is_left_out_and_counted():
    result = clip_contributions({0: vec(1, 1), 1: vec(np.nan, 0), 2: vec(2, 0)}, 4.0)
    assert sorted(result.kept) == [0, 2] and result.clipped == 1


def test_clipping_does_not_depend_on_the_order_the_contributions_came_in():
    vectors = {0: vec(1, 0), 1: vec(0, 30), 2: vec(2, 2)}
    a = clip_contributions(vectors, 3.0)
    b = clip_contributions(dict(reversed(list(vectors.items()))), 3.0)
    assert a.clipped == b.clipped == 1
    for o in vectors:
        np.testing.assert_array_equal(a.kept[o], b.kept[o])


def test_the_average_is_over_those_present_in_origin_order():
    assert average({2: vec(3, 3), 0: vec(1, 1)}).tolist() == [2.0, 2.0]
    assert average({1: vec(5, -5)}).tolist() == [5.0, -5.0]
    rng = np.random.default_rng(1)
    vectors = {o: rng.normal(size=1000).astype(np.float32) for o in range(3)}
    shuffled = {o: vectors[o] for o in (2, 0, 1)}
    np.testing.assert_array_equal(average(vectors), average(shuffled))
    with pytest.raises(ValueError):
        average({})


def test_the_outer_step_is_sgd_with_nesterov_momentum_as_torch_has_it():
    """torch.optim.SGD(nesterov=True, momentum=mu, lr=lr), dampening 0, written out:
    b1 = g1; p -= lr * (g1 + mu * b1); b2 = mu * b1 + g2; p -= lr * (g2 + mu * b2)."""
    lr, mu = 0.7, 0.9
    p0 = vec(1.0, -2.0)
    g1, g2 = vec(0.5, 0.25), vec(-0.125, 1.0)
    p1, b1 = nesterov_step(p0, np.zeros(2, np.float32), g1, lr=lr, mu=mu)
    np.testing.assert_allclose(b1, g1)
    np.testing.assert_allclose(p1, p0 - lr * (g1 + mu * g1), rtol=1e-6)
    p2, b2 = nesterov_step(p1, b1, g2, lr=lr, mu=mu)
    np.testing.assert_allclose(b2, mu * g1 + g2, rtol=1e-6)
    np.testing.assert_allclose(p2, p1 - lr * (g2 + mu * (mu * g1 + g2)), rtol=1e-6)
    # Without momentum and at rate 1 the anchor takes the averaged pseudo-gradient whole:
    # the weights become the replicas' average weights.
    anchor, weights = vec(1.0, 1.0), vec(0.5, 3.0)
    got, _ = nesterov_step(anchor, np.zeros(2, np.float32), anchor - weights, lr=1.0, mu=0.0)
    np.testing.assert_allclose(got, weights)


def test_relay_subjects_of_replicas_and_rings_never_collide():
    tokens = {relay_link(b, r) for b in range(3) for r in range(3)}
    tokens |= {sync_link(s, r) for s in range(3) for r in range(3)}
    assert len(tokens) == 18 and relay_link(1, 0) == "1"


def test_replicated_chain_plans_link_every_stage_s_replicas_in_a_ring():
    k, n = 3, 2
    sync = [[f"tcp://h{r}:{s}" for s in range(n)] for r in range(k)]
    plans = replicated_chain_plans(
        job_id="j",
        model=MODEL,
        train=TrainConfig(steps=2, batch_size=4),
        addresses=[[None, f"tcp://h{r}:9"] for r in range(k)],
        sync_addresses=sync,
        transport=Transport.P2P,
        secure=True,
    )
    assert [[(p.replica, p.stage, p.n_replicas) for p in row] for row in plans] == [
        [(r, s, k) for s in range(n)] for r in range(k)
    ]
    for r in range(k):
        assert plans[r][1].prev.fellow_id == plans[r][0].fellow_id, "each replica its own chain"
        for s in range(n):
            plan, nxt = plans[r][s], plans[(r + 1) % k][s]
            assert (
                plan.sync_address == sync[r][s]
                and plan.sync_next.data_address == sync[(r + 1) % k][s]
            )
            assert plan.sync_next.fellow_id == nxt.fellow_id
            assert nxt.sync_prev.fellow_id == plan.fellow_id
            assert plan.curve_sync_down.peer_public == nxt.curve_sync_up.public
            assert nxt.curve_sync_up.peer_public == plan.curve_sync_down.public
            assert plan.relay_sync_down_token == nxt.relay_sync_up_token is not None
    assert {p.checkpoint_every for row in plans for p in row} == {0}
    assert len({p.fellow_id for row in plans for p in row}) == k * n


# --- rings of real links ----------------------------------------------------------------------


def ring_plans(
    k: int, *, transport: Transport = Transport.P2P, nats_url: str | None = None, **train: Any
) -> list[StagePlan]:
    config = TrainConfig(steps=4, batch_size=4, sync_timeout_s=20.0, **train)
    p2p = transport != Transport.TUNNEL
    plans = replicated_chain_plans(
        job_id="ring",
        model=MODEL,
        train=config,
        addresses=[[None] for _ in range(k)],
        sync_addresses=[[f"tcp://127.0.0.1:{free_port()}" if p2p else None] for _ in range(k)],
        transport=transport,
        nats_url=nats_url,
        secure=True,
        intra_op_threads=1,
    )
    return [row[0] for row in plans]


def in_threads(fns: list[Callable[[], Any]], timeout: float = 60.0) -> list[Any]:
    """Run each of ``fns`` in a thread of its own; their results (an exception re-raised)."""
    results: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a ring member hung"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def opened(plans: list[StagePlan]) -> list[ReplicaSync]:
    members = [ReplicaSync(plan, FINGERPRINT) for plan in plans]
    in_threads([m.open for m in members])
    return members


def closed(members: list[ReplicaSync]) -> None:
    assert all(in_threads([m.finish for m in members]))
    for m in members:
        m.close()


def rounds(members: list[ReplicaSync], round_id: int, mine: list[np.ndarray]) -> list[Any]:
    """Round ``round_id`` on every member at once, member i contributing ``mine[i]``."""
    calls = [lambda m=m, x=x: m.round(round_id, x) for m, x in zip(members, mine, strict=True)]
    return in_threads(calls)


def contributions(k: int, rows: int = 3, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(rows, ROW)).astype(np.float32) for _ in range(k)]


@pytest.mark.parametrize(
    ("k", "compression"), [(2, "none"), (3, "none"), (3, "fixed_int8"), (2, "fp16")]
)
def test_a_ring_gathers_every_contribution_and_all_members_agree(k, compression):
    members = opened(ring_plans(k, sync_compression=compression))
    try:
        assert [m.up.transport for m in members] == ["p2p"] * k
        for round_id in range(3):
            mine = contributions(k, seed=round_id)
            results = rounds(members, round_id, mine)
            for r in results:
                assert r.present == list(range(k)) and r.missed == 0 and r.clipped == 0
                np.testing.assert_array_equal(r.average, results[0].average)
            exact = np.mean(mine, axis=0)
            tolerance = 0 if compression == "none" else 0.05
            np.testing.assert_allclose(results[0].average, exact, atol=tolerance, rtol=1e-6)
        sent = sum(m.bytes_sent for m in members)
        assert sent == sum(m.bytes_received for m in members) > 0
        # k - 1 hops of k contributions per round, 3 rounds, plus the handshakes
        per_frame = 3 * ROW * {"none": 4, "fp16": 2, "fixed_int8": 1}[compression]
        assert sent >= 3 * k * (k - 1) * per_frame
    finally:
        closed(members)


def test_a_hostile_contribution_is_clipped_alike_on_every_member():
    members = opened(ring_plans(3, sync_clip_ratio=4.0))
    try:
        mine = contributions(3)
        mine[1] = mine[1] * 1000.0
        results = rounds(members, 0, mine)
        for r in results:
            assert r.clipped == 1
            np.testing.assert_array_equal(r.average, results[0].average)
        norms = [np.linalg.norm(x) for x in (mine[0], mine[2])]
        bound = 4.0 * float(np.median(norms))
        want = (mine[0] + mine[1] * (bound / np.linalg.norm(mine[1])) + mine[2]) / 3
        np.testing.assert_allclose(results[0].average, want, rtol=1e-4, atol=1e-5)
        assert [m.clipped for m in members] == [1, 1, 1]
    finally:
        closed(members)


def test_a_stalled_member_is_left_out_and_its_late_frame_dropped():
    """Member 1 starts round 0 after member 0's timeout: member 0 averages alone and counts
    the miss; member 1 finds 0's frame waiting and averages both; in round 1 member 0 drops
    1's late round-0 frame and both are in."""
    plans = [msgspec.structs.replace(p, train=_timeout(p.train, 1.0)) for p in ring_plans(2)]
    members = opened(plans)
    try:
        a, b = contributions(2)
        first = members[0].round(0, a)  # member 1 is not there yet
        assert first.present == [0] and first.missed == 1
        np.testing.assert_array_equal(first.average, a)
        late = members[1].round(0, b)
        assert late.present == [0, 1] and late.missed == 0
        results = in_threads([lambda: members[0].round(1, a), lambda: members[1].round(1, b)])
        for r in results:
            assert r.present == [0, 1]
            np.testing.assert_array_equal(r.average, (a + b) / 2)
        assert members[0].missed == 1 and members[0].stale == 1 and members[1].missed == 0
    finally:
        closed(members)


def _timeout(train: TrainConfig, seconds: float) -> TrainConfig:
    return msgspec.structs.replace(train, sync_timeout_s=seconds)


def test_a_malformed_contribution_is_a_frame_error():
    members = opened(ring_plans(2))
    try:
        a = contributions(1)[0]
        b = np.zeros((a.shape[0] + 1, ROW), dtype=np.float32)
        results: list[Any] = [None, None]

        def run(i: int, x: np.ndarray) -> None:
            try:
                results[i] = members[i].round(0, x)
            except FrameError as exc:
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i, x)) for i, x in enumerate([a, b])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(isinstance(r, FrameError) for r in results)
        assert "shape" in str(results[0])
    finally:
        for m in members:
            m.close()


def test_a_ring_of_three_over_the_relay(nats_server):
    """transport tunnel: every ring link through NATS subjects of its own, tagged with its
    token; the same rounds as over ZeroMQ."""
    members = opened(ring_plans(3, transport=Transport.TUNNEL, nats_url=nats_server.url))
    try:
        assert [m.up.transport for m in members] == ["relay"] * 3
        mine = contributions(3)
        results = rounds(members, 7, mine)
        for r in results:
            assert r.present == [0, 1, 2]
            np.testing.assert_array_equal(r.average, average(dict(enumerate(mine))))
    finally:
        closed(members)


def test_replicas_of_another_schedule_refuse_to_join_the_ring():
    """The ring's handshake compares the stage's fingerprint, as a boundary's does."""
    plans = ring_plans(2)
    members = [ReplicaSync(plans[0], FINGERPRINT), ReplicaSync(plans[1], b"another schedule")]
    errors: list[BaseException | None] = [None, None]

    def run(i: int) -> None:
        try:
            members[i].open()
        except HandshakeError as exc:
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(e, HandshakeError) for e in errors), errors
    for m in members:
        m.close()
