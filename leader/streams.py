"""JetStream streams for history: every progress record and every log batch, as sent.

The streams capture the fellows' own subjects (``<prefix>.progress.>``, ``<prefix>.log.>``)
inside the NATS server, so history is recorded even while the leader is down, and nothing is
written twice. Readers use ordered consumers (ephemeral, flow-controlled, gap-free): ``read``
returns what is stored now, ``follow`` keeps going live. Stream sequence numbers identify
records, which is what SSE event ids are made of.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError

log = logging.getLogger(__name__)

DAY_S = 86400.0


@dataclass(frozen=True)
class StreamSpec:
    """A history stream over fellows' own subjects.

    Fellows are strangers, so the limits are per subject (a fellow's own subject, or its
    own per job): ``max_msgs_per_subject`` messages of at most ``max_msg_size`` bytes,
    dropped oldest first within that subject only. There is no total byte limit with
    discard-old (it would let one fellow's volume evict everyone else's history); age ends
    everything. The stream never acknowledges (``no_ack``): a PubAck goes to whatever reply
    subject a message carries, and a fellow chooses that.
    """

    name: str
    subject: str
    max_age_s: float
    max_msgs_per_subject: int
    max_msg_size: int

    @property
    def max_bytes_per_subject(self) -> int:
        return self.max_msgs_per_subject * self.max_msg_size


# Progress records are a few hundred bytes (their strings are bounded in swarm.protocol);
# one job's subject of one fellow keeps its newest 100,000.
PROGRESS_MAX_MSG_BYTES = 4096
PROGRESS_PER_SUBJECT = 100_000
# Log batches stay under LOG_MAX_MSG_BYTES (agent/logship.py cuts them so); a fellow keeps
# its newest 5,000 batches.
LOG_MAX_MSG_BYTES = 32 * 1024
LOG_PER_SUBJECT = 5_000


def progress_stream(prefix: str) -> StreamSpec:
    return StreamSpec(
        name=f"{prefix}_progress", subject=f"{prefix}.progress.>", max_age_s=30 * DAY_S,
        max_msgs_per_subject=PROGRESS_PER_SUBJECT, max_msg_size=PROGRESS_MAX_MSG_BYTES,
    )  # fmt: skip


def log_stream(prefix: str) -> StreamSpec:
    return StreamSpec(
        name=f"{prefix}_logs", subject=f"{prefix}.log.>", max_age_s=7 * DAY_S,
        max_msgs_per_subject=LOG_PER_SUBJECT, max_msg_size=LOG_MAX_MSG_BYTES,
    )  # fmt: skip


async def ensure_stream(nc: Client, spec: StreamSpec) -> None:
    """Create the stream, or bring an existing one to this configuration."""
    config = StreamConfig(
        name=spec.name,
        subjects=[spec.subject],
        max_bytes=-1,
        max_age=spec.max_age_s,
        max_msgs_per_subject=spec.max_msgs_per_subject,
        max_msg_size=spec.max_msg_size,
        discard=DiscardPolicy.OLD,
        storage=StorageType.FILE,
        no_ack=True,
    )
    js = nc.jetstream()
    try:
        await js.add_stream(config)
    except BadRequestError:
        await js.update_stream(config)


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
