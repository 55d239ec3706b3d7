"""Junk on every subject the leader listens to: dropped, logged with its subject, counted;
the leader stays up and its registry does not change."""

from __future__ import annotations

import os

import msgspec

from silentswarm import subjects
from silentswarm.protocol import FellowIdentity, HardwareSnapshot, Heartbeat, Progress, ShardChunk
from tests.conftest import start_agent
from tests.helpers import dropped_messages, wait_for
from tests.integration.nats_client import with_nats


def dropped(leader, reason: str | None = None) -> float:
    return dropped_messages(leader.http, reason)


def test_junk_is_dropped_logged_and_counted_and_changes_nothing(procs, nats_server, leader):
    start_agent(procs, nats_server.url, "honest")
    leader.wait_status("honest", "ready", timeout=20)
    before = leader.workers()
    counted = dropped(leader)

    identity = FellowIdentity(
        fellow_id="someone-else", instance_id="i", hostname="h", version="v", pid=1
    )
    hardware = HardwareSnapshot(hostname="h", cpu_cores=1, ram_total_bytes=1, ram_available_bytes=1)
    impostor = Heartbeat(fellow=identity, seq=1, status="ready", hardware=hardware)
    wrong_type = Progress(job_id="j", fellow_id="honest", attempt=1, step=1)
    junk = [
        os.urandom(64),
        b"",
        b"\xc1" * 10,  # never valid msgpack
        os.urandom(900_000),  # big, under the server's 1 MiB max_payload
        subjects.encode(wrong_type),  # a valid message of another kind
        msgspec.msgpack.encode({"v": 1, "fellow": "not a struct"}),
    ]

    async def attack(nc):
        replies = []
        for payload in junk:
            for subject in (
                "swarm.hb.mallory",
                "swarm.progress.job-1.mallory",
                "swarm.log.mallory",
                "swarm.shard.job-1.mallory",
            ):
                await nc.publish(subject, payload)
            msg = await nc.request("swarm.register.mallory", payload, timeout=5)
            replies.append(subjects.REGISTER.decode_reply(msg.data))
        # A well-formed heartbeat on another fellow's subject: an impostor.
        await nc.publish("swarm.hb.honest", subjects.encode(impostor))
        # A well-formed shard piece for a job that does not exist: refused in the reply.
        msg = await nc.request("swarm.shard.job-1.mallory", subjects.encode(piece), timeout=5)
        replies.append(subjects.SHARD.decode_reply(msg.data))
        await nc.flush()
        return replies

    piece = ShardChunk(
        job_id="job-1",
        fellow_id="mallory",
        attempt=1,
        stage=0,
        step=10,
        name="stage-0.npz",
        size=3,
        sha256="0" * 64,
        seq=0,
        total=1,
        data=b"abc",
    )
    *replies, shard_reply = with_nats(nats_server.url, attack, inbox_prefix="_INBOX.mallory")
    assert all(not r.accepted and r.code == "PROTOCOL_ERROR" for r in replies)
    assert not shard_reply.ok and "no job" in shard_reply.message
    # Every kind of junk on the heartbeat, register, progress, log and shard subjects counts.
    wait_for(lambda: dropped(leader) >= counted + 5 * len(junk) + 1, timeout=10, what="drops")
    assert leader.get("/health")["status"] == "ok"
    after = leader.workers()
    assert set(after) == set(before) == {"honest"}
    assert after["honest"]["instance_id"] == before["honest"]["instance_id"]
    leader_log = procs.log(procs.started[0])  # the leader fixture's process
    for subject in (
        "swarm.hb.mallory",
        "swarm.register.mallory",
        "swarm.progress.job-1.mallory",
        "swarm.shard.job-1.mallory",
    ):
        assert f"dropped message on {subject}" in leader_log, subject
    assert "dropped message on swarm.hb.honest" in leader_log  # the impostor


def test_a_heartbeat_and_registration_flood_is_limited_per_fellow(procs, nats_server, leader):
    start_agent(procs, nats_server.url, "honest")
    leader.wait_status("honest", "ready", timeout=20)
    identity = FellowIdentity(
        fellow_id="mallory", instance_id="i", hostname="h", version="v", pid=1
    )
    hardware = HardwareSnapshot(hostname="h", cpu_cores=1, ram_total_bytes=1, ram_available_bytes=1)
    beat = subjects.encode(Heartbeat(fellow=identity, seq=1, status="ready", hardware=hardware))

    async def flood(nc):
        for _ in range(2000):
            await nc.publish("swarm.hb.mallory", beat)
            await nc.publish("swarm.register.mallory", b"junk", reply="_INBOX.mallory.x")
        await nc.flush()

    with_nats(nats_server.url, flood, inbox_prefix="_INBOX.mallory")
    for reason in ("heartbeat_rate", "register_rate"):
        wait_for(lambda r=reason: dropped(leader, r) >= 1000, timeout=20, what=reason)
    assert leader.get("/health")["status"] == "ok"
    leader.wait_status("honest", "ready", timeout=20)  # its own heartbeats still count
