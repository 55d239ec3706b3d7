"""Figures a fellow reports reach the leader's decisions bounded, and a part of the job loop
that fails on them anyway does not stop the rest of the loop."""

from __future__ import annotations

import asyncio
import logging
import math

import msgspec
import pytest
from nats.aio.msg import Msg

from silentswarm import subjects as topics
from silentswarm.cli.watch import link_line
from silentswarm.errors import ConfigError, ProtocolError
from silentswarm.jobspec import JobSpec
from silentswarm.leader import balance, decide
from silentswarm.leader.aggregate import RateMeter
from silentswarm.leader.jobs import JobManager
from silentswarm.leader.metrics import fellow_families, loop_failure_family
from silentswarm.leader.orchestrator import PROGRESS_MAX_BYTES
from silentswarm.leader.placement import place
from silentswarm.leader.registry import FellowRegistry
from silentswarm.plan import ModelConfig
from silentswarm.protocol import (
    MIN_COMPUTE_SPEED,
    FellowIdentity,
    FellowStatus,
    GpuInfo,
    HardwareSnapshot,
    Heartbeat,
    Progress,
    RegisterRequest,
)
from silentswarm.settings import Settings
from silentswarm.text import loggable
from silentswarm.types.links import LinkStats
from silentswarm.types.metrics import BoundaryMetrics
from tests.fakes import Clock, offline_orchestrator

GIB = 1 << 30


def identity(fellow: str, hostname: str | None = None) -> FellowIdentity:
    return FellowIdentity(
        fellow_id=fellow,
        instance_id=f"i-{fellow}",
        hostname=hostname or fellow,
        version="1",
        pid=1,
        data_address=f"tcp://{fellow}:1",
        sync_address=f"tcp://{fellow}:2",
    )


def register_request(fellow: str, hostname: str) -> RegisterRequest:
    return RegisterRequest(
        fellow=identity(fellow, hostname),
        hardware=HardwareSnapshot(
            hostname=fellow, cpu_cores=1, ram_total_bytes=GIB, ram_available_bytes=GIB
        ),
        status=FellowStatus.READY,
    )


def heartbeat(fellow: str, speed: float, quota: float | None = None) -> bytes:
    hb = Heartbeat(
        fellow=identity(fellow),
        seq=1,
        status=FellowStatus.READY,
        hardware=HardwareSnapshot(
            hostname=fellow,
            cpu_cores=8,
            cpu_quota=quota,
            ram_total_bytes=16 * GIB,
            ram_available_bytes=16 * GIB,
            compute_speed=speed,
        ),
    )
    return topics.encode(hb)


@pytest.mark.parametrize("speed", [5e-324, 1e-300, MIN_COMPUTE_SPEED / 2, 0.0, -1.0, 2e6])
def test_a_compute_speed_out_of_bounds_is_refused_on_the_wire(speed):
    with pytest.raises(ProtocolError, match="compute_speed"):
        topics.HEARTBEAT.decode(heartbeat("evil", speed))


def test_the_slowest_speed_allowed_still_places_with_a_quota():
    """The floor keeps a stage's time finite: speed times a quota's share never underflows
    to a division by zero (5e-324 under a quota of half the cores did)."""
    registry = FellowRegistry(heartbeat_interval_s=1, offline_after_s=3, leader_version="1")
    for fellow in ("a", "b"):
        registry.heartbeat(topics.HEARTBEAT.decode(heartbeat(fellow, 10.0)))
    registry.heartbeat(topics.HEARTBEAT.decode(heartbeat("slow", MIN_COMPUTE_SPEED, quota=0.01)))
    spec = JobSpec(
        model=ModelConfig(n_layers=8), allow_cpu=True, stages=3, partition="balanced", steps=10
    )
    candidates = [decide.candidate(registry.get(f)) for f in ("a", "b", "slow")]
    placed = place(spec, candidates)
    assert [s.layer_end - s.layer_start for s in placed.stages if s.fellow_id == "slow"] == [1]


@pytest.mark.parametrize(
    ("busy_s", "expected"),
    [(1e300, balance.MIN_SPEED), (1e-300, balance.MAX_SPEED)],
)
def test_a_speed_learned_from_step_records_stays_within_the_bounds(busy_s, expected):
    model = ModelConfig(n_layers=4, d_model=64, seq_len=16, n_heads=4)
    speed = balance.measured_speed(model, batch_size=1, layers=1, last=False, busy_s=busy_s)
    assert speed == expected


def test_an_operator_speed_below_the_floor_is_a_config_error():
    with pytest.raises(ConfigError, match="SWARM_FELLOW_COMPUTE_SPEED"):
        Settings.from_env({"SWARM_FELLOW_COMPUTE_SPEED": "1e-9"})


