"""The agent's compute speed: declared by the operator, or probed; failures are reasons."""

import asyncio
import sys
import time

import psutil
import pytest

from silentswarm.agent.hardware import HardwareProbe, probe_compute_speed
from silentswarm.agent.runtime import forkserver
from silentswarm.errors import ConfigError
from silentswarm.procs import is_gone
from silentswarm.settings import Settings


def test_a_declared_speed_travels_in_every_snapshot_and_is_never_probed():
    probe = HardwareProbe(compute_speed=2.5)
    try:
        asyncio.run(probe.probe_speed())  # declared: returns at once, TensorFlow never starts
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
    speed, error = asyncio.run(probe_compute_speed(timeout=30, prefix=prefix))
    assert speed is None
    assert reason in error


def test_a_probe_past_its_time_is_a_reason():
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    started = time.monotonic()
    speed, error = asyncio.run(probe_compute_speed(timeout=0.5, prefix=sleeper))
    assert speed is None and "TimeoutExpired" in error
    assert time.monotonic() - started < 10
    assert not _live_children()


def _live_children() -> list[psutil.Process]:
    """This process's live descendants but the stage fork servers an earlier test of the
    same worker started (agent/runtime/forkserver.py), which live as long as the worker."""
    live = []
    for child in psutil.Process().children(recursive=True):
        try:
            if not is_gone(child) and forkserver.__name__ not in child.cmdline():
                live.append(child)
        except psutil.NoSuchProcess:
            continue
    return live


def test_a_cancelled_probe_is_killed_at_once():
    """An agent that stops mid-probe must not wait for TensorFlow: cancelling the probe
    kills its process."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]

    async def main() -> float:
        task = asyncio.create_task(probe_compute_speed(timeout=120, prefix=sleeper))
        await asyncio.sleep(0)
        deadline = time.monotonic() + 10
        while not _live_children():
            assert time.monotonic() < deadline, "the probe process never started"
            await asyncio.sleep(0.05)
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - started

    assert asyncio.run(main()) < 5
    assert not _live_children()


@pytest.mark.parametrize("value", ["0", "-1", "2e6"])
def test_a_declared_speed_out_of_bounds_names_the_variable(value):
    with pytest.raises(ConfigError, match="SWARM_FELLOW_COMPUTE_SPEED"):
        Settings.from_env({"SWARM_FELLOW_COMPUTE_SPEED": value})


def test_a_declared_speed_is_read():
    assert Settings.from_env({"SWARM_FELLOW_COMPUTE_SPEED": "4.5"}).fellow_compute_speed == 4.5
    assert Settings.from_env({"SWARM_FELLOW_COMPUTE_SPEED": ""}).fellow_compute_speed is None
