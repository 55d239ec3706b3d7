"""Attacks a fellow can make with its own NATS credentials against a live swarm, each next
to a running job: every one fails, and the job is untouched (see conftest.Beside).

The attacker is ``mallory``: admitted by the authority (its own NATS user), placed in no
job. Where an attack needs more than mallory's own user, the test says what it holds
instead: a user of an honest fellow (as a thief of its credentials), or a user minted with
the permissions fellows had before per-attempt users (still valid until the authority is
rotated), which the leader's own checks must stop.
"""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from silentswarm import subjects as topics
from silentswarm.natsauth import Permissions
from silentswarm.protocol import (
    DeregisterRequest,
    FellowIdentity,
    GpuInfo,
    HardwareSnapshot,
    Heartbeat,
    LogBatch,
    LogRecord,
    Progress,
    RegisterRequest,
    ShardChunk,
)
from tests.helpers import dropped_messages, until, wait_for
from tests.hostile.conftest import HONEST, Beside

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def dropped(beside: Beside, reason: str) -> float:
    return dropped_messages(beside.leader.http, reason)


def identity(name: str = "mallory", instance: str = "m1") -> FellowIdentity:
    return FellowIdentity(fellow_id=name, instance_id=instance, hostname="evil", version="1", pid=1)


def hardware(**overrides) -> HardwareSnapshot:
    return HardwareSnapshot(
        hostname="evil", cpu_cores=2, ram_total_bytes=1 << 30, ram_available_bytes=1 << 30,
        **overrides,
    )  # fmt: skip


def placed(beside: Beside) -> dict[int, str]:
    """Stage -> the honest fellow placed there."""
    return {s["stage"]: s["fellow_id"] for s in beside.job()["placement"]["stages"]}


def legacy_user(beside: Beside, name: str):
    """A user with the rights fellows had before per-attempt users: progress for any job."""
    path = beside.procs.log_dir.parent / f"legacy-{name}.creds"
    perms = Permissions(
        publish=(f"swarm.progress.*.{name}", f"swarm.shard.*.{name}", "swarm.relay.>"),
        subscribe=(f"_INBOX.{name}.>", "swarm.relay.>"),
    )
    path.write_text(beside.authority.user_creds(name, perms))
    path.chmod(0o600)
    return path


def test_the_leader_answers_only_in_the_senders_inbox(beside: Beside):
    """Attack 1: junk and real requests on mallory's own subjects, with reply subjects that
    point into the job store, the JetStream API and another fellow's inbox."""
    job_id = beside.job_id
    targets = [
        f"$KV.swarm_jobs.{job_id}",
        "$KV.swarm_fellows.h1",
        "$JS.API.STREAM.PURGE.swarm_progress",
        "$JS.API.STREAM.PURGE.swarm_logs",
        "_INBOX.h1.mallory",
    ]
    register = topics.encode(RegisterRequest(fellow=identity(), hardware=hardware()))
    piece = topics.encode(
        ShardChunk(
            job_id=job_id, fellow_id="mallory", attempt=1, stage=0, step=1, name="stage-0.npz",
            size=1, sha256="0" * 64, seq=0, total=1, data=b"x",
        )
    )  # fmt: skip
    line = LogRecord(ts=1, level="INFO", logger="x", message="m")
    batch = topics.encode(LogBatch(fellow_id="mallory", records=[line]))
    sends = [
        ("swarm.register.mallory", register),
        ("swarm.register.mallory", b"junk"),
        ("swarm.log.mallory", batch),  # stored by the log stream: its PubAck must go nowhere
    ]
    before = dropped(beside, "reply")

    async def attack():
        watcher = await beside.connect(beside.authority.leader_creds_path)
        seen: list[tuple[str, bytes]] = []

        async def on_target(msg) -> None:
            seen.append((msg.subject, msg.data))

        for subject in ("$KV.swarm_jobs.>", "$KV.swarm_fellows.>", "$JS.API.STREAM.PURGE.>"):
            await watcher.subscribe(subject, cb=on_target)
        victim = await beside.connect(beside.creds("h1"), inbox_prefix="_INBOX.h1")
        stolen = await victim.subscribe("_INBOX.h1.mallory")
        await watcher.flush()
        await victim.flush()
        progress = await watcher.jetstream().stream_info("swarm_progress")
        mallory = await beside.connect(beside.mallory_creds, inbox_prefix="_INBOX.mallory")
        # Mallory's own user may not push shards: a user with the rights fellows had before
        # per-attempt users does, and the leader must still not answer elsewhere.
        legacy = await beside.connect(legacy_user(beside, "mallory"))
        for reply in targets:
            for subject, payload in sends:
                await mallory.publish(subject, payload, reply=reply)
            await legacy.publish(f"swarm.shard.{job_id}.mallory", piece, reply=reply)
        await mallory.flush()
        await legacy.flush()
        await legacy.close()
        # Mallory asking in its own inbox is answered: the requests before it were handled.
        answer = await mallory.request("swarm.register.mallory", b"junk", timeout=5)
        assert not topics.REGISTER.decode_reply(answer.data).accepted
        after = await watcher.jetstream().stream_info("swarm_progress")
        try:
            await stolen.next_msg(timeout=0.5)
        except TimeoutError:
            stolen_msg = None
        else:
            stolen_msg = "delivered"
        for nc in (mallory, victim, watcher):
            await nc.close()
        return seen, progress.state.messages, after.state.messages, stolen_msg

    seen, progress_before, progress_after, stolen = beside.run(attack)
    assert stolen is None, "the leader answered into h1's inbox"
    assert progress_after >= progress_before, "the progress stream was purged"
    assert not [s for s, _ in seen if s.startswith("$JS.API")], "someone purged a stream"
    for subject, data in seen:  # only the leader's own writes: JSON records
        assert isinstance(json.loads(data), dict), subject
    # 3 kinds of request x 5 targets refused (the stored log batch gets no ack at all).
    wait_for(lambda: dropped(beside, "reply") >= before + 15, timeout=10, what="reply drops")
    job = beside.assert_untouched()
    assert job["job_id"] == job_id
    assert "mallory" not in beside.leader.workers()


