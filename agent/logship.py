"""FellowLogShipper: the agent's log records (and its stage runtime's output) to the leader.

A logging handler puts records in a bounded buffer and returns at once: shipping never
blocks training, and when NATS is away or slow the oldest records are dropped (and counted)
rather than memory growing. A task publishes what is buffered as ``LogBatch`` messages on
``<prefix>.log.<fellow>`` a few times a second, under NATS's max payload.

Every record passes ``add``, which redacts secrets (swarm/redact.py: tokens, JWTs, nkey
seeds, private keys, ``Bearer`` values, ``token=``-style parameters) before it is buffered:
what the leader stores and serves (``GET /api/v1/workers/<id>/logs``) never holds them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque

from nats.aio.client import Client
from nats.errors import Error as NatsError

from silentswarm import subjects as topics
from silentswarm.protocol import LogBatch, LogRecord
from silentswarm.redact import redact

CAPACITY = 10_000
BATCH_RECORDS = 200
# Under the log stream's message size (leader/streams.py LOG_MAX_MSG_BYTES, 32 KiB): a batch
# the stream refused would be lost. One record (MESSAGE_CHARS, UTF-8) always fits.
BATCH_BYTES = 24 * 1024
MESSAGE_CHARS = 4000
# Redacted before it is cut to MESSAGE_CHARS (a secret cut in half must still be found), but
# no further than this: a huge message costs no more than a long one.
REDACT_CHARS = 4 * MESSAGE_CHARS
FLUSH_EVERY_S = 0.5


class FellowLogShipper(logging.Handler):
    def __init__(self, fellow_id: str, *, capacity: int = CAPACITY) -> None:
        super().__init__(level=logging.INFO)
        self.fellow_id = fellow_id
        self._buffer: deque[LogRecord] = deque()
        self._capacity = capacity
        self._lock = threading.Lock()
        self.dropped = 0
        self.shipped = 0

    # --- producers (any thread) ------------------------------------------------------------

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("nats"):
            return  # the shipper's own transport talking about itself would loop
        try:
            message = self.format(record) if self.formatter else record.getMessage()
            if record.exc_info and not self.formatter:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
        except Exception:
            self.handleError(record)
            return
        self.add(record.levelname, record.name, message, record.created)

    def add(self, level: str, logger: str, message: str, ts: float | None = None) -> None:
        message = redact(message[:REDACT_CHARS])[:MESSAGE_CHARS]
        # Within swarm.protocol.LogRecord's bounds: the leader refuses a batch outside them.
        entry = LogRecord(
            ts=ts or time.time(), level=level[:16], logger=logger[:256], message=message
        )
        with self._lock:
            if len(self._buffer) >= self._capacity:
                self._buffer.popleft()
                self.dropped += 1
            self._buffer.append(entry)

    # --- the shipping task -----------------------------------------------------------------

    def take(self) -> list[LogRecord]:
        """Up to one batch of buffered records, oldest first, within the size bound."""
        batch, size = [], 0
        with self._lock:
            while self._buffer and len(batch) < BATCH_RECORDS:
                head = self._buffer[0]
                cost = len(head.message.encode()) + len(head.logger) + 64
                if batch and size + cost > BATCH_BYTES:
                    break
                batch.append(self._buffer.popleft())
                size += cost
        return batch

    def give_back(self, batch: list[LogRecord]) -> None:
        with self._lock:
            room = self._capacity - len(self._buffer)
            keep = batch[-room:] if room > 0 else []
            self.dropped += len(batch) - len(keep)
            self._buffer.extendleft(reversed(keep))

    async def run(self, nc: Client, prefix: str, stop: asyncio.Event) -> None:
        """Publish batches until ``stop``, then flush what is left (best effort)."""
        subject = topics.LOG.subject(prefix, fellow=self.fellow_id)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), FLUSH_EVERY_S)
            await self.flush_to(nc, subject)

    async def flush_to(self, nc: Client, subject: str) -> None:
        while nc.is_connected:
            batch = self.take()
            if not batch:
                return
            try:
                await nc.publish(
                    subject, topics.encode(LogBatch(fellow_id=self.fellow_id, records=batch))
                )
            except NatsError:
                self.give_back(batch)
                return
            self.shipped += len(batch)
