"""Revoking NATS users, the pure parts: the account claims with their revocations, the
record of which user keys each fellow was given, and reading nats-server's answer
(tests/integration/test_nats_revocation.py: a real nats-server disconnecting them)."""

from __future__ import annotations

import asyncio
import json
import stat
import threading

import pytest

from silentswarm.leader.jobs import JobManager
from silentswarm.leader.observe import Observability
from silentswarm.leader.purges import PurgeBook
from silentswarm.leader.registry import FellowRegistry
from silentswarm.leader.revocations import update_outcome
from silentswarm.leader.services.fleet import FleetService
from silentswarm.leader.services.package import BootstrapPackage
from silentswarm.leader.storage import StorageMonitor
from silentswarm.natsauth import (
    KEPT_ATTEMPT_KEYS,
    NatsAuthority,
    account_claims,
    creds_user_key,
    decode_jwt_claims,
    jwt_revocations,
    merge_revocations,
)
from silentswarm.settings import Settings
from tests.unit.test_leader_services import FakeLoop, _register

UA, UB = "UAAA", "UBBB"


@pytest.mark.parametrize(
    ("jetstream", "revocations", "js_limits", "listed"),
    [
        (True, {}, True, None),
        (False, {}, False, None),
        (True, {UB: 20, UA: 10}, True, {UA: 10, UB: 20}),
    ],
)
def test_account_claims_carry_jetstream_and_revocations(jetstream, revocations, js_limits, listed):
    claims = account_claims(jetstream=jetstream, revocations=revocations)
    assert claims["type"] == "account"
    assert ("disk_storage" in claims["limits"]) is js_limits
    assert claims["limits"]["conn"] == -1
    assert claims.get("revocations") == listed
    if listed:
        assert list(claims["revocations"]) == sorted(listed)  # a stable JWT body


@pytest.mark.parametrize(
    ("sources", "merged"),
    [
        ((), {}),
        (({UA: 10},), {UA: 10}),
        (({UA: 10}, {UB: 5}), {UA: 10, UB: 5}),
        (({UA: 10}, {UA: 30}, {UA: 20}), {UA: 30}),  # the latest time refuses the most
    ],
)
def test_revocations_merge_to_the_latest_time_per_key(sources, merged):
    assert merge_revocations(*sources) == merged


@pytest.mark.parametrize(
    ("reply", "problem"),
    [
        (b'{"server":{},"data":{"account":"A1","code":200,"message":"jwt updated"}}', None),
        (
            b'{"server":{},"error":{"account":"A1","code":500,"description":"bad sig"}}',
            "refused the account JWT: bad sig",
        ),
        (b'{"server":{}}', "did not confirm"),
        (b"not json", "unreadable answer"),
    ],
)
def test_the_servers_answer_to_a_claims_update(reply, problem):
    outcome = update_outcome(reply)
    if problem is None:
        assert outcome is None
    else:
        assert outcome is not None and problem in outcome


def test_a_fellow_dropped_from_one_attempt_loses_that_attempts_users_alone(tmp_path):
    authority = NatsAuthority.load_or_create(tmp_path / "auth")
    own = creds_user_key(authority.fellow_creds("swarm", "f1"))

    def attempt_key(fellow_id: str, job_id: str, attempt: int, stage: int = 0) -> str:
        creds = authority.attempt_creds(
            "swarm", fellow_id=fellow_id, job_id=job_id, attempt=attempt, stage=stage, n_stages=2
        )
        return creds_user_key(creds)

    dropped = [attempt_key("f1", "j1", 1, 0), attempt_key("f1", "j1", 1, 1)]  # two stages
    older = attempt_key("f1", "j1", 0)
    other_job = attempt_key("f1", "j2", 1)
    other_fellow = attempt_key("f2", "j1", 1)
    assert authority.revoke_attempt("f1", "j1", 1, at=99) == dropped
    assert authority.revocations() == dict.fromkeys(dropped, 99)
    assert authority.fellow_user_keys("f1") == [own, older, other_job]
    assert authority.fellow_user_keys("f2") == [other_fellow]
    assert authority.revoke_attempt("f1", "j1", 1) == []  # nothing left of it
    assert authority.revoke_attempt("f3", "j1", 1) == []  # a fellow never placed
    # Only the newest attempts' keys are kept, and their names with them.
    for attempt in range(2, 8):
        attempt_key("f1", "j3", attempt)
    users = json.loads((authority.dir / "users.json").read_text())
    assert len(users["attempts"]["f1"]) == 4
    assert set(users["attempt_names"]) == {k for held in users["attempts"].values() for k in held}


