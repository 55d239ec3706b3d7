"""The replicas' sync (agent/runtime/replicas.py): its pure math, and rings of real links,
elastic membership included (ring changes, the donor's state handed around)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest

from silentswarm.agent.errors import (
    ForwardRefusedError,
    FrameError,
    HandshakeError,
    PeerTimeoutError,
    RelayGapError,
    SlowReceiverError,
    SuccessorStalledError,
)
from silentswarm.agent.pipe.wire import Direction, encode_frame
from silentswarm.agent.runtime import replicas
from silentswarm.agent.runtime.replicas import (
    MAX_ROUNDS_AHEAD,
    ROW,
    ReplicaSync,
    adam_moment_bound,
    average,
    clip_contributions,
    donor_refusal,
    layout_rows,
    nesterov_step,
    next_member,
    pack,
    pack_state,
    position_refusal,
    prev_member,
    relative_distance,
    ring_send_queue,
    state_digest,
    state_rows,
    unpack,
    unpack_state,
)
from silentswarm.compression import parse_wire_codec
from silentswarm.errors import ErrorCode
from silentswarm.plan import (
    ModelConfig,
    Peer,
    RingChange,
    StagePlan,
    SyncRing,
    TrainConfig,
    Transport,
    replicated_chain_plans,
)
from silentswarm.procs import free_port
from silentswarm.rings import link_secrets, public_key, signing_seeds
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
            (ring,), (ring_next,) = plan.sync_rings, nxt.sync_rings
            assert plan.sync_ports == [sync[r][s]] and ring.port == 0
            assert ring.next.data_address == sync[(r + 1) % k][s]
            assert ring.next.fellow_id == nxt.fellow_id
            assert ring_next.prev.fellow_id == plan.fellow_id
            assert ring.curve_down.peer_public == ring_next.curve_up.public
            assert ring_next.curve_up.peer_public == ring.curve_down.public
            assert ring.relay_down_token == ring_next.relay_up_token is not None
    assert {p.checkpoint_every for row in plans for p in row} == {0}
    assert len({p.fellow_id for row in plans for p in row}) == k * n


# --- rings of real links ----------------------------------------------------------------------


def ring_plans(
    k: int, *, transport: Transport = Transport.P2P, nats_url: str | None = None, **train: Any
) -> list[StagePlan]:
    config = TrainConfig(**{"steps": 4, "batch_size": 4, "sync_timeout_s": 20.0, **train})
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


def _plan(plan: StagePlan, sync_timeout_s: float) -> StagePlan:
    return msgspec.structs.replace(plan, train=_timeout(plan.train, sync_timeout_s))


def test_a_malformed_contribution_costs_that_contribution_not_the_member():
    """A contribution of another shape is dropped and counted as clipped; the member that
    got it goes on with the round (a hostile predecessor cannot end it)."""
    members = opened([_plan(p, 1.0) for p in ring_plans(2)])
    try:
        a = contributions(1)[0]
        b = np.zeros((a.shape[0] + 1, ROW), dtype=np.float32)
        results = in_threads([lambda: members[0].round(0, a), lambda: members[1].round(0, b)])
        for i, r in enumerate(results):
            assert r.present == [i], r
        assert [m.clipped for m in members] == [1, 1] and [m.missed for m in members] == [1, 1]
    finally:
        closed(members)


def first_recv_raises(member: ReplicaSync, error: Exception) -> None:
    """``member``'s next receive from its predecessor raises ``error``; the later ones work."""
    real_recv, failed = member.up.recv, []

    def recv(timeout_s: float):
        if not failed:
            failed.append(True)
            raise error
        return real_recv(timeout_s)

    member.up.recv = recv


def test_a_relay_frame_that_does_not_assemble_costs_that_frame_not_the_member():
    """Over the relay a predecessor's chunks that do not add up reach the receive as a
    FrameError: dropped and counted as clipped, and the member waits on for the round."""
    members = opened(ring_plans(2))
    victim = members[1]
    first_recv_raises(victim, FrameError("ring-1: relay frame cut short at chunk 3"))
    try:
        a, b = contributions(2)
        results = rounds(members, 0, [a, b])
        assert results[1].present == [0, 1] and victim.clipped == 1
        np.testing.assert_allclose(results[1].average, (a + b) / 2, rtol=1e-6)
    finally:
        closed(members)


