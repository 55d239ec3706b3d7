import pytest

from silentswarm import protocol as p
from silentswarm import subjects as topics
from silentswarm.errors import ProtocolError


def test_subjects_are_exactly_the_documented_per_fellow_families():
    assert topics.REGISTER.subject("swarm", fellow="f1") == "swarm.register.f1"
    assert topics.HEARTBEAT.subject("swarm", fellow="f1") == "swarm.hb.f1"
    assert topics.SIGNAL.subject("swarm", fellow="f1") == "swarm.sig.f1"
    assert topics.LOG.subject("swarm", fellow="f1") == "swarm.log.f1"
    assert topics.PROGRESS.subject("swarm", job="j1", fellow="f1") == "swarm.progress.j1.f1"
    assert topics.SHARD.subject("swarm", job="j1", fellow="f1") == "swarm.shard.j1.f1"
    relay = topics.RELAY.subject("swarm", job="j1", attempt=2, boundary=0, direction="fwd")
    assert relay == "swarm.relay.j1.2.0.fwd"


def test_each_subject_is_bound_to_one_schema():
    assert topics.HEARTBEAT.schema is p.Heartbeat
    assert topics.SIGNAL.reply is p.SignalAck
    assert topics.REGISTER.reply is p.RegisterReply
    assert len({t.template for t in topics.ALL_TOPICS}) == len(topics.ALL_TOPICS)


def test_prefix_is_configurable_and_wildcards_cover_every_fellow():
    assert topics.HEARTBEAT.wildcard("lab") == "lab.hb.*"
    assert topics.PROGRESS.wildcard("lab", job="j1") == "lab.progress.j1.*"


def test_parse_gives_the_tokens_back():
    assert topics.PROGRESS.parse("swarm", "swarm.progress.j1.f1") == {"job": "j1", "fellow": "f1"}
    with pytest.raises(ProtocolError):
        topics.HEARTBEAT.parse("swarm", "swarm.register.f1")
    with pytest.raises(ProtocolError):
        topics.HEARTBEAT.parse("swarm", "swarm.hb.f1.extra")


@pytest.mark.parametrize("bad", ["a.b", "*", ">", "", "sp ace", "x" * 65])
def test_tokens_that_would_change_the_subject_are_refused(bad):
    with pytest.raises(ProtocolError):
        topics.HEARTBEAT.subject("swarm", fellow=bad)


def test_each_fellow_gets_its_own_inbox_prefix():
    assert topics.inbox_prefix("f1") == "_INBOX.f1"
    with pytest.raises(ProtocolError):
        topics.inbox_prefix("f.1")


@pytest.mark.parametrize(
    ("reply", "fellow", "allowed"),
    [
        ("_INBOX.f1.AbC123.xyz", "f1", True),
        ("_INBOX.f1.AbC123", "f1", True),
        ("_INBOX.f1", "f1", False),
        ("_INBOX.f1.", "f1", False),
        ("_INBOX.f2.AbC.x", "f1", False),  # another fellow's inbox
        ("_INBOX.f10.AbC.x", "f1", False),
        ("$KV.swarm_jobs.j1", "f1", False),
        ("$JS.API.STREAM.PURGE.swarm_progress", "f1", False),
        ("swarm.sig.f2", "f1", False),
        ("_INBOX.f1.*", "f1", False),
        ("_INBOX.f1.>", "f1", False),
        ("_INBOX.f1.a..b", "f1", False),
        ("_INBOX.f1." + "a" * 300, "f1", False),
        ("_INBOX.bad.id.x", "bad.id", False),
    ],
)
def test_the_leader_answers_only_in_the_senders_own_inbox(reply, fellow, allowed):
    assert topics.reply_allowed(reply, fellow) is allowed
