"""Fellows for a fixed split (issue 23, item 3): a resumed job's stages and a replacement
replica's are chosen and ordered by their measured speeds, links and the rings they join
(``leader/refill.py``), not dealt by memory. Table-driven where the logic is pure."""

from __future__ import annotations

import itertools
import math

import msgspec
import pytest

from silentswarm.jobspec import JobSpec, LastStagePlacement, Partition, PlacedStage, Placement
from silentswarm.leader import elastic
from silentswarm.leader.balance import MAX_CHAINS, split_seconds
from silentswarm.leader.jobs import JobManager
from silentswarm.leader.memory import CPU_RUNTIME_BYTES
from silentswarm.leader.placement import _stage_memory, place
from silentswarm.leader.refill import (
    MAX_POOL,
    JoinedRings,
    chain_seconds,
    joined_rings,
    orders_tried,
    pool_size,
    refill,
)
from silentswarm.plan import ModelConfig, Transport
from silentswarm.protocol import GpuInfo, JobState
from silentswarm.types.jobs import JobRecord
from silentswarm.types.links import MeasuredLink
from tests.fakes import Clock
from tests.fakes import cpu_candidate as cpu

GIB = 1 << 30
MODEL = ModelConfig(n_layers=8)
LAN, WAN = MeasuredLink(mbit_s=1000.0, rtt_ms=1.0), MeasuredLink(mbit_s=10.0, rtt_ms=50.0)


def sites(*groups: str) -> dict[tuple[str, str], MeasuredLink]:
    """Every pair of these fellows (one letter each): LAN within a site, WAN across."""
    site = {f: at for at, names in enumerate(groups) for f in names}
    return {
        (a, b): LAN if site[a] == site[b] else WAN
        for a, b in itertools.combinations(sorted(site), 2)
    }


def compute_cost(sizes: list[int], speeds: dict[str, float]):
    def cost(chain: list[str]) -> float:
        return chain_seconds(
            chain,
            model=MODEL,
            batch_size=8,
            micro_batches=4,
            sizes=sizes,
            speeds=speeds,
            links=None,
            bits_per_step=0.0,
        )

    return cost


# --- the pure search -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "keep_last", "expected"),
    [
        # c is 4x as fast as b: the 6-layer middle stage goes to c; a (best ranked) runs last.
        ([1, 6, 1], True, ["b", "c", "a"]),
        # The head's stage is large: the fastest takes it once the last stage is free to move.
        # (a and b tie on the first two: rank order; the head's stage wants the faster.)
        ([1, 1, 6], False, ["a", "b", "c"]),
        ([6, 1, 1], False, ["c", "b", "a"]),
    ],
)
def test_refill_gives_the_largest_ranges_to_the_fastest(sizes, keep_last, expected):
    speeds = {"a": 2.0, "b": 1.0, "c": 4.0}
    assert refill(list("abc"), 3, compute_cost(sizes, speeds), keep_last=keep_last) == expected


@pytest.mark.parametrize(
    ("keep_last", "expected"), [(True, ["b", "c", "a"]), (False, ["a", "b", "c"])]
)
def test_ties_keep_the_fellows_as_they_would_be_dealt(keep_last, expected):
    assert refill(list("abcde"), 3, lambda chain: 1.0, keep_last=keep_last) == expected


def test_nothing_that_fits_or_too_few_fellows_is_none():
    assert refill(list("abc"), 2, lambda chain: math.inf, keep_last=True) is None
    assert refill(list("ab"), 3, lambda chain: 1.0, keep_last=False) is None


