"""Balanced splits for fellows under a CPU quota: the quota's stalls modelled, not measured
into the speed (silentswarm.leader.balance.throttled_step_cost). Pure, table-tested."""

from __future__ import annotations

import math
import random

import msgspec
import pytest

from silentswarm.jobspec import JobSpec, Partition
from silentswarm.leader.balance import (
    MAX_EVERY_SPLIT,
    balanced_sizes,
    head_blocks,
    stage_time,
    step_cost,
    throttled_step_cost,
)
from silentswarm.leader.decide import cpu_share
from silentswarm.leader.jobs import JobRecord, plan_schedule
from silentswarm.leader.placement import Candidate, Unplaceable, intra_op_threads, place
from silentswarm.plan import ModelConfig
from silentswarm.protocol import HardwareSnapshot, JobState
from tests.unit.test_balance import all_splits, cand

GIB = 1 << 30

COSTS = {
    # 1 and 3 blocks at speed 1, no micro-batches: the step is 3; stage 0 is busy a third
    # of it, under its share of a half: it runs at full speed.
    "under its share": ([1, 3], [1.0, 1.0], [0.5, 1.0], None, 3.0),
    # 2 and 2: stage 0 would be busy the whole step, over its half: held to 2 / 0.5 = 4.
    "over its share": ([2, 2], [1.0, 1.0], [0.5, 1.0], None, 4.0),
    # 1F1B, m = 4: 2-6 takes (3 * 6 + 8) / 4 = 6.5 and stage 0 is busy 2 of it (31%) ...
    "1F1B under": ([2, 6], [1.0, 1.0], [0.5, 1.0], 4, 6.5),
    # ... 3-5 would take 5.75, but stage 0 is then busy 52% of it: held to 6, (18 + 11) / 4.
    "1F1B over": ([3, 5], [1.0, 1.0], [0.5, 1.0], 4, 7.25),
    "no quota: the plain 1F1B step": ([3, 5], [1.0, 2.0], [1.0, 1.0], 4, None),
}


@pytest.mark.parametrize("case", COSTS, ids=list(COSTS))
def test_throttled_step_cost(case):
    sizes, speeds, shares, m, want = COSTS[case]
    extras = [0.0] * len(sizes)
    got = throttled_step_cost(sizes, speeds, extras, shares, m)
    if want is None:
        want = step_cost(sizes, speeds, extras, m)
    assert got == pytest.approx(want)


def test_a_held_stage_can_only_lengthen_the_step():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 4)
        sizes = [rng.randint(1, 5) for _ in range(n)]
        speeds = [rng.uniform(0.2, 4) for _ in range(n)]
        shares = [rng.choice([1.0, 0.25, 0.5, rng.uniform(0.05, 1)]) for _ in range(n)]
        m = rng.choice([None, 1, 4, 16])
        extras = [0.0] * n
        free = (
            step_cost(sizes, speeds, extras, m)
            if m
            else max(stage_time(k, v) for k, v in zip(sizes, speeds, strict=True))
        )
        scaled = [v * q for v, q in zip(speeds, shares, strict=True)]
        worst = (
            step_cost(sizes, scaled, extras, m)
            if m
            else max(stage_time(k, v) for k, v in zip(sizes, scaled, strict=True))
        )
        got = throttled_step_cost(sizes, speeds, extras, shares, m)
        assert free - 1e-9 <= got <= worst + 1e-9


