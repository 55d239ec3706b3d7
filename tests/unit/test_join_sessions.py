"""Join sessions kept across a leader restart (pure: what ``JoinSessions`` marks, writes and
restores; the real store and a real restart: tests/integration/test_bootstrap.py)."""

from __future__ import annotations

import msgspec
import pytest

from silentswarm.errors import NotFoundError
from silentswarm.leader.bootstrap import KEEP_ENDED_S, JoinSessions
from silentswarm.leader.errors import JoinGoneError, JoinRefusedError
from silentswarm.types.onboarding import JoinSessionRecord
from tests.fakes import Clock


def restarted(sessions: JoinSessions, clock: Clock) -> JoinSessions:
    """What a new leader holds after the store wrote ``sessions``' changes and read them back
    (through JSON, as the KV bucket keeps them)."""
    kept = {sid: msgspec.json.encode(record) for sid, record in sessions.take_dirty() if record}
    fresh = JoinSessions(wall=clock)
    fresh.restore([msgspec.json.decode(data, type=JoinSessionRecord) for data in kept.values()])
    return fresh


def test_a_session_outlives_a_restart_token_and_secret_alike():
    clock = Clock(1000.0)
    sessions = JoinSessions(wall=clock)
    waiting, token = sessions.create(fellow_name="w", ttl_s=600)
    started, started_token = sessions.create(fellow_name="s", ttl_s=600)
    _, secret = sessions.claim(started.session_id, started_token)
    assert sessions.append_log(started.session_id, secret, ["one", "two"], failed=False) == 2

    after = restarted(sessions, clock)
    assert [s.session_id for s in after.list()] == [waiting.session_id, started.session_id]
    assert after.get(started.session_id).status == "installing"
    assert after.append_log(started.session_id, secret, ["three"], failed=False) == 3
    assert [line.seq for line in after.lines_after(started.session_id, 0)] == [3]
    with pytest.raises(JoinGoneError, match="already used"):
        after.claim(started.session_id, started_token)
    with pytest.raises(JoinRefusedError):
        after.claim(waiting.session_id, started_token)
    with pytest.raises(JoinRefusedError):
        after.append_log(started.session_id, "not-the-secret", ["x"], failed=False)
    claimed, _ = after.claim(waiting.session_id, token)
    assert claimed.status == "installing" and claimed.fellow_name == "w"


def test_the_record_holds_hashes_never_the_token_or_the_secret():
    sessions = JoinSessions(wall=Clock(0.0))
    session, token = sessions.create(fellow_name=None, ttl_s=60)
    _, secret = sessions.claim(session.session_id, token, proposed_name="host")
    [(sid, record)] = sessions.take_dirty()
    assert sid == session.session_id and record is not None
    data = msgspec.json.encode(record)
    assert token.encode() not in data and secret.encode() not in data
    assert len(record.token_sha256) == 64 and record.secret_sha256 is not None


def test_every_change_is_marked_and_written_once():
    clock = Clock(0.0)
    sessions = JoinSessions(wall=clock)
    session, token = sessions.create(fellow_name="f", ttl_s=60)
    assert [sid for sid, _ in sessions.take_dirty()] == [session.session_id]
    assert sessions.take_dirty() == []
    _, secret = sessions.claim(session.session_id, token)
    assert len(sessions.take_dirty()) == 1
    sessions.append_log(session.session_id, secret, ["a line"], failed=False)
    assert sessions.take_dirty() == [], "log lines are not kept: nothing to write"
    sessions.fellow_registered("f")
    [(_, record)] = sessions.take_dirty()
    assert record is not None and record.session.status == "registered"
    unused, _ = sessions.create(fellow_name=None, ttl_s=60)
    sessions.take_dirty()
    clock.advance(61)
    [(sid, record)] = sessions.take_dirty()  # expired: its status changed
    assert sid == unused.session_id and record is not None
    assert record.session.status == "failed"


def test_ended_sessions_are_dropped_after_a_week():
    clock = Clock(0.0)
    sessions = JoinSessions(wall=clock)
    done, token = sessions.create(fellow_name="f", ttl_s=60)
    sessions.claim(done.session_id, token)
    sessions.fellow_registered("f")
    open_one, _ = sessions.create(fellow_name=None, ttl_s=7 * 86_400)
    sessions.take_dirty()
    clock.advance(KEEP_ENDED_S + 1)
    # The registered one is dropped (deleted from the store); the open one expired just now
    # and is kept for a week from its end.
    written = dict(sessions.take_dirty())
    assert written[done.session_id] is None
    assert written[open_one.session_id] is not None
    assert [s.session_id for s in sessions.list()] == [open_one.session_id]
    with pytest.raises(NotFoundError):
        sessions.get(done.session_id)


def test_a_restore_keeps_a_session_already_there():
    clock = Clock(0.0)
    sessions = JoinSessions(wall=clock)
    session, token = sessions.create(fellow_name=None, ttl_s=60)
    [(_, stale)] = sessions.take_dirty()
    assert stale is not None
    sessions.claim(session.session_id, token)
    sessions.restore([stale])  # the older record of the same session
    assert sessions.get(session.session_id).status == "installing"