def test_the_relay_is_closed_to_fellows_the_attempt_did_not_place(beside: Beside):
    """Attack 2: read another job's activations, and fail it with one junk message."""
    boundary = f"swarm.relay.{beside.job_id}.1.0"
    step_before = min(p["step"] for p in beside.job()["progress"])

    async def attack():
        watcher = await beside.connect(beside.authority.leader_creds_path)
        traffic = await watcher.subscribe(f"{boundary}.fwd")
        await watcher.flush()
        await traffic.next_msg(timeout=10)  # the boundary is busy: there is something to read
        results = {}
        for who, creds in (("mallory", beside.mallory_creds), ("h1-thief", beside.creds("h1"))):
            errors: list[str] = []

            async def on_error(exc, errors=errors) -> None:
                errors.append(str(exc).lower())

            nc = await beside.connect(creds, error_cb=on_error)
            read: list[bytes] = []

            async def on_frame(msg, read=read) -> None:
                read.append(msg.data)

            await nc.subscribe("swarm.relay.>", cb=on_frame)
            await nc.subscribe(f"{boundary}.fwd", cb=on_frame)
            await nc.publish(f"{boundary}.fwd", b"Zjunk")
            await nc.publish(f"{boundary}.bwd", b"Zjunk")
            await nc.flush()
            await until(
                lambda errors=errors: len(errors) >= 4,
                timeout=10,
                what=f"4 permission errors for {who}",
            )
            await traffic.next_msg(timeout=10)  # frames kept flowing meanwhile
            results[who] = (list(errors), len(read))
            await nc.close()
        await watcher.close()
        return results

    results = beside.run(attack)
    for who, (errors, frames) in results.items():
        assert frames == 0, f"{who} read {frames} relay messages"
        joined = " ".join(errors)
        assert 'subscription to "swarm.relay.>"' in joined, (who, errors)
        assert f'publish to "{boundary}.fwd"' in joined, (who, errors)
    wait_for(
        lambda: min(p["step"] for p in beside.job()["progress"]) > step_before + 5,
        timeout=30,
        what="the job to keep training",
    )
    beside.assert_untouched()


