"""The balanced partition and the link-aware stage order: pure, table-tested."""

import itertools
import random

import msgspec
import pytest

from silentswarm.jobspec import JobSpec, Partition, PlacedStage
from silentswarm.leader.balance import (
    SAME_HOST_LINK,
    LinkBook,
    balanced_sizes,
    bottleneck,
    boundary_bits,
    boundary_link,
    chain_order,
    fellows_along_links,
    guessed_links,
    head_blocks,
    measured_speed,
    ranges_of,
    smoothed,
    stage_busy_s,
    step_cost,
)
from silentswarm.leader.decide import candidate
from silentswarm.leader.jobs import JobRecord, plan_schedule
from silentswarm.leader.placement import Candidate, Unplaceable, place
from silentswarm.leader.registry import FellowRegistry
from silentswarm.plan import ModelConfig, Transport
from silentswarm.protocol import (
    FellowIdentity,
    FellowStatus,
    GpuInfo,
    HardwareSnapshot,
    JobState,
    Progress,
    ProgressEvent,
    RegisterRequest,
)
from silentswarm.types.links import LinkStats, MeasuredLink

GIB = 1 << 30

SIZES = {
    "equal speeds: equal": (8, [1.0, 1.0], {}, [4, 4]),
    "one twice as fast: two thirds": (9, [2.0, 1.0], {}, [6, 3]),
    "100% and 50% of a core, 8 blocks: 6-2 ties 5-3": (8, [1.0, 0.5], {}, [6, 2]),
    "the head weighs on the last stage": (8, [1.0, 1.0], {"last_extra": 2.0}, [5, 3]),
    "the embedding on the first": (8, [1.0, 1.0], {"first_extra": 2.0}, [3, 5]),
    "a cap holds the fast one back": (8, [4.0, 1.0], {"caps": [5, None]}, [5, 3]),
    "every stage keeps one layer": (3, [100.0, 1.0, 1.0], {}, [1, 1, 1]),
    "three stages": (12, [3.0, 2.0, 1.0], {}, [6, 4, 2]),
    "ties to the earlier stage": (5, [1.0, 1.0], {}, [3, 2]),
    "caps below the layers: no split": (8, [1.0, 1.0], {"caps": [3, 4]}, None),
    "a cap of zero: no split": (8, [1.0, 1.0], {"caps": [0, None]}, None),
}


@pytest.mark.parametrize("case", SIZES, ids=list(SIZES))
def test_balanced_sizes(case):
    n, speeds, kw, want = SIZES[case]
    assert balanced_sizes(n, speeds, **kw) == want