def test_a_relay_gap_costs_the_predecessors_contributions_not_the_member():
    """A predecessor on the relay that skips a chunk and never sends it (or a loss still open
    at the round's end) reaches the receive as a RelayGapError: that round goes on without
    what it would have brought, as if it had sent nothing, and the member lives on. It used
    to end the member, the one replica the gap is not the fault of."""
    members = opened([_plan(p, 1.0) for p in ring_plans(2)])
    victim = members[1]
    first_recv_raises(victim, RelayGapError("ring-1: relay gap: expected chunk 414, got 415"))
    try:
        a, b = contributions(2)
        assert rounds(members, 0, [a, b])[1].present == [1]
        assert victim.missed == 1
        results = rounds(members, 1, [a, b])
        assert [r.present for r in results] == [[0, 1], [0, 1]]
    finally:
        closed(members)


def test_a_successor_that_takes_nothing_is_sent_nothing_more_in_that_round(monkeypatch):
    """Member 0's successor takes none of its own frame within the round: member 0 forwards
    it nothing more that round (each forward used to wait a whole timeout again, k - 1 in
    all), and still gathers what its predecessor brings."""
    members = opened([_plan(p, 1.0) for p in ring_plans(3)])
    first = members[0]
    waits: list[float] = []

    def stalled(parts, timeout_s):
        waits.append(timeout_s)
        raise PeerTimeoutError("ring-0: no peer took a message for 1s")

    monkeypatch.setattr(first.down, "send", stalled)
    try:
        results = rounds(members, 0, contributions(3))
        assert len(waits) == 1 and waits[0] <= 1.0
        assert results[0].present == [0, 1, 2] and results[1].present == [1]
    finally:
        monkeypatch.undo()
        closed(members)


def test_a_ring_link_queues_no_more_than_the_rounds_a_successor_may_be_behind():
    members = opened(ring_plans(3))
    try:
        import zmq

        queued = {m.down._sock.getsockopt(zmq.SNDHWM) for m in members}
        assert queued == {ring_send_queue(3)} and ring_send_queue(3) == 2 * MAX_ROUNDS_AHEAD + 1
    finally:
        closed(members)


def test_under_diloco_a_frame_of_the_next_sync_is_kept_for_it():
    """DiLoCo's rounds are named by their step, ``sync_every`` apart: a predecessor one sync
    ahead is kept for that round (it was dropped as "more than 8 rounds ahead", and the late
    member missed it again in its next round); MAX_ROUNDS_AHEAD syncs ahead still bound it,
    and a step that is no sync names no round."""
    members = opened(ring_plans(2, sync="diloco", sync_every=20, steps=400))
    try:
        a = contributions(1)[0]
        first, second = members
        got: dict[int, np.ndarray] = {}
        assert second._check(first._encode(39, a), 19, got, a.shape) == -1
        far = 19 + 20 * MAX_ROUNDS_AHEAD + 20
        assert second._check(first._encode(far, a), 19, got, a.shape) is None
        assert list(second._early) == [39] and second.stale == 1
        # Steps between syncs (or past the run) name no round: each would hold a frame.
        for step in (20, 38, first.plan.train.steps):
            assert second._check(first._encode(step, a), 19, got, a.shape) is None
        assert list(second._early) == [39] and second.clipped == 3
        second._early.clear()
    finally:
        closed(members)


def test_in_a_ring_of_three_a_forwarder_cannot_forge_another_members_contribution():
    """Member 1 takes member 2's contributions through member 0: a frame that claims origin
    2 but carries member 0's signature, or none, is dropped and counted; member 2's own
    signed frame, passed on unchanged, is taken; so is a signed state of the donor."""
    members = opened(ring_plans(3))
    try:
        a, b, c = contributions(3)
        forger, victim, honest = members
        assert all(m.signer.active for m in members)
        got: dict[int, np.ndarray] = {}

        def as_origin_2(x: np.ndarray, signer) -> list:
            _, parts = encode_frame(
                x, honest.codec, job=honest.plan.job_id, attempt=honest.plan.attempt, step=0,
                micro=2, direction=Direction.FWD, phase="sync",
            )  # fmt: skip
            return signer.sign(parts)

        assert victim._check(as_origin_2(a * 1000, forger.signer), 0, got, a.shape) is None
        assert victim._check(forger._encode(0, a), 0, got, a.shape) is None  # unsigned
        assert victim.clipped == 2 and got == {}
        assert victim._check(as_origin_2(c, honest.signer), 0, got, a.shape) == 2
        assert victim._check(forger.signer.sign(forger._encode(0, a)), 0, got, a.shape) == 0
        np.testing.assert_array_equal(got[2], c)
        # A tampered signed frame: one value changed after signing.
        parts = as_origin_2(b, honest.signer)
        payload = bytearray(parts[1])
        payload[0] ^= 1
        tampered = [parts[0], bytes(payload), *parts[2:]]
        assert victim._check(tampered, 1, {}, a.shape) is None and victim.clipped == 3
        # Rounds of the three still agree, every frame signed and checked.
        results = rounds(members, 0, [a, b, c])
        for r in results:
            np.testing.assert_allclose(r.average, (a + b + c) / 3, rtol=1e-6)
    finally:
        closed(members)


