"""Revoking fellows' NATS users at once: the leader re-signs the swarm account's JWT with the
revoked user keys and sends it to nats-server as the system account
(``$SYS.REQ.CLAIMS.UPDATE``); the server then disconnects those users and refuses them from
then on (see :mod:`silentswarm.natsauth`).

At start, after every reconnection and after a failed push, the leader reads the account JWT
the server holds (``$SYS.REQ.ACCOUNT.<account>.CLAIMS.LOOKUP``), keeps every revocation
either side knows, and sends the merged JWT: a leader whose authority directory was lost (a
Nomad secrets dir) learns the revocations back from the server, and a server that lost its
resolver directory learns them from the leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.errors import NoRespondersError

from silentswarm.leader.errors import RevocationPushError
from silentswarm.natsauth import NatsAuthority, jwt_revocations
from silentswarm.natsconn import NatsAccess, connect_forever
from silentswarm.retrying import Backoff

log = logging.getLogger(__name__)

CLAIMS_UPDATE = "$SYS.REQ.CLAIMS.UPDATE"
PUSH_RETRIES = Backoff(wait_initial=1.0, wait_max=30.0)


def claims_lookup_subject(account: str) -> str:
    return f"$SYS.REQ.ACCOUNT.{account}.CLAIMS.LOOKUP"


class ClaimUpdateStatus(msgspec.Struct):
    account: str = ""
    code: int = 0
    message: str = ""


class ClaimUpdateError(msgspec.Struct):
    account: str = ""
    code: int = 0
    description: str = ""


class ClaimUpdateReply(msgspec.Struct):
    """nats-server's answer to a claims update (its ServerAPIClaimUpdateResponse)."""

    data: ClaimUpdateStatus | None = None
    error: ClaimUpdateError | None = None


def update_outcome(reply: bytes) -> str | None:
    """None when the server took the JWT; else why not, in words."""
    try:
        answer = msgspec.json.decode(reply, type=ClaimUpdateReply)
    except msgspec.DecodeError as exc:
        return f"unreadable answer from nats-server ({exc}): {reply[:200]!r}"
    if answer.error is not None:
        return f"nats-server refused the account JWT: {answer.error.description or answer.error}"
    if answer.data is None or answer.data.code != 200:
        return f"nats-server did not confirm the account JWT: {reply[:200]!r}"
    return None


class UserRevoker:
    """Revokes fellows' NATS users and keeps nats-server's account JWT current: it pushes
    the JWT at start, after every reconnection (a restarted server may have preloaded an
    older one) and whenever a revocation could not be pushed at once."""

    def __init__(self, authority: NatsAuthority, nats_access: NatsAccess) -> None:
        """``nats_access``: the leader's (its URL and TLS); the system user's creds replace
        its credentials."""
        self.authority = authority
        self.access = msgspec.structs.replace(
            nats_access, creds=str(authority.ensure_system_creds())
        )
        self._nc: Client | None = None
        self._dirty = asyncio.Event()
        self._dirty.set()  # push once at start
        self._tasks: set[asyncio.Task[bool]] = set()
        # Set once nats-server has taken the account JWT after the start (or a reconnection).
        self.pushed = asyncio.Event()

    async def push(self, *, timeout: float = 5.0) -> None:
        """Send the account JWT with every revocation known here or on the server; returns
        once the server took it (RevocationPushError: it did not)."""
        nc = self._nc
        if nc is None or not nc.is_connected:
            raise RevocationPushError("the leader's system user is not connected to NATS")
        try:
            held = await nc.request(
                claims_lookup_subject(self.authority.account_public), b"", timeout=timeout
            )
            known = jwt_revocations(held.data.decode()) if held.data else {}
            if set(known) - set(self.authority.revocations()):
                await asyncio.to_thread(self.authority.revoke, known)
            reply = await nc.request(
                CLAIMS_UPDATE, self.authority.account_jwt().encode(), timeout=timeout
            )
        except NoRespondersError:
            raise RevocationPushError(
                "nats-server does not take account JWT updates (no responders): its config "
                "predates revocations; regenerate it with 'swarm nats-auth init --dir "
                f"{self.authority.dir}' and restart it"
            ) from None
        except Exception as exc:
            raise RevocationPushError(f"pushing the account JWT failed: {exc!r}") from None
        problem = update_outcome(reply.data)
        if problem is not None:
            raise RevocationPushError(problem)

    async def run(self) -> None:
        """Connect as the system user and push whenever needed, retrying until it works."""

        async def reconnected() -> None:
            self.pushed.clear()
            self._dirty.set()

        self._nc = await connect_forever(
            self.access, name="swarm-leader-system", on_reconnected=reconnected
        )
        try:
            while True:
                await self._dirty.wait()
                self._dirty.clear()
                async for attempt in PUSH_RETRIES.context(on=RevocationPushError):
                    with attempt:
                        try:
                            await self.push()
                        except RevocationPushError as exc:
                            log.error("%s; retrying", exc)
                            raise
                self.pushed.set()
                count = len(self.authority.revocations())
                log.info("nats-server has the account JWT (%d revoked user key(s))", count)
        finally:
            nc, self._nc = self._nc, None
            if nc is not None:
                with contextlib.suppress(Exception):
                    await nc.close()

    async def revoke_fellow(self, fellow_id: str, *, timeout: float = 5.0) -> bool:
        """Revoke every NATS user minted for ``fellow_id``; True once nats-server has
        disconnected them (False: recorded, the push is retried in the background)."""
        keys = await asyncio.to_thread(self.authority.revoke_fellow, fellow_id)
        return await self._pushed(keys, f"fellow {fellow_id}", timeout)

    async def revoke_attempt(
        self, fellow_id: str, job_id: str, attempt: int, *, timeout: float = 5.0
    ) -> bool:
        """Revoke the NATS users of ``fellow_id``'s stages in one job's attempt (its replica
        was dropped; the job goes on without it); as :meth:`revoke_fellow`."""
        keys = await asyncio.to_thread(self.authority.revoke_attempt, fellow_id, job_id, attempt)
        return await self._pushed(keys, f"fellow {fellow_id} in job {job_id} ({attempt})", timeout)

    def revoke_attempt_soon(self, fellow_id: str, job_id: str, attempt: int) -> None:
        """:meth:`revoke_attempt` in the background (for callers that cannot wait)."""
        self._spawn(
            self.revoke_attempt(fellow_id, job_id, attempt),
            name=f"revoke-{fellow_id}-{job_id}-{attempt}",
        )

    async def _pushed(self, keys: list[str], whose: str, timeout: float) -> bool:
        """Push the account JWT after ``keys`` were revoked: True once the server took it."""
        if not keys:
            return True
        log.info("revoking %d NATS user(s) of %s", len(keys), whose)
        try:
            await self.push(timeout=timeout)
        except RevocationPushError as exc:
            log.error("%s: %s; retrying in the background", whose, exc)
            self._dirty.set()
            return False
        return True

    def revoke_fellow_soon(self, fellow_id: str) -> None:
        """:meth:`revoke_fellow` in the background (for callers that cannot wait)."""
        self._spawn(self.revoke_fellow(fellow_id), name=f"revoke-{fellow_id}")

    def _spawn(self, work: Coroutine[Any, Any, bool], *, name: str) -> None:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
