"""A tiny synchronous face over nats-py for tests that poke the bus directly."""

from __future__ import annotations

import asyncio
import json
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


def stored_job(url: str, job_id: str) -> dict[str, Any]:
    """The job's record as the leader last wrote it to its JetStream KV bucket (not the REST
    view of it, which may be ahead of the store by a tick)."""

    async def read(nc: Any) -> dict[str, Any]:
        entry = await (await nc.jetstream().key_value("swarm_jobs")).get(job_id)
        return json.loads(entry.value)

    return with_nats(url, read)
