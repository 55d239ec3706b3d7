"""The accounts service: create, list, change and revoke accounts (admin), saved to JetStream.

Every change is made in the in-memory book first (a revoke takes effect on the next
request), then saved; a create the store refuses is undone and answered 503, a revoke or
change the store refuses stays in effect in this process and is answered 503 saying to
repeat it (repeating saves it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from silentswarm.leader.accounts import AccountBook, AccountStore
from silentswarm.leader.errors import NotReadyError, StorageUnavailableError
from silentswarm.leader.permissions import ANONYMOUS, Principal
from silentswarm.types.account_api import AccountCreated, AccountView, CreateAccount, UpdateAccount
from silentswarm.types.accounts import Account

log = logging.getLogger(__name__)
# How long a request waits for the accounts to load (a leader that just started) before 503.
LOAD_WAIT_S = 10.0


class AccountsService:
    def __init__(self, book: AccountBook) -> None:
        self.book = book
        self.store: AccountStore | None = None  # set once the accounts are loaded
        self.loaded = asyncio.Event()

    def reader_check(self, principal: Principal) -> Callable[[], bool]:
        """Whether ``principal`` may still read, asked again and again by a stream it opened:
        the operator and anonymous readers always; an account while the very account it was
        (its token's digest) exists and is not revoked, so revoking a name and creating it
        again ends the streams of the old token too."""
        if principal.is_operator or principal == ANONYMOUS:
            return lambda: True
        opened = self.book.find(principal.name)
        digest = opened.token_sha256 if opened is not None else None

        def permitted() -> bool:
            now = self.book.find(principal.name)
            return now is not None and now.revoked_at is None and now.token_sha256 == digest

        return permitted

    def opened(self, store: AccountStore) -> None:
        self.store = store
        self.loaded.set()

    async def list(self) -> list[AccountView]:
        await self._loaded()
        return [AccountView.of(account) for account in self.book.list()]

    async def get(self, name: str) -> AccountView:
        await self._loaded()
        return AccountView.of(self.book.get(name))

    async def create(self, request: CreateAccount) -> AccountCreated:
        await self._loaded()
        account, token = self.book.create(request)
        try:
            await self._save(account)
        except StorageUnavailableError:
            self.book.forget(account.name)
            raise
        log.info("account %s created (%s)", account.name, account.role)
        return AccountCreated(account=AccountView.of(account), token=token)

    async def revoke(self, name: str) -> AccountView:
        await self._loaded()
        account = self.book.revoke(name)
        log.info("account %s revoked", name)
        await self._save(account, undone=False)
        return AccountView.of(account)

    async def rotate(self, name: str) -> AccountCreated:
        """A new token for ``name``; the old one stops at once. A store that refuses leaves
        the new token in force in this leader (its answer is a 503 saying to repeat it, and
        the repeat gives yet another token), never the old one."""
        await self._loaded()
        account, token = self.book.rotate(name)
        log.info("account %s: token rotated", name)
        await self._save(account, undone=False)
        return AccountCreated(account=AccountView.of(account), token=token)

    async def update(self, name: str, request: UpdateAccount) -> AccountView:
        await self._loaded()
        account = self.book.update(name, request)
        await self._save(account, undone=False)
        return AccountView.of(account)

    async def _loaded(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.loaded.wait(), LOAD_WAIT_S)
        if self.store is None:
            raise NotReadyError(
                "the leader has not loaded its accounts from JetStream yet; retry shortly"
            )

    async def _save(self, account: Account, *, undone: bool = True) -> None:
        assert self.store is not None
        try:
            await self.store.save(account)
        except Exception as exc:
            then = "nothing was changed" if undone else "it holds in this leader until it restarts"
            log.error("cannot save account %s: %s", account.name, exc)
            raise StorageUnavailableError(
                f"the account store refused the change ({exc}): {then}; repeat it once "
                "JetStream is back (GET /health says why)"
            ) from None