@pytest.mark.parametrize("seed", range(40))
def test_with_shares_it_is_the_least_throttled_step_of_all_splits(seed):
    rng = random.Random(500 + seed)
    stages = rng.randint(2, 4)
    n = rng.randint(stages, 10)
    speeds = [rng.choice([0.5, 1.0, 3.0, rng.uniform(0.1, 5)]) for _ in range(stages)]
    shares = [rng.choice([1.0, 0.5, 0.25, rng.uniform(0.1, 1)]) for _ in range(stages)]
    shares[rng.randrange(stages)] = 0.5  # at least one fellow under a quota
    caps = [rng.choice([None, None, rng.randint(1, n)]) for _ in range(stages)]
    m = rng.choice([None, 1, 4, 8])
    extras = [0.0] * stages
    extras[-1] = rng.choice([0.0, 1.3])
    fitting = [
        s
        for s in all_splits(n, stages)
        if all(c is None or k <= c for k, c in zip(s, caps, strict=True))
    ]
    got = balanced_sizes(
        n, speeds, caps=caps, last_extra=extras[-1], micro_batches=m, shares=shares
    )
    if not fitting:
        assert got is None
        return
    best = min(throttled_step_cost(s, speeds, extras, shares, m) for s in fitting)
    assert throttled_step_cost(got, speeds, extras, shares, m) == pytest.approx(best)


@pytest.mark.parametrize("seed", range(20))
def test_shares_of_one_change_nothing(seed):
    rng = random.Random(900 + seed)
    stages = rng.randint(1, 4)
    n = rng.randint(stages, 12)
    speeds = [rng.uniform(0.1, 5) for _ in range(stages)]
    m = rng.choice([None, 4])
    assert balanced_sizes(n, speeds, micro_batches=m, shares=[1.0] * stages) == (
        balanced_sizes(n, speeds, micro_batches=m)
    )


def test_too_many_splits_to_try_falls_back_to_the_quota_scaled_speeds():
    n, stages = 40, 8
    assert math.comb(n - 1, stages - 1) > MAX_EVERY_SPLIT
    speeds, shares = [1.0 + i / 4 for i in range(stages)], [0.5] + [1.0] * (stages - 1)
    scaled = [speeds[0] * 0.5, *speeds[1:]]
    assert balanced_sizes(n, speeds, micro_batches=4, shares=shares) == balanced_sizes(
        n, scaled, micro_batches=4
    )


@pytest.mark.parametrize("shares", [[0.5], [0.5, 0.0], [0.5, -1.0]])
def test_shares_must_be_one_positive_per_stage(shares):
    with pytest.raises(ValueError, match="shares"):
        balanced_sizes(8, [1.0, 1.0], shares=shares)


PLACEMENT_MODEL = ModelConfig(n_layers=8, d_model=256, seq_len=128, n_heads=4)
BENCH = {
    # The placement benchmark's fellows on 2026-12-06: the probe (their speed while they
    # ran) found them equal; one holds 0.5 of a core for its one thread.
    "probed": ([14.01, 14.13], [2, 6]),
    # Measured on the equal split's steps, the quota's stalls left out (stage 0 pays the
    # embedding and its tape, stage 1 the head).
    "measured": ([8.05, 10.57], [2, 6]),
}


@pytest.mark.parametrize("case", BENCH, ids=list(BENCH))
def test_the_placement_benchmarks_fellows(case):
    speeds, want = BENCH[case]
    got = balanced_sizes(
        8,
        speeds,
        last_extra=head_blocks(PLACEMENT_MODEL),
        micro_batches=4,
        shares=[0.5, 1.0],
    )
    assert got == want


@pytest.mark.parametrize(
    ("cores", "quota", "share"),
    [(4, None, 1.0), (1, 0.5, 0.5), (2, 1.5, 0.75), (2, 2.0, 1.0), (2, 8.0, 1.0), (0, 0.5, 1.0)],
)
def test_cpu_share(cores, quota, share):
    assert cpu_share(cores, quota) == share


