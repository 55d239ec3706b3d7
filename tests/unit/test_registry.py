"""FellowRegistry rules, with both clocks under the test's control."""

import msgspec
import pytest

from silentswarm.leader import registry as registry_module
from silentswarm.leader.hostview import HostFellow, merge_host
from silentswarm.leader.registry import LINKS_KEPT, FellowRegistry
from silentswarm.protocol import (
    DeregisterRequest,
    FellowIdentity,
    FellowLimits,
    FellowStatus,
    GpuInfo,
    HardwareSnapshot,
    Heartbeat,
    RegisterRequest,
)
from silentswarm.telemetry import CUDA_FIX
from silentswarm.types.links import MeasuredLink
from tests.fakes import Clock


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
    r = FellowRegistry(
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


def test_read_each_and_online_ids_see_what_list_shows_without_copying(reg, clock):
    register(reg, "f2")
    beat(reg, "f2")
    register(reg, "f1")
    beat(reg, "f1", status=FellowStatus.TRAINING)
    register(reg, "f3")
    clock.advance(2.0)
    beat(reg, "f1", status=FellowStatus.TRAINING)
    beat(reg, "f2")
    clock.advance(2.0)
    beat(reg, "f1", status=FellowStatus.TRAINING)
    beat(reg, "f2")
    reg.sweep()  # f3 has not been heard for 4 s, over offline_after_s: offline
    listed = {r.fellow_id: (r.status, r.last_heartbeat_at) for r in reg.list()}
    read = reg.read_each(lambda r: (r.fellow_id, (r.status, r.last_heartbeat_at)))
    assert dict(read) == listed and len(read) == 3
    assert reg.online_ids() == {"f1", "f2"} and listed["f3"][0] is FellowStatus.OFFLINE


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
    other = FellowRegistry(heartbeat_interval_s=1, offline_after_s=3, leader_version="t")
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


def test_machines_cloned_from_one_image_are_two_hosts(reg):
    """Two machines named alike (their kernels' boot ids differ) are two host views; two
    fellows of one machine, one."""
    one, other = "650e89de-8cb4-407d-99e5-45fed725057a", "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
    for fid, boot in (("a", one), ("b", one), ("c", other)):
        register(reg, fid, host="ubuntu")
        beat(
            reg, fid, host="ubuntu", hardware=msgspec.structs.replace(hw("ubuntu"), machine_id=boot)
        )
    nodes = reg.nodes()
    assert sorted((n.machine_id, n.fellows) for n in nodes) == [(other, ["c"]), (one, ["a", "b"])]
    assert {n.hostname for n in nodes} == {"ubuntu"} and reg.host_count() == 2


def test_a_host_counts_its_cores_not_its_fellows_quota(reg):
    """A fellow in a one-core container on an 8-core host: the host has 8 cores."""
    register(reg, "boxed", host="h1")
    boxed = msgspec.structs.replace(hw("h1"), cpu_cores=1, cpu_quota=0.5, host_cpu_cores=8)
    beat(reg, "boxed", host="h1", hardware=boxed)
    (node,) = reg.nodes()
    assert node.cpu_cores == 8
    assert reg.get("boxed").hardware.cpu_cores == 1


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


def test_a_release_is_stored_and_a_restarted_registry_keeps_ignoring_that_instance(reg, clock):
    """The release marker goes to the store; a registry restored from it refuses the
    released instance and drops its heartbeats (counting them, and naming the fellow for
    the leader to tell it again to exit) until another instance takes the id."""
    register(reg, "a", instance="old")
    reg.release("a")
    [(fid, marker)] = reg.take_released_dirty()
    assert (fid, marker.instance_id, marker.released_at) == ("a", "old", clock.now)
    assert reg.take_released_dirty() == []

    restarted = FellowRegistry(
        heartbeat_interval_s=1.0, offline_after_s=3.0, leader_version="t", clock=clock, wall=clock
    )
    restarted.restore_released([marker])
    restarted.bus_connected()
    assert beat(restarted, "a", instance="old") is False and restarted.get("a") is None
    assert restarted.dropped["released"] == 1
    assert restarted.take_released_heard() == {"a"} and restarted.take_released_heard() == set()
    assert register(restarted, "a", instance="old").code == "RELEASED"
    assert restarted.take_released_dirty() == []

    assert beat(restarted, "a", instance="new") is True, "another instance takes the id"
    assert restarted.take_released_dirty() == [("a", None)], "and the marker goes"
    assert beat(restarted, "a", instance="old") is False, "the old one is another instance now"
    assert restarted.take_released_heard() == set()


def test_release_markers_are_bounded_the_oldest_dropped_first(reg, clock, monkeypatch):
    monkeypatch.setattr(registry_module, "RELEASED_KEPT", 2)
    for fid in ("a", "b", "c"):
        register(reg, fid)
        clock.now += 1
        reg.release(fid)
    assert [(fid, m is None) for fid, m in reg.take_released_dirty()] == [
        ("a", True),
        ("b", False),
        ("c", False),
    ]
    assert register(reg, "a").accepted, "a's marker was dropped"
    assert register(reg, "b").code == "RELEASED"


def test_restored_records_get_a_fresh_offline_window(reg, clock):
    first = reg
    register(first, "a")
    beat(first, "a")
    saved = [record for _, record in first.take_dirty()]
    clock.now += 100
    second = FellowRegistry(
        heartbeat_interval_s=1.0, offline_after_s=3.0, leader_version="t", clock=clock, wall=clock
    )
    second.restore(saved)
    second.bus_connected()
    assert second.sweep() == [] and second.get("a").status is FellowStatus.READY
    clock.now += 4
    assert [fid for fid, _ in second.sweep()] == ["a"]


def test_measured_links_outlive_a_leader_restart(reg, clock):
    """The links a balanced job's order is chosen by are kept on the upstream fellow's
    record, so the store writes them and a restarted leader has them back."""
    for fid in ("a", "b", "c"):
        register(reg, fid)
    reg.take_dirty()
    near, far = MeasuredLink(mbit_s=900.0, rtt_ms=0.5), MeasuredLink(mbit_s=90.0, rtt_ms=50.0)
    reg.record_link("a", "b", far)
    reg.record_link("b", "c", near)
    assert [fid for fid, _ in reg.take_dirty()] == ["a", "b"]
    reg.record_link("a", "b", far)  # a stage repeats its latest measurement every step
    assert reg.take_dirty() == []
    reg.record_link("a", "b", near)
    [(fid, record)] = reg.take_dirty()
    near = msgspec.structs.replace(near, measured_at=clock())  # recorded with the time
    assert fid == "a" and record.links == {"b": near}
    saved = [record for record in reg.list()]
    second = FellowRegistry(
        heartbeat_interval_s=1.0, offline_after_s=3.0, leader_version="t", clock=clock, wall=clock
    )
    encoded = msgspec.json.encode(saved)  # as the store keeps them
    second.restore(msgspec.json.decode(encoded, type=list[type(saved[0])]))
    assert dict(second.links) == {("a", "b"): near, ("b", "c"): near}
    second.release("b")
    assert dict(second.links) == {("a", "b"): near}


def test_a_fellow_keeps_its_latest_links_only(reg):
    register(reg, "a")
    for i in range(LINKS_KEPT + 5):
        reg.record_link("a", f"peer{i}", MeasuredLink(mbit_s=float(i + 1), rtt_ms=1.0))
    reg.record_link("a", "peer0", MeasuredLink(mbit_s=7.0, rtt_ms=1.0))  # measured again
    kept = reg.get("a").links
    assert len(kept) == LINKS_KEPT and list(kept)[-1] == "peer0"
    assert {b for a, b in reg.links} == set(kept)
    reg.record_link("nobody", "a", MeasuredLink(mbit_s=1.0, rtt_ms=1.0))
    reg.record_link("a", "a", MeasuredLink(mbit_s=1.0, rtt_ms=1.0))
    assert ("nobody", "a") not in reg.links and ("a", "a") not in reg.links


# --- host views merged over every fellow of a host (leader.hostview) ------------------------


def gpu_at(index: int, uuid: str, free_gib: int = 70, total_gib: int = 80) -> GpuInfo:
    return msgspec.structs.replace(gpu(uuid, "A100", total_gib, free_gib), index=index)


def snap(taken_at: float, gpus=(), tf=None, nvml_error=None, ram_free_gib=16, **limits):
    return msgspec.structs.replace(
        hw(gpus=list(gpus), taken_at=taken_at),
        tf_gpu_count=tf,
        nvml_error=nvml_error,
        ram_available_bytes=ram_free_gib << 30,
        limits=FellowLimits(**limits),
    )


def fellow(fid: str, hardware: HardwareSnapshot, online: bool = True) -> HostFellow:
    return HostFellow(fellow_id=fid, online=online, hardware=hardware)


G0, G1 = gpu_at(0, "GPU-0"), gpu_at(1, "GPU-1")


@pytest.mark.parametrize(
    ("fellows", "expected"),
    [
        pytest.param(  # pinned to different GPUs: the union, whoever reported last
            [fellow("a", snap(2.0, [G0], tf=1)), fellow("b", snap(1.0, [G1], tf=1))],
            {"gpus": ["GPU-0", "GPU-1"], "tf_gpu_count": 2, "ram_free_gib": 16},
            id="pinned-a-fresher",
        ),
        pytest.param(
            [fellow("a", snap(1.0, [G0], tf=1)), fellow("b", snap(2.0, [G1], tf=1))],
            {"gpus": ["GPU-0", "GPU-1"], "tf_gpu_count": 2},
            id="pinned-b-fresher",
        ),
        pytest.param(  # one GPU seen by both: once, with the freshest reading
            [
                fellow("a", snap(1.0, [gpu_at(0, "GPU-0", free_gib=70)], tf=1)),
                fellow("b", snap(2.0, [gpu_at(0, "GPU-0", free_gib=10)], tf=1)),
            ],
            {"gpus": ["GPU-0"], "gpu0_free_gib": 10, "tf_gpu_count": 1},
            id="shared-gpu-freshest-reading",
        ),
        pytest.param(  # an unpinned fellow and one pinned to GPU 1: both GPUs, counted once
            [fellow("a", snap(1.0, [G0, G1], tf=2)), fellow("b", snap(2.0, [G1], tf=1))],
            {"gpus": ["GPU-0", "GPU-1"], "tf_gpu_count": 2},
            id="unpinned-and-pinned",
        ),
        pytest.param(  # host numbers from the freshest snapshot
            [fellow("a", snap(1.0, ram_free_gib=4)), fellow("b", snap(2.0, ram_free_gib=9))],
            {"gpus": [], "tf_gpu_count": None, "ram_free_gib": 9},
            id="host-numbers-freshest",
        ),
        pytest.param(  # an offline fellow's stale readings do not count while one is online
            [
                fellow("a", snap(9.0, [G0], tf=1, ram_free_gib=1), online=False),
                fellow("b", snap(2.0, [G1], tf=1, ram_free_gib=5)),
            ],
            {"gpus": ["GPU-1"], "tf_gpu_count": 1, "ram_free_gib": 5, "online": True},
            id="offline-fellow-left-out",
        ),
        pytest.param(  # ... but all of them give the last known view of an offline host
            [
                fellow("a", snap(1.0, [G0], tf=1), online=False),
                fellow("b", snap(2.0, [G1], tf=1), online=False),
            ],
            {"gpus": ["GPU-0", "GPU-1"], "tf_gpu_count": 2, "online": False},
            id="offline-host-last-known",
        ),
        pytest.param(  # a probe not answered yet counts nothing; a probe that did counts
            [fellow("a", snap(1.0, [G0], tf=None)), fellow("b", snap(2.0, [G1], tf=1))],
            {"gpus": ["GPU-0", "GPU-1"], "tf_gpu_count": 1},
            id="probe-pending-on-one",
        ),
        pytest.param(  # NVML works for one fellow: the host has no NVML error
            [
                fellow("a", snap(2.0, nvml_error="NVML unavailable: no library")),
                fellow("b", snap(1.0, [G1], tf=1)),
            ],
            {"gpus": ["GPU-1"], "nvml_error": None},
            id="nvml-error-on-one",
        ),
        pytest.param(
            [fellow("a", snap(2.0, nvml_error="NVML unavailable: no library"))],
            {"gpus": [], "nvml_error": "NVML unavailable: no library"},
            id="nvml-error-on-all",
        ),
    ],
)
def test_merge_host_table(fellows, expected):
    view = merge_host("h1", fellows)
    assert [g.uuid for g in view.gpus] == expected["gpus"]
    if "tf_gpu_count" in expected:
        assert view.tf_gpu_count == expected["tf_gpu_count"]
    if "gpu0_free_gib" in expected:
        assert view.gpus[0].memory_free_bytes == expected["gpu0_free_gib"] << 30
    if "ram_free_gib" in expected:
        assert view.ram_available_bytes == expected["ram_free_gib"] << 30
    if "online" in expected:
        assert view.online is expected["online"]
    if "nvml_error" in expected:
        assert view.nvml_error == expected["nvml_error"]
    assert view.fellows == sorted(f.fellow_id for f in fellows)
    assert view == merge_host("h1", list(reversed(fellows))), "the input order does not matter"


def test_merge_host_keeps_caps_and_gpus_per_fellow():
    view = merge_host(
        "h1",
        [
            fellow("b", snap(2.0, [G1], tf=1, max_memory_bytes=2 << 30)),
            fellow("a", snap(1.0, [G0], tf=1, max_vram_bytes=8 << 30), online=False),
        ],
    )
    assert view.limits == {
        "a": FellowLimits(max_vram_bytes=8 << 30),
        "b": FellowLimits(max_memory_bytes=2 << 30),
    }
    assert view.fellow_gpus == {"a": ["GPU-0"], "b": ["GPU-1"]}
    assert list(view.limits) == ["a", "b"]


@pytest.mark.parametrize(
    ("tfs", "expected"),
    [
        ((None, None), "TensorFlow GPU probe still running; GPUs unused until it answers"),
        ((0, 1), "a: NVML sees 1 GPU(s) but TensorFlow sees none: " + CUDA_FIX),
        ((1, 1), None),
        (
            (0, None),
            "a: NVML sees 1 GPU(s) but TensorFlow sees none: "
            f"{CUDA_FIX}; b: TensorFlow GPU probe still running; GPUs unused until it answers",
        ),
    ],
)
def test_merge_host_gpu_warning_names_the_fellow_when_they_differ(tfs, expected):
    a, b = tfs
    view = merge_host(
        "h1", [fellow("a", snap(1.0, [G0], tf=a)), fellow("b", snap(2.0, [G1], tf=b))]
    )
    assert view.gpu_warning == expected


def test_merge_host_needs_a_fellow():
    with pytest.raises(ValueError):
        merge_host("h1", [])


def test_two_pinned_fellows_on_one_host_give_the_same_view_on_every_heartbeat(reg, clock):
    """The fault: each heartbeat used to replace the host's GPUs with the sender's."""
    register(reg, "a")
    register(reg, "b")
    views = []
    for i in range(6):
        clock.now += 0.5
        sender, seen = ("a", G0) if i % 2 == 0 else ("b", G1)
        caps = {"max_vram_bytes": 8 << 30} if sender == "a" else {"max_memory_bytes": 4 << 30}
        beat(reg, sender, hardware=snap(clock.now, [seen], tf=1, **caps))
        if i >= 1:  # both have heartbeated
            views.append(reg.nodes())
    for [node] in views:
        assert [g.uuid for g in node.gpus] == ["GPU-0", "GPU-1"]
        assert sum(g.memory_total_bytes for g in node.gpus) == 160 << 30
        assert node.tf_gpu_count == 2
        assert node.limits == {
            "a": FellowLimits(max_vram_bytes=8 << 30),
            "b": FellowLimits(max_memory_bytes=4 << 30),
        }
    assert all(v == views[0] for v in views), "the same readings give the same view"