def all_splits(n, stages):
    """Every composition of n into ``stages`` positive parts."""
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        yield [b - a for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("seed", range(60))
def test_balanced_sizes_is_the_best_of_all_splits(seed):
    rng = random.Random(seed)
    stages = rng.randint(1, 4)
    n = rng.randint(stages, 10)
    speeds = [rng.choice([0.25, 0.5, 1.0, 1.5, 3.0, rng.uniform(0.1, 5)]) for _ in range(stages)]
    caps = [rng.choice([None, None, rng.randint(1, n)]) for _ in range(stages)]
    first, last = rng.choice([0.0, 0.7]), rng.choice([0.0, 1.3])
    fitting = [
        s
        for s in all_splits(n, stages)
        if all(c is None or size <= c for size, c in zip(s, caps, strict=True))
    ]
    got = balanced_sizes(n, speeds, caps=caps, first_extra=first, last_extra=last)
    if not fitting:
        assert got is None
        return
    assert got in fitting
    best = min(bottleneck(s, speeds, first, last) for s in fitting)
    assert bottleneck(got, speeds, first, last) == pytest.approx(best)


@pytest.mark.parametrize("seed", range(80))
def test_with_micro_batches_it_is_the_shortest_1f1b_step_of_all_splits(seed):
    rng = random.Random(1000 + seed)
    stages = rng.randint(1, 4)
    n = rng.randint(stages, 10)
    speeds = [rng.choice([0.25, 0.5, 1.0, 3.0, rng.uniform(0.1, 5)]) for _ in range(stages)]
    caps = [rng.choice([None, None, rng.randint(1, n)]) for _ in range(stages)]
    first, last = rng.choice([0.0, 0.7]), rng.choice([0.0, 1.3])
    m = rng.choice([1, 2, 4, 8, 32])
    extras = [0.0] * stages
    extras[0] += first
    extras[-1] += last
    fitting = [
        s
        for s in all_splits(n, stages)
        if all(c is None or size <= c for size, c in zip(s, caps, strict=True))
    ]
    got = balanced_sizes(n, speeds, caps=caps, first_extra=first, last_extra=last, micro_batches=m)
    if not fitting:
        assert got is None
        return
    assert got in fitting
    best = min(step_cost(s, speeds, extras, m) for s in fitting)
    assert step_cost(got, speeds, extras, m) == pytest.approx(best)


ONE_F_ONE_B = {
    # Slow first at half speed, 8 blocks: the bottleneck alone says 3-5 (6 against 5),
    # with 4 micro-batches the step is (3 * 6 + 11) / 4 = 7.25 there, 7.0 at 2-6.
    "a small m moves layers off the slow stage": (8, [0.5, 1.0], 4, [2, 6]),
    "a large m: the bottleneck decides": (9, [0.5, 1.0], 64, [3, 6]),
    "a bottleneck tie goes to the least sum": (8, [0.5, 1.0], 64, [2, 6]),
    "one micro-batch: all but one on the fastest": (8, [0.5, 1.0], 1, [1, 7]),
}


@pytest.mark.parametrize("case", ONE_F_ONE_B, ids=list(ONE_F_ONE_B))
def test_micro_batches_weigh_the_fill_and_drain(case):
    n, speeds, m, want = ONE_F_ONE_B[case]
    assert balanced_sizes(n, speeds, micro_batches=m) == want


@pytest.mark.parametrize(
    ("n", "speeds"), [(1, [1.0, 1.0]), (4, []), (4, [1.0, 0.0]), (4, [1.0, -2.0])]
)
def test_balanced_sizes_refuses_what_it_cannot_split(n, speeds):
    with pytest.raises(ValueError):
        balanced_sizes(n, speeds)


def test_ranges_of():
    assert ranges_of([5, 3]) == [(0, 5), (5, 8)]
    assert ranges_of([1, 1, 2]) == [(0, 1), (1, 2), (2, 4)]


def test_head_blocks_grows_with_the_vocabulary():
    small, big = ModelConfig(vocab_size=256), ModelConfig(vocab_size=50257)
    assert head_blocks(small) < 0.2 < 1.0 < head_blocks(big)


def hop(mbit_s: float, rtt_ms: float = 0.0) -> MeasuredLink:
    return MeasuredLink(mbit_s=mbit_s, rtt_ms=rtt_ms)


MB = 8e6  # bits
# (fellows, links, bits per step, last, the expected order: its reverse is as good)
ORDERS = {
    "no measurements: as given": (["a", "b", "c"], {}, MB, None, ["a", "b", "c"]),
    "two fellows: as given": (["a", "b"], {("a", "b"): hop(5.0)}, MB, None, ["a", "b"]),
    "the slow link off the chain": (
        ["a", "b", "c"],
        {("a", "b"): hop(1.0), ("b", "c"): hop(100.0), ("a", "c"): hop(100.0)},
        MB,
        None,
        ["b", "c", "a"],
    ),
    "either direction counts": (
        ["a", "b", "c"],
        {("b", "a"): hop(1.0), ("c", "b"): hop(100.0), ("c", "a"): hop(100.0)},
        MB,
        None,
        ["b", "c", "a"],
    ),
    "the last stays last": (
        ["a", "b", "c"],
        {("a", "c"): hop(1.0), ("a", "b"): hop(100.0), ("b", "c"): hop(100.0)},
        MB,
        "c",
        ["a", "b", "c"],
    ),
    "pairs never measured between fast ends beat measured slow ones": (
        ["a", "b", "c", "d"],
        {("a", "b"): hop(1.0), ("c", "d"): hop(1.0), ("b", "c"): hop(50.0), ("a", "d"): hop(50.0)},
        MB,
        None,
        ["a", "c", "b", "d"],  # or any chain without a-b and c-d
    ),
    "a fellow whose links are all slow goes to an end": (
        ["a", "b", "c", "d"],
        {("a", "b"): hop(1.0), ("a", "c"): hop(1.0), ("b", "c"): hop(50.0), ("c", "d"): hop(50.0)},
        MB,
        None,
        ["a", "b", "c", "d"],  # or any chain with a at an end
    ),
    "equal rates: the far pair off the chain": (
        ["a", "b", "c"],
        {("a", "b"): hop(100.0, 100.0), ("b", "c"): hop(100.0, 1.0), ("a", "c"): hop(100.0, 1.0)},
        MB,
        None,
        ["a", "c", "b"],
    ),
    "a fast far link loses to slower near ones": (
        ["a", "b", "c"],
        {("a", "b"): hop(1000.0, 200.0), ("b", "c"): hop(100.0, 1.0), ("a", "c"): hop(100.0, 1.0)},
        MB,
        None,
        ["a", "c", "b"],
    ),
    "a big transfer: the fast far links win": (
        ["a", "b", "c"],
        {
            ("a", "b"): hop(1000.0, 200.0),
            ("b", "c"): hop(1000.0, 200.0),
            ("a", "c"): hop(100.0, 1.0),
        },
        1000 * MB,
        None,
        ["a", "b", "c"],
    ),
    "a small transfer: the near slow link wins": (
        ["a", "b", "c"],
        {
            ("a", "b"): hop(1000.0, 200.0),
            ("b", "c"): hop(1000.0, 200.0),
            ("a", "c"): hop(100.0, 1.0),
        },
        MB / 10,
        None,
        ["b", "a", "c"],  # or a-c-b: one far link either way
    ),
}


@pytest.mark.parametrize("case", ORDERS, ids=list(ORDERS))
def test_chain_order(case):
    fellows, links, bits, last, want = ORDERS[case]
    got = chain_order(fellows, links, bits_per_step=bits, last=last)
    assert sorted(got) == sorted(fellows)
    slow = [p for p in itertools.pairwise(got) if hop(1.0) in (links.get(p), links.get(p[::-1]))]
    if case == "pairs never measured between fast ends beat measured slow ones":
        assert not slow, got
    elif case == "a fellow whose links are all slow goes to an end":
        assert "a" in (got[0], got[-1]), got
    elif case == "a small transfer: the near slow link wins":
        assert {"a", "c"} in [set(p) for p in itertools.pairwise(got)]
    elif last is None:
        assert got in (want, want[::-1])
    else:
        assert got == want


def test_a_boundary_carries_the_batch_in_the_wire_codec():
    spec = job(layers=4)
    width = spec.batch_size * spec.model.seq_len * spec.model.d_model
    assert boundary_bits(spec) == width * 32
    assert boundary_bits(msgspec.structs.replace(spec, compression="fixed_int4")) == width * 4
    assert boundary_bits(msgspec.structs.replace(spec, compression="auto")) == width * 8
    learned = msgspec.structs.replace(spec, compression="learned_dim16_int8")
    assert boundary_bits(learned) == width // spec.model.d_model * 16 * 8


# --- through place() ---------------------------------------------------------------------


def cand(fid, speed, ram_gib=16.0, host=None, share=1.0):
    return Candidate(
        fellow_id=fid,
        hostname=host or fid,
        data_address=f"tcp://{fid}:1",
        cpu_cores=1,
        ram_available_bytes=int(ram_gib * GIB),
        compute_speed=speed,
        cpu_share=share,
    )


def job(**kw) -> JobSpec:
    kw.setdefault("partition", Partition.BALANCED)
    return JobSpec(
        model=ModelConfig(n_layers=kw.pop("layers", 8)),
        allow_cpu=True,
        pipeline_last_stage_placement="preserve",
        **kw,
    )


def sizes_of(placement):
    return [(s.fellow_id, s.layer_end - s.layer_start) for s in placement.stages]


PLACES = {
    "by speed": ([cand("fast", 2.0), cand("slow", 1.0)], {}, [("fast", 6), ("slow", 2)]),
    "no speed known: equal": ([cand("a", None), cand("b", None)], {}, [("a", 4), ("b", 4)]),
    "an unknown speed counts at the mean": (
        [cand("a", 3.0), cand("b", None), cand("c", 1.0)],
        {"layers": 12, "micro_batches": "auto"},
        [("a", 6), ("b", 4), ("c", 2)],
    ),
    "4 micro-batches: the fill and drain count": (
        [cand("a", 3.0), cand("b", 2.0), cand("c", 1.0)],
        {"layers": 12, "micro_batches": 4},
        [("a", 7), ("b", 4), ("c", 1)],
    ),
    "weighted stays by memory": (
        [cand("a", 1.0, ram_gib=24), cand("b", 3.0, ram_gib=8)],
        {"partition": Partition.WEIGHTED},
        [("a", 6), ("b", 2)],
    ),
}


@pytest.mark.parametrize("case", PLACES, ids=list(PLACES))
def test_place_balanced(case):
    candidates, kw, want = PLACES[case]
    placement = place(job(**kw), candidates)
    assert not isinstance(placement, Unplaceable), placement
    assert sizes_of(placement) == want


def test_place_balanced_stays_within_memory():
    # A d_model 1024 block needs ~0.25 GiB: 1.5 GiB of RAM after TensorFlow's fits few.
    model = ModelConfig(n_layers=8, d_model=1024, n_heads=8)
    spec = JobSpec(
        model=model,
        partition=Partition.BALANCED,
        allow_cpu=True,
        stages=2,
        pipeline_last_stage_placement="preserve",
    )
    tight = [cand("fast", 10.0, ram_gib=2.25), cand("slow", 1.0, ram_gib=64)]
    placement = place(spec, tight)
    assert not isinstance(placement, Unplaceable), placement
    got = dict(sizes_of(placement))
    assert got == {"fast": 6, "slow": 2}  # speed alone would give it 7 of 8
    assert all(s.memory_estimate_bytes <= s.memory_offered_bytes for s in placement.stages)
    both_tight = [cand("a", 10.0, ram_gib=1.5), cand("b", 1.0, ram_gib=1.5)]
    refused = place(spec, both_tight)
    assert isinstance(refused, Unplaceable)
    assert "fits the fellows' memory" in refused.reason


def test_place_balanced_orders_along_measured_links():
    fellows = [cand("a", 1.0), cand("b", 1.0), cand("c", 1.0)]
    links = {("a", "b"): hop(1.0), ("b", "c"): hop(100.0), ("a", "c"): hop(100.0)}
    placement = place(job(layers=6), fellows, links=links)
    order = [s.fellow_id for s in placement.stages]
    assert order in (["b", "c", "a"], ["a", "c", "b"])  # the slow pair a-b not adjacent
    equal = place(job(layers=6, partition=Partition.EQUAL), fellows, links=links)
    assert [s.fellow_id for s in equal.stages] == ["a", "b", "c"]  # only balanced reorders


# (speeds, measured links, the two fellows a 2-stage balanced job of 6 layers takes)
ALONG_LINKS = {
    "nothing measured: the fastest": ({"a": 2.0, "b": 2.0, "c": 1.0}, {}, {"a", "b"}),
    "a slow link between the fastest: the next fastest instead": (
        {"a": 2.0, "b": 2.0, "c": 1.8},
        {("a", "b"): hop(1.0, 50.0), ("a", "c"): hop(100.0, 1.0)},
        {"a", "c"},
    ),
    "compute outweighs a fair link": (
        {"a": 10.0, "b": 10.0, "c": 1.0},
        {("a", "b"): hop(50.0, 10.0), ("c", "a"): hop(1000.0, 0.1)},
        {"a", "b"},
    ),
    "a pair never measured: its slower end's best link": (
        {"a": 2.0, "b": 2.0, "c": 2.0, "d": 0.1},
        # b's only link is slow, a's and c's best are fast: a-c, never measured, is the pick
        {("a", "b"): hop(1.0), ("a", "d"): hop(100.0), ("c", "d"): hop(100.0)},
        {"a", "c"},
    ),
    "an end never measured counts as the median": (
        {"a": 2.0, "b": 2.0, "c": 2.0},
        {("a", "b"): hop(1.0), ("a", "x"): hop(100.0), ("y", "z"): hop(100.0)},
        {"a", "c"},
    ),
}


def test_six_stages_take_the_fastest_whatever_the_links():
    """Choosing 6 of 7 would cost 7 x 720 orders on every tick a job waits: no choice."""
    speeds = {f: 2.0 for f in "abcdefg"} | {"g": 1.9}
    links = {("a", "b"): hop(0.1, 500.0), ("f", "g"): hop(1000.0)}
    spec = job(layers=6)
    kw = {"model": spec.model, "batch_size": 8, "micro_batches": 4, "bits_per_step": MB}
    assert set(fellows_along_links(speeds, 6, links, **kw)) == set("abcdef")
    assert "g" in fellows_along_links(speeds, 5, links, **kw)  # 21 x 120: chosen


def test_a_link_book_finds_links_by_pair_and_by_fellow():
    book = LinkBook({("a", "b"): hop(1.0), ("c", "a"): hop(2.0)})
    assert book.between("b", "a") == hop(1.0) and book.between("b", "c") is None
    assert sorted(m.mbit_s for m in book.of("a")) == [1.0, 2.0] and book.of("z") == []
    book.put(("a", "b"), hop(3.0))
    book.drop(("c", "a"))
    book.drop(("x", "y"))  # never there
    assert dict(book) == {("a", "b"): hop(3.0)} and book.of("c") == [] and len(book) == 1


def test_guessed_links():
    links = {("a", "b"): hop(1.0, 40.0), ("d", "a"): hop(100.0, 2.0), ("c", "d"): hop(50.0, 6.0)}
    pairs = guessed_links(["a", "b", "c", "e"], links)
    assert set(pairs) == {("a", "b"), ("a", "c"), ("a", "e"), ("b", "c"), ("b", "e"), ("c", "e")}
    assert pairs["a", "b"] == hop(1.0, 40.0)  # measured
    assert pairs["a", "c"] == hop(50.0, 6.0)  # c's best is 50, a's 100; the median round trip
    assert pairs["b", "c"] == hop(1.0, 6.0)
    assert pairs["a", "e"] == hop(50.0, 6.0)  # e never measured: the median of their links
    assert guessed_links(["a", "b"], {}) == {}


@pytest.mark.parametrize("case", ALONG_LINKS, ids=list(ALONG_LINKS))
def test_fellows_along_links(case):
    speeds, links, want = ALONG_LINKS[case]
    spec = job(layers=6)
    got = fellows_along_links(
        speeds,
        2,
        links,
        model=spec.model,
        batch_size=spec.batch_size,
        micro_batches=spec.micro_batches,
        bits_per_step=boundary_bits(spec),
    )
    assert set(got) == want


def test_place_balanced_takes_fellows_along_their_links():
    """Three fellows ready for two stages: the two fastest are joined by a slow link, so the
    job takes the fast pair with a fast link; unmeasured or other partitions as before."""
    fellows = [cand("a", 2.0), cand("b", 2.0), cand("c", 1.8)]
    links = {("a", "b"): hop(1.0, 50.0), ("a", "c"): hop(100.0, 1.0)}
    placement = place(job(layers=6, stages=2), fellows, links=links)
    assert {s.fellow_id for s in placement.stages} == {"a", "c"}
    unmeasured = [cand("a", 2.0), cand("b", 2.0), cand("c", None)]
    placement = place(job(layers=6, stages=2), unmeasured, links=links)
    assert {s.fellow_id for s in placement.stages} == {"a", "b"}
    spare = [*fellows, cand("d", None)]  # an unmeasured spare is not among the fastest
    placement = place(job(layers=6, stages=2), spare, links=links)
    assert {s.fellow_id for s in placement.stages} == {"a", "c"}
    # the pair along the links lacks the memory: the best pair that fits, a with d (slow,
    # but its link guessed at the measured links' median beats a-b's 1 Mbit/s) ...
    tight = [cand("a", 2.0), cand("b", 2.0), cand("c", 1.8, ram_gib=0.05), cand("d", 0.5, 64)]
    placement = place(job(layers=6, stages=2), tight, links=links)
    assert {s.fellow_id for s in placement.stages} == {"a", "d"}
    # ... or, d's links as slow as b's, the fastest pair (not the memory ranking's, d's)
    slow_d = links | {("a", "d"): hop(1.0, 50.0), ("b", "d"): hop(1.0, 50.0)}
    placement = place(job(layers=6, stages=2), tight, links=slow_d)
    assert {s.fellow_id for s in placement.stages} == {"a", "b"}
    fastest_unmeasured = [cand("a", None), cand("b", None), cand("c", 1.8)]
    placement = place(job(layers=6, stages=2), fastest_unmeasured, links=links)
    assert {s.fellow_id for s in placement.stages} == {"c", "a"}  # measured first, as before
    equal = place(job(layers=6, stages=2, partition=Partition.EQUAL), fellows, links=links)
    assert {s.fellow_id for s in equal.stages} == {"a", "b"}


def test_a_pair_on_one_machine_counts_as_a_fast_link():
    """a and b share a machine (their link never measured: its loopback), c, the fastest,
    sits behind slow links to both: a balanced 2-stage job takes a and b. Without the
    machine, a-b would be guessed as slow as their links to c, and c taken."""

    def on(fid, speed, host):
        return msgspec.structs.replace(cand(fid, speed), data_address=f"tcp://{host}:5701")

    fellows = [on("a", 2.0, "10.0.0.1"), on("b", 1.5, "10.0.0.1"), on("c", 3.0, "10.0.0.2")]
    links = {("a", "c"): hop(2.0, 50.0), ("b", "c"): hop(2.0, 50.0)}
    placement = place(job(layers=6, stages=2), fellows, links=links)
    assert {s.fellow_id for s in placement.stages} == {"a", "b"}
    assert guessed_links(["a", "b", "c"], links)["a", "b"].mbit_s == 2.0
    one_machine = guessed_links(["a", "b", "c"], links, same_host=lambda x, y: {x, y} == {"a", "b"})
    assert one_machine["a", "b"] == SAME_HOST_LINK and one_machine["a", "c"] == hop(2.0, 50.0)
    # A job that relays every boundary does not talk over the loopback: c and a.
    relayed = place(job(layers=6, stages=2, transport=Transport.TUNNEL), fellows, links=links)
    assert {s.fellow_id for s in relayed.stages} == {"a", "c"}
    # b advertises no address, only a's host name (its own claim, and its links relay).
    claimed = [fellows[0], msgspec.structs.replace(fellows[1], data_address=None), fellows[2]]
    claimed[1] = msgspec.structs.replace(claimed[1], hostname=fellows[0].hostname)
    placed = place(job(layers=6, stages=2), claimed, links=links)
    assert {s.fellow_id for s in placed.stages} == {"a", "c"}


def relay_only(fid, speed):
    return msgspec.structs.replace(cand(fid, speed), data_address=None)


# the fast pair a-b sits behind a slow link; c, d have no data address (they connect out)
BEHIND_A_SLOW_LINK = {("a", "b"): hop(1.0, 50.0), ("a", "x"): hop(100.0, 1.0)}


@pytest.mark.parametrize("transport", [None, Transport.P2P], ids=["auto", "p2p"])
def test_a_fellow_without_an_address_chosen_for_its_links_runs_stage_0(transport):
    """c (no data address) with a is the pair along the links: c runs stage 0 and connects
    to a, so the job's boundary stays direct."""
    fellows = [cand("a", 2.0), cand("b", 2.0), relay_only("c", 1.8)]
    placed = place(job(layers=6, stages=2, transport=transport), fellows, links=BEHIND_A_SLOW_LINK)
    assert [s.fellow_id for s in placed.stages] == ["c", "a"]
    assert placed.transport == (transport or Transport.AUTO)


def test_links_never_turn_a_job_over_to_the_relay():
    """A 3-stage job: the set along the links (a, c, d) holds two fellows without a data
    address, so one would run a stage after the first and the job would relay every
    boundary; the fastest three (over the slow link, but direct) instead, c first."""
    fellows = [cand("a", 2.0), cand("b", 2.0), relay_only("c", 1.9), relay_only("d", 1.9)]
    three = place(job(layers=6, stages=3), fellows, links=BEHIND_A_SLOW_LINK)
    assert [s.fellow_id for s in three.stages] == ["c", "a", "b"]  # not a, c, d: relayed
    assert three.transport == Transport.AUTO


@pytest.mark.parametrize("transport", [None, Transport.P2P], ids=["auto", "p2p"])
def test_a_set_is_costed_in_the_orders_it_can_run_in(transport):
    """a-c-b would cost a step least (c's links are fast), but c has no data address and
    may only run stage 0: c-a-b crosses the 1 Mbit/s link. a-d-b is the set to take."""
    fellows = [cand("a", 2.0), cand("b", 2.0), relay_only("c", 1.7), cand("d", 1.8)]
    links = {("a", "b"): hop(1.0), ("c", "a"): hop(100.0), ("c", "b"): hop(100.0)}
    links |= {("d", x): hop(20.0) for x in "abc"}
    placed = place(job(layers=6, stages=3, transport=transport), fellows, links=links)
    assert [s.fellow_id for s in placed.stages] == ["a", "d", "b"]


def test_a_lone_fellow_without_an_address_runs_stage_0_when_dealt():
    """No link known: dealt by memory, c (no data address) would run stage 1 and the job
    would relay its boundary; it runs stage 0 and connects out instead, unless it is the
    best ranked, which runs the last stage."""
    fellows = [cand("a", None, ram_gib=32), relay_only("c", None)]
    equal = job(layers=6, stages=2, partition=Partition.EQUAL)
    placed = place(equal, fellows)
    assert [s.fellow_id for s in placed.stages] == ["c", "a"]
    assert placed.transport == Transport.AUTO
    last = msgspec.structs.replace(equal, pipeline_last_stage_placement="largest_vram")
    best_ranked = [
        cand("a", None),
        msgspec.structs.replace(relay_only("c", None), ram_available_bytes=64 * GIB),
    ]
    pinned = place(last, best_ranked)
    assert [s.fellow_id for s in pinned.stages] == ["a", "c"]
    assert pinned.transport == Transport.TUNNEL


def gpu_cand(fid, speed, free_gib=24.0):
    gpu = GpuInfo(
        index=0,
        uuid=f"GPU-{fid}",
        name="test GPU",
        memory_total_bytes=int(32 * GIB),
        memory_free_bytes=int(free_gib * GIB),
        memory_used_bytes=int((32 - free_gib) * GIB),
    )
    return msgspec.structs.replace(cand(fid, speed), gpus=(gpu,))


TAKES = {
    "a spare fast fellow beats a slow one with more memory": (
        [cand("big", 1.0, ram_gib=64), cand("mid", 2.0, ram_gib=32), cand("fast", 3.0)],
        ["mid", "fast"],  # in the memory ranking's order
        ["big", "mid"],
    ),
    "its quota's share counts": (
        [cand("boxed", 4.0, ram_gib=64, share=0.25), cand("b", 2.0), cand("c", 1.5)],
        ["b", "c"],
        ["boxed", "b"],
    ),
    "an unmeasured fellow comes after the measured": (
        [cand("new", None, ram_gib=64), cand("b", 1.0), cand("c", 0.5)],
        ["b", "c"],
        ["new", "b"],
    ),
    "fellows with a GPU still first": (
        [gpu_cand("gpu", 0.5), cand("cpu1", 3.0), cand("cpu2", 2.0)],
        ["gpu", "cpu1"],
        ["gpu", "cpu1"],
    ),
    "as many as there are: every one": (
        [cand("a", 1.0, ram_gib=64), cand("b", 3.0)],
        ["a", "b"],
        ["a", "b"],
    ),
}


@pytest.mark.parametrize("case", TAKES, ids=list(TAKES))
def test_a_balanced_job_takes_the_fastest_fellows(case):
    fellows, balanced, equal = TAKES[case]
    spec = job(layers=8, stages=2)
    placement = place(spec, fellows)
    assert [s.fellow_id for s in placement.stages] == balanced
    by_memory = place(msgspec.structs.replace(spec, partition=Partition.EQUAL), fellows)
    assert [s.fellow_id for s in by_memory.stages] == equal


def test_a_balanced_job_takes_the_best_ranked_where_the_fastest_do_not_fit():
    spec = JobSpec(
        model=ModelConfig(n_layers=8, d_model=1024, n_heads=8),
        partition=Partition.BALANCED,
        allow_cpu=True,
        stages=2,
        pipeline_last_stage_placement="preserve",
    )
    fast = [cand(f"fast{i}", 10.0, ram_gib=1.5) for i in range(2)]  # too little for 4 blocks
    big = [cand(f"big{i}", 1.0, ram_gib=64) for i in range(2)]
    assert isinstance(place(spec, fast), Unplaceable)
    placement = place(spec, [*fast, *big])
    assert not isinstance(placement, Unplaceable), placement
    assert [s.fellow_id for s in placement.stages] == ["big0", "big1"]
    # A fast fellow with room for 6 of the 8 blocks: taken, beside the best ranked big one.
    mixed = [cand("fast", 10.0, ram_gib=2.25), *big]
    assert [s.fellow_id for s in place(spec, mixed).stages] == ["big0", "fast"]


# --- speeds: the probe's unit, what a step shows, what the leader keeps ---------------------


def test_a_standard_block_at_one_second_a_step_is_speed_one():
    unit = ModelConfig(d_model=256, seq_len=128, n_heads=4, n_layers=8)
    one = measured_speed(unit, batch_size=8, layers=1, last=False, busy_s=1.0)
    assert one == pytest.approx(1.0)
    assert measured_speed(unit, batch_size=8, layers=4, last=False, busy_s=2.0) == (
        pytest.approx(2.0)
    )
    with_head = measured_speed(unit, batch_size=8, layers=1, last=True, busy_s=1.0)
    assert with_head == pytest.approx(1 + head_blocks(unit))
    half = ModelConfig(d_model=256, seq_len=128, n_heads=4, n_layers=8)
    assert measured_speed(half, batch_size=4, layers=1, last=False, busy_s=0.5) == (
        pytest.approx(1.0)
    )
    assert measured_speed(unit, batch_size=8, layers=1, last=False, busy_s=0.0) is None


def step(**kw) -> Progress:
    fields = {"job_id": "j", "fellow_id": "f", "attempt": 1, "stage": 0, "step": 10}
    return Progress(**{**fields, **kw})


BUSY = {
    "time less waits": (step(step_time_s=0.5, wait_s=0.2), 0.3),
    "and less a CPU quota's stalls": (step(step_time_s=0.5, wait_s=0.1, throttled_s=0.3), 0.1),
    "all held back by the quota": (step(step_time_s=0.5, wait_s=0.1, throttled_s=0.4), None),
    "no waits reported (an older agent)": (step(step_time_s=0.5), None),
    "no step time": (step(wait_s=0.1), None),
    "a first step compiles": (step(step=2, step_time_s=3.0, wait_s=0.1), None),
    "all waiting": (step(step_time_s=0.5, wait_s=0.5), None),
    "not a step record": (
        step(event=ProgressEvent.CHECKPOINT, step_time_s=0.5, wait_s=0.1),
        None,
    ),
}


@pytest.mark.parametrize("case", BUSY, ids=list(BUSY))
def test_stage_busy_s(case):
    progress, want = BUSY[case]
    got = stage_busy_s(progress)
    assert got == (None if want is None else pytest.approx(want))


def test_progress_refuses_a_negative_wait():
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(
            msgspec.json.encode(step(step_time_s=0.5, wait_s=0.1)).replace(b"0.1", b"-1"),
            type=Progress,
        )


def test_the_registry_keeps_a_smoothed_speed_and_placement_prefers_it():
    reg = FellowRegistry(heartbeat_interval_s=1.0, offline_after_s=3.0, leader_version="t")
    reg.bus_connected()
    hw = HardwareSnapshot(
        hostname="h",
        cpu_cores=2,
        ram_total_bytes=8 << 30,
        ram_available_bytes=4 << 30,
        compute_speed=5.0,
    )
    ident = FellowIdentity(fellow_id="f", instance_id="i", hostname="h", version="t", pid=1)
    reg.register(RegisterRequest(fellow=ident, hardware=hw, status=FellowStatus.READY))
    assert candidate(reg.get("f")).compute_speed == 5.0  # the probe's, until measured
    reg.record_speed("f", 10.0)
    assert reg.get("f").measured_speed == 10.0
    reg.record_speed("f", 20.0)
    assert reg.get("f").measured_speed == pytest.approx(smoothed(10.0, 20.0))
    assert 10.0 < reg.get("f").measured_speed < 20.0
    assert candidate(reg.get("f")).compute_speed == reg.get("f").measured_speed
    reg.record_speed("nobody", 3.0)  # a fellow the registry forgot: nothing to keep


@pytest.mark.parametrize("speed", [0.0, -1.0, 1e7])
def test_a_snapshot_with_an_absurd_speed_is_refused(speed):
    body = {
        "hostname": "h",
        "cpu_cores": 1,
        "ram_total_bytes": 1,
        "ram_available_bytes": 1,
        "compute_speed": speed,
    }
    with pytest.raises(msgspec.ValidationError, match="compute_speed"):
        msgspec.convert(body, HardwareSnapshot)


def placed(*fellows):
    return [
        PlacedStage(stage=i, fellow_id=f, hostname=f, layer_start=i, layer_end=i + 1)
        for i, f in enumerate(fellows)
    ]


def test_a_boundary_link_names_its_fellow_pair_and_the_slower_direction():
    stages = placed("a", "b", "c")
    link = LinkStats(boundary=1, step=0, rtt_ms=1.0, fwd_mbit_s=800.0, bwd_mbit_s=300.0)
    assert boundary_link(stages, link) == (("b", "c"), hop(300.0, 1.0))
    past_the_end = LinkStats(boundary=2, step=0, rtt_ms=1.0, fwd_mbit_s=1.0, bwd_mbit_s=1.0)
    assert boundary_link(stages, past_the_end) is None


def test_the_schedule_orders_a_balanced_job_along_the_measured_links():
    now = 1.0
    record = JobRecord(
        job_id="j",
        name="j",
        spec=job(layers=6),
        state=JobState.PENDING,
        created_at=now,
        updated_at=now,
    )
    fellows = [cand("a", 1.0), cand("b", 1.0), cand("c", 1.0)]
    links = {("a", "b"): hop(1.0), ("b", "c"): hop(100.0), ("a", "c"): hop(100.0)}
    (assignment,), waiting = plan_schedule([record], fellows, links=links)
    assert not waiting
    order = [s.fellow_id for s in assignment.placement.stages]
    assert order in (["b", "c", "a"], ["a", "c", "b"])
