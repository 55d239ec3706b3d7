"""WorkerRegistry rules, with both clocks under the test's control."""

import pytest

from leader.registry import WorkerRegistry
from swarm.protocol import (
    DeregisterRequest,
    FellowIdentity,
    FellowStatus,
    GpuInfo,
    HardwareSnapshot,
    Heartbeat,
    RegisterRequest,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def hw(host: str = "h1", gpus: list[GpuInfo] | None = None, taken_at: float = 0.0):
    return HardwareSnapshot(
        hostname=host,
        cpu_cores=8,
        ram_total_bytes=32 << 30,
        ram_available_bytes=16 << 30,
        gpus=gpus or [],
        taken_at=taken_at,
    )


def gpu(uuid: str, name: str, total_gib: int, free_gib: int) -> GpuInfo:
    return GpuInfo(
        index=0,
        uuid=uuid,
        name=name,
        memory_total_bytes=total_gib << 30,
        memory_free_bytes=free_gib << 30,
        memory_used_bytes=(total_gib - free_gib) << 30,
    )


def ident(fid: str, instance: str = "i1", host: str = "h1") -> FellowIdentity:
    return FellowIdentity(fellow_id=fid, instance_id=instance, hostname=host, version="t", pid=1)


def register(reg, fid, instance="i1", host="h1", status=FellowStatus.REGISTERING):
    return reg.register(
        RegisterRequest(fellow=ident(fid, instance, host), hardware=hw(host), status=status)
    )


def beat(reg, fid, instance="i1", status=FellowStatus.READY, host="h1", hardware=None):
    return reg.heartbeat(
        Heartbeat(
            fellow=ident(fid, instance, host),
            seq=1,
            status=status,
            hardware=hardware or hw(host),
        )
    )


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def reg(clock):
    r = WorkerRegistry(
        heartbeat_interval_s=1.0, offline_after_s=3.0, leader_version="t", clock=clock, wall=clock
    )
    r.bus_connected()
    return r


def test_register_then_heartbeat_makes_ready(reg):
    reply = register(reg, "f1")
    assert reply.accepted and reply.heartbeat_interval_s == 1.0 and reply.offline_after_s == 3.0
    assert reg.get("f1").status is FellowStatus.REGISTERING
    beat(reg, "f1")
    record = reg.get("f1")
    assert record.status is FellowStatus.READY
    assert [t.to_status for t in record.history] == [FellowStatus.REGISTERING, FellowStatus.READY]


def test_stale_fellow_goes_offline_after_the_timeout_not_before(reg, clock):
    register(reg, "f1")
    beat(reg, "f1")
    clock.now += 2.9
    assert reg.sweep() == []
    beat(reg, "f1")
    clock.now += 3.0
    assert reg.sweep() == []
    clock.now += 0.2
    made = reg.sweep()
    assert [(fid, t.to_status) for fid, t in made] == [("f1", FellowStatus.OFFLINE)]
    assert reg.get("f1").status is FellowStatus.OFFLINE
    assert "no heartbeat for 3.2s" in reg.get("f1").offline_reason
    assert reg.sweep() == []  # offline once, not again


def test_staleness_is_not_judged_while_the_leader_is_disconnected(reg, clock):
    register(reg, "f1")
    beat(reg, "f1")
    reg.bus_disconnected()
    clock.now += 60
    assert reg.sweep() == []
    assert reg.get("f1").status is FellowStatus.READY


def test_leader_reconnect_gives_every_fellow_a_fresh_window(reg, clock):
    register(reg, "f1")
    beat(reg, "f1")
    reg.bus_disconnected()
    clock.now += 60
    reg.bus_connected()
    clock.now += 2.9
    assert reg.sweep() == [], "counted from the leader's reconnection, not the last heartbeat"
    clock.now += 0.2
    assert [fid for fid, _ in reg.sweep()] == ["f1"]


def test_live_id_held_by_another_instance_is_refused_until_stale(reg, clock):
    register(reg, "f1", instance="a")
    beat(reg, "f1", instance="a")
    reply = register(reg, "f1", instance="b")
    assert not reply.accepted and reply.code == "FELLOW_ID_IN_USE"
    assert "f1" in reply.message and "--name" in reply.message
    assert not beat(reg, "f1", instance="b"), "heartbeats of the refused instance are dropped"
    assert reg.dropped["instance_mismatch"] == 1
    clock.now += 3.5
    assert register(reg, "f1", instance="b").accepted
    record = reg.get("f1")
    assert record.instance_id == "b"


def test_same_instance_registering_again_keeps_its_status(reg):
    register(reg, "f1")
    beat(reg, "f1", status=FellowStatus.READY)
    reply = register(reg, "f1", status=FellowStatus.READY)
    assert reply.accepted and reply.message == "registered again"
    assert reg.get("f1").registrations == 2
    assert reg.get("f1").status is FellowStatus.READY
    assert FellowStatus.OFFLINE not in [t.to_status for t in reg.get("f1").history]


def test_deregister_marks_offline_at_once_and_a_restart_is_accepted(reg):
    secret = register(reg, "f1", instance="a").instance_secret
    beat(reg, "f1", instance="a")
    reply = reg.deregister(
        DeregisterRequest(fellow_id="f1", instance_id="a", instance_secret=secret)
    )
    assert reply.accepted
    record = reg.get("f1")
    assert record.status is FellowStatus.OFFLINE
    assert record.offline_reason.startswith("deregistered")
    assert register(reg, "f1", instance="b").accepted
    statuses = [t.to_status for t in reg.get("f1").history]
    assert statuses == [
        FellowStatus.REGISTERING,
        FellowStatus.READY,
        FellowStatus.OFFLINE,
        FellowStatus.REGISTERING,
    ]


def test_deregister_by_another_instance_is_refused(reg):
    register(reg, "f1", instance="a")
    reply = reg.deregister(DeregisterRequest(fellow_id="f1", instance_id="zzz"))
    assert not reply.accepted and reply.code == "INSTANCE_MISMATCH"
    assert reg.get("f1").status is FellowStatus.REGISTERING
    assert reg.deregister(DeregisterRequest(fellow_id="nobody", instance_id="a")).code == (
        "NOT_FOUND"
    )


def test_deregister_needs_the_secret_only_the_registering_process_got(reg):
    """The instance id is public (the API shows it): knowing it deregisters nobody."""
    secret = register(reg, "f1", instance="a").instance_secret
    assert len(secret) == 32
    assert register(reg, "f1", instance="a").instance_secret == secret  # again: the same
    for guess in ("", "a", "0" * 32, secret[:-1] + ("0" if secret[-1] != "0" else "1")):
        reply = reg.deregister(
            DeregisterRequest(fellow_id="f1", instance_id="a", instance_secret=guess)
        )
        assert not reply.accepted and reply.code == "INSTANCE_SECRET_INVALID", guess
    assert reg.get("f1").status is FellowStatus.REGISTERING
    assert reg.dropped["deregister_secret"] == 4
    # Another leader with another key (or another instance) makes another secret.
    other = WorkerRegistry(heartbeat_interval_s=1, offline_after_s=3, leader_version="t")
    assert other.instance_secret("f1", "a") != secret
    assert reg.instance_secret("f1", "b") != secret


def test_unknown_heartbeat_is_adopted(reg):
    assert beat(reg, "f9", status=FellowStatus.TRAINING)
    record = reg.get("f9")
    assert record.status is FellowStatus.TRAINING
    assert record.history[0].reason == "adopted from heartbeat"


def test_heartbeat_after_offline_revives_through_registering(reg, clock):
    register(reg, "f1")
    beat(reg, "f1")
    clock.now += 5
    reg.sweep()
    beat(reg, "f1")
    statuses = [t.to_status for t in reg.get("f1").history]
    assert statuses[-3:] == [FellowStatus.OFFLINE, FellowStatus.REGISTERING, FellowStatus.READY]
    assert reg.get("f1").offline_reason is None


def test_heartbeat_updates_progress_and_hardware(reg):
    register(reg, "f1")
    reg.heartbeat(
        Heartbeat(
            fellow=ident("f1"),
            seq=7,
            status=FellowStatus.TRAINING,
            job_id="j1",
            step=12,
            loss=2.5,
            bytes_sent=100,
            bytes_received=200,
            hardware=hw(gpus=[gpu("GPU-1", "A100", 80, 70)]),
        )
    )
    record = reg.get("f1")
    assert (record.job_id, record.step, record.loss) == ("j1", 12, 2.5)
    assert (record.bytes_sent, record.bytes_received) == (100, 200)
    assert record.hardware.gpus[0].uuid == "GPU-1"


def test_nodes_group_fellows_by_host_with_freshest_snapshot(reg, clock):
    register(reg, "a", host="h1")
    register(reg, "b", host="h1")
    register(reg, "c", host="h2")
    beat(reg, "a", host="h1", hardware=hw("h1", taken_at=1.0))
    t4 = gpu("GPU-x", "T4", 16, 15)
    beat(reg, "b", host="h1", hardware=hw("h1", gpus=[t4], taken_at=2.0))
    nodes = {n.hostname: n for n in reg.nodes()}
    assert set(nodes) == {"h1", "h2"}
    assert nodes["h1"].fellows == ["a", "b"]
    assert nodes["h1"].gpus[0].uuid == "GPU-x"
    assert nodes["h1"].online
    clock.now += 10
    reg.sweep()
    assert not any(n.online for n in reg.nodes())


def test_counts_cover_every_status(reg):
    register(reg, "f1")
    beat(reg, "f1")
    counts = reg.counts()
    assert counts["ready"] == 1
    assert set(counts) == {s.value for s in FellowStatus}


def test_history_is_bounded(reg, clock):
    register(reg, "f1")
    for _ in range(100):
        beat(reg, "f1", status=FellowStatus.READY)
        beat(reg, "f1", status=FellowStatus.TRAINING)
    assert len(reg.get("f1").history) == 50


def test_a_heartbeat_that_arrives_after_deregister_does_not_revive(reg):
    secret = register(reg, "f1", instance="a").instance_secret
    beat(reg, "f1", instance="a")
    reg.deregister(DeregisterRequest(fellow_id="f1", instance_id="a", instance_secret=secret))
    assert not beat(reg, "f1", instance="a")
    assert reg.get("f1").status is FellowStatus.OFFLINE
    assert reg.dropped["after_deregister"] == 1
    assert register(reg, "f1", instance="a").accepted  # the same process may come back
    assert beat(reg, "f1", instance="a")
    assert reg.get("f1").status is FellowStatus.READY


def test_changes_are_marked_for_the_store_but_plain_heartbeats_are_not(reg, clock):
    register(reg, "a")
    assert [fid for fid, _ in reg.take_dirty()] == ["a"]
    beat(reg, "a")  # registering -> ready: a transition
    assert [fid for fid, _ in reg.take_dirty()] == ["a"]
    beat(reg, "a")  # nothing changed
    assert reg.take_dirty() == []
    clock.now += 10
    reg.sweep()
    [(fid, record)] = reg.take_dirty()
    assert fid == "a" and record.status is FellowStatus.OFFLINE


def test_release_forgets_the_fellow_and_ignores_its_agent_until_a_new_instance_comes(reg):
    register(reg, "a", instance="old")
    beat(reg, "a", instance="old")
    reg.take_dirty()
    reg.release("a")
    assert reg.get("a") is None and reg.take_dirty() == [("a", None)]
    assert beat(reg, "a", instance="old") is False and reg.get("a") is None
    assert register(reg, "a", instance="old").code == "RELEASED"
    assert register(reg, "a", instance="new").accepted
    assert reg.get("a").instance_id == "new"
    with pytest.raises(KeyError):
        reg.release("nobody")


def test_restored_records_get_a_fresh_offline_window(reg, clock):
    first = reg
    register(first, "a")
    beat(first, "a")
    saved = [record for _, record in first.take_dirty()]
    clock.now += 100
    second = WorkerRegistry(
        heartbeat_interval_s=1.0, offline_after_s=3.0, leader_version="t", clock=clock, wall=clock
    )
    second.restore(saved)
    second.bus_connected()
    assert second.sweep() == [] and second.get("a").status is FellowStatus.READY
    clock.now += 4
    assert [fid for fid, _ in second.sweep()] == ["a"]