@pytest.mark.parametrize(
    ("candidates", "n", "keep_last", "pool"),
    [
        (10, 3, False, 10),
        (20, 4, False, 8),
        (20, 4, True, 11),
        (3, 3, True, 3),
        (30, 9, True, 14),
        (3000, 1, False, MAX_POOL),
        (3000, 2, True, MAX_POOL),
        (40, 20, True, 20),
    ],
)
def test_the_pool_keeps_the_chains_within_the_budget(candidates, n, keep_last, pool):
    assert pool_size(candidates, n, keep_last=keep_last) == pool
    costed = []
    ranked = [f"f{i:02d}" for i in range(candidates)]
    refill(ranked, n, lambda chain: costed.append(chain) or 1.0, keep_last=keep_last)
    assert len(costed) <= MAX_CHAINS
    assert {f for chain in costed for f in chain} == set(ranked[:pool])


def test_past_the_budget_a_set_keeps_its_rank_order():
    assert orders_tried(7, keep_last=True) == 720 and orders_tried(8, keep_last=False) == 1
    ranked = [f"f{i}" for i in range(9)]
    assert refill(ranked, 9, lambda chain: 1.0, keep_last=True) == [*ranked[1:], ranked[0]]


def test_the_pool_is_the_fastest_by_pace():
    ranked = [f"f{i:02d}" for i in range(20)]
    pace = {f: float(at) for at, f in enumerate(ranked)}  # the worst ranked are the fastest
    chain = refill(ranked, 4, compute_cost([2, 2, 2, 2], pace), keep_last=True, pace=pace)
    assert set(chain) == {"f16", "f17", "f18", "f19"} and chain[-1] == "f16"


def test_chain_seconds_adds_compute_links_and_the_joined_rings():
    links = sites("ab", "xy")
    joined = JoinedRings(members=[["x"], ["y"]], at=0, bits=[1e7, 1e7], rounds=0.5, addresses={})
    rings = joined.seconds(["a", "b"], links)
    speeds = {"a": 1.0, "b": 2.0}
    kw = dict(model=MODEL, batch_size=8, micro_batches=4, sizes=[3, 5], bits_per_step=1e6)
    compute = split_seconds(MODEL, batch_size=8, sizes=[3, 5], speeds=[1.0, 2.0], micro_batches=4)
    assert chain_seconds(["a", "b"], speeds=speeds, links=None, **kw) == compute
    wire = 1e6 / 1e9 + 0.001  # one LAN boundary: its transfer and round trip
    ring = 1e7 / 1e7 + 0.05  # a ring of two over the WAN: one contribution, one round trip
    found = chain_seconds(["a", "b"], speeds=speeds, links=links, rings=rings, **kw)
    assert found == pytest.approx(compute + wire + 0.5 * ring)


# --- the rings a replacement joins -----------------------------------------------------------


def stage(replica: int, i: int, fellow: str, start: int, end: int) -> PlacedStage:
    return PlacedStage(
        stage=i, fellow_id=fellow, replica=replica, hostname=fellow, layer_start=start,
        layer_end=end,
    )  # fmt: skip


def test_joined_rings_pair_each_stage_with_who_holds_most_of_its_layers():
    """Replica 1 of three is lost; 0 (the lead) and 2 split the layers differently."""
    placement = Placement(
        stages=[
            stage(0, 0, "a0", 0, 2), stage(0, 1, "a1", 2, 8),
            stage(2, 0, "c0", 0, 6), stage(2, 1, "c1", 6, 8),
        ],
        transport=Transport.P2P,
        replica_slots=3,
    )  # fmt: skip
    rings = joined_rings(placement, 1, [5.0, 7.0], 0.25)
    assert rings.members == [["a0", "c0"], ["a1", "c0"]]  # c0 holds 4 of layers 2-8
    assert rings.at == 1 and rings.bits == [5.0, 7.0] and rings.rounds == 0.25
    assert rings.fellows == ["a0", "a1", "c0"]
    assert joined_rings(placement, 0, [5.0, 7.0], 1.0).at == 0


# --- placement on fixed ranges -----------------------------------------------------------------


def balanced(**kw) -> JobSpec:
    kw.setdefault("partition", Partition.BALANCED)
    kw.setdefault("stages", 3)
    kw.setdefault("model", MODEL)
    kw.setdefault("allow_cpu", True)
    return JobSpec(**kw)