def test_frames_no_honest_predecessor_sends_are_dropped_and_counted():
    """Twice from one origin, from this member itself, of another shape: each is dropped and
    counted as clipped; a frame further ahead than MAX_ROUNDS_AHEAD (this member is far
    behind) is dropped as stale; nothing of them is kept."""
    members = opened(ring_plans(2, steps=100))
    try:
        a, b = contributions(2)
        first, second = members
        got: dict[int, np.ndarray] = {}

        def check(parts, round_id: int = 0) -> int | None:
            return second._check(parts, round_id, got, a.shape)

        assert check(first._encode(MAX_ROUNDS_AHEAD + 1, a)) is None and second.stale == 1
        assert check(first._encode(MAX_ROUNDS_AHEAD, a)) == -1  # kept for its round
        assert check(first._encode(MAX_ROUNDS_AHEAD, b)) is None
        assert check(second._encode(0, a)) is None  # its own origin, forged
        assert check(first._encode(0, np.zeros((4, ROW), np.float32))) is None
        assert check(first._encode(0, a)) == 0 and check(first._encode(0, b)) is None
        assert second.clipped == 4 and first.clipped == 0
        assert {k: list(v) for k, v in second._early.items()} == {MAX_ROUNDS_AHEAD: [0]}
        np.testing.assert_array_equal(got[0], a)
        second._early.clear()
    finally:
        closed(members)


def test_a_contribution_is_refused_on_its_header_before_its_payload_is_decoded(monkeypatch):
    """A payload is sized by its sender: 2-bit values of a shape the header makes up decode
    to 40 times their bytes. Another phase, codec or shape, a sender outside the ring, a
    stranger's job: refused on the header, the payload never decoded; the rest decoded once."""
    members = opened(ring_plans(2))
    try:
        a = contributions(2)[0]
        first, second = members
        decoded: list[int] = []
        real = replicas.decode_frame

        def spy(parts, **given):
            decoded.append(len(parts))
            return real(parts, **given)

        monkeypatch.setattr(replicas, "decode_frame", spy)

        def frame(**changes: Any) -> list[bytes]:
            matrix = changes.pop("matrix", a)
            codec = parse_wire_codec(changes.pop("codec", "none"))
            fields = {
                "job": first.plan.job_id,
                "attempt": first.plan.attempt,
                "step": 0,
                "micro": first.replica,
                "direction": Direction.FWD,
                "phase": "sync",
                **changes,
            }
            _, parts = encode_frame(matrix, codec, **fields)
            return [bytes(p) for p in parts]

        huge = np.zeros((4096, ROW), dtype=np.float32)
        refused = [
            frame(codec="fixed_int2", matrix=huge),  # another codec, another shape
            frame(codec="fixed_int2"),  # another codec
            frame(matrix=huge),  # another shape
            frame(phase="state"),
            frame(micro=7),  # not a member
        ]
        got: dict[int, np.ndarray] = {}
        for parts in refused:
            assert second._check(parts, 0, got, a.shape) is None
        assert second._check(frame(job="another-job"), 0, got, a.shape) is None
        assert (second.clipped, second.dropped, decoded) == (len(refused), 1, [])
        assert second._check(frame(), 0, got, a.shape) == first.replica
        assert decoded == [2]
        np.testing.assert_array_equal(got[first.replica], a)
    finally:
        closed(members)


def test_refused_sync_frames_are_logged_at_most_every_few_seconds(caplog):
    members = opened(ring_plans(2))
    try:
        a = contributions(2)[0]
        second = members[1]
        with caplog.at_level("WARNING", logger="silentswarm.agent.runtime.replicas"):
            for _ in range(50):
                assert second._check(second._encode(0, a), 0, {}, a.shape) is None
        assert second.clipped == 50
        lines = [r for r in caplog.records if "dropped a sync frame" in r.getMessage()]
        assert len(lines) == 1
    finally:
        closed(members)


