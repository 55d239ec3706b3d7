"""A small JetStream store (a tmpfs, as root): the leader fits its history streams to what the
server grants, a job runs with no storage error and a healthy /health; a store too small for
the streams, or one that fills up, makes /health degraded (503) with the reason."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest
from nats.js.api import KeyValueConfig, StorageType, StreamConfig
from nats.js.errors import APIError, KeyNotFoundError

from silentswarm import subjects as topics
from silentswarm.natsd import NatsServer, start_nats_server
from silentswarm.protocol import LogBatch, LogRecord
from tests.conftest import leader_process, start_agent
from tests.helpers import Leader, Processes, wait_for
from tests.integration.test_jobs import tiny, wait_ready

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root"),
]
MIB = 1 << 20


@contextlib.contextmanager
def tmpfs(path: Path, size_mib: int) -> Iterator[Path]:
    path.mkdir(parents=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)], check=True
    )
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def nats_on_tmpfs(tmp_path: Path, size_mib: int) -> Iterator[NatsServer]:
    """A nats-server whose JetStream store is a tmpfs of ``size_mib`` MiB (its max_store is
    then 75% of that); stopped, and the tmpfs unmounted, whatever happens."""
    with tmpfs(tmp_path / "small-store", size_mib) as store:
        server = start_nats_server(
            host="127.0.0.1",
            port=0,
            store_dir=store,
            log_path=tmp_path / "nats.log",
            tie_to_parent=True,
        )
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def store_64(tmp_path: Path) -> Iterator[NatsServer]:
    with nats_on_tmpfs(tmp_path, 64) as server:
        yield server


@pytest.fixture
def store_8(tmp_path: Path) -> Iterator[NatsServer]:
    with nats_on_tmpfs(tmp_path, 8) as server:
        yield server


# The store first: its processes (leader, fellows) end before the server stops.
@pytest.fixture
def leader_64(store_64: NatsServer, procs: Processes, tmp_path: Path) -> Iterator[Leader]:
    yield from leader_process(procs, store_64, tmp_path)


@pytest.fixture
def leader_8(store_8: NatsServer, procs: Processes, tmp_path: Path) -> Iterator[Leader]:
    yield from leader_process(procs, store_8, tmp_path)


def leader_log(procs: Processes) -> str:
    return "".join(
        path.read_text(errors="replace") for path in sorted(procs.log_dir.glob("leader-*.log"))
    )


def storage(leader: Leader) -> dict:
    return leader.get("/api/v1/info")["storage"]


def checked_after(leader: Leader, checks: int) -> dict:
    """The storage view once the leader has looked at its store again (after ``checks``)."""
    return wait_for(
        lambda: (view := storage(leader))["checks"] > checks and view,
        timeout=30,
        what="the leader to look at its store again",
    )


def first_log_event(leader: Leader, fellow_id: str) -> str:
    with leader.http.stream("GET", f"/api/v1/workers/{fellow_id}/logs/stream") as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("event:"):
                return line.split(":", 1)[1].strip()
    raise AssertionError("the log stream ended without an event")


def test_a_64_mib_store_runs_a_job_with_no_storage_error_and_a_healthy_health(
    store_64: NatsServer, procs: Processes, leader_64: Leader, tmp_path: Path
):
    leader = leader_64
    view = wait_for(
        lambda: (v := storage(leader))["capacity_bytes"] and v,
        timeout=30,
        what="the leader to measure its store",
    )
    # nats-server's max_store is 75% of the 64 MiB free at its start; the leader found it.
    capacity = view["capacity_bytes"]
    assert 47 * MIB <= capacity <= 48 * MIB and not view["capacity_at_least"], view
    limits = {s["name"]: s for s in view["streams"]}
    assert set(limits) == {"swarm_progress", "swarm_logs"}
    for stream in limits.values():
        assert 0.34 * capacity < stream["max_bytes"] <= 0.35 * capacity, stream
    assert limits["swarm_logs"]["max_msgs_per_subject"] < 5000  # fitted, not the default

    for name in ("s1", "s2"):
        start_agent(procs, store_64.url, name)
    wait_ready(leader, "s1", "s2")
    assert first_log_event(leader, "s1") == "logs"
    job_id = leader.submit(**tiny(name="small-store", steps=40, stages=2))["job_id"]
    job = leader.wait_job(job_id, "COMPLETED", timeout=200)
    assert job["final_loss"] is not None
    assert leader.get(f"/api/v1/jobs/{job_id}/metrics/history")[-1]["step"] == 40

    view = checked_after(leader, storage(leader)["checks"])
    assert view["reasons"] == [] and view["used_bytes"] > 0
    health = leader.request("GET", "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    log = leader_log(procs)
    assert "insufficient" not in log and "storage degraded" not in log, log[-3000:]
    assert "insufficient" not in (tmp_path / "nats.log").read_text()


def test_a_store_too_small_for_the_history_makes_health_degraded_with_the_reason(
    leader_8: Leader,
):
    # 8 MiB: max_store 6 MiB, so each history stream gets 2.1 MiB, under the 4 MiB useful.
    response = wait_for(
        lambda: (r := leader_8.request("GET", "/health")).status_code == 503 and r,
        timeout=30,
        what="/health to say degraded",
    )
    body = response.json()
    assert body["status"] == "degraded" and body["nats"] == "connected"
    assert any("too small" in r and "swarm_progress" in r for r in body["reasons"]), body
    assert leader_8.get("/api/v1/info")["state_loaded"]  # the leader serves all the same
    assert "swarm_leader_storage_degraded 1.0" in leader_8.http.get("/api/v1/metrics").text


def test_a_full_store_makes_health_degraded_and_healthy_again_once_freed(
    store_64: NatsServer, leader_64: Leader
):
    leader = leader_64
    wait_for(lambda: storage(leader)["capacity_bytes"], timeout=30, what="the store's capacity")
    assert leader.request("GET", "/health").status_code == 200

    async def fill() -> int:
        """Another tenant's bucket, filled until JetStream refuses: the store is full."""
        nc = await nats.connect(store_64.url)
        kv = await nc.jetstream().create_key_value(
            KeyValueConfig(bucket="hog", history=1, storage=StorageType.FILE)
        )
        written = 0
        try:
            while written < 64 * MIB:
                await kv.put(f"k{written}", b"x" * 256 * 1024)
                written += 256 * 1024
        except APIError:
            pass
        finally:
            await nc.close()
        return written

    written = asyncio.run(fill())
    assert 30 * MIB < written < 64 * MIB, written  # refused: the store (48 MiB) is full
    response = wait_for(
        lambda: (r := leader.request("GET", "/health")).status_code == 503 and r,
        timeout=30,
        what="/health to say the store is full",
    )
    assert any("store is full" in r for r in response.json()["reasons"]), response.json()

    async def free() -> None:
        nc = await nats.connect(store_64.url)
        await nc.jetstream().delete_key_value("hog")
        await nc.close()

    asyncio.run(free())
    wait_for(
        lambda: leader.request("GET", "/health").status_code == 200,
        timeout=30,
        what="/health to be ok again once the store has room",
    )
    assert httpx.get(f"{leader.url}/health").json()["status"] == "ok"


