"""Accounts as the leader keeps them: in memory for every request, in JetStream KV for restarts.

:class:`AccountBook` answers "whose token is this" on every request without I/O: it keeps the
accounts by name and by their token's SHA-256 (the token itself is never stored). A revoke
changes the book first, so the token stops working on the very next request, then the record
is saved. :class:`AccountStore` is the ``<prefix>_accounts`` bucket, one key per account,
read back when the leader starts (:func:`load_forever`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable

import msgspec
from nats.aio.client import Client
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from silentswarm.errors import ConflictError, FieldError, NotFoundError
from silentswarm.leader.errors import AccountExistsError, NotReadyError, RevokedTokenError
from silentswarm.leader.permissions import Principal
from silentswarm.leader.store import bucket_name, read_records
from silentswarm.retrying import Backoff
from silentswarm.types.account_api import CreateAccount, UpdateAccount
from silentswarm.types.accounts import OPERATOR_ACCOUNT, Account

log = logging.getLogger(__name__)
BUCKET = "accounts"
LOAD_RETRIES = Backoff(wait_initial=1.0, wait_max=5.0)
TOKEN_BYTES = 32
# An account token starts so, so that logs scrubbers and people can tell it from others.
TOKEN_PREFIX = "swa_"


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def principal_of(account: Account) -> Principal:
    pools = None if account.pools is None else tuple(account.pools)
    return Principal(name=account.name, role=account.role, pools=pools)


class AccountBook:
    """Every account by name, and the live ones by their token's SHA-256."""

    def __init__(
        self,
        *,
        wall: Callable[[], float] = time.time,
        new_token: Callable[[], str] = lambda: TOKEN_PREFIX + secrets.token_urlsafe(TOKEN_BYTES),
    ) -> None:
        self._accounts: dict[str, Account] = {}
        self._by_digest: dict[str, str] = {}
        self._wall = wall
        self._new_token = new_token
        self.loaded = asyncio.Event()

    def restore(self, accounts: list[Account]) -> None:
        for account in accounts:
            self._put(account)
        self.loaded.set()

    def resolve(self, token: str) -> Principal | None:
        """The account ``token`` is the token of; None for no account's. RevokedTokenError
        (401) for a revoked account's, NotReadyError (503) while the accounts are not
        loaded yet (a token this leader may know, but cannot tell yet)."""
        digest = token_digest(token)
        name = self._by_digest.get(digest)
        if name is None:
            if not self.loaded.is_set():
                raise NotReadyError(
                    "the leader has not loaded its accounts from JetStream yet; retry shortly"
                )
            return None
        account = self._accounts[name]
        # The lookup found it by digest; compare in constant time all the same.
        if not hmac.compare_digest(account.token_sha256, digest):
            return None
        if account.revoked_at is not None:
            raise RevokedTokenError(
                f"the token of account {name!r} was revoked "
                f"({time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime(account.revoked_at))}); "
                "ask an admin for a new one",
            )
        return principal_of(account)

    def principal(self, name: str) -> Principal | None:
        """The live account called ``name`` (for a read ticket issued to it); None if it is
        gone or revoked."""
        account = self._accounts.get(name)
        if account is None or account.revoked_at is not None:
            return None
        return principal_of(account)

    def list(self) -> list[Account]:
        return sorted(self._accounts.values(), key=lambda a: a.name)

    def token_of(self, name: str) -> str:
        """The SHA-256 of ``name``'s token now ("" for the operator and unknown names): what
        a read ticket is bound to, so that rotating the token voids the tickets it took."""
        account = self._accounts.get(name)
        return "" if account is None else account.token_sha256

    def find(self, name: str) -> Account | None:
        """The account called ``name`` (revoked or not: its running jobs keep its pool
        limits), None for the operator and unknown names: placement's lookup."""
        return self._accounts.get(name)

    def get(self, name: str) -> Account:
        try:
            return self._accounts[name]
        except KeyError:
            raise NotFoundError(f"no account {name!r} (swarm account list)") from None

    def create(self, request: CreateAccount) -> tuple[Account, str]:
        """A new account and its token (the only time the token exists in the leader). A
        revoked account's name may be created again: a new token for the same name (its
        jobs stay its own); a live one's is a 409."""
        if request.name == OPERATOR_ACCOUNT:
            raise FieldError(
                f"name: {OPERATOR_ACCOUNT!r} is reserved for the bootstrap operator token",
                field="name",
            )
        known = self._accounts.get(request.name)
        if known is not None and known.revoked_at is None:
            raise AccountExistsError(
                f"account {request.name!r} exists ({known.role}); revoke it first to give "
                "the name a new token"
            )
        _check_limits(request.pools, request.pool_limits)
        token = self._new_token()
        account = Account(
            name=request.name,
            role=request.role,
            token_sha256=token_digest(token),
            created_at=self._wall(),
            pools=None if request.pools is None else sorted(set(request.pools)),
            pool_limits=dict(request.pool_limits),
        )
        self._put(account)
        return account, token

    def revoke(self, name: str) -> Account:
        """Revoke now (the token stops working on the next request); again: the same record."""
        account = self.get(name)
        if account.revoked_at is None:
            # Its digest stays in the book, so that the token is told it was revoked.
            account.revoked_at = self._wall()
        return account

    def rotate(self, name: str) -> tuple[Account, str]:
        """A new token for a live account, in place of its old one, which stops working on
        the next request, as do the read tickets it took (bound to the token:
        ``leader.auth.ReadTickets``); the streams it opened end at their next check. The
        account keeps its role, pools, limits and jobs. A revoked account is refused: create
        it again."""
        account = self.get(name)
        if account.revoked_at is not None:
            raise ConflictError(
                f"account {name!r} was revoked; create it again to give the name a new token"
            )
        token = self._new_token()
        rotated = msgspec.structs.replace(account, token_sha256=token_digest(token))
        self._put(rotated)
        return rotated, token

    def update(self, name: str, request: UpdateAccount) -> Account:
        account = self.get(name)
        if request.any_pool and request.pools is not None:
            raise FieldError("any_pool: not with pools (one or the other)", field="any_pool")
        pools = account.pools if request.pools is None else request.pools
        if request.any_pool:
            pools = None
        limits = account.pool_limits if request.pool_limits is None else request.pool_limits
        _check_limits(pools, limits)
        account.pools = None if pools is None else sorted(set(pools))
        account.pool_limits = dict(limits)
        return account

    def forget(self, name: str) -> None:
        """Undo a create the store refused (the caller says so with a 503)."""
        account = self._accounts.pop(name, None)
        if account is not None:
            self._by_digest.pop(account.token_sha256, None)

    def _put(self, account: Account) -> None:
        old = self._accounts.get(account.name)
        if old is not None:
            self._by_digest.pop(old.token_sha256, None)
        self._accounts[account.name] = account
        self._by_digest[account.token_sha256] = account.name


