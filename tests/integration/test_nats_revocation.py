"""Revoking a fellow's NATS user against a real nats-server: its live connection is closed at
once, its creds are refused from then on (a restarted server too), and everyone else stays
connected."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import nats
import pytest

from silentswarm.leader.revocations import UserRevoker
from silentswarm.natsauth import NatsAuthority
from silentswarm.natsconn import NatsAccess
from tests.conftest import NatsControl, start_agent
from tests.helpers import Leader, wait_for
from tests.integration.test_jobs import wait_ready

pytestmark = pytest.mark.timeout(180)


class Watched:
    """A NATS connection that records when the server closes it."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.errors: list[str] = []
        self.nc: nats.NATS | None = None

    async def connect(self, url: str, creds: Path) -> Watched:
        async def error_cb(exc: Exception) -> None:
            self.errors.append(str(exc))

        async def closed_cb() -> None:
            self.closed.set()

        self.nc = await nats.connect(
            url,
            user_credentials=str(creds),
            allow_reconnect=False,
            max_reconnect_attempts=0,
            error_cb=error_cb,
            closed_cb=closed_cb,
        )
        return self


async def refused(url: str, creds: Path) -> bool:
    """Whether the server turns these creds away (authorization violation)."""
    try:
        nc = await nats.connect(
            url, user_credentials=str(creds), allow_reconnect=False, max_reconnect_attempts=0
        )
    except nats.errors.Error as exc:
        assert "authorization violation" in str(exc).lower(), exc
        return True
    await nc.close()
    return False


async def answers(leader: nats.NATS, fellow: nats.NATS, subject: str) -> None:
    """The leader asks the fellow on its signal subject and the fellow answers: both work."""

    async def reply(msg) -> None:
        await msg.respond(b"ok")

    sub = await fellow.subscribe(subject, cb=reply)
    await fellow.flush()
    deadline = time.monotonic() + 10
    try:
        while True:
            try:
                assert (await leader.request(subject, b"ping", timeout=5)).data == b"ok"
                return
            except nats.errors.NoRespondersError:
                # Under load the server may not have the fellow's interest yet after the
                # account's revocation update: its subscription is there within moments.
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
    finally:
        await sub.unsubscribe()


def test_a_revoked_fellow_user_is_cut_off_at_once_and_stays_refused(
    secure_nats: NatsControl, nats_authority: NatsAuthority, tmp_path: Path
):
    # Copies the fellows keep (the authority removes its own file of a revoked fellow).
    f1 = nats_authority.write_fellow_creds("swarm", "f1", tmp_path / "f1.creds")
    f2 = nats_authority.write_fellow_creds("swarm", "f2", tmp_path / "f2.creds")
    before = nats_authority.server_config_path.read_text()  # preloads no revocation

    async def main() -> None:
        revoker = UserRevoker(nats_authority, NatsAccess(url=secure_nats.url))
        running = asyncio.create_task(revoker.run())
        await asyncio.wait_for(revoker.pushed.wait(), 15)
        revoked = await Watched().connect(secure_nats.url, f1)
        other = await Watched().connect(secure_nats.url, f2)
        leader = await Watched().connect(secure_nats.url, nats_authority.leader_creds_path)
        assert revoked.nc and other.nc and leader.nc

        assert await revoker.revoke_fellow("f1") is True
        await asyncio.wait_for(revoked.closed.wait(), 5)  # disconnected at once
        assert await refused(secure_nats.url, f1)
        assert not other.closed.is_set() and not leader.closed.is_set()
        await answers(leader.nc, other.nc, "swarm.sig.f2")
        await other.nc.close()
        await leader.nc.close()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

    asyncio.run(main())

    # A restarted server (no leader about) refuses it from its preload and resolver dir.
    secure_nats.stop()
    secure_nats.start()
    assert asyncio.run(refused(secure_nats.url, f1))
    assert not asyncio.run(refused(secure_nats.url, f2))

    # A server that lost its resolver dir and preloads an older JWT admits f1 again, until
    # the leader's revoker (re)connects and pushes the revocations back.
    secure_nats.stop()
    shutil.rmtree(nats_authority.resolver_dir)
    nats_authority.server_config_path.write_text(before)
    secure_nats.start()

    async def recovered() -> None:
        back = await Watched().connect(secure_nats.url, f1)
        revoker = UserRevoker(nats_authority, NatsAccess(url=secure_nats.url))
        running = asyncio.create_task(revoker.run())
        try:
            await asyncio.wait_for(back.closed.wait(), 15)
            assert await refused(secure_nats.url, f1)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)

    asyncio.run(recovered())


def test_a_dropped_replicas_attempt_user_is_cut_off_and_the_fellows_others_stay(
    secure_nats: NatsControl, nats_authority: NatsAuthority, tmp_path: Path
):
    """What the orchestrator does for a fellow whose replica was dropped: its user of that
    job's attempt goes (it read the stage's ring subjects), its own user and its user of
    another job stay."""

    def attempt_creds(job_id: str, replica: int) -> Path:
        path = tmp_path / f"{job_id}-{replica}.creds"
        path.write_text(
            nats_authority.attempt_creds(
                "swarm",
                fellow_id="f1",
                job_id=job_id,
                attempt=1,
                stage=0,
                n_stages=1,
                replica=replica,
                n_replicas=2,
            )
        )
        return path

    dropped, other_job = attempt_creds("j1", 1), attempt_creds("j2", 0)
    own = nats_authority.write_fellow_creds("swarm", "f1", tmp_path / "f1.creds")

    async def main() -> None:
        revoker = UserRevoker(nats_authority, NatsAccess(url=secure_nats.url))
        running = asyncio.create_task(revoker.run())
        await asyncio.wait_for(revoker.pushed.wait(), 15)
        cut = await Watched().connect(secure_nats.url, dropped)
        kept = [await Watched().connect(secure_nats.url, p) for p in (other_job, own)]
        try:
            assert await revoker.revoke_attempt("f1", "j1", 1) is True
            await asyncio.wait_for(cut.closed.wait(), 5)
            assert await refused(secure_nats.url, dropped)
            assert not any(w.closed.is_set() for w in kept)
            assert not await refused(secure_nats.url, other_job)
            assert not await refused(secure_nats.url, own)
        finally:
            for watched in kept:
                assert watched.nc is not None
                await watched.nc.close()
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)

    asyncio.run(main())


def test_releasing_a_fellow_revokes_its_nats_user(
    procs,
    secure_nats: NatsControl,
    nats_authority: NatsAuthority,
    secure_leader: Leader,
    tmp_path: Path,
):
    creds = {
        name: nats_authority.write_fellow_creds("swarm", name, tmp_path / f"{name}.creds")
        for name in ("r1", "r2")
    }
    for name, path in creds.items():
        start_agent(procs, secure_nats.url, name, SWARM_NATS_CREDS=str(path))
    wait_ready(secure_leader, "r1", "r2")

    response = secure_leader.request("POST", "/api/v1/workers/r1/release", json={})
    assert response.status_code == 200, response.text
    assert response.json()["nats_user_revoked"] is True
    assert asyncio.run(refused(secure_nats.url, creds["r1"]))
    assert not asyncio.run(refused(secure_nats.url, creds["r2"]))
    assert nats_authority.fellow_user_keys("r1") == []
    assert nats_authority.fellow_user_keys("r2")
    wait_for(
        lambda: secure_leader.workers()["r2"]["status"] == "ready",
        timeout=10,
        what="r2 to stay ready",
    )