def test_a_flood_of_history_stays_within_its_share_and_the_state_is_still_saved(
    store_64: NatsServer, leader_64: Leader
):
    """Ten chatty fellows send 45 MiB of large log batches into a 48 MiB store: the log stream
    keeps their newest within its fitted limits, and the leader's state still saves."""
    limits = wait_for(
        lambda: {s["name"]: s for s in storage(leader_64)["streams"] if s["max_bytes"] > 0},
        timeout=30,
        what="the fitted streams",
    )["swarm_logs"]
    fellows, batches = [f"chatty-{i}" for i in range(10)], 190
    record = LogRecord(ts=1.0, level="INFO", logger="flood", message="y" * 8000)  # the largest

    async def flood() -> dict:
        nc = await nats.connect(store_64.url)
        for fellow in fellows:
            data = topics.encode(LogBatch(fellow_id=fellow, records=[record] * 3))
            for _ in range(batches):
                await nc.publish(f"swarm.log.{fellow}", data)
        await nc.flush()
        js = nc.jetstream()
        deadline = asyncio.get_running_loop().time() + 30
        while (info := await js.stream_info("swarm_logs")).state.last_seq < len(fellows) * batches:
            assert asyncio.get_running_loop().time() < deadline, "the stream stopped storing"
            await asyncio.sleep(0.05)
        info = await js.stream_info("swarm_logs", subjects_filter="swarm.log.>")
        await nc.close()
        return {"bytes": info.state.bytes, "subjects": info.state.subjects or {}}

    stored = asyncio.run(flood())
    assert stored["bytes"] <= limits["max_bytes"]
    # Oldest first: the stream's total pushed out the first fellows' batches, not the last's.
    assert f"swarm.log.{fellows[-1]}" in stored["subjects"]
    assert max(stored["subjects"].values()) <= limits["max_msgs_per_subject"]

    job_id = leader_64.submit(**tiny(name="after-the-flood", steps=10, stages=2))["job_id"]

    async def saved() -> bool:
        nc = await nats.connect(store_64.url)
        try:
            kv = await nc.jetstream().key_value("swarm_jobs")
            deadline = asyncio.get_running_loop().time() + 30
            while True:
                with contextlib.suppress(KeyNotFoundError):
                    return (await kv.get(job_id)).value is not None
                assert asyncio.get_running_loop().time() < deadline, "the job was not saved"
                await asyncio.sleep(0.05)
        finally:
            await nc.close()

    assert asyncio.run(saved())
    view = checked_after(leader_64, storage(leader_64)["checks"])
    assert view["reasons"] == [], view
    assert leader_64.request("GET", "/health").status_code == 200