def test_place_gives_a_quota_bound_fellow_what_it_can_do_within_its_share():
    spec = JobSpec(
        model=PLACEMENT_MODEL,
        partition=Partition.BALANCED,
        allow_cpu=True,
        pipeline_last_stage_placement="preserve",
        batch_size=8,
        micro_batches=4,
    )
    placement = place(spec, [cand("boxed", 14.0, share=0.5), cand("free", 14.0)])
    assert not isinstance(placement, Unplaceable), placement
    got = [(s.fellow_id, s.layer_end - s.layer_start) for s in placement.stages]
    assert got == [("boxed", 2), ("free", 6)]
    # Without the quota the two are equal: the split is even.
    placement = place(spec, [cand("boxed", 14.0), cand("free", 14.0)])
    assert [s.layer_end - s.layer_start for s in placement.stages] == [4, 4]


@pytest.mark.parametrize(
    ("cores", "quota", "share"),
    [(2, 0.01, 0.01), (1, float("nan"), 1.0), (1, float("inf"), 1.0)],
)
def test_cpu_share_stays_a_usable_number(cores, quota, share):
    assert cpu_share(cores, quota) == share


@pytest.mark.parametrize(
    ("speeds", "shares"),
    [([1.0, float("nan")], None), ([1.0, 1.0], [0.5, float("nan")]), ([1.0, 1.0], [0.5, 0.0])],
)
def test_balanced_sizes_refuses_figures_that_are_not_numbers(speeds, shares):
    with pytest.raises(ValueError):
        balanced_sizes(8, speeds, micro_batches=4, shares=shares)


def test_a_heartbeat_may_not_carry_a_vanishing_quota():
    snapshot = {"hostname": "h", "cpu_cores": 2, "ram_total_bytes": 1, "ram_available_bytes": 1}
    ok = msgspec.json.decode(
        msgspec.json.encode({**snapshot, "cpu_quota": 0.5}), type=HardwareSnapshot
    )
    assert ok.cpu_quota == 0.5
    for quota in (5e-324, 0.0, -1.0, 1e9):
        with pytest.raises(msgspec.ValidationError, match="cpu_quota"):
            msgspec.json.decode(
                msgspec.json.encode({**snapshot, "cpu_quota": quota}), type=HardwareSnapshot
            )


@pytest.mark.parametrize(
    ("cores", "host", "on_host", "threads"),
    [
        (2, 2, 2, 1),  # two fellows on a 2-core host, no quotas: one core each
        (2, 64, 2, 2),  # two containers of 2 cores on a 64-core host: their own
        (16, 16, 3, 5),
        (1, 64, 1, 1),  # a quota of a core on a big host: one thread
        (4, None, 2, 2),  # an older agent: its count is the host's
    ],
)
def test_a_stages_threads_are_its_fellows_and_its_share_of_the_host(cores, host, on_host, threads):
    c = Candidate(
        fellow_id="f",
        hostname="h",
        data_address=None,
        cpu_cores=cores,
        host_cpu_cores=host,
        ram_available_bytes=GIB,
    )
    assert intra_op_threads(c, on_host) == threads


def test_a_fellows_absurd_figures_hold_its_job_not_the_schedule():
    """A speed at the protocol's lower edge times the least share is no number placement can
    divide by: that job waits with the reason, the next one is placed."""
    now = 1.0

    def record(job_id: str, partition: Partition, stages: int) -> JobRecord:
        spec = JobSpec(
            model=ModelConfig(n_layers=40),
            partition=partition,
            allow_cpu=True,
            stages=stages,
            micro_batches=4,
        )
        return JobRecord(
            job_id=job_id,
            name=job_id,
            spec=spec,
            state=JobState.PENDING,
            created_at=now,
            updated_at=now,
        )

    # The balanced job takes every fellow, the liar too (it takes the fastest of more).
    fellows = [cand("liar", 5e-324, ram_gib=64, share=0.01)]
    fellows += [cand(f"f{i}", 1.0) for i in range(7)]
    fellows += [cand(f"g{i}", 1.0) for i in range(8)]
    assignments, waiting = plan_schedule(
        [record("bad", Partition.BALANCED, 16), record("next", Partition.EQUAL, 8)], fellows
    )
    assert "placement failed" in waiting["bad"]
    assert [a.job_id for a in assignments] == ["next"]