def test_a_failing_part_of_the_job_loop_does_not_stop_the_others(monkeypatch, caplog):
    registry = FellowRegistry(heartbeat_interval_s=1, offline_after_s=3, leader_version="1")
    orch = offline_orchestrator(registry, JobManager(wall=Clock()))
    ran: list[str] = []

    def broken() -> None:
        ran.append("replace")
        raise ZeroDivisionError("float division by zero")

    async def flushed() -> None:
        ran.append("flush")

    monkeypatch.setattr(orch, "_replace", broken)
    monkeypatch.setattr(orch, "_stop_released", lambda: ran.append("stop released"))
    monkeypatch.setattr(orch, "flush", flushed)
    with caplog.at_level(logging.ERROR, logger="silentswarm.leader.orchestrator"):
        for _ in range(3):
            asyncio.run(orch.tick())
    assert ran == ["replace", "stop released", "flush"] * 3
    assert orch.tick_failures == {"replace": 3}
    logged = [r for r in caplog.records if "replace failed" in r.getMessage()]
    assert len(logged) == 1, "a part that keeps failing is logged once a minute"
    family = loop_failure_family(orch.tick_failures)
    assert [(s.name, s.labels, s.value) for s in family.samples] == [
        ("swarm_leader_loop_failures_total", {"part": "replace"}, 3.0)
    ]


def test_settings_decode_of_the_speed_bound_is_the_protocols():
    """One floor: what an operator may declare is what the leader accepts on the wire."""
    hb = topics.HEARTBEAT.decode(heartbeat("a", MIN_COMPUTE_SPEED))
    assert hb.hardware.compute_speed == MIN_COMPUTE_SPEED
    assert Settings.from_env({"SWARM_FELLOW_COMPUTE_SPEED": str(MIN_COMPUTE_SPEED)})


def progress_msg(fellow: str, data: bytes) -> Msg:
    subject = topics.PROGRESS.subject("s", job="job-1", fellow=fellow)
    return Msg(_client=None, subject=subject, data=data)  # type: ignore[arg-type]


def test_a_progress_flood_is_cut_by_its_senders_budget_before_it_is_decoded(monkeypatch):
    """Decoding is what a flood costs: a record over the size bound, and records past the
    sender's rate in records or in bytes, are dropped and counted undecoded."""
    registry = FellowRegistry(heartbeat_interval_s=1, offline_after_s=3, leader_version="1")
    orch = offline_orchestrator(registry, JobManager(wall=Clock()))
    decoded: list[str] = []
    monkeypatch.setattr(
        orch.bus, "decode_job_message", lambda msg, topic: decoded.append(msg.subject)
    )
    big = b"\x00" * (PROGRESS_MAX_BYTES + 1)
    asyncio.run(orch._on_progress(progress_msg("evil", big)))
    assert decoded == [] and orch.bus.dropped["progress_size"] == 1

    async def flood(fellow: str, size: int, n: int) -> None:
        for _ in range(n):
            await orch._on_progress(progress_msg(fellow, b"\x00" * size))

    asyncio.run(flood("evil", 300_000, 100))  # about 30 MB: the byte budget's burst is 1 MiB
    assert 3 <= len(decoded) <= 4 and orch.bus.dropped["progress_rate"] == 100 - len(decoded)
    asyncio.run(flood("honest", 300, 10))  # another fellow's budget is its own
    assert len([s for s in decoded if s.endswith(".honest")]) == 10


def stamped(at: float, *, step: int, down: int, loss: float | None = None) -> Progress:
    return Progress(
        job_id="j",
        fellow_id="a",
        attempt=1,
        stage=0,
        step=step,
        total_steps=100,
        loss=loss,
        step_time_s=0.5,
        down_bytes_sent=down,
        at=at,
    )


@pytest.mark.parametrize("at", [float("inf"), 1e300, -1.0, 1e11])
def test_a_progress_time_out_of_bounds_is_refused_on_the_wire(at):
    with pytest.raises(ProtocolError, match=r"\$.at"):
        topics.PROGRESS.decode(topics.encode(stamped(at, step=4, down=0)))


def test_records_a_denormal_apart_give_no_infinite_rate():
    """Two records at 0.0 and 5e-324 made a rate of infinity, which JSON writes as null:
    ``swarm watch`` then failed to read the job's metrics."""
    meter = RateMeter("j")
    meter.apply(stamped(0.0, step=4, down=0, loss=2.0), last_stage=True)
    meter.apply(stamped(5e-324, step=5, down=1 << 40, loss=2.0), last_stage=True)
    rates = meter._fellows["a"]
    assert math.isfinite(rates.down_per_s) and rates.down_per_s == 0.0
    assert meter.steps_per_min() is None
    meter.apply(stamped(1.0, step=6, down=2 << 40, loss=2.0), last_stage=True)
    assert meter._fellows["a"].down_per_s == float(1 << 40) and meter.steps_per_min() == 120.0


