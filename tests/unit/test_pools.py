"""Pools and labels: what a fellow and a job say, where a job may be placed, why it waits,
and the accounts' pool limits. Pure functions, table-driven."""

from __future__ import annotations

import msgspec
import pytest

from silentswarm import subjects
from silentswarm.errors import ConfigError, FieldError, ProtocolError
from silentswarm.jobspec import JobSpec, PlacedStage, Placement, decode_job_spec
from silentswarm.leader.jobs import JobManager, plan_schedule
from silentswarm.leader.placement import Candidate, Unplaceable, place
from silentswarm.leader.pools import Held, account_limit, by_pool, fits, fleet_note, holdings
from silentswarm.leader.registry import FellowRegistry
from silentswarm.plan import ModelConfig, Transport
from silentswarm.pools import DEFAULT_POOL, format_labels, parse_labels
from silentswarm.protocol import (
    FellowIdentity,
    FellowStatus,
    HardwareSnapshot,
    Heartbeat,
    JobState,
    RegisterRequest,
)
from silentswarm.settings import Settings
from silentswarm.types.accounts import Account, PoolLimit, Role
from silentswarm.types.fleet import FellowRecord
from silentswarm.types.jobs import JobRecord
from tests.fakes import Clock


def spec(**kw) -> JobSpec:
    return JobSpec(model=ModelConfig(n_layers=4), **kw)


def cand(fid: str, pool: str = DEFAULT_POOL, **labels: str) -> Candidate:
    return Candidate(
        fellow_id=fid,
        hostname=f"h-{fid}",
        data_address=f"tcp://127.0.0.1:1{len(fid)}",
        cpu_cores=2,
        ram_available_bytes=8 << 30,
        pool=pool,
        labels=labels,
    )


def record(fid: str, pool: str = DEFAULT_POOL, status=FellowStatus.READY, **labels) -> FellowRecord:
    return FellowRecord(
        fellow_id=fid,
        instance_id="i",
        hostname="h",
        version="t",
        pid=1,
        data_address=None,
        status=status,
        hardware=HardwareSnapshot(
            hostname="h", cpu_cores=2, ram_total_bytes=1 << 33, ram_available_bytes=1 << 33
        ),
        registered_at=0.0,
        pool=pool,
        labels=labels,
    )


def account(name="alice", pools=None, **limits: PoolLimit) -> Account:
    return Account(
        name=name,
        role=Role.SUBMITTER,
        token_sha256="0" * 64,
        created_at=0.0,
        pools=pools,
        pool_limits=limits,
    )


# --- what a fellow and a job say -------------------------------------------------------------

LABELS = {
    "one": ("gpu=a100", {"gpu": "a100"}),
    "two, spaces": (" gpu = a100 , zone=eu ", {"gpu": "a100", "zone": "eu"}),
    "none": ("", {}),
    "trailing comma": ("gpu=a100,", {"gpu": "a100"}),
}


@pytest.mark.parametrize("name", list(LABELS))
def test_labels_parse(name):
    text, expected = LABELS[name]
    assert parse_labels(text) == expected
    assert parse_labels(format_labels(expected)) == expected


BAD_LABELS = {
    "no value": ("gpu", "not key=value"),
    "twice": ("gpu=a,gpu=b", "given twice"),
    "space in key": ("g pu=a", "'g pu=a'"),
    "empty value": ("gpu=", "'gpu='"),
    "too long": ("gpu=" + "a" * 64, "1-63 letters"),
    "too many": (",".join(f"k{i}=v" for i in range(17)), "17 labels; at most 16"),
}


@pytest.mark.parametrize("name", list(BAD_LABELS))
def test_bad_labels_are_refused_naming_the_setting(name):
    text, words = BAD_LABELS[name]
    with pytest.raises(ConfigError) as err:
        Settings.from_env({"SWARM_FELLOW_LABELS": text})
    assert err.value.message.startswith("SWARM_FELLOW_LABELS: ") and words in err.value.message


def test_a_fellow_without_a_pool_is_in_the_default_pool():
    assert Settings.from_env({}).pool == DEFAULT_POOL
    settings = Settings.from_env({"SWARM_FELLOW_POOL": "gpu", "SWARM_FELLOW_LABELS": "gpu=a100"})
    assert (settings.pool, settings.labels) == ("gpu", {"gpu": "a100"})
    with pytest.raises(ConfigError, match=r"^SWARM_FELLOW_POOL: "):
        Settings.from_env({"SWARM_FELLOW_POOL": "no spaces"})


