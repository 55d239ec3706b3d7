"""Fellows on one machine split its cores (issue 23's throughput-aware placement): a fellow's
speed is measured on all its own cores, and every stage of a job on its host gets its share
of them (``intra_op_threads``), so the placement's choices weigh what each keeps."""

from __future__ import annotations

import random

import msgspec
import pytest

from silentswarm.agent.hardware import boot_id
from silentswarm.jobspec import JobSpec, Partition, PlacedStage, Placement
from silentswarm.leader import elastic
from silentswarm.leader.balance import MAX_SPEED, balanced_sizes, head_blocks, measured_speed
from silentswarm.leader.decide import candidate
from silentswarm.leader.jobs import JobManager
from silentswarm.leader.memory import CPU_RUNTIME_BYTES
from silentswarm.leader.placement import (
    Candidate,
    Unplaceable,
    _stage_memory,
    core_share,
    core_shares,
    machine,
    place,
    speed_alone,
    stage_cores,
    thread_cores,
)
from silentswarm.leader.registry import FellowRegistry
from silentswarm.plan import ModelConfig, Transport, split_layers
from silentswarm.protocol import (
    FellowIdentity,
    FellowStatus,
    HardwareSnapshot,
    MachineId,
    Progress,
    RegisterRequest,
)
from silentswarm.types.jobs import JobRecord
from silentswarm.types.links import MeasuredLink
from tests.fakes import Clock, cpu_candidate, offline_orchestrator

GIB = 1 << 30


def on(fid: str, speed: float | None, host: str, *, cores: int = 8, **kw) -> Candidate:
    """A CPU fellow of ``cores`` cores on machine ``host`` (8 cores), its data address there."""
    kw.setdefault("host_cpu_cores", 8)
    return msgspec.structs.replace(
        cpu_candidate(fid, kw.pop("ram_gib", 16.0), speed),
        hostname=host,
        data_address=f"tcp://{host}:{5700 + ord(fid[0])}",
        cpu_cores=cores,
        **kw,
    )


def job(**kw) -> JobSpec:
    kw.setdefault("partition", Partition.BALANCED)
    kw.setdefault("stages", 2)
    return JobSpec(
        model=ModelConfig(n_layers=8),
        allow_cpu=True,
        pipeline_last_stage_placement="preserve",
        **kw,
    )


def taken(placement) -> set[str]:
    assert not isinstance(placement, Unplaceable), placement
    return {s.fellow_id for s in placement.stages}


# (its cores, the host's, its CPU quota's share, stages of the job on its host, the share
# it keeps). A fellow's cores are its quota rounded up (swarm/cpus.py).
SHARES = {
    "alone": (8, 8, 1.0, 1, 1.0),
    "two stages on a machine: half its cores each": (8, 8, 1.0, 2, 0.5),
    "three: 2 threads of 8": (8, 8, 1.0, 3, 0.25),
    "4 cores of the machine's 8: two such fellows do not contend": (4, 8, 1.0, 2, 1.0),
    "a quota of 1.5 cores alone": (2, 8, 0.75, 1, 1.0),
    "a quota of 1.5 cores on 1 thread of 8 stages'": (2, 8, 0.75, 8, 1 / 1.5),
    "a quota of 3.5 cores, 4 stages on 8: 2 threads": (4, 8, 0.875, 4, 2 / 3.5),
    "more stages than cores: a thread each, 2 cores for 3": (2, 2, 1.0, 3, 1 / 3),
}


@pytest.mark.parametrize("case", SHARES, ids=list(SHARES))
def test_core_share(case):
    cores, host, share, on_host, want = SHARES[case]
    c = on("a", 1.0, "h", cores=cores, host_cpu_cores=host, cpu_share=share)
    assert core_share(c, on_host) == pytest.approx(want)


