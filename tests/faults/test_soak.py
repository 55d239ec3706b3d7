"""Soak: 200 simulated fellows (real NATS clients speaking the real protocol, in one process)
register and heartbeat every second against a real leader for a bounded time. Every
heartbeat arrives, nobody goes offline, and the leader's memory stays flat."""

from __future__ import annotations

import asyncio
import os
import uuid

import nats
import psutil
import pytest

from silentswarm import subjects as topics
from silentswarm.protocol import (
    FellowIdentity,
    FellowStatus,
    HardwareSnapshot,
    Heartbeat,
    RegisterRequest,
)
from tests.helpers import Leader, wait_for

pytestmark = pytest.mark.timeout(180)
FELLOWS = 200
ROUNDS = 15  # heartbeats each, one a second


class SimulatedFellow:
    def __init__(self, index: int) -> None:
        self.identity = FellowIdentity(
            fellow_id=f"soak-{index:03d}",
            instance_id=uuid.uuid4().hex[:16],
            hostname=f"soak-host-{index % 20}",
            version="soak",
            pid=os.getpid(),
        )
        self.hardware = HardwareSnapshot(
            hostname=self.identity.hostname,
            cpu_cores=4,
            ram_total_bytes=8 << 30,
            ram_available_bytes=6 << 30,
        )
        self.sent = 0

    async def run(self, url: str, start: asyncio.Event) -> None:
        nc = await nats.connect(url, inbox_prefix=topics.inbox_prefix(self.identity.fellow_id))
        try:
            subject = topics.REGISTER.subject("swarm", fellow=self.identity.fellow_id)
            request = RegisterRequest(fellow=self.identity, hardware=self.hardware)
            reply = await nc.request(subject, topics.encode(request), timeout=20)
            assert topics.REGISTER.decode_reply(reply.data).accepted
            await start.wait()
            hb_subject = topics.HEARTBEAT.subject("swarm", fellow=self.identity.fellow_id)
            for seq in range(1, ROUNDS + 1):
                hb = Heartbeat(
                    fellow=self.identity,
                    seq=seq,
                    status=FellowStatus.READY,
                    hardware=self.hardware,
                )
                await nc.publish(hb_subject, topics.encode(hb))
                self.sent += 1
                await asyncio.sleep(1.0)  # the protocol's 1 Hz, not a wait for an event
            await nc.flush()
        finally:
            await nc.close()


def test_200_fellows_heartbeat_without_loss_and_the_leader_stays_flat(nats_server, leader: Leader):
    leader_proc = next(
        p
        for p in psutil.process_iter(["cmdline"])
        if "silentswarm.leader.main" in " ".join(p.info["cmdline"] or [])
        and p.ppid() == os.getpid()
    )
    fellows = [SimulatedFellow(i) for i in range(FELLOWS)]
    rss: list[int] = []

    async def main() -> None:
        start = asyncio.Event()
        tasks = [asyncio.create_task(f.run(nats_server.url, start)) for f in fellows]
        await asyncio.to_thread(
            wait_for,
            lambda: len(leader.get("/api/v1/workers")) == FELLOWS,
            timeout=60,
            what=f"{FELLOWS} fellows to register",
        )
        start.set()
        for _ in range(ROUNDS):
            await asyncio.sleep(1.0)
            rss.append(leader_proc.memory_info().rss)
        await asyncio.gather(*tasks)

    asyncio.run(main())
    workers = {w["fellow_id"]: w for w in leader.get("/api/v1/workers")}
    assert len(workers) == FELLOWS
    for fellow in fellows:
        record = workers[fellow.identity.fellow_id]
        assert record["heartbeats"] == fellow.sent == ROUNDS, record["fellow_id"]
        assert all(t["to_status"] != "offline" for t in record["history"]), record["history"]
    # Flat: after the first seconds (imports, caches), the leader grows by under 16 MiB.
    settled = rss[len(rss) // 3 :]
    assert max(settled) - settled[0] < 16 * 2**20, [r >> 20 for r in rss]
