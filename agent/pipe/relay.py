"""The relay through NATS: :class:`RelayLink`, frames over two subjects, and the thread its
NATS client runs in (:class:`LoopThread`).

A stage's code is synchronous; nats-py is asyncio. Each RelayLink owns an event loop in a
daemon thread of its own: the NATS callbacks (chunks, credits, control messages) run there,
and the caller's thread hands it sends and waits for them with a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from silentswarm.agent.errors import LinkError, PeerTimeoutError, RelayGapError
from silentswarm.agent.pipe import relaymsg
from silentswarm.agent.pipe.base import Parts

log = logging.getLogger(__name__)

CONTROL_BACKLOG = 64  # control messages kept for the handshake; older ones are dropped
DROP_LOG_EVERY_S = 5.0

T = TypeVar("T")


def serialize_parts(parts: Sequence[bytes | memoryview]) -> bytes:
    views = [memoryview(p) for p in parts]
    head = struct.pack(f">I{len(views)}Q", len(views), *(v.nbytes for v in views))
    return b"".join([head, *(v if v.contiguous else v.tobytes() for v in views)])


def deserialize_parts(blob: bytes) -> Parts:
    view = memoryview(blob)
    if len(view) < 4:
        raise LinkError("relay frame shorter than its header")
    (count,) = struct.unpack_from(">I", view, 0)
    offset = 4 + 8 * count
    if count > 64 or len(view) < offset:
        raise LinkError("relay frame header is corrupt")
    lengths = struct.unpack_from(f">{count}Q", view, 4)
    parts: Parts = []
    for length in lengths:
        if offset + length > len(view):
            raise LinkError("relay frame is truncated")
        parts.append(view[offset : offset + length])
        offset += length
    if offset != len(view):
        raise LinkError("relay frame has trailing bytes")
    return parts


class LoopThread:
    """An asyncio event loop running in a daemon thread of its own."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name)
        self._thread.daemon = True
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """``coro``'s result, run on the loop; TimeoutError after ``timeout`` (it is cancelled)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def call_soon(self, callback: Callable[..., object], *args: object) -> None:
        """``callback(*args)`` on the loop, from any thread."""
        self.loop.call_soon_threadsafe(callback, *args)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


class RelayLink:
    """Frames over two NATS subjects, chunked below the server's max_payload.

    Chunks carry a sequence number: a gap (a chunk lost to a reconnect or a slow-consumer
    drop) fails the receive instead of corrupting a tensor. The receiver grants credits, so
    at most ``window`` chunks are in flight and a fast sender cannot exhaust memory. Grants
    pause while ``max_frames`` whole frames wait unread and resume as the reader takes them,
    so a reader that keeps reading never stalls a sender, whatever the frame size.

    With ``token`` (the boundary's relay secret) every message is tagged and checked (see
    :mod:`silentswarm.agent.pipe.relaymsg`). A message that fails the check, or is malformed, or
    repeats a chunk or a grant already seen, is dropped and counted in ``dropped`` and
    ``dropped_by_reason``; it never fails the link. Only a gap in the sequence of the
    authentic peer's chunks does.
    """

    def __init__(
        self,
        *,
        name: str,
        nats: str | dict[str, Any],
        send_subject: str,
        recv_subject: str,
        token: bytes | None = None,
        chunk_bytes: int = 512 * 1024,
        window: int = 16,
        max_frames: int = 4,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.name = name
        self.transport = "relay"
        self.bytes_sent = 0
        self.bytes_received = 0
        self.dropped = 0
        self.dropped_by_reason: dict[str, int] = {}
        self.send_subject = send_subject
        self.recv_subject = recv_subject
        self._send_auth = relaymsg.RelayAuth(token, send_subject)
        self._recv_auth = relaymsg.RelayAuth(token, recv_subject)
        self._chunk = chunk_bytes
        self._window = window
        self._max_frames = max_frames
        self._frames: deque[Parts | LinkError] = deque()
        self._control: deque[bytes] = deque(maxlen=CONTROL_BACKLOG)
        self._cv = threading.Condition()
        self._assembling: list[memoryview] = []
        self._expected_seq = 0
        self._next_seq = 0
        self._granted = 0  # chunks this end has granted its peer, in all
        self._deferred_grants = 0
        self._peer_granted = 0  # the largest total the peer has granted this end
        self._drop_logged_at: float | None = None
        self._drops_unlogged = 0
        self._peer_done = False
        self._io = LoopThread(f"relay-{name}")
        self._credit_event: asyncio.Event | None = None
        self._nc = None
        try:
            self._run(self._connect(nats), timeout=connect_timeout_s)
        except BaseException:
            self._io.stop()
            raise

    # --- thread bridging ------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        try:
            return self._io.run(coro, timeout)
        except TimeoutError:
            raise PeerTimeoutError(
                f"{self.name}: relay did not answer within {timeout:.0f}s{self._drops_note()}"
            ) from None

    async def _connect(self, access: str | dict[str, Any]) -> None:
        """``access``: a URL, or keyword arguments for ``nats.connect`` (servers, creds...)."""
        import nats

        if isinstance(access, str):
            access = {"servers": [access]}
        self._credit_event = asyncio.Event()
        self._nc = await nats.connect(
            **access,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            name=f"relay-{self.name}",
        )
        # Chunks must fit the server's max_payload (1 MiB by default, smaller if configured).
        self._chunk = max(1024, min(self._chunk, self._nc.max_payload - 2 * relaymsg.OVERHEAD))
        await self._nc.subscribe(self.recv_subject, cb=self._on_message)
        await self._nc.flush()

    # --- receiving (NATS thread) ----------------------------------------------------------

    async def _on_message(self, msg) -> None:
        data = msg.data
        reason = self._take(relaymsg.parse_message(data, self._recv_auth))
        if reason is None:
            self.bytes_received += len(data)  # junk does not count: it would skew the ratios
        else:
            self._drop(reason)

    def _take(
        self, message: relaymsg.DataChunk | relaymsg.Credit | relaymsg.Control | relaymsg.DropReason
    ) -> relaymsg.DropReason | None:
        """Act on a parsed message; why it is dropped instead, if it is."""
        if isinstance(message, relaymsg.DropReason):
            return message
        if isinstance(message, relaymsg.DataChunk):
            return self._on_chunk(message)
        if isinstance(message, relaymsg.Credit):
            if message.total <= self._peer_granted:
                return relaymsg.DropReason.STALE
            self._peer_granted = message.total
            self._credit_event.set()
            return None
        with self._cv:
            if message.kind == relaymsg.DONE:
                self._peer_done = True
            else:  # HELLO, ACK: for the handshake
                self._control.append(message.kind + message.body)
            self._cv.notify_all()
        return None

    def _on_chunk(self, chunk: relaymsg.DataChunk) -> relaymsg.DropReason | None:
        seq, index, count = chunk.seq, chunk.index, chunk.count
        if seq < self._expected_seq:  # seen already: the peer never repeats a chunk
            return relaymsg.DropReason.STALE
        if seq != self._expected_seq or index != len(self._assembling):
            self._fail(
                RelayGapError(
                    f"{self.name}: relay gap: expected chunk {self._expected_seq} "
                    f"(part {len(self._assembling)}), got {seq} (part {index} of {count})"
                )
            )
            self._expected_seq = seq + 1
            self._assembling = []
            return None
        self._expected_seq += 1
        self._assembling.append(chunk.chunk)
        with self._cv:
            if len(self._frames) < self._max_frames:
                self._grant(1)
            else:
                self._deferred_grants += 1
        if index + 1 < count:
            return None
        blob = b"".join(self._assembling)
        self._assembling = []
        try:
            parts: Parts | LinkError = deserialize_parts(blob)
        except LinkError as exc:
            parts = LinkError(f"{self.name}: {exc}")
        with self._cv:
            self._frames.append(parts)
            self._cv.notify_all()
        return None

    def _drop(self, reason: relaymsg.DropReason) -> None:
        """Count a message that is not acted on; log the first, then every few seconds."""
        self.dropped += 1
        # A new dict each time: another thread may be reading the old one.
        counts = self.dropped_by_reason
        self.dropped_by_reason = {**counts, reason.value: counts.get(reason.value, 0) + 1}
        self._drops_unlogged += 1
        now = time.monotonic()
        if self._drop_logged_at is not None and now - self._drop_logged_at < DROP_LOG_EVERY_S:
            return
        log.warning(
            "%s: dropped %d relay message(s) on %s, the last one %s; %d dropped in all %s",
            self.name,
            self._drops_unlogged,
            self.recv_subject,
            reason.value,
            self.dropped,
            self.dropped_by_reason,
        )
        self._drop_logged_at = now
        self._drops_unlogged = 0

    def _drops_note(self) -> str:
        if not self.dropped:
            return ""
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.dropped_by_reason.items()))
        return f" ({self.dropped} relay messages dropped: {reasons})"

    def _fail(self, error: LinkError) -> None:
        with self._cv:
            self._frames.append(error)
            self._cv.notify_all()

    def _grant(self, n: int) -> None:
        if n > 0 and self._nc is not None:
            self._granted += n
            payload = self._send_auth.credit(self._granted)
            self.bytes_sent += len(payload)
            self._io.loop.create_task(self._nc.publish(self.send_subject, payload))

    # --- sending (caller thread -> NATS thread) -------------------------------------------

    async def _send_blob(self, blob: bytes, timeout_s: float) -> None:
        view = memoryview(blob)
        count = max(1, -(-len(view) // self._chunk))
        for index in range(count):
            # The first ``window`` chunks need no grant; each grant allows one more.
            while self._next_seq >= self._window + self._peer_granted:
                self._credit_event.clear()
                try:
                    await asyncio.wait_for(self._credit_event.wait(), timeout_s)
                except TimeoutError:
                    raise PeerTimeoutError(
                        f"{self.name}: the receiver granted no credit for {timeout_s:.0f}s"
                        f"{self._drops_note()}"
                    ) from None
            chunk = view[index * self._chunk : (index + 1) * self._chunk]
            payload = self._send_auth.data(self._next_seq, index, count, chunk)
            self._next_seq += 1
            self.bytes_sent += len(payload)
            await self._nc.publish(self.send_subject, payload)

    def send(self, parts: Sequence[bytes | memoryview], timeout_s: float = 60.0) -> None:
        self._run(self._send_blob(serialize_parts(parts), timeout_s), timeout=timeout_s + 5)

    def send_control(self, kind: bytes, body: bytes = b"") -> None:
        async def publish() -> None:
            payload = self._send_auth.message(kind, body)
            self.bytes_sent += len(payload)
            await self._nc.publish(self.send_subject, payload)
            await self._nc.flush()

        self._run(publish(), timeout=10)

    def send_done(self) -> None:
        self.send_control(relaymsg.DONE)

    def wait_done(self, timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._peer_done, timeout_s)

    def recv_control(self, timeout_s: float) -> bytes | None:
        with self._cv:
            if not self._cv.wait_for(lambda: bool(self._control), timeout_s):
                return None
            return self._control.popleft()

    def recv(self, timeout_s: float) -> Parts:
        with self._cv:
            if not self._cv.wait_for(lambda: bool(self._frames), timeout_s):
                raise PeerTimeoutError(
                    f"{self.name}: nothing received for {timeout_s:.0f}s{self._drops_note()}"
                )
            item = self._frames.popleft()
            deferred = 0
            if len(self._frames) < self._max_frames:
                deferred, self._deferred_grants = self._deferred_grants, 0
        if deferred:
            self._io.call_soon(self._grant, deferred)
        if isinstance(item, LinkError):
            raise item
        return item

    def close(self) -> None:
        async def shutdown() -> None:
            if self._nc is not None:
                with contextlib.suppress(Exception):
                    await self._nc.drain()  # flushes what is still buffered

        with contextlib.suppress(Exception):
            self._run(shutdown(), timeout=5)
        self._io.stop()