# (its cores, the host's, stages on the host, the cores' worth of threads a stage runs on)
THREAD_CORES = {
    "alone": (8, 8, 1, 8),
    "two": (8, 8, 2, 4),
    "its own 4 of 8, two stages": (4, 8, 2, 4),
    "its own 4 of 8, four stages": (4, 8, 4, 2),
    "three stages on 2 cores: a thread each, two thirds of a core": (2, 2, 3, 2 / 3),
}


@pytest.mark.parametrize("case", THREAD_CORES, ids=list(THREAD_CORES))
def test_thread_cores(case):
    cores, host, on_host, want = THREAD_CORES[case]
    c = on("a", 1.0, "h", cores=cores, host_cpu_cores=host)
    assert thread_cores(c, on_host) == pytest.approx(want)


def test_core_shares_count_each_host_apart():
    fellows = [on("a", 1.0, "h"), on("b", 1.0, "h"), on("c", 1.0, "x")]
    assert core_shares(fellows) == {"a": 0.5, "b": 0.5, "c": 1.0}


# (its cores, the cores' worth its stage ran on, the speed it showed, the speed alone)
ALONE = {
    "its own threads": (8, None, 3.0, 3.0),
    "all its cores": (8, 8, 3.0, 3.0),
    "half its cores beside another stage": (8, 4, 3.0, 6.0),
    "bounded as a protocol speed is": (8, 1, MAX_SPEED / 2, MAX_SPEED),
}


@pytest.mark.parametrize("case", ALONE, ids=list(ALONE))
def test_speed_alone(case):
    cores, ran_on, shown, want = ALONE[case]
    assert speed_alone(on("a", 1.0, "h", cores=cores), shown, ran_on) == pytest.approx(want)


def placed(fellow: str, host: str, threads: int | None, replica: int = 0) -> PlacedStage:
    return PlacedStage(
        stage=0,
        fellow_id=fellow,
        replica=replica,
        hostname=host,
        layer_start=0,
        layer_end=8,
        intra_op_threads=threads,
    )


# (the job's stages: fellow, host, threads; the stage asked of; the cores' worth it ran on)
CORES = {
    "alone on its host": ([("a", "h", 8), ("b", "x", 8)], "a", 8.0),
    "two stages that split the host": ([("a", "h", 4), ("b", "h", 4)], "a", 4.0),
    "a replacement beside a stage that kept its 8 threads": (
        [("a", "h", 8), ("u", "h", 4)],
        "u",
        4 * 8 / 12,
    ),
    "threads never set": ([("a", "h", None)], "a", None),
}


@pytest.mark.parametrize("case", CORES, ids=list(CORES))
def test_stage_cores(case):
    rows, asked, want = CORES[case]
    stages = [placed(f, h, t, replica=r) for r, (f, h, t) in enumerate(rows)]
    got = stage_cores(stages, next(s for s in stages if s.fellow_id == asked), 8)
    assert got == (None if want is None else pytest.approx(want))


FAR = {("a", "c"): MeasuredLink(mbit_s=1000.0, rtt_ms=1.0)}


@pytest.mark.parametrize("links", [None, FAR], ids=["nothing measured", "a fast link to c"])
def test_a_job_does_not_take_two_fellows_that_would_halve_each_other(links):
    """a and b (10 blocks/s each, alone) share one 8-core machine: together each runs on 4
    threads, 5 and 5. c, on its own machine, runs at 7: a with c is the faster pipeline.
    Two fellows of 4 cores each on that machine do not contend: a and b then."""
    fellows = [on("a", 10.0, "h"), on("b", 10.0, "h"), on("c", 7.0, "x")]
    assert taken(place(job(), fellows, links=links)) == {"a", "c"}
    apart = [on("a", 10.0, "h", cores=4), on("b", 10.0, "h", cores=4), on("c", 7.0, "x")]
    assert taken(place(job(), apart, links=links)) == {"a", "b"}