def test_a_users_file_of_an_older_version_still_loads(tmp_path):
    authority = NatsAuthority.load_or_create(tmp_path / "auth")
    key = creds_user_key(authority.fellow_creds("swarm", "f1"))
    (authority.dir / "users.json").write_text(
        json.dumps({"fellows": {"f1": [key]}, "attempts": {}})
    )
    assert authority.fellow_user_keys("f1") == [key]
    assert authority.revoke_attempt("f1", "j1", 1) == []


def test_revoking_a_fellow_revokes_every_user_minted_for_it(tmp_path):
    authority = NatsAuthority.load_or_create(tmp_path / "auth")
    own = creds_user_key(authority.fellow_creds("swarm", "f1"))
    path = authority.write_fellow_creds("swarm", "f1")
    again = creds_user_key(path.read_text())
    attempt = creds_user_key(
        authority.attempt_creds(
            "swarm", fellow_id="f1", job_id="j1", attempt=1, stage=0, n_stages=1
        )
    )
    other = creds_user_key(authority.fellow_creds("swarm", "f2"))
    assert authority.fellow_user_keys("f1") == [own, again, attempt]
    assert stat.S_IMODE((authority.dir / "users.json").stat().st_mode) == 0o600

    assert authority.revoke_fellow("f1", at=1234) == [own, again, attempt]
    assert not path.exists()  # dead creds are not left about
    assert authority.revocations() == {own: 1234, again: 1234, attempt: 1234}
    assert authority.fellow_user_keys("f1") == []  # revoked keys are no longer its users
    assert authority.fellow_user_keys("f2") == [other]
    assert authority.revoke_fellow("f1") == []  # nothing left to revoke

    # The JWT the leader pushes and the one server.conf preloads both carry them.
    jwt = authority.account_jwt()
    assert decode_jwt_claims(jwt)["sub"] == authority.account_public
    assert jwt_revocations(jwt) == authority.revocations()
    conf = authority.server_config_path.read_text()
    preloaded = conf.split(f'{authority.account_public}: "')[1].split('"')[0]
    assert jwt_revocations(preloaded) == authority.revocations()
    # Revocations the server knows and this directory lost are taken back.
    assert jwt_revocations(authority.account_jwt({UA: 99}))[UA] == 99


def test_a_fellow_keeps_its_newest_attempt_users_only(tmp_path):
    """Revocations stay bounded: a fellow that ran many attempts is revoked with its own
    users and its newest KEPT_ATTEMPT_KEYS attempts' (older ones' subjects are dead)."""
    authority = NatsAuthority.load_or_create(tmp_path / "auth")
    own = creds_user_key(authority.fellow_creds("swarm", "f1"))
    attempts = [
        creds_user_key(
            authority.attempt_creds(
                "swarm", fellow_id="f1", job_id="j1", attempt=n, stage=0, n_stages=1
            )
        )
        for n in range(1, 11)
    ]
    assert authority.fellow_user_keys("f1") == [own, *attempts[-KEPT_ATTEMPT_KEYS:]]
    assert sorted(authority.revoke_fellow("f1", at=7)) == sorted(
        [own, *attempts[-KEPT_ATTEMPT_KEYS:]]
    )
    assert authority.fellow_user_keys("f1") == []


