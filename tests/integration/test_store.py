"""The leader's durable state in a real JetStream: written, read back after a restart."""

import asyncio

import msgspec
import pytest
from nats.js.api import KeyValueConfig

from silentswarm.jobspec import JobSpec
from silentswarm.leader.errors import StoreReadError
from silentswarm.leader.jobs import JobManager
from silentswarm.leader.purges import PurgeBook
from silentswarm.leader.store import StateStore, stream_subjects
from tests.integration.nats_client import with_nats


def test_jobs_and_purges_survive_a_server_restart_and_bad_records_are_skipped(nats_server):
    jobs, purges = JobManager(), PurgeBook()
    job = jobs.submit(JobSpec(name="keep me", steps=7))
    purges.add("gone-fellow")

    async def save(nc):
        store = await StateStore.open(nc, prefix="swarm")
        await store.put(store.jobs, job.job_id, job)
        await store.put(store.purges, "gone-fellow", purges.get("gone-fellow"))
        await store.put(store.purges, "dropped", purges.get("gone-fellow"))
        await store.delete(store.purges, "dropped")
        # A record from an incompatible version must not stop the leader from loading.
        await store.fellows.put("weird", b'{"not": "a fellow"}')

    with_nats(nats_server.url, save)
    nats_server.stop()
    nats_server.start()

    async def load(nc):
        store = await StateStore.open(nc, prefix="swarm")
        return await store.load()

    state = with_nats(nats_server.url, load)
    assert msgspec.to_builtins(state.jobs) == msgspec.to_builtins([job])
    assert [p.fellow_id for p in state.purges] == ["gone-fellow"]
    assert state.fellows == []


def test_an_empty_store_loads_as_empty_and_other_prefixes_are_apart(nats_server):
    async def run(nc):
        await nc.jetstream().create_key_value(KeyValueConfig(bucket="other_jobs"))
        store = await StateStore.open(nc, prefix="swarm")
        return await store.load()

    state = with_nats(nats_server.url, run)
    assert (state.jobs, state.fellows, state.purges) == ([], [], [])


def test_every_load_lists_every_key(nats_server):
    # nats-py's KeyValue.keys() can answer "no keys" for a bucket that has some
    # (nats-io/nats.py#842); a restarted leader then loaded no jobs. Every load must see all.
    jobs = JobManager()
    records = [jobs.submit(JobSpec(name=f"job {i}", steps=3)) for i in range(3)]

    async def run(nc):
        store = await StateStore.open(nc, prefix="swarm")
        for record in records:
            await store.put(store.jobs, record.job_id, record)
        await store.delete(store.jobs, records[1].job_id)
        seen = []
        for _ in range(40):
            state = await (await StateStore.open(nc, prefix="swarm")).load()
            seen.append(sorted(job.job_id for job in state.jobs))
        return seen

    expected = sorted([records[0].job_id, records[2].job_id])
    assert with_nats(nats_server.url, run) == [expected] * 40


def test_subjects_are_read_past_the_servers_page_of_100k(nats_server):
    async def run(nc):
        js = nc.jetstream()
        await js.add_stream(name="MANY", subjects=["many.>"])
        for i in range(100_050):
            await nc.publish(f"many.{i}", b"")
        await nc.flush()
        for _ in range(100):  # core publishes land asynchronously; wait for the last one
            if (await js.stream_info("MANY")).state.messages == 100_050:
                break
            await asyncio.sleep(0.1)
        return await stream_subjects(nc, "MANY", "many.>")

    subjects = with_nats(nats_server.url, run)
    assert len(subjects) == 100_050 and "many.100049" in subjects and "many.0" in subjects


def test_a_bucket_the_server_cannot_list_stops_the_load(nats_server):
    async def run(nc):
        store = await StateStore.open(nc, prefix="swarm")
        await nc.jetstream().delete_stream("KV_swarm_jobs")
        with pytest.raises(StoreReadError, match="KV_swarm_jobs"):
            await store.load()

    with_nats(nats_server.url, run)