def chain_of(placement) -> list[str]:
    assert isinstance(placement, Placement), placement
    return [s.fellow_id for s in placement.pipeline(0)]


RESUMED = [(0, 1), (1, 7), (7, 8)]  # the middle stage holds most layers


def test_a_resumed_job_puts_its_largest_range_on_its_fastest_fellow():
    """Dealt by memory, the third ranked (c, the slowest) would take the 6-layer stage."""
    fellows = [cpu("a", 16, 2.0), cpu("b", 15, 4.0), cpu("c", 14, 1.0)]
    assert chain_of(place(balanced(), fellows, ranges=RESUMED)) == ["c", "b", "a"]
    unmeasured = [cpu(c.fellow_id, 16 - at) for at, c in enumerate(fellows)]
    assert chain_of(place(balanced(), unmeasured, ranges=RESUMED)) == ["b", "c", "a"]
    equal = balanced(partition=Partition.EQUAL)
    assert chain_of(place(equal, fellows, ranges=RESUMED)) == ["b", "c", "a"]


def test_a_resumed_job_takes_the_fastest_set_and_keeps_off_a_slow_link():
    fellows = [cpu("a", 16, 1.0), cpu("b", 15, 1.0), cpu("c", 14, 1.0), cpu("d", 13, 1.0)]
    # Without links the best ranked three, dealt; with them, the order that stays on the
    # LAN (a runs last: the best ranked; d's WAN link to everyone keeps it out).
    assert chain_of(place(balanced(), fellows, ranges=RESUMED)) == ["b", "c", "a"]
    links = sites("abc", "d") | {("a", "c"): WAN}
    assert chain_of(place(balanced(), fellows, ranges=RESUMED, links=links)) == ["c", "b", "a"]
    faster = [*fellows[:3], cpu("d", 13, 8.0)]
    chosen = chain_of(place(balanced(), faster, ranges=RESUMED))
    assert chosen[1] == "d", "without links the fastest takes the large stage"


def test_a_stage_that_does_not_fit_its_fellow_is_never_chosen():
    spec = balanced(model=ModelConfig(n_layers=8, d_model=1024, n_heads=8))
    small = _stage_memory(spec, 1, 3, 1).total + CPU_RUNTIME_BYTES
    large = _stage_memory(spec, 1, 3, 6).total + CPU_RUNTIME_BYTES
    assert small < large
    room = (small + large) / 2 / GIB  # b holds a 1-layer stage, not the 6-layer one
    fellows = [cpu("a", 64, 2.0), cpu("b", room, 8.0), cpu("c", 32, 1.0)]
    placed = place(spec, fellows, ranges=RESUMED)
    assert chain_of(placed) == ["b", "c", "a"]
    assert all(s.memory_estimate_bytes <= s.memory_offered_bytes for s in placed.stages)


def gpu(free_gib: float) -> list[GpuInfo]:
    return [
        GpuInfo(
            index=0, uuid="GPU-1", name="H100", memory_total_bytes=80 * GIB,
            memory_free_bytes=int(free_gib * GIB), memory_used_bytes=10 * GIB,
        )
    ]  # fmt: skip


def test_gpu_fellows_are_ordered_by_their_links_alone():
    fellows = [cpu(f, 16, 1.0, gpus=gpu(70)) for f in "abc"]
    spec = balanced(allow_cpu=False)
    assert chain_of(place(spec, fellows, ranges=RESUMED)) == ["b", "c", "a"]
    links = sites("ab", "c") | {("b", "c"): LAN}  # c reaches b alone
    assert chain_of(place(spec, fellows, ranges=RESUMED, links=links)) == ["c", "b", "a"]


