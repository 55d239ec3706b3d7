"""A fellow's answer to a signal is a stranger's: the leader records it under the ids it
sent, refuses an answer for another signal or fellow, and keeps the words clean and short."""

from __future__ import annotations

import asyncio

import nats
import pytest

from silentswarm import subjects as topics
from silentswarm.errors import ErrorCode
from silentswarm.leader.signals import ACK_MESSAGE_SHOWN, SignalHub, answered
from silentswarm.protocol import ACK_MESSAGE_CHARS, SignalAck
from silentswarm.types.signals import CheckpointArgs, PurgeArgs, StopArgs


def ack(**fields: object) -> SignalAck:
    base: dict[str, object] = {"signal_id": "s1", "fellow_id": "f1", "ok": True}
    return SignalAck(**{**base, **fields})


def answer_of(given: SignalAck):
    """The record of ``given`` as f1's answer to STOP s1, sent at 5.0, in two tries."""
    return answered(given, signal_id="s1", fellow_id="f1", kind="stop", sent_at=5.0, attempts=2)


CASES = {
    "an honest yes": (ack(), (True, None, "")),
    "an honest refusal": (
        ack(ok=False, code="BUSY", message="running job j1"),
        (False, "BUSY", "running job j1"),
    ),
    "a refusal that names another fellow counts against this one": (
        ack(ok=False, fellow_id="f2", code="BUSY"),
        (False, ErrorCode.PROTOCOL_ERROR, "answered signal 's1' as 'f2'"),
    ),
    "a yes to another signal is no yes": (
        ack(signal_id="s0"),
        (False, ErrorCode.PROTOCOL_ERROR, "answered signal 's0' as 'f1'"),
    ),
    "terminal escapes and newlines become spaces": (
        ack(ok=False, code="BAD\x1b[2J", message="line\nnext\x1b]0;owned\x07"),
        (False, "BAD [2J", "line next ]0;owned"),
    ),
}


@pytest.mark.parametrize(("given", "want"), CASES.values(), ids=CASES.keys())
def test_an_answer_is_recorded_under_the_ids_the_leader_sent(given, want):
    record = answer_of(given)
    assert (record.signal_id, record.fellow_id) == ("s1", "f1")
    assert (record.kind, record.sent_at, record.attempts) == ("stop", 5.0, 2)
    assert (record.ok, record.code, record.message) == want


def test_long_words_are_cut_to_what_the_record_keeps():
    record = answer_of(ack(ok=False, message="x" * ACK_MESSAGE_CHARS))
    assert len(record.message) == ACK_MESSAGE_SHOWN and record.message.endswith("...")


def test_on_a_real_server_a_fellow_cannot_refuse_in_another_s_name_or_flood_the_record(
    nats_server,
):
    async def run() -> list:
        fellow = await nats.connect(nats_server.url)
        leader = await nats.connect(nats_server.url)

        async def answer(msg) -> None:
            sig = topics.SIGNAL.decode(msg.data)
            refusal = SignalAck(signal_id=sig.signal_id, fellow_id="f1", ok=False)
            if isinstance(sig.args, CheckpointArgs):
                refusal.fellow_id = "healthy"
            elif isinstance(sig.args, StopArgs):  # an older agent's long words: still a refusal
                refusal.code, refusal.message = "SIGNAL_FAILED", "x" * 100_000
            else:  # an id no signal has: unreadable
                refusal.signal_id = "s" * 65
            await msg.respond(topics.encode(refusal))

        await fellow.subscribe(topics.SIGNAL.subject("swarm", fellow="f1"), cb=answer)
        await fellow.flush()
        hub = SignalHub(leader, prefix="swarm")
        records = [
            await hub.send("f1", CheckpointArgs(checkpoint_id="c1", at_step=2), deadline_s=5.0),
            await hub.send("f1", StopArgs(reason="t"), deadline_s=5.0),
            await hub.send("f1", PurgeArgs(reason="t"), deadline_s=1.5),
        ]
        await fellow.close()
        await leader.close()
        return records

    other, long, unreadable = asyncio.run(run())
    assert (other.fellow_id, other.ok, other.code) == ("f1", False, ErrorCode.PROTOCOL_ERROR)
    assert "as 'healthy'" in other.message
    assert (long.ok, long.code, len(long.message)) == (False, "SIGNAL_FAILED", ACK_MESSAGE_SHOWN)
    assert (unreadable.fellow_id, unreadable.ok, unreadable.code) == (
        "f1",
        False,
        ErrorCode.NO_ANSWER,
    )
    assert unreadable.message.startswith("unreadable answer") and unreadable.attempts >= 2