def test_a_successor_that_takes_no_more_of_the_state_is_named_by_its_sender(monkeypatch):
    """A successor that grants no credit (or too slowly) stalls the donor's hand-over: the
    sender names it (SUCCESSOR_STALLED), so the leader drops both, not the sender alone."""
    members = opened(ring_plans(3))
    try:
        donor = members[0]
        change = RingChange(epoch=1, members=[0, 1, 2], donor=0, at_step=4, rings=[donor.ring])

        def stalled(parts, timeout_s):
            raise PeerTimeoutError("the receiver granted no credit for 30s")

        monkeypatch.setattr(donor.down, "send", stalled)
        donor.members, donor.epoch = [0, 1, 2], 1
        state = np.zeros((2, ROW), dtype=np.float32)
        with pytest.raises(SuccessorStalledError) as raised:
            donor.hand_over(change, state, state.shape, timeout_s=30)
        assert raised.value.code == ErrorCode.SUCCESSOR_STALLED
        assert "handing the state on to replica 1, ring epoch 1" in raised.value.message

        def slow(parts, timeout_s):  # credit came, too slowly: a slow uplink looks the same
            raise SlowReceiverError("the receiver took the frame at under 128 KiB/s")

        monkeypatch.setattr(donor.down, "send", slow)
        with pytest.raises(SlowReceiverError):
            donor.hand_over(change, state, state.shape, timeout_s=30)
    finally:
        closed(members)


def test_a_hand_over_ends_at_its_timeout_however_many_frames_of_others_come(monkeypatch):
    """Frames of another attempt are dropped, but each went round the wait again: a
    predecessor sending them without end held a joining member's hand-over for ever."""
    members = opened(ring_plans(2))
    try:
        first, second = members
        change = RingChange(epoch=1, members=[0, 1], donor=0, at_step=4, rings=[first.ring])
        second.members, second.epoch = [0, 1], 1
        state = np.zeros((2, ROW), dtype=np.float32)
        other = msgspec.structs.replace(first.plan, attempt=first.plan.attempt + 1)
        _, parts = encode_frame(
            state, first.codec, job=other.job_id, attempt=other.attempt, step=1, micro=0,
            direction=Direction.FWD, phase="state",
        )  # fmt: skip
        monkeypatch.setattr(second.up, "recv", lambda timeout_s: parts)
        with pytest.raises(PeerTimeoutError, match="no state of donor 0"):
            in_threads([lambda: second.hand_over(change, None, state.shape, 0.5)], timeout=10)
        assert second.dropped > 0
    finally:
        monkeypatch.undo()
        closed(members)


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


# --- elastic membership: the pure parts -------------------------------------------------------


@pytest.mark.parametrize(
    ("members", "replica", "nxt", "prev"),
    [
        ([0, 1, 2], 0, 1, 2),
        ([0, 1, 2], 2, 0, 1),
        ([0, 2], 0, 2, 2),
        ([0, 2], 2, 0, 0),
        ([1, 3, 4], 3, 4, 1),
        ([5], 5, 5, 5),  # a ring of one: itself both ways (and no links)
    ],
)
def test_the_next_and_previous_member_of_a_ring(members, replica, nxt, prev):
    assert next_member(members, replica) == nxt
    assert prev_member(members, replica) == prev