def test_history_streams_that_cannot_be_made_are_a_reason_and_come_once_there_is_room(
    store_64: NatsServer, procs: Processes, tmp_path: Path
):
    """Another tenant reserved all of the store but 1 KiB before the leader started (its KV
    buckets need no room to be made, a stream needs a record's): /health and the log SSE say
    why, and the streams come as soon as the reservation is gone."""

    async def hog() -> int:
        nc = await nats.connect(store_64.url)
        js = nc.jetstream()

        async def grants(max_bytes: int) -> bool:
            try:
                await js.add_stream(
                    StreamConfig(name="hog", subjects=["hog.>"], max_bytes=max_bytes)
                )
            except APIError:
                return False
            await js.delete_stream("hog")
            return True

        low, high = 0, 1 << 30  # granted, refused: to the byte
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if await grants(middle) else (low, middle)
        await js.add_stream(StreamConfig(name="hog", subjects=["hog.>"], max_bytes=low - 1024))
        await nc.close()
        return low

    assert asyncio.run(hog()) > 40 * MIB
    leaders = leader_process(procs, store_64, tmp_path)
    leader = next(leaders)
    try:
        response = wait_for(
            lambda: (r := leader.request("GET", "/health")).status_code == 503 and r,
            timeout=30,
            what="/health to say the streams could not be made",
        )
        [reason] = response.json()["reasons"]
        assert "could not be created" in reason and "too small" in reason, reason
        logs = leader.request("GET", "/api/v1/workers/anyone/logs/stream")
        assert logs.status_code == 503 and logs.json()["code"] == "STORAGE_UNAVAILABLE"
        assert leader.get("/api/v1/info")["state_loaded"]  # the state store works meanwhile

        async def unhog() -> None:
            nc = await nats.connect(store_64.url)
            await nc.jetstream().delete_stream("hog")
            await nc.close()

        asyncio.run(unhog())
        wait_for(
            lambda: leader.request("GET", "/health").status_code == 200,
            timeout=30,
            what="the streams to be made once the store has room",
        )
        with leader.http.stream("GET", "/api/v1/workers/anyone/logs/stream") as stream:
            assert stream.status_code == 200
        assert leader_log(procs).count("cannot open the history streams") == 1  # not per retry
    finally:
        leaders.close()
