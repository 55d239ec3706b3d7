"""Leader + fellow agents as real processes over a real nats-server."""

from __future__ import annotations

import signal
import time

import msgspec
import nats
import pytest

from silentswarm import protocol as p
from silentswarm import subjects as topics
from silentswarm.agent.hardware import boot_id
from silentswarm.types.signals import CheckpointArgs
from tests.conftest import start_agent
from tests.helpers import wait_for
from tests.integration.nats_client import with_nats

pytestmark = pytest.mark.integration
OFFLINE_AFTER_S = 3.0  # the default


def test_two_agents_become_ready_and_a_killed_one_goes_offline_within_4s(
    procs, nats_server, leader
):
    a = start_agent(procs, nats_server.url, "alpha")
    b = start_agent(procs, nats_server.url, "beta")
    for name in ("alpha", "beta"):
        record = leader.wait_status(name, "ready", timeout=20)
        assert record["hardware"]["cpu_cores"] >= 1
        assert record["hardware"]["ram_total_bytes"] > 0
        # Both run on this machine: its kernel's boot id tells the leader they share it.
        assert record["hardware"]["machine_id"] == boot_id()
    assert leader.workers()["alpha"]["pid"] == a.pid

    a.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    record = leader.wait_status("alpha", "offline", timeout=4.0)
    assert time.monotonic() - killed_at <= 4.0
    assert record["offline_reason"].startswith("no heartbeat")
    assert leader.status("beta") == "ready"
    assert b.poll() is None


def test_sigterm_deregisters_at_once_and_exits_cleanly(procs, nats_server, leader):
    agent = start_agent(procs, nats_server.url, "gamma")
    leader.wait_status("gamma", "ready", timeout=20)
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=10) == 0
    record = leader.wait_status("gamma", "offline", timeout=OFFLINE_AFTER_S - 1)
    assert record["offline_reason"].startswith("deregistered")


def test_nats_restart_agent_reregisters_and_nobody_is_marked_offline(procs, nats_server, leader):
    agent = start_agent(procs, nats_server.url, "delta")
    leader.wait_status("delta", "ready", timeout=20)

    nats_server.stop()
    wait_for(
        lambda: leader.http.get("/health").status_code == 503,
        timeout=10,
        what="the leader to notice NATS is gone",
    )
    # Hold the outage longer than the offline timeout: a leader that counted staleness from
    # the last heartbeat alone would now mark the fellow offline on reconnect.
    time.sleep(OFFLINE_AFTER_S + 1.0)
    nats_server.start()

    def reregistered():
        record = leader.workers()["delta"]
        return record["registrations"] == 2 and record["status"] == "ready" and record

    record = wait_for(reregistered, timeout=15, what="delta to register again")
    # Stay connected a full offline window: still nobody goes offline.
    deadline = time.monotonic() + OFFLINE_AFTER_S + 0.5
    while time.monotonic() < deadline:
        assert leader.status("delta") == "ready"
        time.sleep(0.2)
    record = leader.workers()["delta"]
    assert "offline" not in [t["to_status"] for t in record["history"]]
    assert agent.poll() is None, "the agent recovered without a restart"
    assert record["pid"] == agent.pid


def test_each_fellow_receives_replies_on_its_own_inbox(procs, nats_server, leader):
    async def scenario(nc):
        sub = await nc.subscribe("_INBOX.>")
        await nc.flush()
        start_agent(procs, nats_server.url, "epsilon")
        deadline = time.monotonic() + 20
        while True:  # the leader's reply to the agent's register
            msg = await sub.next_msg(timeout=max(0.01, deadline - time.monotonic()))
            # The leader's own JetStream API replies (JSON) land under _INBOX too: not ours.
            if not msg.data.startswith(b"{"):
                break
        await sub.unsubscribe()
        return msg

    msg = with_nats(nats_server.url, scenario)
    assert msg.subject.startswith("_INBOX.epsilon.")
    assert topics.REGISTER.decode_reply(msg.data).accepted
    leader.wait_status("epsilon", "ready", timeout=20)


def test_signals_are_acknowledged_once_and_duplicates_flagged(procs, nats_server, leader):
    start_agent(procs, nats_server.url, "zeta")
    leader.wait_status("zeta", "ready", timeout=20)
    subject = topics.SIGNAL.subject("swarm", fellow="zeta")
    sig = p.CheckpointSignal(signal_id="sig-1", job_id="j1", args=CheckpointArgs(checkpoint_id="c"))

    async def scenario(nc):
        first = await nc.request(subject, topics.encode(sig), timeout=5)
        second = await nc.request(subject, topics.encode(sig), timeout=5)
        junk = await nc.request(subject, b"\x01\x02junk", timeout=5)
        return [topics.SIGNAL.decode_reply(m.data) for m in (first, second, junk)]

    first, second, junk = with_nats(nats_server.url, scenario)
    assert first.signal_id == "sig-1" and first.fellow_id == "zeta"
    assert not first.duplicate and second.duplicate
    assert (second.ok, second.code) == (first.ok, first.code)
    assert not junk.ok and junk.code == "PROTOCOL_ERROR"
    assert leader.status("zeta") == "ready"


def test_malformed_messages_are_dropped_and_change_nothing(procs, nats_server, leader):
    start_agent(procs, nats_server.url, "eta")
    leader.wait_status("eta", "ready", timeout=20)
    before = _comparable(leader.workers())
    good = p.RegisterRequest(
        fellow=p.FellowIdentity(fellow_id="eta", instance_id="x", hostname="h", version="0", pid=1),
        hardware=p.HardwareSnapshot(
            hostname="h", cpu_cores=1, ram_total_bytes=1, ram_available_bytes=1
        ),
    )

    async def scenario(nc):
        await nc.publish("swarm.hb.eta", b"\xc1\xc1 not msgpack")
        await nc.publish("swarm.hb.eta", msgspec.msgpack.encode({"v": 1, "seq": "x"}))
        await nc.publish("swarm.hb.eta", topics.encode(p.StopSignal(signal_id="s")))
        await nc.publish("swarm.hb.theta", b"")
        await nc.publish("swarm.hb.eta.extra", b"")
        # The leader answers only in the sender's own inbox: one connection per name.
        as_iota = await nats.connect(nats_server.url, inbox_prefix="_INBOX.iota")
        try:
            spoofed = await as_iota.request("swarm.register.iota", topics.encode(good), timeout=5)
        finally:
            await as_iota.drain()
        garbage = await nc.request("swarm.register.eta", b"garbage", timeout=5)
        taken = await nc.request("swarm.register.eta", topics.encode(good), timeout=5)
        return [topics.REGISTER.decode_reply(m.data) for m in (garbage, spoofed, taken)]

    garbage, spoofed, taken = with_nats(nats_server.url, scenario, inbox_prefix="_INBOX.eta")
    assert not garbage.accepted and garbage.code == "PROTOCOL_ERROR"
    assert not spoofed.accepted and spoofed.code == "SUBJECT_MISMATCH"
    assert not taken.accepted and taken.code == "FELLOW_ID_IN_USE"
    assert leader.get("/health")["status"] == "ok"
    assert _comparable(leader.workers()) == before


def _comparable(workers):
    return {
        fid: (w["status"], w["instance_id"], w["pid"], len(w["history"]))
        for fid, w in workers.items()
    }