def test_a_crowded_machine_does_not_fill_the_fellows_weighed():
    """Eight fellows at 10 on one 8-core machine, four at 7 apart: a pipeline takes one of
    the machine's (alone there it keeps 10) and the rest apart, at 2 stages as at 4 (two
    of h would keep 5 each, four 2.5), fresh or resumed."""
    crowded = [on(f"h{i}", 10.0, "h") for i in range(8)]
    apart = [on(f, 7.0, "x" + f) for f in "cdef"]
    fellows = [*crowded, *apart]
    quarters = [(0, 2), (2, 4), (4, 6), (6, 8)]
    for placement in (
        place(job(), fellows),
        place(job(stages=4), fellows),
        place(job(stages=4), fellows, ranges=quarters),
    ):
        assert sum(f.startswith("h") for f in taken(placement)) == 1, taken(placement)


def test_replicas_take_the_fellows_that_keep_the_most_speed():
    """Four fellows at 10 on one 8-core machine, four at 7 apart: two replicas of two
    stages on all of h would run at 2 threads each (2.5); those apart keep 7."""
    crowded = [on(f"h{i}", 10.0, "h", ram_gib=64) for i in range(4)]
    apart = [on(f, 7.0, "x" + f) for f in "cdef"]
    chosen = taken(place(job(replicas=2), [*crowded, *apart]))
    assert sum(f.startswith("h") for f in chosen) <= 1, chosen


def test_a_resumed_job_s_split_is_refilled_off_a_shared_machine():
    fellows = [on("a", 10.0, "h"), on("b", 10.0, "h"), on("c", 7.0, "x")]
    resumed = place(job(), fellows, ranges=[(0, 4), (4, 8)])
    assert taken(resumed) == {"a", "c"}


@pytest.mark.parametrize("ranges", [None, [(0, 4), (4, 8)]], ids=["fresh", "resumed"])
def test_replicas_on_a_shared_machine_are_grouped_with_the_fellows_apart(ranges):
    """Two replicas of two stages on a and b (one machine: 5 blocks/s each while all four
    run) and c and d (10 each, apart). Dealt by memory, a and b would make one replica,
    which would pace the job; grouped by what each keeps, each replica takes one of them
    (a resumed job's fixed split too)."""
    fellows = [
        on("a", 10.0, "h", ram_gib=40),
        on("c", 10.0, "x", ram_gib=30),
        on("b", 10.0, "h", ram_gib=20),
        on("d", 10.0, "y", ram_gib=10),
    ]
    ids = [c.fellow_id for c in fellows]
    links = {(x, y): MeasuredLink(mbit_s=1000.0, rtt_ms=1.0) for x in ids for y in ids if x < y}
    placed = place(job(replicas=2), fellows, links=links, ranges=ranges)
    assert not isinstance(placed, Unplaceable), placed
    grid = [{s.fellow_id for s in placed.pipeline(r)} for r in range(2)]
    assert all(len(group & {"a", "b"}) == 1 for group in grid), grid


def running(spec: JobSpec, fellows: list[Candidate]) -> JobRecord:
    """``spec`` RUNNING on ``fellows``; replica 1 lost."""
    jobs = JobManager(wall=Clock())
    record = jobs.submit(spec)
    placement = place(spec, fellows)
    assert isinstance(placement, Placement), placement
    jobs.begin_start(record.job_id, placement)
    jobs.start_succeeded(record.job_id)
    jobs.lose_stage(record.job_id, placement.pipeline(1)[0].fellow_id, "went offline")
    return record


def test_a_replacement_shares_the_machine_of_a_live_replica_s_stage():
    """Replica 0 runs on machines ha and hb. u, the fastest idle fellow, sits on ha: beside
    replica 0's stage it would keep half its cores (5 of 10), so the replacement takes v and
    w (7 each, apart); and where it must take u, u runs on half of ha's cores."""
    spec = job(replicas=2, sync="allreduce", steps=1000)
    record = running(spec, [on(f, 10.0, "h" + f, ram_gib=32 - at) for at, f in enumerate("abcd")])
    hosts = {s.hostname for s in record.placement.pipeline(0)}
    u = on("u", 10.0, sorted(hosts)[0], ram_gib=64)
    idle = [u, on("v", 7.0, "hv"), on("w", 7.0, "hw")]
    assert {s.fellow_id for s in elastic.replacement(record, idle)} == {"v", "w"}
    forced = elastic.replacement(record, idle[:2])
    assert {s.fellow_id: s.intra_op_threads for s in forced} == {"u": 4, "v": 8}