BAD_SPECS = {
    "pool with a space": ({"pool": "g pu"}, "pool"),
    "pool too long": ({"pool": "p" * 65}, "pool"),
    "label value not a string": ({"labels": {"gpu": 1}}, "labels"),
    "label key with a slash": ({"labels": {"a/b": "x"}}, "labels"),
    "too many labels": ({"labels": {f"k{i}": "v" for i in range(17)}}, "labels"),
    "labels not an object": ({"labels": ["gpu=a100"]}, "labels"),
}


@pytest.mark.parametrize("name", list(BAD_SPECS))
def test_a_bad_pool_or_label_in_a_job_spec_names_the_field(name):
    body, field = BAD_SPECS[name]
    with pytest.raises(FieldError) as err:
        decode_job_spec(msgspec.json.encode(body))
    assert err.value.field.startswith(field) and err.value.message.startswith(field)


def test_a_job_spec_with_a_pool_and_labels_decodes():
    job = decode_job_spec(b'{"pool": "gpu", "labels": {"gpu": "a100"}}')
    assert (job.pool, job.run_pool, job.labels) == ("gpu", "gpu", {"gpu": "a100"})
    assert decode_job_spec(b"{}").run_pool == DEFAULT_POOL


def test_a_fellows_claims_outside_the_bounds_are_refused_on_the_wire():
    ident = {"fellow_id": "f", "instance_id": "i", "hostname": "h", "version": "1", "pid": 1}
    hardware = {"hostname": "h", "cpu_cores": 1, "ram_total_bytes": 1, "ram_available_bytes": 1}
    for claim in (
        {"pool": "../etc"},
        {"labels": {f"k{i}": "v" for i in range(17)}},
        {"labels": {"gpu": "x" * 100}},
    ):
        payload = {"kind": "register", "fellow": {**ident, **claim}, "hardware": hardware}
        with pytest.raises(ProtocolError):
            subjects.REGISTER.decode(msgspec.msgpack.encode(payload))
    old = {"kind": "register", "fellow": ident, "hardware": hardware}
    assert subjects.REGISTER.decode(msgspec.msgpack.encode(old)).fellow.pool == DEFAULT_POOL


def test_the_registry_records_a_fellows_pool_and_labels_and_their_changes():
    registry = FellowRegistry(heartbeat_interval_s=1, offline_after_s=3, leader_version="t")
    hw = HardwareSnapshot(hostname="h", cpu_cores=1, ram_total_bytes=1, ram_available_bytes=1)
    ident = FellowIdentity(
        fellow_id="f", instance_id="i1", hostname="h", version="t", pid=1, pool="gpu",
        labels={"gpu": "a100"},
    )  # fmt: skip
    assert registry.register(RegisterRequest(fellow=ident, hardware=hw)).accepted
    assert (registry.get("f").pool, registry.get("f").labels) == ("gpu", {"gpu": "a100"})
    # What it says last counts (a heartbeat carries its identity too).
    again = msgspec.structs.replace(ident, pool="cpu", labels={})
    assert registry.heartbeat(
        Heartbeat(fellow=again, seq=1, status=FellowStatus.READY, hardware=hw)
    )
    assert (registry.get("f").pool, registry.get("f").labels) == ("cpu", {})


# --- where a job may run --------------------------------------------------------------------

FITS = {
    "default job, default fellow": (spec(), DEFAULT_POOL, {}, True),
    "default job, pooled fellow": (spec(), "gpu", {}, False),
    "pooled job, default fellow": (spec(pool="gpu"), DEFAULT_POOL, {}, False),
    "pooled job, its pool": (spec(pool="gpu"), "gpu", {"gpu": "a100"}, True),
    "labels all carried": (
        spec(labels={"gpu": "a100"}),
        DEFAULT_POOL,
        {"gpu": "a100", "z": "eu"},
        True,
    ),
    "a label with another value": (
        spec(labels={"gpu": "a100"}),
        DEFAULT_POOL,
        {"gpu": "h100"},
        False,
    ),
    "a label missing": (
        spec(labels={"gpu": "a100", "z": "eu"}),
        DEFAULT_POOL,
        {"gpu": "a100"},
        False,
    ),
    "the right labels in another pool": (
        spec(pool="b", labels={"gpu": "a100"}),
        "a",
        {"gpu": "a100"},
        False,
    ),
}


