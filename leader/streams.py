"""JetStream streams for history: every progress record and every log batch, as sent.

The streams capture the fellows' own subjects (``<prefix>.progress.>``, ``<prefix>.log.>``)
inside the NATS server, so history is recorded even while the leader is down, and nothing is
written twice. Readers use ordered consumers (ephemeral, flow-controlled, gap-free): ``read``
returns what is stored now, ``follow`` keeps going live. Stream sequence numbers identify
records, which is what SSE event ids are made of.

Their sizes are fitted to the store the server has (:func:`fit_limits`): a stream's
``max_bytes`` is a reservation that nats-server checks against its ``max_store`` (by default
75% of the disk space free when it started), and nothing reports that number to a client,
so :func:`store_capacity` asks the server by trying reservations on a probe stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
)
from nats.js.client import JetStreamContext
from nats.js.errors import APIError, BadRequestError, NotFoundError

from silentswarm.leader.errors import StoreTooSmallError

log = logging.getLogger(__name__)

DAY_S = 86400.0
MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class StreamSpec:
    """A history stream over fellows' own subjects.

    Fellows are strangers, so the limits are per subject (a fellow's own subject, or its
    own per job): ``max_msgs_per_subject`` messages of at most ``max_msg_size`` bytes,
    dropped oldest first within that subject only. The stream's total, ``max_bytes``, is
    ``share`` of the store (at most ``ceiling_bytes``), and one subject may fill at most
    SUBJECT_SHARE of it (:func:`fit_limits`): a flooding fellow pushes out its own oldest
    records, and can take at most that share from the others' history. Below ``min_bytes``
    the stream works but is too small to be useful, and the leader's health says so. Age
    ends everything. The stream never acknowledges (``no_ack``): a PubAck goes to whatever
    reply subject a message carries, and a fellow chooses that.
    """

    name: str
    subject: str
    max_age_s: float
    max_msgs_per_subject: int
    max_msg_size: int
    share: float
    ceiling_bytes: int
    min_bytes: int


# Progress records are a few hundred bytes (their strings are bounded in swarm.protocol);
# one job's subject of one fellow keeps its newest 100,000.
PROGRESS_MAX_MSG_BYTES = 4096
PROGRESS_PER_SUBJECT = 100_000
# Log batches stay under LOG_MAX_MSG_BYTES (agent/logship.py cuts them so); a fellow keeps
# its newest 5,000 batches.
LOG_MAX_MSG_BYTES = 32 * 1024
LOG_PER_SUBJECT = 5_000
# Shares of the store: the two streams reserve at most 70%; the rest stays unreserved for
# the KV buckets (the leader's own state, never evicted: leader.store), the consumers and
# the server's own files. The ceilings keep a large disk from being reserved for history
# that 30 or 7 days would never fill.
PROGRESS_SHARE = 0.35
LOG_SHARE = 0.35
PROGRESS_CEILING = 4 * GIB
LOG_CEILING = 2 * GIB
MIN_STREAM_BYTES = 4 * MIB
# One subject (a fellow's logs, or its records of one job) may fill at most this much of
# its stream; at the ceilings the per-subject counts above fit within it.
SUBJECT_SHARE = 0.25
# What the server charges a stored message beyond its payload (30 bytes and the subject,
# whose tokens swarm.subjects bounds).
RECORD_OVERHEAD = 256


def progress_stream(prefix: str) -> StreamSpec:
    return StreamSpec(
        name=f"{prefix}_progress", subject=f"{prefix}.progress.>", max_age_s=30 * DAY_S,
        max_msgs_per_subject=PROGRESS_PER_SUBJECT, max_msg_size=PROGRESS_MAX_MSG_BYTES,
        share=PROGRESS_SHARE, ceiling_bytes=PROGRESS_CEILING, min_bytes=MIN_STREAM_BYTES,
    )  # fmt: skip


def log_stream(prefix: str) -> StreamSpec:
    return StreamSpec(
        name=f"{prefix}_logs", subject=f"{prefix}.log.>", max_age_s=7 * DAY_S,
        max_msgs_per_subject=LOG_PER_SUBJECT, max_msg_size=LOG_MAX_MSG_BYTES,
        share=LOG_SHARE, ceiling_bytes=LOG_CEILING, min_bytes=MIN_STREAM_BYTES,
    )  # fmt: skip


# --- fitting the streams to the store --------------------------------------------------------


class StreamLimits(msgspec.Struct, frozen=True):
    """What a stream gets: ``max_bytes`` 0 when it cannot hold even one record."""

    name: str
    max_bytes: int
    max_msgs_per_subject: int
    too_small: bool  # under the spec's min_bytes (or nothing at all)


def limits_for(spec: StreamSpec, max_bytes: int) -> StreamLimits:
    """The limits of ``spec`` with a total of ``max_bytes``: per-subject counts cut so that
    one subject's largest records fill at most SUBJECT_SHARE of it."""
    charge = spec.max_msg_size + RECORD_OVERHEAD
    if max_bytes < charge:
        return StreamLimits(spec.name, 0, 0, too_small=True)
    per_subject = max(1, int(max_bytes * SUBJECT_SHARE) // charge)
    return StreamLimits(
        name=spec.name,
        max_bytes=max_bytes,
        max_msgs_per_subject=min(spec.max_msgs_per_subject, per_subject),
        too_small=max_bytes < spec.min_bytes,
    )


def fit_limits(
    available_bytes: int, specs: Sequence[StreamSpec], *, max_stream_bytes: int = -1
) -> list[StreamLimits]:
    """Each stream's limits in a store where ``available_bytes`` can be reserved in all:
    its share, at most its ceiling (and the account's ``max_stream_bytes``, if it has one).
    Pure."""
    out = []
    for spec in specs:
        target = min(spec.ceiling_bytes, int(max(0, available_bytes) * spec.share))
        if max_stream_bytes > 0:
            target = min(target, max_stream_bytes)
        out.append(limits_for(spec, target - target % PROBE_STEP))
    return out


def settle(target: StreamLimits, spec: StreamSpec, current_bytes: int) -> StreamLimits:
    """Keep a stream's current size when the new fit is within FIT_TOLERANCE of it (the
    probe measures to PROBE_STEP, and a restart should not resize for that). Pure."""
    close = abs(target.max_bytes - current_bytes) <= FIT_TOLERANCE * current_bytes
    if current_bytes > 0 and target.max_bytes > 0 and close:
        return limits_for(spec, current_bytes)
    return target


class StoreCapacity(msgspec.Struct, frozen=True):
    """What this account's streams can reserve in the store: ``free_bytes`` more now, on
    top of the ``reserved_bytes`` its streams hold. ``at_least``: the probe stopped at its
    upper bound, so the store is larger than that."""

    free_bytes: int
    reserved_bytes: int
    at_least: bool = False

    @property
    def total_bytes(self) -> int:
        return self.free_bytes + self.reserved_bytes


PROBE_STEP = 64 * 1024  # the probe's resolution, and the unit of a fitted max_bytes
FIT_TOLERANCE = 0.02
PROBE_SUBJECT = "_swarm.storeprobe"
# JetStream's answers when a reservation, a store or an account has run out.
STORAGE_ERROR_CODES = frozenset({10002, 10023, 10028, 10047})
_STORAGE_WORDS = ("insufficient", "resources", "storage", "no space", "maximum bytes")


def is_storage_error(exc: BaseException) -> bool:
    """Does this JetStream error say that storage ran out (a reservation, the store, the
    account's limits, the disk)?"""
    if not isinstance(exc, APIError):
        return False
    if exc.err_code in STORAGE_ERROR_CODES:
        return True
    description = (exc.description or "").lower()
    return any(word in description for word in _STORAGE_WORDS)


def describe(exc: BaseException) -> str:
    """A JetStream error as an operator reads it."""
    if isinstance(exc, APIError) and exc.description:
        code = f" ({exc.err_code})" if exc.err_code else ""
        return f"{exc.description}{code}"
    return str(exc) or type(exc).__name__


async def _all_streams(js: JetStreamContext) -> list[StreamInfo]:
    found: list[StreamInfo] = []
    while page := await js.streams_info(offset=len(found)):
        found.extend(page)
    return found


def reservation(info: StreamInfo) -> int:
    """What a file stream reserves of the store (nothing without ``max_bytes``)."""
    config = info.config
    if config.storage not in (None, StorageType.FILE) or not config.max_bytes:
        return 0
    return max(0, config.max_bytes) * max(1, config.num_replicas or 1)


async def store_capacity(js: JetStreamContext, *, probe: str, upper: int) -> StoreCapacity:
    """Ask the server what this account's streams can reserve: the largest ``max_bytes``
    (to PROBE_STEP, at most ``upper``) a new stream named ``probe`` is granted, plus what
    the account's streams reserve already. The probe stream lives for one request each."""
    streams = await _all_streams(js)
    if any(info.config.name == probe for info in streams):
        await js.delete_stream(probe)  # left by a leader that died while probing
    reserved = sum(reservation(info) for info in streams if info.config.name != probe)

    async def grants(max_bytes: int) -> bool:
        config = StreamConfig(
            name=probe,
            subjects=[f"{PROBE_SUBJECT}.{probe}"],
            max_bytes=max_bytes,
            max_msgs=1,
            storage=StorageType.FILE,
            no_ack=True,
        )
        try:
            await js.add_stream(config)
        except APIError as exc:
            if is_storage_error(exc):
                return False
            raise
        await js.delete_stream(probe)
        return True

    upper = max(PROBE_STEP, upper)
    if await grants(upper):
        return StoreCapacity(free_bytes=upper, reserved_bytes=reserved, at_least=True)
    low, high = 0, upper  # granted, refused
    while high - low > PROBE_STEP:
        middle = (low + high) // 2
        if await grants(middle):
            low = middle
        else:
            high = middle
    return StoreCapacity(free_bytes=low, reserved_bytes=reserved)


def _readable(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


async def ensure_stream(nc: Client, spec: StreamSpec) -> StreamLimits:
    """Create the stream, or bring an existing one to this configuration, with its limits
    fitted to the store (an existing stream is updated, never recreated: its history stays,
    trimmed oldest first when its new limits are lower).

    StoreTooSmallError when the store cannot hold the stream at all."""
    js = nc.jetstream()
    account = await js.account_info()
    upper = math.ceil(spec.ceiling_bytes / spec.share)
    capacity = await store_capacity(js, probe=f"{spec.name}_probe", upper=upper)
    [limits] = fit_limits(
        capacity.total_bytes, [spec], max_stream_bytes=account.limits.storage_max_stream_bytes
    )
    existing: StreamInfo | None = None
    with contextlib.suppress(NotFoundError):
        existing = await js.stream_info(spec.name)
    current = 0 if existing is None else reservation(existing)
    limits = settle(limits, spec, current)
    if limits.max_bytes > current + capacity.free_bytes:
        # Other streams of the account hold more than their share: take what is left.
        limits = limits_for(spec, current + capacity.free_bytes)
    if not limits.max_bytes:
        raise StoreTooSmallError(
            f"the JetStream store is too small for the stream {spec.name}: it grants this "
            f"account {_readable(capacity.total_bytes)} of reservations, "
            f"{_readable(capacity.free_bytes)} of them still free; give nats-server a larger "
            "store (its default max_store is 75% of the disk space free when it starts; or "
            "set jetstream { max_file_store }), or remove streams it does not need"
        )
    config = StreamConfig(
        name=spec.name,
        subjects=[spec.subject],
        max_bytes=limits.max_bytes,
        max_age=spec.max_age_s,
        max_msgs_per_subject=limits.max_msgs_per_subject,
        max_msg_size=spec.max_msg_size,
        discard=DiscardPolicy.OLD,
        storage=StorageType.FILE,
        no_ack=True,
    )
    # An update for an existing stream: adding it again would ask for its whole new
    # reservation on top of the old one.
    if existing is None:
        try:
            await js.add_stream(config)
        except BadRequestError:  # created meanwhile
            await js.update_stream(config)
    else:
        await js.update_stream(config)
    log.info(
        "stream %s: %s (%d records per subject) of a store of %s%s",
        spec.name,
        _readable(limits.max_bytes),
        limits.max_msgs_per_subject,
        _readable(capacity.total_bytes),
        " or more" if capacity.at_least else "",
    )
    return limits


@dataclass(frozen=True)
class Record:
    seq: int
    subject: str
    data: bytes


async def _stored(nc: Client, stream: str, subject: str) -> tuple[int, int]:
    """How many messages on ``subject`` (a filter) the stream holds, and its last sequence."""
    try:
        info = await nc.jetstream().stream_info(stream, subjects_filter=subject)
    except NotFoundError:
        return 0, 0
    return sum((info.state.subjects or {}).values()), info.state.last_seq


async def _subscribe(nc: Client, stream: str, subject: str, *, start_seq: int | None, last: bool):
    """An ephemeral push consumer that acks nothing and cleans itself up when abandoned.

    (nats-py's ordered consumer mode re-delivers the last message when its idle heartbeat
    fires while the reader is slow; a plain consumer without acks is just as ordered.)
    """
    if last:
        policy: dict = {"deliver_policy": DeliverPolicy.LAST_PER_SUBJECT}
    elif start_seq and start_seq > 1:
        policy = {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": start_seq}
    else:
        policy = {"deliver_policy": DeliverPolicy.ALL}
    config = ConsumerConfig(
        ack_policy=AckPolicy.NONE, max_deliver=1, inactive_threshold=60.0, **policy
    )
    return await nc.jetstream().subscribe(subject, stream=stream, config=config)


async def read(
    nc: Client, stream: str, subject: str, *, start_seq: int | None = None
) -> AsyncIterator[Record]:
    """Every stored message on ``subject`` from ``start_seq``, in order; ends when caught up."""
    count, last_seq = await _stored(nc, stream, subject)
    if not count or (start_seq or 0) > last_seq:
        return
    sub = await _subscribe(nc, stream, subject, start_seq=start_seq, last=False)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=2.0)
            except (NatsTimeoutError, TimeoutError):
                return  # nothing (more) at or after start_seq
            yield Record(msg.metadata.sequence.stream, msg.subject, msg.data)
            if msg.metadata.num_pending == 0:
                return
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def follow(
    nc: Client,
    stream: str,
    subject: str,
    *,
    start_seq: int | None = None,
    last_per_subject: bool = False,
    idle_s: float = 15.0,
    stop: asyncio.Event | None = None,
) -> AsyncIterator[Record | None]:
    """Stored then live messages, forever; ``None`` after ``idle_s`` without one (keep-alive).

    Ends when ``stop`` is set (the leader shuts down).
    """
    sub = await _subscribe(nc, stream, subject, start_seq=start_seq, last=last_per_subject)
    stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
    waiter: asyncio.Future | None = None
    try:
        while stopper is None or not stopper.done():
            waiter = asyncio.ensure_future(sub.next_msg(timeout=idle_s))
            await asyncio.wait({waiter, stopper} - {None}, return_when=asyncio.FIRST_COMPLETED)
            if not waiter.done():
                return
            try:
                msg = waiter.result()
            except (NatsTimeoutError, TimeoutError):
                yield None
                continue
            yield Record(msg.metadata.sequence.stream, msg.subject, msg.data)
    finally:
        # Also when the client went away (the generator is closed or cancelled): nothing of
        # this reader may outlive it.
        for future in (waiter, stopper):
            if future is not None and not future.done():
                future.cancel()
        if waiter is not None and waiter.done() and not waiter.cancelled():
            waiter.exception()  # retrieved: a late timeout is not "never retrieved"
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