def test_progress_from_anyone_but_the_placed_stage_shows_nowhere(beside: Beside):
    """Attack 3: forged metrics for the job, from an unplaced fellow and from a placed one
    claiming another stage or attempt, and a flood."""
    job_id = beside.job_id
    stage0 = placed(beside)[0]
    legacy_mallory = legacy_user(beside, "mallory")
    legacy_stage0 = legacy_user(beside, stage0)
    forged = [
        (legacy_mallory, Progress(job_id=job_id, fellow_id="mallory", attempt=1, stage=1,
                                  step=10**6, loss=99.0, total_steps=10**6)),
        (legacy_mallory, Progress(job_id=job_id, fellow_id="mallory", attempt=7, stage=1,
                                  step=3, loss=99.0)),
        (legacy_stage0, Progress(job_id=job_id, fellow_id=stage0, attempt=1, stage=1,
                                 step=10**6, loss=99.0)),
        (legacy_stage0, Progress(job_id=job_id, fellow_id=stage0, attempt=9, stage=0,
                                 step=10**6, loss=99.0)),
    ]  # fmt: skip
    last = len(placed(beside)) - 1
    in_last_stages_name = Progress(
        job_id=job_id, fellow_id=placed(beside)[last], attempt=1, stage=last, step=10**6, loss=99.0
    )
    refused_before = dropped(beside, "progress")
    rate_before = dropped(beside, "progress_rate")

    async def attack():
        errors: list[str] = []

        async def on_error(exc) -> None:
            errors.append(str(exc).lower())

        # Mallory's own user may not publish progress at all: the server refuses.
        own = await beside.connect(beside.mallory_creds, error_cb=on_error)
        await own.publish(f"swarm.progress.{job_id}.mallory", topics.encode(forged[0][1]))
        await own.flush()
        await until(lambda: errors, timeout=10, what="the server to refuse mallory's progress")
        await own.close()
        for creds, record in forged:
            nc = await beside.connect(creds)
            subject = topics.PROGRESS.subject("swarm", job=job_id, fellow=record.fellow_id)
            await nc.publish(subject, topics.encode(record))
            await nc.flush()
            await nc.close()
        # On its own subject (no flood evicts it from the stream), a record in the placed
        # last stage's name: the live check refuses it, and the history (a replay) must too.
        nc = await beside.connect(legacy_user(beside, "trudy"))
        await nc.publish(f"swarm.progress.{job_id}.trudy", topics.encode(in_last_stages_name))
        await nc.flush()
        await nc.close()
        # A flood from one (legacy) user: over its rate, dropped and counted.
        nc = await beside.connect(legacy_mallory)
        flood = topics.encode(forged[0][1])
        for _ in range(3000):
            await nc.publish(f"swarm.progress.{job_id}.mallory", flood)
        await nc.flush()
        await nc.close()
        return errors

    errors = beside.run(attack)
    assert f'publish to "swarm.progress.{job_id}.mallory"' in " ".join(errors)
    wait_for(
        lambda: dropped(beside, "progress") >= refused_before + len(forged) + 1,
        timeout=10,
        what="the forged records to be refused",
    )
    wait_for(
        lambda: dropped(beside, "progress_rate") > rate_before,
        timeout=10,
        what="the flood to be limited",
    )
    # The stream did store what the legacy user published; the history rebuilt from it
    # (as after a leader restart) shows none of it.
    job = beside.assert_untouched()
    history = beside.leader.get(f"/api/v1/jobs/{job_id}/metrics/history")
    assert history and max(p["step"] for p in history) <= job["spec"]["steps"]
    assert beside.leader.get("/health")["status"] == "ok"


def test_a_deregister_needs_the_secret_only_the_registered_process_holds(beside: Beside):
    """Attack 4 (the part on NATS): knock an honest fellow offline with its public
    instance id, holding a user of its name (as a stolen or claimed one would be)."""
    victim = HONEST[0]
    instance = beside.leader.workers()[victim]["instance_id"]
    goodbye = DeregisterRequest(fellow_id=victim, instance_id=instance, reason="bye")

    async def attack():
        nc = await beside.connect(beside.creds(victim), inbox_prefix=f"_INBOX.{victim}")
        subject = topics.REGISTER.subject("swarm", fellow=victim)
        replies = [await nc.request(subject, topics.encode(goodbye), timeout=5)]
        guessed = msgspec.structs.replace(goodbye, instance_secret="0" * 32)
        replies.append(await nc.request(subject, topics.encode(guessed), timeout=5))
        await nc.close()
        return [topics.REGISTER.decode_reply(r.data) for r in replies]

    for reply in beside.run(attack):
        assert not reply.accepted and reply.code == "INSTANCE_SECRET_INVALID", reply
    assert beside.leader.workers()[victim]["status"] == "training"
    beside.assert_untouched()