def test_the_balanced_split_gives_a_fellow_apart_the_layers_its_cores_can_take():
    """a and b halve each other on one machine: c, as fast alone, takes twice their layers
    (equal speeds alone would give it fewer: the head's work rides on the last stage)."""
    fellows = [on("a", 10.0, "h"), on("b", 10.0, "h"), on("c", 10.0, "x")]
    placed = place(job(stages=3, micro_batches=8), fellows)
    assert not isinstance(placed, Unplaceable), placed
    layers = {s.fellow_id: s.layer_end - s.layer_start for s in placed.stages}
    assert layers == {"a": 2, "b": 2, "c": 4}


def test_each_replica_s_split_counts_the_other_replicas_on_its_machine():
    """Replica 0 on a (machine h) and c, replica 1 on b (machine h too) and d: a and b
    halve each other though they are in different replicas, so each replica's stage on h
    takes fewer layers than its stage apart."""
    fellows = [
        on("a", 10.0, "h", ram_gib=40),
        on("b", 10.0, "h", ram_gib=39),
        on("c", 10.0, "x", ram_gib=38),
        on("d", 10.0, "y", ram_gib=37),
    ]
    placed = place(job(replicas=2, micro_batches=8), fellows)
    assert not isinstance(placed, Unplaceable), placed
    for r in range(2):
        shared, apart = placed.pipeline(r)  # preserve: in rank order
        assert shared.hostname == "h" and apart.hostname != "h"
        assert shared.layer_end - shared.layer_start < apart.layer_end - apart.layer_start


def test_the_leader_keeps_a_stage_s_speed_on_its_fellow_s_cores_alone():
    """Two stages on one 8-core machine ran on 4 threads each: the speed their step records
    show is kept twice over (what each would do alone on its 8), and the next placement's
    shares halve it again, to what the stages showed."""
    registry = FellowRegistry(heartbeat_interval_s=1, offline_after_s=3, leader_version="t")
    registry.bus_connected()
    for fid in "ab":
        hw = HardwareSnapshot(
            hostname="h",
            cpu_cores=8,
            host_cpu_cores=8,
            ram_total_bytes=32 * GIB,
            ram_available_bytes=16 * GIB,
            compute_speed=5.0,
        )
        ident = FellowIdentity(fellow_id=fid, instance_id="i", hostname="h", version="t", pid=1)
        registry.register(RegisterRequest(fellow=ident, hardware=hw, status=FellowStatus.READY))
    jobs = JobManager(wall=Clock())
    spec = job(steps=100)
    record = jobs.submit(spec)
    placement = place(spec, [candidate(registry.get(f)) for f in "ab"])
    assert isinstance(placement, Placement), placement
    assert [s.intra_op_threads for s in placement.stages] == [4, 4]
    jobs.begin_start(record.job_id, placement)
    jobs.start_succeeded(record.job_id)
    orchestrator = offline_orchestrator(registry, jobs)
    first = placement.stages[0]
    progress = Progress(
        job_id=record.job_id,
        fellow_id=first.fellow_id,
        attempt=record.attempt,
        stage=0,
        step=10,
        step_time_s=0.5,
        wait_s=0.1,
    )
    orchestrator._learn(record, progress)
    shown = measured_speed(
        spec.model,
        batch_size=spec.batch_size,
        layers=first.layer_end - first.layer_start,
        last=False,
        busy_s=0.4,
    )
    kept = registry.get(first.fellow_id).measured_speed
    assert kept == pytest.approx(2 * shown)
    again = candidate(registry.get(first.fellow_id))
    assert again.compute_speed * core_share(again, 2) == pytest.approx(shown)


BOOT_A, BOOT_B = "650e89de-8cb4-407d-99e5-45fed725057a", "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"


