"""A tiny synchronous face over nats-py for tests that poke the bus directly."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats

T = TypeVar("T")


def with_nats(url: str, fn: Callable[[Any], Awaitable[T]], **options: Any) -> T:
    """Run ``fn(nc)`` on a fresh connection; ``options`` go to ``nats.connect`` (for example
    ``inbox_prefix="_INBOX.<fellow>"``: the leader answers requests only in the sender's inbox)."""

    async def main() -> T:
        nc = await nats.connect(url, max_reconnect_attempts=1, **options)
        try:
            return await fn(nc)
        finally:
            await nc.drain()

    return asyncio.run(main())
