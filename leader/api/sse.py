"""Shared bits of the SSE endpoints."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from litestar import Request

from silentswarm.errors import FieldError
from silentswarm.leader.auth import principal_of
from silentswarm.leader.services.accounts import AccountsService

T = TypeVar("T")
# How often a stream checks that its reader may still read (a revoked account's stream ends).
PERMISSION_CHECK_S = 5.0


def last_event_id(request: Request) -> int | None:
    """The ``Last-Event-ID`` a reconnecting client sends (a stream sequence), if any.

    A browser's EventSource cannot set it on its first request, so ``?after=N`` says the
    same (the header wins: the browser sends it on its own reconnects).
    """
    raw = request.headers.get("last-event-id")
    if raw is None or raw.strip() == "":
        raw = request.query_params.get("after")
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise FieldError(
            f"Last-Event-ID: {raw!r} is not an event id", field="Last-Event-ID"
        ) from None
    if value < 0:
        raise FieldError("Last-Event-ID: must be >= 0", field="Last-Event-ID")
    return value


async def while_permitted(
    events: AsyncIterator[T], permitted: Callable[[], bool], every_s: float = PERMISSION_CHECK_S
) -> AsyncIterator[T]:
    """``events`` for as long as ``permitted()`` holds, checked at least every ``every_s``
    seconds (a quiet stream too): a stream opened with an account's token or read ticket
    ends once the account is revoked, instead of flowing for as long as it stays open."""
    pending: asyncio.Future[T] | None = None
    try:
        while permitted():
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait((pending,), timeout=every_s)
            if not done or not permitted():
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        closing = getattr(events, "aclose", None)
        if closing is not None:
            await closing()


def for_reader(
    request: Request, accounts: AccountsService, events: AsyncIterator[T]
) -> AsyncIterator[T]:
    """``events`` for as long as the request's reader may read (:func:`while_permitted`)."""
    return while_permitted(events, accounts.reader_check(principal_of(request)))