def test_a_machine_is_told_by_its_boot_id_then_its_address_then_its_host_name():
    """Machines cloned from one image share a host name, machines behind one NAT an
    address: neither splits the other's cores, their boot ids differ. Containers on one
    machine (their own host names and addresses) share its kernel's boot id, and its cores.
    From an older agent (no boot id): its data address's host, else its host name."""

    def at(fid, ip, hostname, boot=None):
        fellow = msgspec.structs.replace(on(fid, 10.0, ip), hostname=hostname)
        return msgspec.structs.replace(fellow, machine_id=boot)

    cloned = [at("a", "10.0.0.1", "ubuntu", BOOT_A), at("b", "10.0.0.2", "ubuntu", BOOT_B)]
    behind_a_nat = [at("a", "203.0.113.5", "a", BOOT_A), at("b", "203.0.113.5", "b", BOOT_B)]
    containers = [at("a", "172.17.0.2", "c0ffee", BOOT_A), at("b", "172.17.0.3", "beef", BOOT_A)]
    for fellows, share, threads in ((cloned, 1.0, 8), (behind_a_nat, 1.0, 8), (containers, 0.5, 4)):
        assert core_shares(fellows) == {"a": share, "b": share}
        placed = place(job(), fellows)
        assert {s.intra_op_threads for s in placed.stages} == {threads}
        assert {s.machine_id for s in placed.stages} == {c.machine_id for c in fellows}
    older = [at("a", "10.0.0.1", "ubuntu"), at("b", "10.0.0.1", "other")]
    assert [machine(c) for c in older] == ["addr:10.0.0.1", "addr:10.0.0.1"]
    no_address = [msgspec.structs.replace(c, data_address=None) for c in older]
    assert [machine(c) for c in no_address] == ["name:ubuntu", "name:other"]
    # Cloned, behind no address at all: the host name alone would merge them.
    relayed = [msgspec.structs.replace(c, data_address=None) for c in cloned]
    assert core_shares(relayed) == {"a": 1.0, "b": 1.0}


def test_the_boot_id_an_agent_reports(tmp_path):
    path = tmp_path / "boot_id"
    path.write_text(BOOT_A.upper() + "\n")
    assert boot_id(path) == BOOT_A
    path.write_text("not an id\n")
    assert boot_id(path) is None
    assert boot_id(tmp_path / "missing") is None
    real = boot_id()  # this machine's kernel (Linux)
    assert real is None or msgspec.convert({"machine_id": real}, MachineOnly).machine_id == real


class MachineOnly(msgspec.Struct):
    machine_id: MachineId


@pytest.mark.parametrize("bad", ["../../etc", "a" * 65, "abc", "650E89DE-8CB4"])
def test_a_machine_id_of_another_form_is_refused_in_a_snapshot(bad):
    snapshot = {"hostname": "h", "cpu_cores": 1, "ram_total_bytes": 1, "ram_available_bytes": 1}
    assert msgspec.convert(snapshot | {"machine_id": BOOT_A}, HardwareSnapshot).machine_id
    with pytest.raises(msgspec.ValidationError, match="machine_id"):
        msgspec.convert(snapshot | {"machine_id": bad}, HardwareSnapshot)


def test_every_fellow_of_one_machine_is_weighed_where_the_search_weighs_all():
    """Three fellows on one machine (as in a test's namespaces): which two of them a
    2-stage job takes is told by the links (a and b over loopback), not by speed alone."""
    fellows = [
        msgspec.structs.replace(on(f, speed, ip), machine_id=BOOT_A)
        for f, speed, ip in (("a", 2.0, "10.0.0.1"), ("b", 1.5, "10.0.0.1"), ("c", 3.0, "10.0.0.2"))
    ]
    links = {
        ("a", "c"): MeasuredLink(mbit_s=1.9, rtt_ms=2.0),
        ("b", "c"): MeasuredLink(mbit_s=1.9, rtt_ms=2.0),
    }
    assert taken(place(job(), fellows, links=links)) == {"a", "b"}


