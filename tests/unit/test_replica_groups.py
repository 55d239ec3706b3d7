"""Which fellows form each replica when links were measured (issue 23, item 3): the pure
grouping of ``leader/replica_groups.py`` and what placement makes of it. Table-driven."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import msgspec
import numpy as np
import pytest

from silentswarm.jobspec import JobSpec, Partition
from silentswarm.leader.balance import chain_order
from silentswarm.leader.memory import block_params, embedding_params, head_params
from silentswarm.leader.placement import Unplaceable, place
from silentswarm.leader.replica_groups import (
    MAX_GROUPINGS,
    MAX_WORK,
    clustered,
    dealt,
    grouping_count,
    groupings,
    replica_groups,
    ring_seconds,
    rounds_per_step,
    sync_bits,
)
from silentswarm.plan import ModelConfig
from silentswarm.types.links import MeasuredLink
from tests.fakes import cpu_candidate as cpu

GIB = 1 << 30
MBIT = 1e6


def hop(mbit_s: float, rtt_ms: float = 0.0) -> MeasuredLink:
    return MeasuredLink(mbit_s=mbit_s, rtt_ms=rtt_ms)


LAN, WAN = hop(1000.0, 1.0), hop(10.0, 50.0)


def sites(*groups: Iterable[str]) -> dict[tuple[str, str], MeasuredLink]:
    """Every pair of fellows: LAN within a site (its fellows' names), WAN across."""
    site = {f: at for at, names in enumerate(groups) for f in names}
    return {
        (a, b): LAN if site[a] == site[b] else WAN
        for a, b in itertools.combinations(sorted(site), 2)
    }


def as_given(group: list[str]) -> list[str]:
    return group


def canonical(grouping) -> frozenset[frozenset[str]]:
    return frozenset(frozenset(g) for g in grouping)


# --- enumeration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "k", "count"),
    [(4, 2, 3), (6, 2, 10), (6, 3, 15), (8, 4, 105), (9, 3, 280), (3, 3, 1), (4, 1, 1)],
)
def test_every_grouping_once(n, k, count):
    ids = [f"f{i}" for i in range(n)]
    found = [canonical(g) for g in groupings(ids, k)]
    assert grouping_count(n, k) == count == len(found) == len(set(found))
    for grouping in found:
        assert len(grouping) == k and all(len(g) == n // k for g in grouping)
        assert set().union(*grouping) == set(ids)


def test_dealt_like_cards():
    assert dealt(list("abcdef"), 2) == [["a", "c", "e"], ["b", "d", "f"]]
    assert dealt(list("abcdef"), 3) == [["a", "d"], ["b", "e"], ["c", "f"]]


# --- the costs ---------------------------------------------------------------------------

# (members in ring order, links, bits, seconds)
RINGS = {
    "one member: no ring": (["a"], {}, 8 * MBIT, 0.0),
    "nothing to send": (["a", "b"], {("a", "b"): WAN}, 0.0, 0.0),
    "two members: one contribution over their link": (
        ["a", "b"],
        {("a", "b"): WAN},
        10 * MBIT,
        1.0 + 0.05,
    ),
    "three: two contributions at the slowest link's pace": (
        ["a", "b", "c"],
        {("a", "b"): LAN, ("b", "c"): LAN, ("a", "c"): WAN},
        10 * MBIT,
        2 * (1.0 + 0.05),
    ),
}


@pytest.mark.parametrize("case", list(RINGS))
def test_ring_seconds(case):
    members, links, bits, want = RINGS[case]
    assert ring_seconds(members, links, bits=bits) == pytest.approx(want)


def test_a_ring_link_never_measured_nor_guessed_is_an_error():
    with pytest.raises(KeyError, match="a and b"):
        ring_seconds(["a", "b"], {}, bits=1.0)


def test_sync_bits_count_every_parameter_once_in_the_sync_codec():
    model = ModelConfig(n_layers=5, d_model=64, n_heads=2, vocab_size=300, seq_len=32)
    full = JobSpec(model=model, replicas=2)
    params = (
        5 * block_params(model)
        + (300 + 32) * 64  # token and position embeddings
        + 64 * 300
        + 2 * 64  # head and its norm
    )
    for stages in (1, 2, 3, 5):
        assert sum(sync_bits(full, stages)) == params * 32
    first, last = sync_bits(full, 2)
    assert first == (3 * block_params(model) + 332 * 64) * 32  # split_layers: 3 then 2
    half = JobSpec(model=model, replicas=2, sync_compression="fp16")
    assert sync_bits(half, 2) == [first / 2, last / 2]
    assert rounds_per_step(full) == 1.0
    assert rounds_per_step(JobSpec(model=model, replicas=2, sync="diloco", sync_every=25)) == 0.04


# --- the grouping --------------------------------------------------------------------------

BOUNDARY = 2 * MBIT  # a step's activations over one boundary
WEIGHTS = 25 * MBIT  # a stage's contribution to its ring round

# (ranked fellows, replicas, links, rounds a step, speeds or None, the expected grouping)
GROUPINGS = {
    "allreduce across two sites: pipelines cross, every step's rings stay home": (
        "abcd",
        2,
        sites("ab", "cd"),
        1.0,
        None,
        [["a", "c"], ["b", "d"]],
    ),
    "diloco across two sites: each pipeline at home, the rare syncs cross": (
        "abcd",
        2,
        sites("ab", "cd"),
        1 / 20,
        None,
        [["a", "b"], ["c", "d"]],
    ),
    "diloco, sites interleaved in the ranking": (
        "acbd",
        2,
        sites("ab", "cd"),
        1 / 20,
        None,
        [["a", "b"], ["c", "d"]],
    ),
    "one site: dealt": ("abcd", 2, sites("abcd"), 1 / 20, None, [["a", "c"], ["b", "d"]]),
    "three sites of two, three replicas": (
        "abcdef",
        3,
        sites("ad", "be", "cf"),
        1 / 20,
        None,
        [["a", "d"], ["b", "e"], ["c", "f"]],
    ),
    "two sites of three, three stages each": (
        "aybxcz",
        2,
        sites("abc", "xyz"),
        1 / 20,
        None,
        [["a", "b", "c"], ["y", "x", "z"]],
    ),
    "a site of slow fellows: compute beats the links, the fast ones split up": (
        "abcd",
        2,
        sites("ab", "cd"),
        1 / 20,
        {"a": 40.0, "b": 40.0, "c": 1.0, "d": 1.0},
        [["a", "c"], ["b", "d"]],
    ),
}


def grouping_of(case: str):
    taken, k, links, rounds, speeds, _ = GROUPINGS[case]

    def compute(chain: list[str]) -> float:  # 8 layers, balanced
        return 8 / sum(speeds[f] for f in chain)

    return replica_groups(
        list(taken),
        k,
        links,
        order=as_given,
        bits_per_step=BOUNDARY,
        ring_bits=[WEIGHTS] * (len(taken) // k),
        rounds=rounds,
        compute=compute if speeds else None,
    )


@pytest.mark.parametrize("case", list(GROUPINGS))
def test_replica_groups(case):
    assert grouping_of(case) == GROUPINGS[case][-1]


def test_orders_come_from_the_caller_and_rings_pair_stage_positions():
    """``order`` puts each group in stage order (here: the chain_order of the links, the
    best ranked last); a ring joins the replicas' stages of one position."""
    links = sites("abc", "xyz") | {("a", "b"): WAN, ("x", "y"): WAN}

    def order(group: list[str]) -> list[str]:
        group = [*group[1:], group[0]]
        return chain_order(group, links, bits_per_step=BOUNDARY, last=group[-1])

    got = replica_groups(
        list("axbycz"),
        2,
        links,
        order=order,
        bits_per_step=BOUNDARY,
        ring_bits=[1.0] * 3,
        rounds=1 / 20,
    )
    assert got == [["b", "c", "a"], ["y", "z", "x"]]  # a-b and x-y (now slow) at no boundary


def test_a_grouping_must_beat_the_dealt_one_by_the_margin():
    """Two sites whose cross links are barely slower: the dealt grouping stays."""
    links = sites("ab", "cd") | {
        pair: hop(990.0, 1.0) for pair, link in sites("ab", "cd").items() if link == WAN
    }
    got = replica_groups(
        list("abcd"),
        2,
        links,
        order=as_given,
        bits_per_step=BOUNDARY,
        ring_bits=[1.0, 1.0],
        rounds=1 / 20,
    )
    assert got == dealt(list("abcd"), 2)


def test_clustered_groups_fellows_close_to_each_other():
    links = sites("adf", "bc", "e")
    assert clustered(list("abcdef"), 3, links) == [["a", "d"], ["b", "c"], ["e", "f"]]
    assert clustered(list("abcdef"), 2, links) == [["a", "d", "f"], ["b", "c", "e"]]


@pytest.mark.parametrize(("rounds", "spread"), [(1 / 100, False), (1.0, True)])
def test_a_large_swarm_by_swaps_keeps_rings_or_pipelines_at_home(rounds, spread):
    """Four sites of four fellows, four 4-stage replicas: 2.6 million groupings, far past
    the budget, searched by swaps. The dealt grouping spreads every replica over the four
    sites (each ring at home): with a sync every step it stays; with one every 100 steps
    (DiLoCo) each pipeline is at home."""
    names = [f"{site}{i}" for site in "pqrs" for i in range(4)]  # ranked p0 p1 ... s3
    assert grouping_count(16, 4) > MAX_GROUPINGS
    links = sites(*([n for n in names if n[0] == site] for site in "pqrs"))
    assert all({f[0] for f in chain} == set("pqrs") for chain in dealt(names, 4))
    got = replica_groups(
        names,
        4,
        links,
        order=as_given,
        bits_per_step=BOUNDARY,
        ring_bits=[WEIGHTS] * 4,
        rounds=rounds,
    )
    at_home = sorted({f[0] for f in chain} for chain in got) == [{"p"}, {"q"}, {"r"}, {"s"}]
    assert got == dealt(names, 4) if spread else at_home


# --- placement -----------------------------------------------------------------------------


def replicas_job(**kw) -> JobSpec:
    kw.setdefault("partition", Partition.BALANCED)
    kw.setdefault("stages", 2)
    kw.setdefault("model", ModelConfig(n_layers=8))
    return JobSpec(allow_cpu=True, replicas=2, **kw)


def grid(placement) -> list[list[str]]:
    return [[s.fellow_id for s in placement.pipeline(r)] for r in range(placement.n_replicas)]


TWO_SITES = sites("ab", "cd")  # every pair measured
FOUR = [cpu("a", 16), cpu("b", 15), cpu("c", 14), cpu("d", 13)]  # ranked a b c d


def test_place_keeps_a_diloco_job_s_pipelines_at_home():
    """Two sites 10 Mbit/s and 50 ms apart: each DiLoCo replica's pipeline on one site (its
    syncs, every 20 steps, cross); the best ranked of each runs its last stage."""
    placed = place(replicas_job(sync="diloco"), FOUR, links=TWO_SITES)
    assert grid(placed) == [["b", "a"], ["d", "c"]]


def test_place_keeps_an_allreduce_job_s_rings_at_home():
    """The same fellows under allreduce: a stage's 27 Mbit of gradients a step would take
    2.7 s over the slow link, a boundary's 2 Mbit of activations 0.26 s: dealt, each ring on
    one site."""
    placed = place(replicas_job(), FOUR, links=TWO_SITES)
    assert grid(placed) == [["c", "a"], ["d", "b"]]


def test_place_groups_by_links_only_balanced_jobs_with_measured_links():
    dealt_grid = [["c", "a"], ["d", "b"]]
    equal = replicas_job(sync="diloco", partition=Partition.EQUAL)
    assert grid(place(equal, FOUR, links=TWO_SITES)) == dealt_grid
    assert grid(place(replicas_job(sync="diloco"), FOUR, links={})) == dealt_grid
    far = {("a", "x"): WAN}  # measured, but none among the four: nothing to go by
    assert grid(place(replicas_job(sync="diloco"), FOUR, links=far)) == dealt_grid


def test_place_weighs_measured_speeds_with_the_links():
    """a and b are 40 times as fast as c and d: a pipeline of c and d would set a DiLoCo
    job's pace, so each replica takes one fast fellow, whatever the links."""
    fellows = [cpu("a", 16, 40.0), cpu("b", 15, 40.0), cpu("c", 14, 1.0), cpu("d", 13, 1.0)]
    placed = place(replicas_job(sync="diloco"), fellows, links=TWO_SITES)
    assert sorted(map(sorted, grid(placed))) == [["a", "c"], ["b", "d"]]
    same_speed = [cpu(c.fellow_id, 16 - at, 1.0) for at, c in enumerate(fellows)]
    placed = place(replicas_job(sync="diloco"), same_speed, links=TWO_SITES)
    assert sorted(map(sorted, grid(placed))) == [["a", "b"], ["c", "d"]]


# --- what the review found ---------------------------------------------------------------

MODELS = {
    "gpt2": ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=97, seq_len=12),
    "gpt2, a wider MLP": ModelConfig(
        n_layers=2, d_model=32, n_heads=4, vocab_size=97, seq_len=12, intermediate_dim=80
    ),
    "llama, grouped-query": ModelConfig(
        family="llama",
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=97,
        seq_len=12,
        intermediate_dim=48,
    ),
}


@pytest.mark.parametrize("case", list(MODELS))
def test_parameter_counts_are_the_real_layers(case):
    """What placement counts (memory and a ring's bits) is what the stages build."""
    from silentswarm.agent.runtime import model as layers
    from silentswarm.leader.memory import adapter_block_params
    from silentswarm.plan import AdapterConfig

    m = MODELS[case]

    def count(layer) -> int:  # the layers make their weights when made
        return sum(int(np.prod(w.shape)) for w in layer.trainable_weights)

    assert count(layers.embedding(m, 1)) == embedding_params(m)
    assert count(layers.block(m, 1, 0, "b")) == block_params(m)
    assert count(layers.head(m, 1)) == head_params(m)
    adapter = AdapterConfig(rank=4)
    lora = count(layers.block(m, 1, 0, "a", adapter=adapter)) - block_params(m)
    assert lora == adapter_block_params(m, adapter)


def test_an_adapter_job_s_rings_carry_the_adapter_alone():
    from silentswarm.plan import AdapterConfig

    m = MODELS["llama, grouped-query"]
    adapter = AdapterConfig(rank=4, targets=["w_q", "w_v"])
    spec = JobSpec(model=m, replicas=2, adapter=adapter, init_from="job:base")
    lora = 4 * ((32 + 32) + (32 + 16))  # A and B of w_q (32 x 32) and of w_v (32 x 16)
    assert sync_bits(spec, 2) == [lora * 32.0, lora * 32.0]
    int8 = JobSpec(model=m, replicas=2, sync_compression="fixed_int8")
    assert sync_bits(int8, 1) == [
        (2 * block_params(m) + embedding_params(m) + head_params(m)) * 8.5
    ]


def test_a_grouping_that_does_not_fit_falls_back_to_the_dealt_one():
    """c and d have room for a third of the layers each: together, as the links would have
    them, they cannot hold a replica; dealt, each pairs with a fellow of room."""
    model = ModelConfig(n_layers=40, d_model=1024, n_heads=8, vocab_size=256, seq_len=64)
    spec = JobSpec(
        model=model,
        allow_cpu=True,
        replicas=2,
        stages=2,
        partition=Partition.BALANCED,
        sync="diloco",
        sync_every=10_000,
    )
    fellows = [cpu("a", 16, 100.0), cpu("b", 15, 100.0), cpu("c", 4, 100.0), cpu("d", 3.9, 100.0)]
    placed = place(spec, fellows, links=TWO_SITES)
    assert not isinstance(placed, Unplaceable), placed
    assert grid(placed) == [["c", "a"], ["d", "b"]]
    roomy = [*fellows[:2], cpu("c", 15, 100.0), cpu("d", 14, 100.0)]
    assert grid(place(spec, roomy, links=TWO_SITES)) == [["b", "a"], ["d", "c"]]


def test_the_grouping_weighs_what_each_fellow_s_memory_holds():
    """b is slow, so its replica's partner should take most of its layers: c holds 7 of the
    8 (its memory: 12, 7 and 5 layers for a, b and c, d), d only 5. Without counting the
    memory the search paired b with d, whose balanced split by speed it cannot hold."""
    model = ModelConfig(n_layers=8, d_model=1024, n_heads=8)
    spec = replicas_job(model=model, sync="diloco")
    fellows = [
        cpu("a", 3.78, 4.0), cpu("b", 3.78, 1.0), cpu("c", 2.52, 4.0), cpu("d", 2.02, 4.0),
    ]  # fmt: skip
    placed = place(spec, fellows, links=TWO_SITES)
    assert grid(placed) == [["d", "a"], ["c", "b"]]
    assert placed.split(1) == [(0, 7), (7, 8)]


def test_a_fellow_without_a_data_address_keeps_the_dealt_grouping():
    """c talks over the relay only: dealt, it runs stage 0 (it connects, never binds); no
    link figure describes its relayed links, so the links do not regroup the job."""
    c = msgspec.structs.replace(cpu("c", 14), data_address=None)
    fellows = [FOUR[0], FOUR[1], c, FOUR[3]]
    for transport in ("p2p", "auto"):
        placed = place(replicas_job(sync="diloco", transport=transport), fellows, links=TWO_SITES)
        assert grid(placed) == [["c", "a"], ["d", "b"]], transport
        assert placed.transport == transport


@pytest.mark.parametrize("p", [3, 5, 7])
def test_place_keeps_deep_diloco_pipelines_at_home(p):
    """Two sites of p fellows, ranked site by site (dealt: every pipeline across): past the
    groupings tried one by one (p = 5 and 7), the swaps and the clustered start still put
    each pipeline on one site, its links in order."""
    near, far = [f"p{i}" for i in range(p)], [f"q{i}" for i in range(p)]
    fellows = [cpu(f, 64 - at) for at, f in enumerate(near + far)]
    spec = replicas_job(sync="diloco", stages=p, sync_every=100, model=ModelConfig(n_layers=2 * p))
    placed = place(spec, fellows, links=sites(near, far))
    assert sorted(sorted(row) for row in grid(placed)) == [sorted(near), sorted(far)]


def test_the_search_s_work_is_bounded():
    """Placement runs on every tick while a job waits: a large swarm's search orders and
    computes at most MAX_WORK chains' worth of replicas beyond the dealt grouping's."""
    for n, p, order_work, compute_work in ((64, 2, 1, 32), (32, 8, 1, 256), (30, 5, 24, 80)):
        k = n // p
        names = [f"f{i:02d}" for i in range(n)]
        links = sites(*(names[s::4] for s in range(4)))
        calls = {"order": 0, "compute": 0}

        def order(group, calls=calls):
            calls["order"] += 1
            return group

        def compute(chain, calls=calls):
            calls["compute"] += 1
            return 0.1

        replica_groups(
            names,
            k,
            links,
            order=order,
            bits_per_step=BOUNDARY,
            ring_bits=[WEIGHTS] * p,
            rounds=1 / 20,
            compute=compute,
            order_work=order_work,
            compute_work=compute_work,
        )
        beyond = calls["order"] - k  # the dealt grouping's replicas are always ordered
        assert beyond * (order_work + compute_work) <= MAX_WORK, (n, p, calls)
        assert calls["compute"] == calls["order"]
