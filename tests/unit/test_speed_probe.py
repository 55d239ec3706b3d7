"""The agent's compute speed: declared by the operator, or probed; failures are reasons."""

import sys

import pytest

from silentswarm.agent.hardware import HardwareProbe, probe_compute_speed
from silentswarm.errors import ConfigError
from silentswarm.settings import Settings


def test_a_declared_speed_travels_in_every_snapshot_and_is_never_probed():
    probe = HardwareProbe(compute_speed=2.5)
    try:
        probe.probe_speed()  # declared: returns at once, TensorFlow never starts
        assert probe.snapshot().compute_speed == 2.5
    finally:
        probe.close()


def test_an_unprobed_fellow_reports_no_speed():
    probe = HardwareProbe()
    try:
        assert probe.snapshot().compute_speed is None
    finally:
        probe.close()


PROBES = {
    "the probe fails": (["sh", "-c", "echo boom >&2; exit 3", "sh"], "boom"),
    "unreadable output": (["sh", "-c", "echo not-json", "sh"], "unreadable"),
    "out of bounds": (["sh", "-c", "echo '{\"compute_speed\": -4}'", "sh"], "out of bounds"),
    "no such program": (["/nonexistent/probe"], "FileNotFoundError"),
}


@pytest.mark.parametrize("case", PROBES, ids=list(PROBES))
def test_a_failed_probe_is_a_reason_not_a_speed(case):
    prefix, reason = PROBES[case]
    speed, error = probe_compute_speed(timeout=30, prefix=prefix)
    assert speed is None
    assert reason in error


def test_a_probe_past_its_time_is_a_reason():
    speed, error = probe_compute_speed(
        timeout=0.5, prefix=[sys.executable, "-c", "import time; time.sleep(5)"]
    )
    assert speed is None and "TimeoutExpired" in error


@pytest.mark.parametrize("value", ["0", "-1", "2e6"])
def test_a_declared_speed_out_of_bounds_names_the_variable(value):
    with pytest.raises(ConfigError, match="SWARM_FELLOW_COMPUTE_SPEED"):
        Settings.from_env({"SWARM_FELLOW_COMPUTE_SPEED": value})


def test_a_declared_speed_is_read():
    assert Settings.from_env({"SWARM_FELLOW_COMPUTE_SPEED": "4.5"}).fellow_compute_speed == 4.5
    assert Settings.from_env({"SWARM_FELLOW_COMPUTE_SPEED": ""}).fellow_compute_speed is None