def test_nothing_shared_leaves_the_balanced_split_as_speeds_and_quotas_give_it():
    """Fellows each on a machine of their own: the split is balance.balanced_sizes of their
    speeds and quotas' shares exactly, whatever their core counts (a float's last digit
    must not break a tie otherwise)."""
    rng = random.Random(7)
    spec = JobSpec(
        model=ModelConfig(n_layers=24),
        partition=Partition.BALANCED,
        stages=3,
        micro_batches=4,
        allow_cpu=True,
        pipeline_last_stage_placement="preserve",
    )
    for _ in range(200):
        fellows = [
            on(
                f,
                rng.choice([0.1, 0.3, 0.7, 1.0, 2.5]),
                "x" + f,
                cores=rng.choice([1, 2, 3, 4, 8]),
                host_cpu_cores=8,
                cpu_share=rng.choice([1.0, 1.0, 0.5, 0.3]),
            )
            for f in "abc"
        ]
        placed = place(spec, fellows)
        assert not isinstance(placed, Unplaceable), placed
        got = [s.layer_end - s.layer_start for s in placed.stages]
        by_id = {c.fellow_id: c for c in fellows}
        order = [by_id[s.fellow_id] for s in placed.stages]
        want = balanced_sizes(
            24,
            [c.compute_speed for c in order],
            last_extra=head_blocks(spec.model),
            micro_batches=4,
            shares=[c.cpu_share for c in order],
        )
        assert got == want, (order, got, want)


def test_a_fellow_moved_to_stage_0_that_cannot_hold_it_keeps_its_place():
    """c (no data address) holds stage 1 of this equal split, not stage 0: dealt with c
    first the job would not fit; it runs as ranked instead, over the relay."""
    spec = JobSpec(
        model=ModelConfig(n_layers=5, vocab_size=1000, d_model=1024),
        partition=Partition.EQUAL,
        stages=2,
        allow_cpu=True,
        pipeline_last_stage_placement="preserve",
    )
    need = [
        _stage_memory(spec, i, 2, end - start).total + CPU_RUNTIME_BYTES
        for i, (start, end) in enumerate(split_layers(5, 2))
    ]
    assert need[0] > need[1]
    a = on("a", None, "x", ram_gib=64)
    c = msgspec.structs.replace(
        on("c", None, "y"), data_address=None, ram_available_bytes=(need[0] + need[1]) // 2
    )
    placed = place(spec, [a, c])
    assert not isinstance(placed, Unplaceable), placed
    assert [s.fellow_id for s in placed.stages] == ["a", "c"]
    assert placed.transport == Transport.TUNNEL
    roomy = msgspec.structs.replace(c, ram_available_bytes=64 * GIB)
    assert [s.fellow_id for s in place(spec, [a, roomy]).stages] == ["c", "a"]


def test_fellows_without_an_address_do_not_take_a_machine_s_place_among_the_linked():
    """A resumed job's refill where more are ready than it weighs: r1 and r2 (no data
    address) fill their machine's two places among all candidates, but the links are
    weighed among fellows with an address, where a1, on that machine, belongs."""
    fellows = [
        msgspec.structs.replace(on(f, 10.0, "m"), data_address=None, machine_id=BOOT_A)
        for f in ("r1", "r2")
    ]
    fellows.append(msgspec.structs.replace(on("a1", 5.0, "m"), machine_id=BOOT_A))
    fellows += [on(f"x{i}", 1.0, f"x{i}") for i in range(15)]
    fast = MeasuredLink(mbit_s=10000.0, rtt_ms=0.1)
    slow = MeasuredLink(mbit_s=1.0, rtt_ms=100.0)
    links = {("a1", "x0"): fast}
    links |= {(f"x{i}", f"x{j}"): slow for i in range(15) for j in range(i + 1, 15)}
    placed = place(job(), fellows, ranges=[(0, 4), (4, 8)], links=links)
    assert taken(placed) == {"a1", "x0"}