def test_a_snapshot_dated_ahead_does_not_win_its_hosts_view():
    """A fellow may claim another machine's host name and boot id; dating its snapshots
    years ahead used to make its figures the host's for good. A snapshot counts as taken no
    later than the leader got it."""
    wall = Clock(1000.0)
    registry = FellowRegistry(
        heartbeat_interval_s=1, offline_after_s=3, leader_version="1", wall=wall
    )
    liar = topics.HEARTBEAT.decode(heartbeat("liar", 10.0))
    liar.hardware.hostname = "victim"
    liar.hardware.taken_at = 9e9
    liar.hardware.ram_available_bytes = 1
    liar.fellow.hostname = "victim"
    registry.heartbeat(liar)
    wall.advance(5.0)
    honest = topics.HEARTBEAT.decode(heartbeat("victim", 10.0))
    honest.hardware.taken_at = wall()
    registry.heartbeat(honest)
    [node] = registry.nodes()
    assert node.fellows == ["liar", "victim"]
    assert node.ram_available_bytes == 16 * GIB, "the honest, later snapshot's"


ESCAPES = "\x1b]0;owned\x07\x1b[2J"


def measured(**codecs: str) -> LinkStats:
    return LinkStats(boundary=0, step=1, rtt_ms=1, fwd_mbit_s=1, bwd_mbit_s=1, **codecs)


@pytest.mark.parametrize(
    "changes",
    [
        {"down_transport": "\x1b[8m"},
        {"down_link": measured(fwd_codec=ESCAPES)},
        {"down_link": measured(bwd_codec="FP16 ")},
    ],
)
def test_transport_and_codec_names_are_words_on_the_wire(changes):
    record = msgspec.structs.replace(stamped(1.0, step=4, down=0), **changes)
    with pytest.raises(ProtocolError):
        topics.PROGRESS.decode(topics.encode(record))


def test_swarm_watch_escapes_what_a_link_line_quotes():
    link = measured(fwd_codec=ESCAPES)
    boundary = BoundaryMetrics(
        boundary=0,
        upstream="a",
        downstream="b",
        bytes_per_s=1.0,
        bytes_total=1,
        transport="\x1b[8m",
        link=link,
    )
    line = link_line(boundary)
    assert "\x1b" not in line and "\x07" not in line and "link 0 a -> b" in line


def test_a_fellows_words_reach_the_leaders_log_escaped_and_cut(caplog):
    """A decode error quoting a fellow's value, its host name, its deregister reason: one
    line each in the leader's log, no terminal escapes, no forged lines, no 200 KB line."""
    registry = FellowRegistry(heartbeat_interval_s=1, offline_after_s=3, leader_version="1")
    orch = offline_orchestrator(registry, JobManager(wall=Clock()))
    forged = "\n2026-12-07 INFO leader: all is well\x1b[2J" + "x" * 200_000
    with caplog.at_level(logging.INFO):
        orch.bus.drop(progress_msg("evil", b""), f"bad kind {forged!s}")
        registry.register(
            topics.REGISTER.decode(topics.encode(register_request("evil", hostname=forged[:256])))
        )
    lines = [r.getMessage() for r in caplog.records]
    assert any("dropped message" in line for line in lines)
    assert any("registered (host" in line for line in lines)
    for line in lines:
        assert "\n" not in line and "\x1b" not in line and len(line) < 1000, line[:200]
    assert loggable("é\u202eok", 2) == "é\\u202e..."


def gpu(index: int, uuid: str) -> GpuInfo:
    return GpuInfo(
        index=index,
        uuid=uuid,
        name="T",
        memory_total_bytes=GIB,
        memory_free_bytes=GIB,
        memory_used_bytes=0,
    )


def test_a_gpu_uuid_is_a_word_and_a_repeated_index_makes_no_second_sample():
    hb = topics.HEARTBEAT.decode(heartbeat("a", 10.0))
    hb.hardware.gpus = [gpu(0, "GPU 0\x1b[2J")]
    with pytest.raises(ProtocolError, match="uuid"):
        topics.HEARTBEAT.decode(topics.encode(hb))
    hb.hardware.gpus = [gpu(0, f"GPU-{i}") for i in range(3)]
    registry = FellowRegistry(heartbeat_interval_s=1, offline_after_s=3, leader_version="1")
    registry.heartbeat(topics.HEARTBEAT.decode(topics.encode(hb)))
    families = list(fellow_families(registry.list(), registry.counts()))
    used = [f for f in families if f.name == "swarm_fellow_gpu_memory_used_bytes"]
    assert [s.labels for s in used[0].samples] == [{"fellow": "a", "gpu": "0"}]
