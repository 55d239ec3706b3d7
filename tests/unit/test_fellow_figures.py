"""Figures a fellow reports reach the leader's decisions bounded, and a part of the job loop
that fails on them anyway does not stop the rest of the loop."""

from __future__ import annotations

import asyncio
import logging

import pytest

from silentswarm import subjects as topics
from silentswarm.errors import ConfigError, ProtocolError
from silentswarm.jobspec import JobSpec
from silentswarm.leader import balance, decide
from silentswarm.leader.jobs import JobManager
from silentswarm.leader.metrics import loop_failure_family
from silentswarm.leader.placement import place
from silentswarm.leader.registry import FellowRegistry
from silentswarm.plan import ModelConfig
from silentswarm.protocol import (
    MIN_COMPUTE_SPEED,
    FellowIdentity,
    FellowStatus,
    HardwareSnapshot,
    Heartbeat,
)
from silentswarm.settings import Settings
from tests.fakes import Clock, offline_orchestrator

GIB = 1 << 30


def heartbeat(fellow: str, speed: float, quota: float | None = None) -> bytes:
    hb = Heartbeat(
        fellow=FellowIdentity(
            fellow_id=fellow,
            instance_id=f"i-{fellow}",
            hostname=fellow,
            version="1",
            pid=1,
            data_address=f"tcp://{fellow}:1",
            sync_address=f"tcp://{fellow}:2",
        ),
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
