"""Join sessions kept across a leader restart (pure: what ``JoinSessions`` marks, writes and
restores, and the onboarding service's saves before it answers; the real store and a real
restart: tests/integration/test_bootstrap.py)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from silentswarm.errors import NotFoundError
from silentswarm.leader.bootstrap import (
    INSTALL_LIMIT_S,
    KEEP_ENDED_S,
    LINE_CHARS,
    LOG_SAVE_S,
    STORED_LOG_BYTES,
    JoinSessions,
    Package,
)
from silentswarm.leader.errors import JoinGoneError, JoinRefusedError, StorageUnavailableError
from silentswarm.leader.registry import FellowRegistry
from silentswarm.leader.services.onboarding import OnboardingService
from silentswarm.settings import Settings
from silentswarm.types.onboarding import JoinSessionRecord, SessionLogLine
from tests.fakes import Clock


class Store:
    """A KV bucket of session records (JSON, as the leader's keeps them) and the flush that
    writes the changed ones, as the orchestrator's does."""

    def __init__(self) -> None:
        self.kept: dict[str, bytes] = {}

    def flush(self, sessions: JoinSessions) -> None:
        for sid in sessions.take_dirty():
            record = sessions.record(sid)
            if record is None:
                self.kept.pop(sid, None)
            else:
                self.kept[sid] = msgspec.json.encode(record)

    def restart(self, clock: Clock) -> JoinSessions:
        """What a new leader holds: the records read back."""
        fresh = JoinSessions(wall=clock)
        fresh.restore([msgspec.json.decode(v, type=JoinSessionRecord) for v in self.kept.values()])
        return fresh


def test_a_session_outlives_a_restart_token_secret_and_log_count_alike():
    clock, store = Clock(1000.0), Store()
    sessions = JoinSessions(wall=clock)
    waiting, token = sessions.create(fellow_name="w", ttl_s=600)
    clock.advance(1)
    started, started_token = sessions.create(fellow_name="s", ttl_s=600)
    store.flush(sessions)
    _, secret = sessions.claim(started.session_id, started_token)
    store.flush(sessions)
    assert sessions.append_log(started.session_id, secret, ["one", "two"], failed=False) == 2
    store.flush(sessions)

    after = store.restart(clock)
    assert [s.session_id for s in after.list()] == [waiting.session_id, started.session_id]
    assert after.get(started.session_id).status == "installing"
    assert after.get(started.session_id).log_lines == 2
    assert after.append_log(started.session_id, secret, ["three"], failed=False) == 3
    lines = after.lines_after(started.session_id, 0)  # the stored ones, then the new
    assert [(line.seq, line.line) for line in lines] == [(1, "one"), (2, "two"), (3, "three")]
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
    assert sessions.take_dirty() == [session.session_id]
    record = sessions.record(session.session_id)
    assert record is not None
    data = msgspec.json.encode(record)
    assert token.encode() not in data and secret.encode() not in data
    assert len(record.token_sha256) == 64 and record.secret_sha256 is not None


def test_every_change_is_marked_for_the_next_write():
    clock = Clock(0.0)
    sessions = JoinSessions(wall=clock)
    session, token = sessions.create(fellow_name="f", ttl_s=60)
    assert sessions.take_dirty() == [session.session_id]
    assert sessions.take_dirty() == []
    _, secret = sessions.claim(session.session_id, token)
    assert sessions.take_dirty() == [session.session_id]
    sessions.append_log(session.session_id, secret, ["a line"], failed=False)
    assert sessions.take_dirty() == [session.session_id]  # its count
    sessions.settle(lambda name: 5.0 if name == "f" else None)
    assert sessions.take_dirty() == [session.session_id]
    assert sessions.get(session.session_id).status == "registered"
    unused, _ = sessions.create(fellow_name=None, ttl_s=60)
    sessions.take_dirty()
    clock.advance(61)
    assert sessions.take_dirty() == [unused.session_id]  # expired: its status changed
    assert sessions.get(unused.session_id).status == "failed"


def test_an_install_that_never_registers_fails_then_goes_and_frees_its_name():
    clock = Clock(0.0)
    sessions = JoinSessions(wall=clock)
    session, token = sessions.create(fellow_name="gpu7", ttl_s=60)
    sessions.claim(session.session_id, token)
    registered_before = {"gpu7": -1.0}  # an older registration of the name: not this install
    sessions.settle(registered_before.get)
    assert sessions.get(session.session_id).status == "installing" and sessions.holds("gpu7")
    clock.advance(INSTALL_LIMIT_S + 1)
    sessions.settle(registered_before.get)
    ended = sessions.get(session.session_id)
    assert ended.status == "failed" and "never registered" in ended.reason
    assert not sessions.holds("gpu7")
    sessions.take_dirty()
    clock.advance(KEEP_ENDED_S)
    assert sessions.take_dirty() == [session.session_id]
    assert sessions.record(session.session_id) is None  # deleted from the store
    with pytest.raises(NotFoundError):
        sessions.get(session.session_id)


def test_ended_sessions_are_dropped_a_week_after_they_end():
    clock = Clock(0.0)
    sessions = JoinSessions(wall=clock)
    done, token = sessions.create(fellow_name="f", ttl_s=60)
    sessions.claim(done.session_id, token)
    sessions.fellow_registered("f")
    open_one, _ = sessions.create(fellow_name=None, ttl_s=7 * 86_400)
    sessions.take_dirty()
    clock.advance(KEEP_ENDED_S + 1)
    # The registered one is dropped; the open one expired just now and is kept a week more.
    assert set(sessions.take_dirty()) == {done.session_id, open_one.session_id}
    assert sessions.record(done.session_id) is None
    assert [s.session_id for s in sessions.list()] == [open_one.session_id]


def test_a_restore_keeps_a_session_already_there():
    sessions = JoinSessions(wall=Clock(0.0))
    session, token = sessions.create(fellow_name=None, ttl_s=60)
    stale = sessions.snapshot(session.session_id)
    sessions.claim(session.session_id, token)
    sessions.restore([stale])  # the older record of the same session
    assert sessions.get(session.session_id).status == "installing"


# --- the service saves before it answers ------------------------------------------------------


class Ready:
    """The bootstrap package, ready (what a claim hands out)."""

    package = Package(file="silentswarm.whl", sha256="0" * 64, size=1, path="/dev/null")

    async def ensure(self) -> Package:
        return self.package

    def ready(self) -> Package:
        return self.package

    def public_url(self, base: str) -> str:
        return base


def service(joins: JoinSessions, saves: list[bool | None]) -> OnboardingService:
    """An onboarding service whose store saves as ``saves`` says, one answer a write (None:
    not open yet)."""

    async def save_join(session_id: str) -> bool | None:
        ok = saves.pop(0)
        if ok:
            joins.dirty.discard(session_id)
        return ok

    registry = FellowRegistry(heartbeat_interval_s=1.0, offline_after_s=5.0, leader_version="0")
    return OnboardingService(
        settings=Settings(dev=True),
        nats_url="nats://127.0.0.1:4222",
        nats_auth="dev",
        authority=None,
        registry=registry,
        joins=joins,
        package=Ready(),  # type: ignore[arg-type]
        stopping=asyncio.Event(),
        require_loaded=lambda: None,
        save_join=save_join,
    )


def test_a_claim_the_store_cannot_save_is_undone_and_answers_503():
    """Were it answered unsaved, a leader restart would bring back the stored 'created'
    record and the used token would claim again."""
    joins = JoinSessions(wall=Clock(0.0))
    saves = [True, False, True]
    onboarding = service(joins, saves)
    created = asyncio.run(onboarding.create_session("box", 600, "http://leader"))
    with pytest.raises(StorageUnavailableError) as err:
        asyncio.run(onboarding.claim(created.session_id, created.token, None))
    assert err.value.http_status == 503 and "nothing was installed" in err.value.message
    session = joins.get(created.session_id)
    assert session.status == "created" and session.claimed_at is None
    assert created.session_id not in joins.dirty  # the store holds the 'created' record
    claim = asyncio.run(onboarding.claim(created.session_id, created.token, None))
    assert claim.fellow_name == "box" and joins.get(created.session_id).status == "installing"
    assert saves == []


def test_a_session_the_store_cannot_save_is_not_handed_out():
    joins = JoinSessions(wall=Clock(0.0))
    onboarding = service(joins, [False])
    with pytest.raises(StorageUnavailableError):
        asyncio.run(onboarding.create_session(None, 600, "http://leader"))
    assert joins.list() == [] and joins.dirty == set()


def test_a_session_made_before_the_store_opens_waits_for_its_first_flush():
    joins = JoinSessions(wall=Clock(0.0))
    onboarding = service(joins, [None])
    created = asyncio.run(onboarding.create_session(None, 600, "http://leader"))
    assert joins.dirty == {created.session_id}


def test_the_store_keeps_the_newest_lines_that_fit_and_no_secret():
    sessions = JoinSessions(wall=Clock(0.0))
    session, token = sessions.create(fellow_name="n", ttl_s=60)
    _, secret = sessions.claim(session.session_id, token)
    long = ["x" * 3000 for _ in range(100)]  # cut to LINE_CHARS each
    sessions.append_log(session.session_id, secret, long, failed=False)
    sessions.append_log(
        session.session_id, secret, ["SWARM_ENROLL_TOKEN=abc123", "ok é"], failed=False
    )
    record = sessions.record(session.session_id)
    assert record is not None
    seqs = [line.seq for line in record.lines]
    assert seqs == list(range(seqs[0], 103)) and 20 < len(seqs) < 40, seqs
    assert all(len(line.line) <= LINE_CHARS for line in record.lines)
    assert len(msgspec.json.encode(record.lines)) <= STORED_LOG_BYTES
    assert record.lines[-2].line == "SWARM_ENROLL_TOKEN=[redacted]"
    assert record.lines[-1].line == "ok é"
    assert b"abc123" not in msgspec.json.encode(record)
    shown = sessions.lines_after(session.session_id, 100)
    assert [line.line for line in shown] == ["SWARM_ENROLL_TOKEN=[redacted]", "ok é"]


def test_stored_lines_numbered_past_the_count_are_not_restored():
    clock, store = Clock(0.0), Store()
    sessions = JoinSessions(wall=clock)
    session, token = sessions.create(fellow_name="n", ttl_s=60)
    _, secret = sessions.claim(session.session_id, token)
    sessions.append_log(session.session_id, secret, ["a", "b"], failed=False)
    store.flush(sessions)
    record = msgspec.json.decode(store.kept[session.session_id], type=JoinSessionRecord)
    record.lines.append(SessionLogLine(seq=9, ts=0.0, line="not the installer's"))
    store.kept[session.session_id] = msgspec.json.encode(record)
    after = store.restart(clock)
    assert [line.line for line in after.lines_after(session.session_id, 0)] == ["a", "b"]


def test_a_log_alone_is_written_at_most_every_few_seconds_a_failure_at_once():
    clock, store = Clock(0.0), Store()
    sessions = JoinSessions(wall=clock)
    session, token = sessions.create(fellow_name="n", ttl_s=600)
    _, secret = sessions.claim(session.session_id, token)
    store.flush(sessions)

    def stored_count() -> int:
        kept = msgspec.json.decode(store.kept[session.session_id], type=JoinSessionRecord)
        return kept.session.log_lines

    sessions.append_log(session.session_id, secret, ["one"], failed=False)
    store.flush(sessions)
    assert stored_count() == 1, "the first lines at the next write"
    clock.advance(LOG_SAVE_S / 4)
    sessions.append_log(session.session_id, secret, ["two"], failed=False)
    store.flush(sessions)
    assert stored_count() == 1, "not again so soon"
    clock.advance(LOG_SAVE_S)
    store.flush(sessions)
    assert stored_count() == 2
    password = "https://user:hunter2@example.org/x password=hunter2"
    sessions.append_log(session.session_id, secret, [password], failed=True)
    store.flush(sessions)
    kept = msgspec.json.decode(store.kept[session.session_id], type=JoinSessionRecord)
    assert kept.session.status == "failed" and kept.session.log_lines == 3, "at once"
    assert "hunter2" not in kept.session.reason and "[redacted]" in kept.session.reason
    assert b"hunter2" not in store.kept[session.session_id]


def test_the_stored_lines_are_bounded_by_their_json_escapes_and_all():
    sessions = JoinSessions(wall=Clock(0.0))
    session, token = sessions.create(fellow_name="n", ttl_s=60)
    _, secret = sessions.claim(session.session_id, token)
    escapes = ["\x1b" * 3000, '"\\' * 1500] * 20  # 6 and 2 bytes a character in JSON
    sessions.append_log(session.session_id, secret, escapes, failed=False)
    record = sessions.record(session.session_id)
    assert record is not None and record.lines
    assert len(msgspec.json.encode(record.lines)) <= STORED_LOG_BYTES
    assert record.lines[-1].seq == 40


def test_a_secret_the_cut_runs_through_is_still_redacted():
    sessions = JoinSessions(wall=Clock(0.0))
    session, token = sessions.create(fellow_name="n", ttl_s=60)
    _, secret = sessions.claim(session.session_id, token)
    seed = "SU" + "A" * 28 + "B" * 28  # an nkey seed's shape: S, U, 56 base32 characters
    line = "x" * (LINE_CHARS - 20) + " " + seed
    sessions.append_log(session.session_id, secret, [line], failed=False)
    [kept] = sessions.lines_after(session.session_id, 0)
    assert "A" * 19 not in kept.line and len(kept.line) <= LINE_CHARS