def test_links_never_trade_the_speed_ranking_s_gpu_fellows_away():
    """Where a GPU's compute cannot be weighed, links only reorder the fellows the speed
    ranking takes: not CPU fellows on a LAN for GPUs far apart, nor a slow GPU for the
    fastest one (d, 100x as fast, fourth by free VRAM)."""
    gpus = [cpu(f, 16, 1.0, gpus=gpu(70 - at)) for at, f in enumerate("abc")]
    cpus = [cpu(f, 16, 50.0) for f in "defgh"]
    links = sites("a", "b", "c", "defgh")
    placed = place(balanced(), gpus + cpus, ranges=RESUMED, links=links)
    assert set(chain_of(placed)) == {"a", "b", "c"}
    fast = [*gpus, cpu("d", 16, 100.0, gpus=gpu(60))]
    placed = place(balanced(), fast, ranges=RESUMED, links=sites("abcd"))
    assert "d" in chain_of(placed) and "c" not in chain_of(placed)


def test_a_relay_only_fellow_may_only_take_the_first_stage():
    """c is the fastest but has no data address: in the middle it would put the job on the
    relay; at stage 0 the job stays direct."""
    fellows = [cpu("a", 16, 1.0), cpu("b", 15, 1.0), cpu("c", 14, 8.0)]
    fellows[2] = msgspec.structs.replace(fellows[2], data_address=None)
    placed = place(balanced(transport="auto"), fellows, ranges=RESUMED)
    assert chain_of(placed) == ["c", "b", "a"] and placed.transport == Transport.AUTO
    tunnel = place(balanced(transport="tunnel"), fellows, ranges=RESUMED)
    assert chain_of(tunnel) == ["b", "c", "a"], "all relayed: the fastest takes the large stage"


def test_a_fellow_without_a_data_address_is_left_out_when_links_decide():
    fellows = [cpu("a", 16), cpu("b", 15), cpu("c", 14), cpu("d", 13)]
    fellows[2] = msgspec.structs.replace(fellows[2], data_address=None)
    links = sites("abd", "c")
    placed = place(balanced(transport="auto"), fellows, ranges=RESUMED, links=links)
    assert set(chain_of(placed)) == {"a", "b", "d"}
    assert placed.transport == Transport.AUTO, "dealt, c would have made it relay"


def test_preserve_lets_the_head_move_to_the_fastest():
    spec = balanced(pipeline_last_stage_placement=LastStagePlacement.PRESERVE)
    fellows = [cpu("a", 16, 1.0), cpu("b", 15, 4.0), cpu("c", 14, 1.0)]
    assert chain_of(place(spec, fellows, ranges=[(0, 1), (1, 2), (2, 8)]))[-1] == "b"


def test_a_resumed_job_with_replicas_orders_each_replica_on_its_fixed_split():
    """Two replicas resumed on a 1-6-1 split, everyone on one LAN: each replica's 6-layer
    stage on a fast fellow, c or d (dealt, e and f, the slow ones, would take them)."""
    fellows = [
        cpu("a", 16, 1.0), cpu("b", 15, 1.0), cpu("c", 14, 8.0),
        cpu("d", 13, 8.0), cpu("e", 12, 1.0), cpu("f", 11, 1.0),
    ]  # fmt: skip
    links = sites("abcdef")
    spec = balanced(replicas=2, sync="diloco")
    placed = place(spec, fellows, ranges=RESUMED, links=links)
    assert isinstance(placed, Placement), placed
    middles = {placed.pipeline(r)[1].fellow_id for r in (0, 1)}
    assert middles == {"c", "d"}
    assert all(placed.split(r) == RESUMED for r in (0, 1))


# --- a replacement replica ---------------------------------------------------------------------


