"""Replicas on the leader's side (issue 23): the spec's checks, placement of k pipelines,
their stage plans (pipeline boundaries and rings) and the attempt users' relay subjects.
Pure functions, table-driven."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from silentswarm.errors import FieldError, JobSpecError
from silentswarm.jobspec import JobSpec, Placement, decode_job_spec, stage_plans
from silentswarm.leader.jobs import JobManager, plan_schedule
from silentswarm.leader.placement import (
    Candidate,
    Unplaceable,
    fellows_needed,
    place,
    shape,
    weighted_ranges,
)
from silentswarm.natsconn import NatsAccess
from silentswarm.plan import ModelConfig, StagePlan, Transport
from silentswarm.pools import DEFAULT_POOL
from silentswarm.protocol import GpuInfo
from silentswarm.types.accounts import Account, PoolLimit, Role
from tests.fakes import Clock

GIB = 1 << 30


def gpu(free_gib: float) -> GpuInfo:
    return GpuInfo(
        index=0,
        uuid="GPU-0",
        name="Test",
        memory_total_bytes=80 * GIB,
        memory_free_bytes=int(free_gib * GIB),
        memory_used_bytes=int((80 - free_gib) * GIB),
    )


def cand(fid, vram=None, *, address=True, sync=True, host=None, ram_gib=16.0, speed=None):
    return Candidate(
        fellow_id=fid,
        hostname=host or fid,
        data_address=f"tcp://{fid}:1" if address else None,
        sync_address=f"tcp://{fid}:2" if sync else None,
        cpu_cores=8,
        ram_available_bytes=int(ram_gib * GIB),
        gpus=(gpu(vram),) if vram is not None else (),
        compute_speed=speed,
    )


def spec(**kw) -> JobSpec:
    return JobSpec(model=ModelConfig(n_layers=kw.pop("layers", 8)), **kw)


def fleet(n: int, **kw) -> list[Candidate]:
    """``n`` GPU fellows, f0 with the most VRAM."""
    return [cand(f"f{i}", 80 - i, **kw) for i in range(n)]


def grid(placement: Placement) -> list[list[str]]:
    """Each replica's fellows in stage order."""
    return [[s.fellow_id for s in placement.pipeline(r)] for r in range(placement.n_replicas)]


# --- the spec -------------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [2, "auto"])
def test_replicas_refuse_the_overlap_schedule_naming_both_fields(replicas):
    problems = spec(replicas=replicas, schedule="overlap").problems()
    assert len(problems) == 1
    assert "schedule" in problems[0] and "replicas" in problems[0]
    assert spec(replicas=1, schedule="overlap").problems() == []


@pytest.mark.parametrize(
    "body",
    [
        {"replicas": "auto"},
        {"replicas": 3, "stages": 2, "sync": "diloco", "sync_every": 5},
        {"replicas": 2, "sync_compression": "fixed_int8", "sync_clip_ratio": 2.5},
    ],
)
def test_replicas_that_can_run_decode(body):
    decoded = decode_job_spec(msgspec.json.encode(body))
    assert decoded.replicas == body["replicas"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"replicas": 0}, "replicas"),
        ({"replicas": "many"}, "replicas"),
        ({"replicas": 2, "sync": "gossip"}, "sync"),
        ({"sync_every": 0}, "sync_every"),
        ({"sync_clip_ratio": 1.0}, "sync_clip_ratio"),
        ({"sync_timeout_s": 0}, "sync_timeout_s"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
    ],
)
def test_a_bad_replica_field_is_named(body, field):
    with pytest.raises(FieldError) as err:
        decode_job_spec(msgspec.json.encode(body))
    assert err.value.field == field


def test_more_fellows_than_any_job_may_take_is_refused():
    body = {"replicas": 3, "stages": 500, "model": {"n_layers": 512}}
    with pytest.raises(JobSpecError, match=r"replicas \(3\) x stages \(500\)"):
        decode_job_spec(msgspec.json.encode(body))