def test_a_state_of_any_dtypes_packs_losslessly_in_the_rows_of_pack():
    rng = np.random.default_rng(3)
    arrays = [
        rng.normal(size=(3, 70)).astype(np.float32),
        np.array(2**53 + 1, dtype=np.int64),  # an optimizer's step count: exact, not float32
        np.array([np.nan, -0.0, np.inf], dtype=np.float32),
        np.array([7, 2**31 + 5], dtype=np.uint32),
        np.arange(5, dtype=np.float16),
    ]
    specs = [(a.shape, a.dtype) for a in arrays]
    matrix = pack_state(arrays)
    assert matrix.dtype == np.float32 and matrix.shape == (state_rows(specs), ROW)
    # float32 arrays sit where pack() puts them
    np.testing.assert_array_equal(matrix[:4].reshape(-1)[:210], arrays[0].reshape(-1))
    back = unpack_state(matrix, specs)
    for a, b in zip(arrays, back, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes(), "bit for bit"
    assert state_digest(matrix) == state_digest(pack_state(back))
    assert state_digest(matrix) != state_digest(pack_state([arrays[0] * 2, *arrays[1:]]))


def test_the_relative_distance_of_a_donors_weights():
    ours = [vec(3.0, 4.0), vec(0.0)]  # norm 5
    assert relative_distance(ours, ours) == 0.0
    assert relative_distance([vec(3.0, 4.5), vec(0.0)], ours) == pytest.approx(0.1)
    assert relative_distance([vec(0.5, 0.0)], [vec(0.0, 0.0)]) == pytest.approx(0.5)  # absolute
    assert relative_distance([vec(1.0)], ours) == float("inf"), "another layout"
    assert relative_distance([vec(np.nan, 4.0), vec(0.0)], ours) == float("inf")


def donor_state(weight=(3.0, 4.0), moment=(0.1, 0.2), velocity=(0.01, 0.04), anchor=None):
    """A ring state's layout: one weight, its AdamW moments, (its DiLoCo anchor,) the step
    count: ``(arrays, n_weights, moments, anchors)``."""
    arrays = [vec(*weight), vec(*moment), vec(*velocity)]
    anchors = ()
    if anchor is not None:
        arrays.append(vec(*anchor))
        anchors = ((3, 0),)
    arrays.append(np.array([7], dtype=np.int64))
    return arrays, 1, ((1, 2),), anchors


BOUND = adam_moment_bound(0.9, 0.999)


def test_adams_first_moment_stays_within_its_bound_of_the_second():
    """The bound holds for AdamW's running means of any gradients, the worst case
    included (gradients that keep their sign and grow); no bound where beta_1^2 >= beta_2."""
    assert 7.27 * 1.1 < BOUND < 8.1 and adam_moment_bound(0.9, 0.5) == float("inf")
    rng = np.random.default_rng(0)
    for grads in (rng.normal(size=(500, 64)), np.geomspace(1e-6, 1e3, 500)[:, None]):
        m = v = np.zeros(grads.shape[1])
        for g in grads:
            m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
            assert (np.abs(m) <= BOUND * np.sqrt(v)).all()


@pytest.mark.parametrize(
    ("epoch", "index", "refused"),
    [(0, 0, False), (3, 17, False), (10**12, 10**9, False), (-1, 0, True), (0, -3, True)],
)
def test_what_a_joiner_refuses_of_its_donors_data_position(epoch, index, refused):
    """Only what is the donor's doing for sure: an index beyond the joiner's own dataset may
    be the joiner's (it fails alone), and a far epoch only reorders the data."""
    why = position_refusal(epoch, index)
    assert (why is not None) == refused and (not refused or "negative" in why)


@pytest.mark.parametrize(
    ("theirs", "joining", "refused"),
    [
        ({}, True, None),
        ({}, False, None),
        ({"weight": (3.0, 4.1)}, False, None),  # 2% away: replicas that missed a round
        ({"moment": (0.15, 0.2)}, False, None),
        ({"moment": (0.6, -0.2)}, False, "optimizer state is 2.816 away"),
        ({"weight": (3.0, 5.0)}, False, "weights are 0.2 away"),
        ({"weight": (3.0, 5.0)}, True, None),  # a joiner has nothing to compare
        ({"moment": (np.nan, 0.0)}, True, "1 of its arrays hold values that are not finite"),
        ({"weight": (np.inf, 4.0)}, False, "not finite"),
        # A negated second moment is close to the member's own (they are tiny next to the
        # first moments) and NaNs every weight at the next step: refused whoever takes it.
        ({"velocity": (-0.01, 0.04)}, False, "second moments hold negative values"),
        ({"velocity": (0.01, -0.04)}, True, "second moments hold negative values"),
        # A second moment forged to nothing makes the next update m / eps.
        ({"velocity": (0.01, 0.0)}, False, "first moments exceed 8"),
        # Gradients below ~1e-21 leave float32's second moment at 0, the first not: honest.
        ({"moment": (1e-22, 0.2), "velocity": (0.0, 0.04)}, False, None),
        ({"velocity": (1e-12, 0.04)}, True, "first moments exceed"),
        ({"anchor": (3.0, 4.0)}, True, None),
        ({"anchor": (3.0, 4.1)}, False, None),
        ({"anchor": (3.0, 5.0)}, False, "DiLoCo anchors are 0.2 away from this replica's"),
        ({"anchor": (3.0, 8.0)}, True, "its DiLoCo anchors are 0.8 away from its weights"),
    ],
)
def test_what_a_member_refuses_of_a_donors_state(theirs, joining, refused):
    own, n_weights, moments, anchors = donor_state(
        anchor=(3.0, 4.0) if "anchor" in theirs else None
    )
    arrays, *_ = donor_state(**theirs)
    why = donor_refusal(
        arrays,
        None if joining else own,
        n_weights=n_weights,
        moments=moments,
        anchors=anchors,
        moment_bound=BOUND,
    )
    assert (why is None) == (refused is None), why
    assert refused is None or refused in why


def test_a_member_refuses_a_donor_whose_step_count_is_not_its_own():
    own, n_weights, moments, _ = donor_state()
    theirs = [*own[:-1], np.array([8], dtype=np.int64)]
    why = donor_refusal(theirs, own, n_weights=n_weights, moments=moments)
    assert why == "its optimizer's step count is not this replica's"
    assert donor_refusal(theirs, None, n_weights=n_weights, moments=moments) is None


@pytest.mark.parametrize(
    ("count", "joining", "steps_done", "refused"),
    [
        (7, True, 7, False),
        (0, True, 7, False),
        (-1, True, 7, True),  # AdamW's bias correction 1 - beta ** 0: every weight NaN
        (-1, False, 7, True),
        (2**63 - 1, True, None, False),  # unbounded where nobody says how many steps
        (2**63 - 1, True, 7, True),  # count + 1 wraps to negative
        (8, True, 7, True),
    ],
)
def test_a_donors_step_count_lies_between_0_and_the_steps_done(count, joining, steps_done, refused):
    own, n_weights, moments, _ = donor_state()
    # A dropout layer's seed state is integer state too, and no count: never bounded.
    seed = np.array([987_654_321, 40], dtype=np.int64)
    theirs = [*own[:-1], seed, np.array([count], dtype=np.int64)]
    if not joining:
        own = theirs  # a member whose own count is the same: only the bounds can refuse
    why = donor_refusal(
        theirs,
        None if joining else own,
        n_weights=n_weights,
        moments=moments,
        counts=(len(theirs) - 1,),
        steps_done=steps_done,
    )
    assert (why is not None) == refused, why
    assert why is None or "step count is outside 0 to" in why


# --- elastic membership: rings of real links ----------------------------------------------------


def ring_changes(
    plans: list[StagePlan],
    members: list[int],
    *,
    epoch: int,
    at_step: int,
    donor: int | None = None,
    joining: list[int] | None = None,
    **fields: Any,
) -> dict[int, RingChange]:
    """What a leader sends each member of a new ring: fresh CURVE keys and relay tokens for
    every link (member ``a`` to its successor), the successor's sync address. ``plans[r]`` is
    replica r's plan for the stage (None for a slot nobody holds)."""
    secrets = link_secrets(len(members), curve=True, relay=True)
    seeds = signing_seeds(members) if len(members) > 2 else {}
    signers = {r: public_key(seed) for r, seed in seeds.items()}
    out = {}
    for i, r in enumerate(members):
        j, h = (i + 1) % len(members), (i - 1) % len(members)
        nxt, prev = plans[members[j]], plans[members[h]]
        many = len(members) > 1
        ring = SyncRing(
            layer_start=plans[r].layer_start,
            layer_end=plans[r].layer_end,
            port=0 if plans[r].sync_ports else None,
            prev=Peer(fellow_id=prev.fellow_id) if many else None,
            next=Peer(fellow_id=nxt.fellow_id, data_address=(nxt.sync_ports or [None])[0])
            if many
            else None,
            curve_up=secrets[h].binding if many else None,
            curve_down=secrets[i].connecting if many else None,
            relay_up_token=secrets[h].token if many else None,
            relay_down_token=secrets[i].token if many else None,
            sign_seed=seeds.get(r),
            signers=signers,
        )
        out[r] = RingChange(
            epoch=epoch,
            at_step=at_step,
            members=members,
            donor=members[0] if donor is None else donor,
            joining=joining or [],
            rings=[ring],
            **fields,
        )
    return out


def test_a_new_ring_of_three_hands_the_donors_signed_state_around():
    """Epoch 1 of the same three members, donor 1: replica 0 takes the state through replica
    2, checks donor 1's signature on it, and every member has the donor's bytes."""
    plans = ring_plans(3)
    members = opened(plans)
    try:
        changes = ring_changes(plans, [0, 1, 2], epoch=1, at_step=3, donor=1)
        in_threads([lambda m=m: m.switch(changes[m.replica], 20.0) for m in members])
        assert all(m.signer.active for m in members)
        state = contributions(1, rows=5, seed=3)[0]
        got = in_threads(
            [
                lambda m=m: m.hand_over(
                    changes[m.replica], state if m.replica == 1 else None, state.shape, 20.0
                )
                for m in members
            ]
        )
        assert all(g.tobytes() == state.tobytes() for g in got)
    finally:
        closed(members)


def test_a_ring_of_three_switches_to_two_and_hands_the_donors_state_around():
    """Replica 1 is lost: 0 and 2 close their links, open a ring of their own (re-binding
    their sync addresses at once), 2 takes 0's state bit for bit, and their rounds wait for
    nobody else; the byte counters go on from the first ring's."""
    plans = ring_plans(3)
    members = opened(plans)
    try:
        rounds(members, 0, contributions(3))
        before = [m.bytes_sent for m in members]
        survivors = [members[0], members[2]]
        changes = ring_changes(plans, [0, 2], epoch=1, at_step=1)
        members[1].close()
        in_threads([lambda m=m: m.switch(changes[m.replica], 20.0) for m in survivors])
        assert [m.members for m in survivors] == [[0, 2], [0, 2]]
        assert [m.epoch for m in survivors] == [1, 1]
        state = np.arange(3 * ROW, dtype=np.float32).reshape(3, ROW)
        got = in_threads(
            [
                lambda m=m, own=own: m.hand_over(changes[m.replica], own, (3, ROW), 20.0)
                for m, own in zip(survivors, [state, None], strict=True)
            ]
        )
        np.testing.assert_array_equal(got[0], state)
        np.testing.assert_array_equal(got[1], state)
        assert state_digest(got[0]) == state_digest(got[1])
        mine = contributions(2, seed=5)
        results = rounds(survivors, 1, mine)
        for r in results:
            assert r.present == [0, 2] and r.missed == 0
            np.testing.assert_array_equal(r.average, average({0: mine[0], 2: mine[1]}))
            assert r.seconds < 5.0
        assert survivors[0].bytes_sent > before[0] and survivors[1].bytes_sent > before[2]
        assert all(in_threads([m.finish for m in survivors]))
    finally:
        for m in members:
            m.close()


def test_a_ring_of_one_has_no_links_and_its_rounds_return_its_own_contribution():
    plans = ring_plans(2)
    members = opened(plans)
    try:
        changes = ring_changes(plans, [1], epoch=3, at_step=2)
        members[0].close()
        survivor = members[1]
        survivor.switch(changes[1], 5.0)
        assert survivor.links() == [] and survivor.members == [1]
        own = contributions(1)[0]
        np.testing.assert_array_equal(survivor.hand_over(changes[1], own, own.shape, 5.0), own)
        result = survivor.round(2, own)
        assert result.present == [1] and result.missed == 0
        np.testing.assert_array_equal(result.average, own)
        assert survivor.finish()
    finally:
        for m in members:
            m.close()


def test_a_joining_member_is_in_no_ring_until_it_switches_and_gets_the_donors_state():
    """A 2-slot stage: replica 0 alone (epoch 1), then a joining replica 1 (a new fellow at a
    new address) and replica 0 form a ring of two; the joiner receives the donor's state."""
    plans = ring_plans(2)
    members = opened(plans)
    members[1].close()
    alone = ring_changes(plans, [0], epoch=1, at_step=1)
    members[0].switch(alone[0], 5.0)
    joiner_plan = msgspec.structs.replace(
        plans[1],
        joining=True,
        fellow_id="r1-joiner",
        sync_ports=[f"tcp://127.0.0.1:{free_port()}"],
        sync_rings=[],
    ).checked()
    joiner = ReplicaSync(joiner_plan, FINGERPRINT)
    try:
        assert joiner.members == [] and joiner.links() == []
        with pytest.raises(ValueError, match="in no ring"):
            joiner.round(0, contributions(1)[0])
        changes = ring_changes([plans[0], joiner_plan], [0, 1], epoch=2, at_step=4, joining=[1])
        ring = [members[0], joiner]
        in_threads([lambda m=m: m.switch(changes[m.replica], 20.0) for m in ring])
        state = contributions(1, rows=5, seed=9)[0]
        got = in_threads(
            [
                lambda: members[0].hand_over(changes[0], state, state.shape, 20.0),
                lambda: joiner.hand_over(changes[1], None, state.shape, 20.0),
            ]
        )
        assert got[1].tobytes() == state.tobytes()
        mine = contributions(2, seed=11)
        results = in_threads(
            [lambda: members[0].round(4, mine[0]), lambda: joiner.round(4, mine[1])]
        )
        for r in results:
            assert r.present == [0, 1]
            np.testing.assert_array_equal(r.average, average(dict(enumerate(mine))))
        assert all(in_threads([m.finish for m in ring]))
    finally:
        for m in (*members, joiner):
            m.close()


def test_a_state_of_another_shape_is_refused_naming_the_replica_that_sent_it():
    plans = ring_plans(2)
    members = opened(plans)
    try:
        changes = ring_changes(plans, [0, 1], epoch=1, at_step=1)
        in_threads([lambda m=m: m.switch(changes[m.replica], 20.0) for m in members])
        own = contributions(1)[0]
        results: list[Any] = [None, None]

        def receive() -> None:
            try:
                results[1] = members[1].hand_over(changes[1], None, (own.shape[0] + 1, ROW), 20.0)
            except ForwardRefusedError as exc:
                results[1] = exc

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        members[0].hand_over(changes[0], own, own.shape, 20.0)
        thread.join(30)
        refused = results[1]
        assert isinstance(refused, ForwardRefusedError) and "state has shape" in str(refused)
        assert refused.code is ErrorCode.FORWARD_REFUSED
        assert "forwarded by replica 0, ring epoch 1" in str(refused)
    finally:
        for m in members:
            m.close()


def test_a_forwarder_that_alters_the_donors_state_is_named_by_its_successor():
    """Ring of three, donor 1: replica 2 receives the signed state and hands on an altered
    copy (one value changed, the donor's signature kept); replica 0 refuses it, naming
    replica 2 (whose replica the leader then drops with 0's)."""
    plans = ring_plans(3)
    members = opened(plans)
    try:
        changes = ring_changes(plans, [0, 1, 2], epoch=1, at_step=3, donor=1)
        in_threads([lambda m=m: m.switch(changes[m.replica], 20.0) for m in members])
        state = contributions(1, rows=5, seed=3)[0]
        forwarder = members[2]

        def alter_and_forward() -> None:
            assert forwarder.up is not None and forwarder.down is not None
            parts = list(forwarder.up.recv(20.0))
            payload = bytearray(parts[1])
            payload[0] ^= 1
            parts[1] = bytes(payload)
            forwarder.down.send(parts, timeout_s=20.0)

        def receive() -> Any:
            try:
                return members[0].hand_over(changes[0], None, state.shape, 20.0)
            except ForwardRefusedError as exc:
                return [exc]  # in_threads raises an exception it is handed

        got = in_threads(
            [
                lambda: members[1].hand_over(changes[1], state, state.shape, 20.0),
                alter_and_forward,
                receive,
            ]
        )
        (refused,) = got[2]
        assert isinstance(refused, ForwardRefusedError), refused
        assert "(the donor) did not sign" in str(refused)
        assert "forwarded by replica 2, ring epoch 1" in str(refused)
    finally:
        closed(members)


def test_a_ring_over_the_relay_switches_to_new_subjects_tokens(nats_server):
    """transport tunnel: the new ring's links are the relay subjects of their senders
    (``sync_link(segment, a)``) tagged with the change's fresh tokens; replica 2 now hears
    replica 0 on 0's subject, and the donor's state crosses it intact."""
    plans = ring_plans(3, transport=Transport.TUNNEL, nats_url=nats_server.url)
    members = opened(plans)
    try:
        survivors = [members[0], members[2]]
        members[1].close()
        changes = ring_changes(plans, [0, 2], epoch=1, at_step=3, donor=2)
        in_threads([lambda m=m: m.switch(changes[m.replica], 20.0) for m in survivors])
        assert [m.up.transport for m in survivors] == ["relay", "relay"]
        state = contributions(1, rows=4, seed=2)[0]
        got = in_threads(
            [
                lambda: members[0].hand_over(changes[0], None, state.shape, 20.0),
                lambda: members[2].hand_over(changes[2], state, state.shape, 20.0),
            ]
        )
        assert got[0].tobytes() == state.tobytes()
        mine = contributions(2, seed=4)
        for r in rounds(survivors, 3, mine):
            assert r.present == [0, 2]
        assert all(in_threads([m.finish for m in survivors]))
    finally:
        for m in members:
            m.close()