@pytest.mark.parametrize("name", list(FITS))
def test_which_fellows_a_job_fits(name):
    job, pool, labels, expected = FITS[name]
    assert fits(pool, labels, job) is expected


FLEET = [cand("a1", "a"), cand("a2", "a"), cand("b1", "b", gpu="a100"), cand("b2", "b", gpu="t4")]

PLACED = {
    "pool b": (spec(pool="b"), ["b1", "b2"]),
    "pool b, a100 only": (spec(pool="b", labels={"gpu": "a100"}), ["b1"]),
    "pool a, two stages": (spec(pool="a", stages=2), ["a1", "a2"]),
    "no pool: the default pool only": (spec(), None),
    "pool b, three stages": (spec(pool="b", stages=3), None),
}


@pytest.mark.parametrize("name", list(PLACED))
def test_a_job_is_placed_only_on_fellows_of_its_pool_with_its_labels(name):
    job, expected = PLACED[name]
    result = place(job, FLEET)
    if expected is None:
        assert isinstance(result, Unplaceable) and result.too_few
    else:
        assert sorted(result.fellow_ids) == expected


REASONS = {
    "a pool": (spec(pool="b", stages=3), "waiting for 3 ready fellows in pool b; 2 available"),
    "labels": (
        spec(pool="b", stages=2, labels={"gpu": "a100"}),
        "waiting for 2 ready fellows in pool b matching gpu=a100; 1 available",
    ),
    "the default pool, said as before": (
        spec(stages=2),
        "waiting for 2 ready fellows; 0 available",
    ),
}


@pytest.mark.parametrize("name", list(REASONS))
def test_why_a_pinned_job_waits_names_its_pool_labels_and_numbers(name):
    job, reason = REASONS[name]
    result = place(job, FLEET)
    assert isinstance(result, Unplaceable) and result.reason == reason


def test_the_account_limit_caps_a_job_that_takes_every_ready_fellow():
    result = place(spec(pool="a"), FLEET, max_stages=1)
    assert len(result.fellow_ids) == 1


NOTES = {
    "busy": ([record("b1", "b", FellowStatus.TRAINING)], ", 1 busy"),
    "offline and not ready": (
        [record("b1", "b", FellowStatus.OFFLINE), record("b2", "b", FellowStatus.REGISTERING)],
        ", 1 not ready, 1 offline",
    ),
    "no such pool": (
        [record("a1", "a"), record("x", DEFAULT_POOL)],
        " (no fellow is in pool b; pools: a, default)",
    ),
    "none carries the labels": (
        [record("b1", "b", gpu="t4")],
        " (none of the 1 fellow(s) in pool b carries gpu=a100)",
    ),
    "the free ones are not counted again": ([record("b1", "b")], ""),
}


@pytest.mark.parametrize("name", list(NOTES))
def test_what_the_fleet_adds_to_a_waiting_reason(name):
    fellows, note = NOTES[name]
    job = spec(pool="b", labels={"gpu": "a100"} if "labels" in name else {})
    free = {"b1"} if "free" in name else set()
    assert fleet_note(job, by_pool(fellows), free=free) == note


# --- accounts' pool limits ------------------------------------------------------------------

LIMITS = {
    "no account: no limit": (None, spec(pool="gpu"), Held(5, 50), "", None),
    "any pool": (account(), spec(pool="gpu"), Held(5, 50), "", None),
    "not its pool": (
        account(pools=["a"]),
        spec(pool="gpu"),
        Held(),
        "may not use pool gpu (its pools: a)",
        None,
    ),
    "a job without a pool is in the default pool": (
        account(pools=["a"]),
        spec(),
        Held(),
        "may not use pool default",
        None,
    ),
    "max_jobs reached": (
        account(gpu=PoolLimit(max_jobs=1)),
        spec(pool="gpu"),
        Held(1, 2),
        "runs 1 job(s) in pool gpu; its limit is 1 (max_jobs)",
        None,
    ),
    "max_jobs not reached": (
        account(gpu=PoolLimit(max_jobs=2)),
        spec(pool="gpu"),
        Held(1, 2),
        "",
        None,
    ),
    "max_fellows: too few left": (
        account(gpu=PoolLimit(max_fellows=3)),
        spec(pool="gpu", stages=2),
        Held(1, 2),
        "holds 2 fellow(s) in pool gpu; its limit is 3 (max_fellows) and the job needs 2",
        None,
    ),
    "max_fellows: what is left caps it": (
        account(gpu=PoolLimit(max_fellows=3)),
        spec(pool="gpu"),
        Held(1, 1),
        "",
        2,
    ),
    "another pool's limit": (account(a=PoolLimit(max_jobs=0)), spec(pool="gpu"), Held(), "", None),
    "max_jobs 0: none": (
        account(gpu=PoolLimit(max_jobs=0)),
        spec(pool="gpu"),
        Held(),
        "its limit is 0 (max_jobs)",
        None,
    ),
}