def test_claims_out_of_bounds_are_refused_with_the_reason(beside: Beside):
    """Attack 9 (the part on NATS): a heartbeat and a registration claiming 7000 GPUs."""
    gpu = GpuInfo(index=0, uuid="GPU-x", name="H100", memory_total_bytes=80 << 30,
                  memory_free_bytes=80 << 30, memory_used_bytes=0)  # fmt: skip
    greedy = hardware(gpus=[gpu] * 7000)
    before = dropped(beside, "hb")

    async def attack():
        nc = await beside.connect(beside.mallory_creds, inbox_prefix="_INBOX.mallory")
        hb = Heartbeat(fellow=identity(), seq=1, status="ready", hardware=greedy)
        await nc.publish("swarm.hb.mallory", topics.encode(hb))
        request = RegisterRequest(fellow=identity(), hardware=greedy)
        reply = await nc.request("swarm.register.mallory", topics.encode(request), timeout=5)
        await nc.close()
        return topics.REGISTER.decode_reply(reply.data)

    reply = beside.run(attack)
    assert not reply.accepted and reply.code == "PROTOCOL_ERROR"
    assert "$.hardware.gpus" in reply.message and "64" in reply.message
    wait_for(lambda: dropped(beside, "hb") > before, timeout=10, what="the heartbeat drop")
    assert "mallory" not in beside.leader.workers()
    assert len(beside.leader.http.get("/api/v1/metrics").content) < 200_000
    beside.assert_untouched()


def test_one_fellows_volume_evicts_nobody_elses_logs(beside: Beside):
    """Quotas: mallory floods its own log subject, with batches too big and too many."""

    async def stored(js, subject: str) -> int:
        info = await js.stream_info("swarm_logs", subjects_filter=subject)
        return sum((info.state.subjects or {}).values())

    def batch(marker: str, size: int) -> bytes:
        record = LogRecord(ts=1, level="INFO", logger="flood", message=marker + "x" * size)
        return topics.encode(LogBatch(fellow_id="mallory", records=[record]))

    async def attack():
        watcher = await beside.connect(beside.authority.leader_creds_path)
        js = watcher.jetstream()
        honest_before = {n: await stored(js, f"swarm.log.{n}") for n in HONEST}
        assert all(honest_before.values()), honest_before
        mine = await stored(js, "swarm.log.mallory")  # what earlier attacks left
        nc = await beside.connect(beside.mallory_creds)
        big = LogRecord(ts=1, level="INFO", logger="flood", message="y" * 8000)
        oversized = topics.encode(LogBatch(fellow_id="mallory", records=[big] * 6))
        assert len(oversized) > 32 * 1024
        for _ in range(3):  # over the stream's message size: not stored
            await nc.publish("swarm.log.mallory", oversized)
        await nc.publish("swarm.log.mallory", batch("marker", 10))
        await nc.flush()
        deadline = asyncio.get_running_loop().time() + 10
        while await stored(js, "swarm.log.mallory") < mine + 1:
            assert asyncio.get_running_loop().time() < deadline, "the marker was not stored"
            await asyncio.sleep(0.05)
        oversized_stored = await stored(js, "swarm.log.mallory") - mine - 1
        for i in range(6000):
            await nc.publish("swarm.log.mallory", batch(f"flood-{i}", 200))
        await nc.flush()
        await nc.close()
        kept = await stored(js, "swarm.log.mallory")
        honest_after = {n: await stored(js, f"swarm.log.{n}") for n in HONEST}
        await watcher.close()
        return oversized_stored, kept, honest_before, honest_after

    oversized, kept, honest_before, honest_after = beside.run(attack)
    assert oversized == 0
    assert kept <= 5000
    for name in HONEST:
        assert honest_after[name] >= honest_before[name], (name, honest_before, honest_after)
    assert beside.leader.get(f"/api/v1/workers/{HONEST[0]}/logs?limit=5")
    beside.assert_untouched()


def test_the_job_beside_completes_in_its_first_attempt(beside: Beside):
    job = beside.leader.wait_job(beside.job_id, "COMPLETED", timeout=200)
    beside.assert_untouched()
    assert job["final_loss"] is not None and job["final_loss"] < 6
    history = beside.leader.get(f"/api/v1/jobs/{beside.job_id}/metrics/history")
    assert history[-1]["step"] == beside.steps