def running_on_site(sync: str, **kw) -> tuple[JobManager, JobRecord]:
    """A RUNNING balanced job of 2 replicas x 2 stages on a, b, c, d; replica 1 lost."""
    jobs = JobManager(wall=Clock())
    spec = balanced(stages=2, replicas=2, sync=sync, steps=1000, transport="p2p", **kw)
    job = jobs.submit(spec)
    placement = place(spec, [cpu(f, 32 - at) for at, f in enumerate("abcd")])
    assert isinstance(placement, Placement), placement
    jobs.begin_start(job.job_id, placement)
    jobs.start_succeeded(job.job_id)
    assert job.state is JobState.RUNNING
    jobs.lose_stage(job.job_id, placement.pipeline(1)[0].fellow_id, "went offline")
    return jobs, job


def test_a_replacement_without_links_or_speeds_is_dealt_by_memory():
    _, job = running_on_site("allreduce")
    idle = [cpu("v", 64), cpu("w", 63), cpu("x", 8), cpu("y", 7)]
    stages = elastic.replacement(job, idle)
    assert [s.fellow_id for s in stages] == ["w", "v"]  # the best ranked runs the last stage
    assert [(s.layer_start, s.layer_end) for s in stages] == job.placement.split(0)
    assert {s.replica for s in stages} == {1}


@pytest.mark.parametrize(
    ("sync", "chosen"),
    [
        # A stage's gradients every step: each ring on one site, the pipeline across.
        ("allreduce", ["x", "w"]),
        # Its pseudo-gradients every 50 steps: the pipeline's boundary on one site.
        ("diloco", ["v", "u"]),
    ],
)
def test_a_replacement_weighs_its_rings_against_its_own_pipeline(sync, chosen):
    """The survivors' two stages sit on sites 1 and 2; x is on site 1, w on site 2, u and v
    together on site 3 (dealt by memory: u and w, u running the last stage)."""
    _, job = running_on_site(sync, sync_every=50) if sync == "diloco" else running_on_site(sync)
    first, second = (s.fellow_id for s in job.placement.pipeline(0))
    idle = [cpu("u", 64), cpu("w", 63), cpu("v", 8), cpu("x", 7)]
    assert [s.fellow_id for s in elastic.replacement(job, idle)] == ["w", "u"]
    links = sites(first + "x", second + "w", "uv")
    assert [s.fellow_id for s in elastic.replacement(job, idle, links=links)] == chosen


def test_a_large_swarm_is_weighed_among_its_fastest_few():
    """3000 ready fellows: the chains are costed, and links guessed, among the fastest few."""
    fellows = [cpu(f"f{i:04d}", 16, 1.0 + (i * 37 % 3000) / 1000) for i in range(3000)]
    links = {(fellows[0].fellow_id, fellows[1].fellow_id): LAN}
    placed = place(balanced(), fellows, ranges=RESUMED, links=links)
    speeds = sorted((c.compute_speed for c in fellows), reverse=True)
    chosen = {c.fellow_id: c.compute_speed for c in fellows if c.fellow_id in chain_of(placed)}
    assert min(chosen.values()) >= speeds[pool_size(3000, 3, keep_last=True) - 1]
    assert max(chosen, key=chosen.get) == placed.pipeline(0)[1].fellow_id, "the large stage"


def test_a_replacement_beside_the_survivors_machines_counts_their_loopback():
    """No link to the survivors was measured, but x and w share their machines (data
    addresses): their rings run over loopback, u's and v's over a network guessed from
    the one link measured (u-v)."""
    _, job = running_on_site("allreduce")
    first, second = job.placement.pipeline(0)
    idle = [
        cpu("u", 64), cpu("v", 63),
        msgspec.structs.replace(cpu("w", 8), data_address=second.data_address[:-1] + "9"),
        msgspec.structs.replace(cpu("x", 7), data_address=first.data_address[:-1] + "9"),
    ]  # fmt: skip
    links = {("u", "v"): MeasuredLink(mbit_s=100.0, rtt_ms=1.0)}
    assert [s.fellow_id for s in elastic.replacement(job, idle)] == ["v", "u"]
    assert [s.fellow_id for s in elastic.replacement(job, idle, links=links)] == ["x", "w"]
