"""The leader's durable state in a real JetStream: written, read back after a restart."""

import msgspec
from nats.js.api import KeyValueConfig

from leader.jobs import JobManager
from leader.purges import PurgeBook
from leader.store import StateStore
from swarm.jobspec import JobSpec
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