# --- the shape of a placement ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "ranked", "max_stages", "expected"),
    [
        # Without replicas: as before (every fellow, one per layer, at most max_stages).
        (dict(), 5, None, (1, 5, 5)),
        (dict(layers=3), 5, None, (1, 3, 3)),
        (dict(), 5, 2, (1, 2, 2)),
        (dict(stages=3), 1, None, (1, 3, 3)),
        # k pipelines of the spec's stages, or of as many as k pipelines allow.
        (dict(replicas=2, stages=2), 9, None, (2, 2, 4)),
        (dict(replicas=2), 5, None, (2, 2, 4)),
        (dict(replicas=2, layers=1), 6, None, (2, 1, 2)),
        (dict(replicas=2), 8, 3, (2, 1, 2)),
        (dict(replicas=3), 2, None, (3, 1, 3)),  # too few: needs one each at least
        (dict(replicas=2, min_fellows=3), 5, None, (2, 3, 6)),
        # "auto": as many pipelines of stages (or min_fellows) as fit, at least one.
        (dict(replicas="auto"), 3, None, (3, 1, 3)),
        (dict(replicas="auto", stages=2), 5, None, (2, 2, 4)),
        (dict(replicas="auto", stages=2), 1, None, (1, 2, 2)),
        (dict(replicas="auto", min_fellows=2), 7, None, (3, 2, 6)),
        (dict(replicas="auto"), 5, 3, (3, 1, 3)),
        (dict(replicas="auto"), 0, None, (1, 1, 1)),
    ],
)
def test_the_shape_of_a_placement(kw, ranked, max_stages, expected):
    assert shape(spec(**kw), ranked, max_stages=max_stages) == expected


def test_a_resumed_job_keeps_its_stages_and_its_replicas():
    ranges = [(0, 3), (3, 8)]
    assert shape(spec(replicas=2), 9, ranges=ranges) == (2, 2, 4)
    assert shape(spec(replicas="auto"), 7, ranges=ranges) == (3, 2, 6)
    assert fellows_needed(spec(replicas=3, stages=2)) == 6
    assert fellows_needed(spec(replicas=3), ranges) == 6
    assert fellows_needed(spec(replicas="auto", stages=2)) == 2
    assert fellows_needed(spec(min_fellows=2)) == 2


# --- placement ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "n", "expected"),
    [
        # Dealt out like cards (f0 the best), the best of each replica on its last stage.
        (dict(replicas=2, stages=2), 4, [["f2", "f0"], ["f3", "f1"]]),
        (
            dict(replicas=2, stages=2, pipeline_last_stage_placement="preserve"),
            4,
            [["f0", "f2"], ["f1", "f3"]],
        ),
        (dict(replicas=3, stages=1), 5, [["f0"], ["f1"], ["f2"]]),
        (dict(replicas=2), 5, [["f2", "f0"], ["f3", "f1"]]),
        (dict(replicas="auto"), 3, [["f0"], ["f1"], ["f2"]]),
        (dict(replicas="auto", stages=2), 5, [["f2", "f0"], ["f3", "f1"]]),
        (dict(replicas="auto", stages=2), 3, [["f1", "f0"]]),
        (dict(replicas=1, stages=2), 4, [["f1", "f0"]]),
    ],
)
def test_replicas_are_placed_on_distinct_fellows(kw, n, expected):
    placement = place(spec(**kw), fleet(n))
    assert isinstance(placement, Placement), placement
    assert grid(placement) == expected
    # Ordered by (replica, stage); one split for every replica.
    keys = [(s.replica, s.stage) for s in placement.stages]
    assert keys == sorted(keys)
    assert len(set(placement.fellow_ids)) == len(placement.fellow_ids)
    splits = {
        tuple((s.layer_start, s.layer_end) for s in placement.pipeline(r))
        for r in range(placement.n_replicas)
    }
    assert len(splits) == 1
    assert placement.n_stages == len(expected[0])


def test_placed_stages_carry_their_replica_and_sync_address():
    placement = place(spec(replicas=2, stages=1), fleet(2))
    assert isinstance(placement, Placement)
    assert [(s.replica, s.sync_address) for s in placement.stages] == [
        (0, "tcp://f0:2"),
        (1, "tcp://f1:2"),
    ]
    # Without replicas nothing changes: no replica, no sync address.
    single = place(spec(stages=2), fleet(2))
    assert isinstance(single, Placement)
    assert {(s.replica, s.sync_address) for s in single.stages} == {(0, None)}


@pytest.mark.parametrize(
    ("kw", "n", "max_stages", "reason"),
    [
        (
            dict(replicas=2, stages=2),
            3,
            None,
            "waiting for 4 ready fellows (2 replicas of 2 stages); 3 available",
        ),
        (dict(replicas=3), 2, None, "waiting for 3 ready fellows (3 replicas of 1 stages)"),
        (dict(replicas="auto", stages=2), 1, None, "waiting for 2 ready fellows; 1 available"),
        (dict(replicas=2, stages=2), 5, 3, "2 replicas of 2 stages need 4 fellows"),
    ],
)
def test_too_few_fellows_for_the_replicas_is_said(kw, n, max_stages, reason):
    result = place(spec(**kw), fleet(n), max_stages=max_stages)
    assert isinstance(result, Unplaceable)
    assert reason in result.reason


