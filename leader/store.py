"""Durable leader state in JetStream KV: one bucket each for jobs, fellows and pending purges.

Values are msgspec JSON (readable with ``nats kv get``). Records are written when they
change (the managers mark them dirty), never on every heartbeat, and all read back when
the leader starts, so a leader restart loses nothing. There is no second database.

The buckets reserve nothing (no ``max_bytes``): the history streams reserve at most 70% of
the store (leader.streams), and what is left is theirs. A write that fails for want of
storage is remembered (``write_error``, until a write succeeds) for the leader's health.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyDeletedError, KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from leader.jobs import JobRecord
from leader.purges import PendingPurge
from leader.registry import FellowRecord
from leader.streams import describe, is_storage_error

log = logging.getLogger(__name__)
T = TypeVar("T")


class LoadedState(msgspec.Struct):
    jobs: list[JobRecord]
    fellows: list[FellowRecord]
    purges: list[PendingPurge]


class StateStore:
    """The three KV buckets, named ``<prefix>_jobs``, ``<prefix>_fellows``, ``<prefix>_purges``."""

    def __init__(self, jobs: KeyValue, fellows: KeyValue, purges: KeyValue) -> None:
        self.jobs = jobs
        self.fellows = fellows
        self.purges = purges
        self.write_error: str | None = None

    @classmethod
    async def open(cls, nc: Client, *, prefix: str) -> StateStore:
        js = nc.jetstream()
        buckets = []
        for name in ("jobs", "fellows", "purges"):
            config = KeyValueConfig(bucket=f"{prefix}_{name}", history=1, storage=StorageType.FILE)
            buckets.append(await js.create_key_value(config))
        return cls(*buckets)

    async def load(self) -> LoadedState:
        return LoadedState(
            jobs=await _load(self.jobs, JobRecord),
            fellows=await _load(self.fellows, FellowRecord),
            purges=await _load(self.purges, PendingPurge),
        )

    async def put(self, bucket: KeyValue, key: str, value: Any) -> None:
        data = msgspec.json.encode(value)
        await self._write(lambda: bucket.put(key, data))

    async def delete(self, bucket: KeyValue, key: str) -> None:
        await self._write(lambda: bucket.delete(key))

    async def _write(self, write: Callable[[], Awaitable[Any]]) -> None:
        try:
            await write()
        except Exception as exc:
            if is_storage_error(exc):
                self.write_error = describe(exc)
            raise
        self.write_error = None


async def _load(bucket: KeyValue, kind: type[T]) -> list[T]:
    try:
        keys = await bucket.keys()
    except NoKeysError:
        return []
    out = []
    for key in keys:
        try:
            entry = await bucket.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            continue
        if not entry.value:
            continue
        try:
            out.append(msgspec.json.decode(entry.value, type=kind))
        except msgspec.DecodeError as exc:
            # A record written by an incompatible version: keep the leader up, say so.
            log.error("skipped unreadable %s record %r: %s", kind.__name__, key, exc)
    return out
