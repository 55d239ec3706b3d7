"""The link emulator shapes for real: a path's round trip and rate are what its profile says,
per direction, bytes arrive whole and in order under jitter, and nothing outlives a path."""

from __future__ import annotations

import random
import subprocess
import threading
from pathlib import Path

import pytest

from tests.helpers import bench_module, shaped_paths_unavailable

linkemu = bench_module("linkemu")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        (why := shaped_paths_unavailable()) is not None, reason=f"no shaped paths here: {why}"
    ),
]
Direction, Profile = linkemu.Direction, linkemu.Profile


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


@pytest.mark.timeout(60)
def test_wan20_round_trip_and_rate():
    got = linkemu.probe(linkemu.PROFILES["wan20"], megabytes=2.0)
    assert 100 <= got["rtt_ms"] < 130, got  # 2 x 50 ms one way
    assert 16 <= got["throughput_mbit_s"] <= 21, got  # 20 Mbit/s, less the headers


@pytest.mark.timeout(60)
def test_each_direction_has_its_own_rate_and_delay():
    # forward: fast, no delay; backward: 30 ms and 10 Mbit/s. The probe's payload goes
    # forward, so it must not see the backward rate; its round trip sees one delay only.
    prof = Profile("asym", Direction(None, 0.0), Direction(10e6, 0.030))
    got = linkemu.probe(prof, megabytes=4.0)
    assert 30 <= got["rtt_ms"] < 45, got
    assert got["throughput_mbit_s"] > 60, got


@pytest.mark.timeout(60)
def test_jitter_keeps_every_byte_in_order():
    prof = Profile("jittery", Direction(50e6, 0.005, 0.010), Direction(50e6, 0.005, 0.010))
    payload = random.Random(7).randbytes(3 * 2**20)
    echo = "while d:=c.recv(1<<16): c.sendall(d)\n"
    with linkemu.FarSide(prof) as far, far.connect_to_server(echo) as sock:

        def send() -> None:
            for i in range(0, len(payload), 10_000):
                sock.sendall(payload[i : i + 10_000])

        sender = threading.Thread(target=send)
        sender.start()
        got = bytearray()
        while len(got) < len(payload):
            chunk = sock.recv(1 << 20)
            assert chunk, "the path closed early"
            got += chunk
        sender.join()
    assert bytes(got) == payload


@pytest.mark.timeout(60)
def test_nothing_outlives_a_path_even_when_the_body_raises():
    before = namespaces()
    with (
        pytest.raises(RuntimeError, match="boom"),
        linkemu.FarSide(linkemu.PROFILES["wan100"]) as far,
    ):
        far.relay(far=True, target=(far.near_ip, 9))
        assert far.namespace in namespaces()
        raise RuntimeError("boom")
    assert namespaces() == before
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert far._near_dev not in links


@pytest.mark.timeout(60)
def test_remove_stale_clears_a_dead_runs_namespace():
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    dead = f"ssw-{pid_max + 1}-beef"  # a pid above pid_max: never alive
    subprocess.run(["ip", "netns", "add", dead], check=True)
    try:
        assert dead in linkemu.remove_stale()
        assert dead not in namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", dead], capture_output=True)
