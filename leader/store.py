"""Durable leader state in JetStream KV: one bucket each for jobs, fellows, pending purges,
released agent instances and join sessions.

Values are msgspec JSON (readable with ``nats kv get``). Records are written when they
change (the managers mark them dirty), never on every heartbeat, and all read back when
the leader starts, so a leader restart loses nothing. There is no second database.

The keys are listed by asking the server for the bucket stream's subjects (STREAM.INFO with
a subjects filter, paged), not with nats-py's ``KeyValue.keys()``: its watcher can signal
"no more keys" before it has processed the ones already delivered (nats-io/nats.py#842),
which once made a restarted leader load no jobs at all.

The buckets reserve nothing (no ``max_bytes``): the history streams reserve at most 70% of
the store (leader.streams), and what is left is theirs. A write that fails for want of
storage is remembered (``write_error``, until a write succeeds) for the leader's health.

A deleted job (:mod:`silentswarm.leader.retention`) is purged, not marked deleted: its
record's revisions and its progress history leave the store, so deleted jobs take no room.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.errors import NotFoundError as StreamNotFoundError
from nats.js.kv import KeyValue

from silentswarm import subjects as topics
from silentswarm.leader.errors import StoreReadError
from silentswarm.leader.streams import describe, is_storage_error, progress_stream
from silentswarm.types.fleet import FellowRecord, PendingPurge, ReleasedFellow
from silentswarm.types.jobs import JobRecord
from silentswarm.types.onboarding import JoinSessionRecord

log = logging.getLogger(__name__)
T = TypeVar("T")


class LoadedState(msgspec.Struct):
    jobs: list[JobRecord]
    fellows: list[FellowRecord]
    purges: list[PendingPurge]
    released: list[ReleasedFellow]
    joins: list[JoinSessionRecord]


def bucket_name(prefix: str, name: str) -> str:
    """The KV bucket of one kind of record (``jobs``, ``fellows``, ``purges``, ``released``,
    ``joins``)."""
    return f"{prefix}_{name}"


class StateStore:
    """The KV buckets ``<prefix>_jobs``, ``<prefix>_fellows``, ``<prefix>_purges``,
    ``<prefix>_released`` and ``<prefix>_joins``."""

    def __init__(
        self,
        nc: Client,
        prefix: str,
        jobs: KeyValue,
        fellows: KeyValue,
        purges: KeyValue,
        released: KeyValue,
        joins: KeyValue,
    ) -> None:
        self.nc = nc
        self.prefix = prefix
        self.jobs = jobs
        self.fellows = fellows
        self.purges = purges
        self.released = released
        self.joins = joins
        self.write_error: str | None = None

    @classmethod
    async def open(cls, nc: Client, *, prefix: str) -> StateStore:
        js = nc.jetstream()
        buckets = []
        for name in ("jobs", "fellows", "purges", "released", "joins"):
            config = KeyValueConfig(
                bucket=bucket_name(prefix, name), history=1, storage=StorageType.FILE
            )
            buckets.append(await js.create_key_value(config))
        return cls(nc, prefix, *buckets)

    async def load(self) -> LoadedState:
        return LoadedState(
            jobs=await self._load("jobs", JobRecord),
            fellows=await self._load("fellows", FellowRecord),
            purges=await self._load("purges", PendingPurge),
            released=await self._load("released", ReleasedFellow),
            joins=await self._load("joins", JoinSessionRecord),
        )

    async def keys(self, name: str) -> list[str]:
        """Every key bucket ``name`` holds a message for (deleted ones too: ``get`` skips them)."""
        return await bucket_keys(self.nc, self.prefix, name)

    async def put(self, bucket: KeyValue, key: str, value: Any) -> None:
        data = msgspec.json.encode(value)
        await self._write(lambda: bucket.put(key, data))

    async def delete(self, bucket: KeyValue, key: str) -> None:
        await self._write(lambda: bucket.delete(key))

    async def delete_job(self, job_id: str) -> None:
        """Remove a job for good: its progress history, then every revision of its record
        (no delete marker stays behind). Its export on disk is not the store's: it stays."""
        js = self.nc.jetstream()
        history = topics.PROGRESS.wildcard(self.prefix, job=job_id)
        with contextlib.suppress(StreamNotFoundError):  # no history stream yet: none to purge
            await js.purge_stream(progress_stream(self.prefix).name, subject=history)
        bucket = bucket_name(self.prefix, "jobs")
        await self._write(lambda: js.purge_stream(f"KV_{bucket}", subject=f"$KV.{bucket}.{job_id}"))

    async def _write(self, write: Callable[[], Awaitable[Any]]) -> None:
        try:
            await write()
        except Exception as exc:
            if is_storage_error(exc):
                self.write_error = describe(exc)
            raise
        self.write_error = None

    async def _load(self, name: str, kind: type[T]) -> list[T]:
        return await read_records(self.nc, self.prefix, name, getattr(self, name), kind)


async def bucket_keys(nc: Client, prefix: str, name: str) -> list[str]:
    """Every key the KV bucket ``name`` holds a message for, from its stream's subjects (not
    ``KeyValue.keys()``, whose watcher can miss keys of a full bucket: nats-io/nats.py#842)."""
    bucket = bucket_name(prefix, name)
    subject_prefix = f"$KV.{bucket}."
    subjects = await stream_subjects(nc, f"KV_{bucket}", f"{subject_prefix}>")
    return sorted(subject[len(subject_prefix) :] for subject in subjects)


async def read_records(
    nc: Client, prefix: str, name: str, bucket: KeyValue, kind: type[T]
) -> list[T]:
    """Every live record of the KV bucket ``name``, decoded as ``kind``; one that does not
    decode (written by an incompatible version) is logged and skipped: the leader stays up."""
    out = []
    for key in await bucket_keys(nc, prefix, name):
        try:
            entry = await bucket.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            continue
        if not entry.value:
            continue
        try:
            out.append(msgspec.json.decode(entry.value, type=kind))
        except msgspec.DecodeError as exc:
            log.error("skipped unreadable %s record %r: %s", kind.__name__, key, exc)
    return out


class _ApiError(msgspec.Struct):
    code: int = 0
    description: str = ""


class _StreamState(msgspec.Struct):
    subjects: dict[str, int] | None = None


class _StreamInfo(msgspec.Struct):
    state: _StreamState | None = None
    error: _ApiError | None = None
    total: int = 0  # how many subjects match the filter, over all pages


async def stream_subjects(nc: Client, stream: str, subjects_filter: str) -> set[str]:
    """All subjects of ``stream`` matching the filter, page by page (the server sends 100k each)."""
    found: set[str] = set()
    while True:
        request = msgspec.json.encode({"subjects_filter": subjects_filter, "offset": len(found)})
        reply = await nc.request(f"$JS.API.STREAM.INFO.{stream}", request, timeout=5.0)
        info = msgspec.json.decode(reply.data, type=_StreamInfo)
        if info.error is not None or info.state is None:
            why = info.error.description if info.error else "no state in the reply"
            raise StoreReadError(f"cannot list the subjects of stream {stream}: {why}")
        before = len(found)
        found.update(info.state.subjects or {})
        if len(found) >= info.total:
            return found
        if len(found) == before:
            raise StoreReadError(
                f"stream {stream} has {info.total} subjects, the server listed {len(found)}"
            )
