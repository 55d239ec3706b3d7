"""The leader and the agent speak systemd's notify protocol (Type=notify, WatchdogSec=)."""

from __future__ import annotations

import socket
import time

import psutil
import pytest

from silentswarm.procs import free_port, is_gone
from tests.helpers import child_env


@pytest.fixture
def notify_socket(tmp_path):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(1.0)
    try:
        yield sock, str(path)
    finally:
        sock.close()


def receive_until(sock, wanted: set[str], timeout: float) -> set[str]:
    """Messages until every line in ``wanted`` was seen (or fail after ``timeout``)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while not wanted <= seen:
        if time.monotonic() > deadline:
            raise AssertionError(f"saw {sorted(seen)}, wanted {sorted(wanted)}")
        try:
            seen |= set(sock.recv(4096).decode().splitlines())
        except TimeoutError:
            continue
    return seen


@pytest.mark.parametrize("who", ["leader", "agent"])
def test_ready_and_watchdog_reach_notify_socket(who, procs, nats_server, notify_socket, tmp_path):
    sock, path = notify_socket
    env = child_env(
        NOTIFY_SOCKET=path,
        WATCHDOG_USEC="400000",
        SWARM_NATS_URL=nats_server.url,
        SWARM_STATE_DIR=str(tmp_path / "state"),
        SWARM_LEADER_PORT=str(free_port()),
    )
    module = "silentswarm.leader.main" if who == "leader" else "silentswarm.agent.main"
    args = ("--name", "notified") if who == "agent" else ()
    proc = procs.python(who, module, *args, env=env)
    seen = receive_until(sock, {"READY=1", "WATCHDOG=1"}, timeout=30)
    assert any(line.startswith("STATUS=") for line in seen)
    # The watchdog keeps coming (every WATCHDOG_USEC / 2).
    receive_until(sock, {"WATCHDOG=1"}, timeout=5)
    children = psutil.Process(proc.pid).children(recursive=True)
    stopped = time.monotonic()
    proc.terminate()
    assert proc.wait(timeout=20) == 0
    if who == "agent":
        # Stopped mid compute-speed probe (TensorFlow, seconds): the probe is killed, not
        # waited for, and nothing of it is left behind.
        assert time.monotonic() - stopped < 5
        assert all(is_gone(child) for child in children)
    receive_until(sock, {"STOPPING=1"}, timeout=5)