def _check_limits(pools: list[str] | None, limits: dict[str, object]) -> None:
    if pools is None:
        return
    outside = sorted(set(limits) - set(pools))
    if outside:
        raise FieldError(
            f"pool_limits: {', '.join(outside)} not in the account's pools ({', '.join(pools)})",
            field="pool_limits",
        )


class AccountStore:
    """The ``<prefix>_accounts`` KV bucket: one msgspec JSON record per account name."""

    def __init__(self, nc: Client, prefix: str, bucket: KeyValue) -> None:
        self.nc = nc
        self.prefix = prefix
        self.bucket = bucket

    @classmethod
    async def open(cls, nc: Client, *, prefix: str) -> AccountStore:
        config = KeyValueConfig(
            bucket=bucket_name(prefix, BUCKET), history=1, storage=StorageType.FILE
        )
        return cls(nc, prefix, await nc.jetstream().create_key_value(config))

    async def save(self, account: Account) -> None:
        await self.bucket.put(account.name, msgspec.json.encode(account))

    async def load(self) -> list[Account]:
        return await read_records(self.nc, self.prefix, BUCKET, self.bucket, Account)


async def load_forever(
    book: AccountBook, nc_ready: Callable[[], Client | None], connected: asyncio.Event, prefix: str
) -> AccountStore:
    """Open the bucket and fill the book, retrying while JetStream is not ready."""
    await connected.wait()
    async for attempt in LOAD_RETRIES.context(on=Exception):
        with attempt:
            nc = nc_ready()
            assert nc is not None
            try:
                store = await AccountStore.open(nc, prefix=prefix)
                accounts = await store.load()
            except Exception as exc:
                log.error("cannot load the accounts from JetStream (%s); retrying", exc)
                raise
    book.restore(accounts)
    live = sum(1 for a in accounts if a.revoked_at is None)
    log.info("loaded %d account(s) (%d live) from JetStream", len(accounts), live)
    return store