def test_server_config_keeps_account_jwts_in_a_full_resolver(tmp_path):
    authority = NatsAuthority.load_or_create(tmp_path / "auth")
    conf = authority.server_config_path.read_text()
    assert "type: full" in conf and "allow_delete: false" in conf
    assert f'dir: "{authority.resolver_dir.resolve()}"' in conf
    system = decode_jwt_claims(authority.system_creds_path.read_text().splitlines()[1])
    assert system["iss"] != authority.account_public  # a user of the system account
    assert stat.S_IMODE(authority.system_creds_path.stat().st_mode) == 0o600


def test_a_delivered_purge_tells_once():
    told: list[str] = []
    book = PurgeBook(wall=lambda: 1.0, on_delivered=told.append)
    book.add("f1")
    book.delivered("f1")
    book.delivered("f1")  # no longer pending: nothing to tell
    book.delivered("f2")
    assert told == ["f1"]


class FakeRevoker:
    def __init__(self) -> None:
        self.revoked: list[str] = []

    async def revoke_fellow(self, fellow_id: str, *, timeout: float = 5.0) -> bool:
        self.revoked.append(fellow_id)
        return True


class PurgingLoop(FakeLoop):
    """A loop whose purge delivery succeeds or not, and tells the book as the real one does."""

    def __init__(self, purges: PurgeBook, delivers: bool) -> None:
        super().__init__()
        self.purges, self.delivers = purges, delivers

    async def deliver_purge(self, fellow_id: str, *, deadline_s: float = 8.0) -> bool:
        if self.delivers:
            self.purges.delivered(fellow_id)
        return self.delivers


@pytest.mark.parametrize(
    ("purge_install", "delivers", "revoked_now", "told", "answer"),
    [
        (False, False, ["b"], [], True),  # STOP: revoked at once
        (True, True, ["b"], ["b"], True),  # purge delivered: revoked
        (True, False, [], [], None),  # purge pending: the fellow needs its user to hear it
    ],
)
def test_release_revokes_the_fellows_users_unless_a_purge_still_needs_them(
    purge_install, delivers, revoked_now, told, answer
):
    registry = FellowRegistry(heartbeat_interval_s=1, offline_after_s=3, leader_version="t")
    jobs, revoker, heard = JobManager(), FakeRevoker(), []
    purges = PurgeBook(on_delivered=heard.append)
    fleet = FleetService(
        registry=registry,
        jobs=jobs,
        purges=purges,
        loop=PurgingLoop(purges, delivers),
        observe=Observability(bus=None, jobs=jobs, prefix="swarm"),  # type: ignore[arg-type]
        storage=StorageMonitor(prefix="swarm", specs=[]),
        package=BootstrapPackage(Settings()),
        revoker=revoker,
    )
    _register(registry, "b")
    result = asyncio.run(fleet.release("b", purge_install=purge_install))
    assert revoker.revoked == revoked_now and heard == told
    assert result.nats_user_revoked is answer


def test_concurrent_revocations_all_reach_server_conf(tmp_path):
    """The leader revokes in threads (several fellows released at once, a push merging the
    server's revocations): none fails, and server.conf preloads every one of them."""
    authority = NatsAuthority.load_or_create(tmp_path / "auth")
    authority.revoke({f"UK{i:054d}": 1 for i in range(2000)})  # a large JWT: slow writes
    start = threading.Barrier(8)
    failures: list[BaseException] = []

    def revoke(n: int) -> None:
        start.wait()
        try:
            for j in range(10):
                authority.revoke({f"UX{n:02d}{j:052d}": 2})
        except BaseException as exc:  # the test reports it
            failures.append(exc)

    threads = [threading.Thread(target=revoke, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert len(authority.revocations()) == 2000 + 80
    conf = authority.server_config_path.read_text()
    preloaded = conf.split(f'{authority.account_public}: "')[1].split('"')[0]
    assert jwt_revocations(preloaded) == authority.revocations()