def test_the_account_limit_caps_the_fellows_of_all_replicas():
    placement = place(spec(replicas="auto"), fleet(6), max_stages=4)
    assert isinstance(placement, Placement)
    assert len(placement.stages) == 4
    placement = place(spec(replicas=2), fleet(8), max_stages=5)
    assert isinstance(placement, Placement)
    assert grid(placement) == [["f2", "f0"], ["f3", "f1"]]


def test_p2p_replicas_need_every_sync_address_and_auto_falls_back_per_link():
    fellows = [*fleet(3), cand("f9", 1, sync=False)]
    result = place(spec(replicas=2, stages=2, transport="p2p"), fellows)
    assert isinstance(result, Unplaceable)
    assert "SWARM_SYNC_ADDRESS" in result.reason and "f9" in result.reason
    auto = place(spec(replicas=2, stages=2, transport="auto"), fellows)
    assert isinstance(auto, Placement)
    assert auto.transport == Transport.AUTO
    assert auto.stage_of("f9").sync_address is None
    # Without replicas a sync address is not needed.
    single = place(spec(stages=2, transport="p2p"), [cand("a", 9, sync=False), cand("b", 8)])
    assert isinstance(single, Placement)


def test_a_missing_data_address_in_any_replica_is_as_without_replicas():
    fellows = [*fleet(3), cand("f9", 1, address=False)]  # f9: replica 1's stage 0
    result = place(spec(replicas=2, stages=2, transport="p2p"), fellows)
    assert isinstance(result, Placement)  # stage 0 binds nothing
    fellows = [cand("f9", 90, address=False), *fleet(3)]  # f9: replica 0's last stage
    result = place(spec(replicas=2, stages=2, transport="p2p"), fellows)
    assert isinstance(result, Unplaceable) and "SWARM_DATA_ADDRESS" in result.reason
    tunnel = place(spec(replicas=2, stages=2, transport="auto"), fellows)
    assert isinstance(tunnel, Placement) and tunnel.transport == Transport.TUNNEL


def test_every_replica_must_fit_the_split_in_memory():
    big = ModelConfig(n_layers=4, d_model=2048, n_heads=16, vocab_size=32000, seq_len=512)
    fellows = [cand("a", 40), cand("b", 40), cand("c", 40), cand("tiny", 4.5)]
    job = JobSpec(model=big, replicas=2, stages=2, batch_size=32, micro_batches=1)
    result = place(job, fellows)
    assert isinstance(result, Unplaceable)
    assert "replica 1 (tiny)" in result.reason
    ok = place(job, [*fellows[:3], cand("d", 40)])
    assert isinstance(ok, Placement)


def splits_of(placement: Placement) -> list[list[tuple[int, int]]]:
    return [[(s.layer_start, s.layer_end) for s in placement.pipeline(r)] for r in range(2)]


def test_weighted_and_balanced_splits_go_by_each_replicas_own_fellows():
    # Replica 0: [f2 (20 GiB), f0 (60)]; replica 1: [f3 (10), f1 (60)].
    fellows = [cand("f0", 60), cand("f1", 60), cand("f2", 20), cand("f3", 10)]
    weighted = place(spec(replicas=2, stages=2, partition="weighted", layers=14), fellows)
    assert isinstance(weighted, Placement)
    assert splits_of(weighted) == [
        weighted_ranges(14, [20 * GIB, 60 * GIB]),
        weighted_ranges(14, [10 * GIB, 60 * GIB]),
    ]
    assert splits_of(weighted)[0] != splits_of(weighted)[1]
    fast = [
        cand("a", ram_gib=16, speed=1.0),
        cand("b", ram_gib=15, speed=1.0),
        cand("c", ram_gib=14, speed=1.0),
        cand("d", ram_gib=13, speed=3.0),
    ]
    # Replica 0: [c, a] (equal speeds: equal layers); replica 1: [d, b]: d is 3x as fast.
    balanced = place(
        spec(replicas=2, stages=2, partition="balanced", micro_batches=1, layers=8), fast
    )
    assert isinstance(balanced, Placement)
    zero, one = splits_of(balanced)
    assert zero == [(0, 4), (4, 8)]
    assert one[0][1] > 4, "the fast fellow's stage takes more layers"