@pytest.mark.parametrize("name", list(LIMITS))
def test_what_an_accounts_pool_limits_let_its_next_job_do(name):
    who, job, held, words, max_stages = LIMITS[name]
    allowance = account_limit(who, job, held)
    assert words in allowance.reason and bool(words) == bool(allowance.reason)
    if words:
        assert allowance.reason.startswith("account alice ")
    assert allowance.max_stages == max_stages


def job_record(job_id, owner, pool, fellows, state=JobState.RUNNING) -> JobRecord:
    placement = Placement(
        stages=[
            PlacedStage(stage=i, fellow_id=f, hostname="h", layer_start=i, layer_end=i + 1)
            for i, f in enumerate(fellows)
        ],
        transport=Transport.TUNNEL,
    )
    return JobRecord(
        job_id=job_id,
        name=job_id,
        spec=spec(pool=pool),
        state=state,
        created_at=0.0,
        updated_at=0.0,
        placement=placement,
        owner=owner,
    )


def test_what_each_owners_placed_jobs_hold_per_pool():
    jobs = [
        job_record("r1", "alice", "gpu", ["f1", "f2"]),
        job_record("r2", "alice", "gpu", ["f3"]),
        job_record("s1", "alice", "gpu", ["f4"], state=JobState.PENDING),  # starting
        job_record("p1", "alice", "gpu", ["f5"], state=JobState.PENDING),  # an abandoned start
        job_record("d1", "alice", "gpu", ["f6"], state=JobState.COMPLETED),
        job_record("b1", "bob", "gpu", ["f7"]),
        job_record("a1", "alice", "cpu", ["f8"]),
    ]
    assert holdings(jobs, starting={"s1"}) == {
        ("alice", "gpu"): Held(3, 4),
        ("bob", "gpu"): Held(1, 1),
        ("alice", "cpu"): Held(1, 1),
    }


def test_a_second_job_beyond_its_accounts_limit_waits_while_another_owners_runs():
    clock = Clock()
    manager = JobManager(wall=clock)
    jobs = []
    for owner in ("alice", "alice", "bob"):
        clock.now += 1
        job = manager.submit(spec(pool="gpu", stages=1))
        job.owner = owner
        jobs.append(job)
    limited = {"alice": account(gpu=PoolLimit(max_jobs=1))}
    fleet = [cand(f"g{i}", "gpu") for i in range(3)]
    assignments, waiting = plan_schedule(manager.pending(), fleet, account_of=limited.get)
    assert [a.job_id for a in assignments] == [jobs[0].job_id, jobs[2].job_id]
    assert waiting == {
        jobs[1].job_id: "waiting: account alice runs 1 job(s) in pool gpu; its limit is 1 "
        "(max_jobs)"
    }


def test_a_job_pinned_to_a_busy_pool_waits_saying_so_and_not_on_another_pool():
    clock = Clock()
    manager = JobManager(wall=clock)
    job = manager.submit(spec(pool="b", stages=1))
    fleet = [record("a1", "a"), record("b1", "b", FellowStatus.TRAINING)]
    assignments, waiting = plan_schedule(manager.pending(), [cand("a1", "a")], fleet=fleet)
    assert assignments == []
    assert waiting[job.job_id] == "waiting for 1 ready fellows in pool b; 0 available, 1 busy"


def test_a_resumed_job_is_placed_again_in_its_pool_only():
    clock = Clock()
    manager = JobManager(wall=clock)
    job = manager.submit(spec(pool="b", stages=2))
    job.layer_ranges = [(0, 2), (2, 4)]
    free = [cand("a1", "a"), cand("a2", "a"), cand("b1", "b")]
    assignments, waiting = plan_schedule(manager.pending(), free)
    assert assignments == [] and "in pool b; 1 available" in waiting[job.job_id]
    assignments, _ = plan_schedule(manager.pending(), [*free, cand("b3", "b")])
    assert sorted(assignments[0].placement.fellow_ids) == ["b1", "b3"]