@pytest.mark.parametrize(
    ("kw", "ports", "ranges"),
    [
        ({"transport": "p2p"}, "7000", None),  # one port: each stage would be in two rings
        ({"compression": "learned_dim32_int8"}, "7000-7003", None),  # boundary projections
        ({}, "7000-7003", [(0, 5), (5, 14)]),  # a resumed job's fixed ranges
    ],
)
def test_one_split_for_every_replica_where_rings_per_segment_cannot_be(kw, ports, ranges):
    fellows = [
        msgspec.structs.replace(cand(f, v), sync_address=f"tcp://{f}:{ports}")
        for f, v in (("f0", 60), ("f1", 60), ("f2", 20), ("f3", 10))
    ]
    job = spec(replicas=2, stages=2, partition="weighted", layers=14, **kw)
    placement = place(job, fellows, ranges=ranges)
    assert isinstance(placement, Placement), placement
    zero, one = splits_of(placement)
    assert zero == one
    # Over each position's weakest fellow, or as the resumed job had them.
    assert zero == (ranges or weighted_ranges(14, [10 * GIB, 60 * GIB]))


def test_p2p_splits_each_replica_when_its_fellows_have_the_ports():
    fellows = [
        msgspec.structs.replace(cand(f, v), sync_address=f"tcp://{f}:7000-7001")
        for f, v in (("f0", 60), ("f1", 60), ("f2", 20), ("f3", 10))
    ]
    job = spec(replicas=2, stages=2, partition="weighted", layers=14, transport="p2p")
    placement = place(job, fellows)
    assert isinstance(placement, Placement), placement
    zero, one = splits_of(placement)
    assert zero != one
    plans = stage_plans(
        job_id="j1", attempt=1, spec=job, placement=placement, subject_prefix="swarm"
    )
    for plan in plans:
        assert plan.problems() == [], plan.problems()
        assert len(plan.sync_ports) == 2
        assert [r.port for r in plan.sync_rings] == list(range(len(plan.sync_rings)))


def test_a_resumed_replicated_job_keeps_its_ranges():
    ranges = [(0, 5), (5, 8)]
    placement = place(spec(replicas=2), fleet(5), ranges=ranges)
    assert isinstance(placement, Placement)
    for r in range(2):
        assert [(s.layer_start, s.layer_end) for s in placement.pipeline(r)] == ranges


def test_stages_sharing_a_host_share_its_cores_across_replicas():
    fellows = [
        msgspec.structs.replace(cand(f"f{i}", 80 - i, host="box"), data_address=f"tcp://box:{i}")
        for i in range(4)
    ]
    placement = place(spec(replicas=2, stages=2), fellows)
    assert isinstance(placement, Placement)
    assert {s.intra_op_threads for s in placement.stages} == {2}


# --- stage plans ----------------------------------------------------------------------------


def plans_of(k: int, p: int, transport: str = "auto", **kw) -> list[StagePlan]:
    job = spec(replicas=k, stages=p, transport=transport, **kw)
    placement = place(job, fleet(k * p))
    assert isinstance(placement, Placement), placement
    plans = stage_plans(
        job_id="j1", attempt=3, spec=job, placement=placement, subject_prefix="swarm"
    )
    # Each fellow fills in its own NATS URL (the tunnel's relay needs one).
    return [msgspec.structs.replace(p, nats=NatsAccess(url="nats://x:4222")) for p in plans]


def by_position(plans: list[StagePlan]) -> dict[tuple[int, int], StagePlan]:
    return {(p.replica, p.stage): p for p in plans}


@pytest.mark.parametrize(
    ("k", "p", "transport"),
    [(2, 2, "auto"), (2, 2, "p2p"), (2, 2, "tunnel"), (3, 1, "auto"), (3, 2, "p2p")],
)
def test_replica_plans_are_valid_and_their_rings_consistent(k, p, transport):
    plans = plans_of(k, p, transport, shard_push_to_leader=True, shard_push_interval_steps=5)
    assert len(plans) == k * p
    at = by_position(plans)
    for plan in plans:
        assert plan.problems() == [], plan.problems()
        assert plan.n_replicas == k and plan.replicated
    curve, relay = transport != "tunnel", transport != "p2p"
    for (r, i), plan in at.items():
        nxt, prev = at[((r + 1) % k, i)], at[((r - 1) % k, i)]
        # One split for all: one ring per stage, of its layers, at its one port.
        (ring,), (ring_next,) = plan.sync_rings, nxt.sync_rings
        assert (ring.layer_start, ring.layer_end) == (plan.layer_start, plan.layer_end)
        assert ring.next.fellow_id == nxt.fellow_id
        assert ring.next.data_address == f"tcp://{nxt.fellow_id}:2"
        assert ring.prev.fellow_id == prev.fellow_id
        assert plan.sync_ports == [f"tcp://{plan.fellow_id}:2"] and ring.port == 0
        # The link r -> r + 1: r connects with the keys nxt trusts, both tag with one token.
        if curve:
            assert ring.curve_down.peer_public == ring_next.curve_up.public
            assert ring_next.curve_up.peer_public == ring.curve_down.public
        else:
            assert ring.curve_down is None and ring.curve_up is None
        if relay:
            assert ring.relay_down_token == ring_next.relay_up_token is not None
        else:
            assert ring.relay_down_token is None and ring.relay_up_token is None
        # Its own pipeline's neighbours.
        if i + 1 < p:
            down = at[(r, i + 1)]
            assert plan.next.fellow_id == down.fellow_id
            assert plan.relay_down_token == down.relay_up_token
            if curve:
                assert plan.curve_down.peer_public == down.curve_up.public
        # Only replica 0 checkpoints for the leader.
        assert (plan.checkpoint_every, plan.checkpoint_at_end) == (
            (5, True) if r == 0 else (0, False)
        )
    # Every link has its own secrets: k * (p - 1) boundaries and k * p ring links.
    if relay:
        tokens = {
            t
            for plan in plans
            for t in (plan.relay_down_token, plan.sync_rings[0].relay_down_token)
        }
        assert len(tokens - {None}) == k * (p - 1) + k * p
    if curve:
        keys = {plan.sync_rings[0].curve_down.public for plan in plans}
        keys |= {plan.curve_down.public for plan in plans if plan.curve_down}
        assert len(keys) == k * (p - 1) + k * p


def test_two_replicas_have_two_ring_links_between_the_same_pair():
    at = by_position(plans_of(2, 1))
    (a,), (b,) = at[(0, 0)].sync_rings, at[(1, 0)].sync_rings
    assert a.next.fellow_id == a.prev.fellow_id == at[(1, 0)].fellow_id
    assert a.relay_down_token == b.relay_up_token
    assert b.relay_down_token == a.relay_up_token
    assert a.relay_down_token != a.relay_up_token


def test_plans_without_replicas_are_as_before():
    plans = plans_of(1, 3, shard_push_to_leader=True, shard_push_interval_steps=5)
    for plan in plans:
        assert plan.problems() == []
        assert (plan.replica, plan.n_replicas, plan.replicated) == (0, 1, False)
        assert plan.sync_ports == [] and plan.sync_rings == []
        assert (plan.checkpoint_every, plan.checkpoint_at_end) == (5, True)
    for up, down in itertools.pairwise(plans):
        assert up.relay_down_token == down.relay_up_token
        assert up.curve_down.peer_public == down.curve_up.public


# --- scheduling -----------------------------------------------------------------------------


def test_an_accounts_fellow_limit_counts_every_replica():
    manager = JobManager(wall=Clock())
    job = manager.submit(spec(replicas=2, stages=2))
    job.owner = "alice"
    limited = {"alice": account(max_fellows=3)}
    assignments, waiting = plan_schedule(manager.pending(), fleet(6), account_of=limited.get)
    assert assignments == []
    assert "its limit is 3 (max_fellows) and the job needs 4" in waiting[job.job_id]
    limited = {"alice": account(max_fellows=5)}
    assignments, _ = plan_schedule(manager.pending(), fleet(6), account_of=limited.get)
    assert len(assignments[0].placement.stages) == 4
    # "auto" takes as many pipelines as the limit leaves room for.
    auto = JobManager(wall=Clock())
    auto.submit(spec(replicas="auto")).owner = "alice"
    assignments, _ = plan_schedule(auto.pending(), fleet(6), account_of=limited.get)
    assert assignments[0].placement.n_replicas == 5


def account(**limit: int) -> Account:
    return Account(
        name="alice",
        role=Role.SUBMITTER,
        token_sha256="0" * 64,
        created_at=0.0,
        pool_limits={DEFAULT_POOL: PoolLimit(**limit)},
    )
