"""The relay through NATS: :class:`RelayLink`, frames over two subjects, and the thread its
NATS client runs in (:class:`LoopThread`).

A stage's code is synchronous; nats-py is asyncio. Each RelayLink owns an event loop in a
daemon thread of its own: the NATS callbacks (chunks, credits, control messages) run there,
and the caller's thread hands it sends and waits for them with a timeout.

NATS core delivers at most once, and a NATS server that dies takes what was in flight with it
(the clients reconnect on their own, nats-py subscribing again). So the relay is reliable
itself: every chunk has a sequence number, the sender keeps each one until the receiver
acknowledges it (the credit grant is also a cumulative acknowledgement), and a receiver that
sees a gap drops the chunks after it and asks for a resend from the one it expects. On a
reconnect both ends say where they are, and a sender that waits and hears nothing probes.
What the sender keeps is bounded by the credit window, so a NATS outage shorter than the
peer timeout costs time, not the attempt. See ``docs/architecture.md`` (the relay) for the
whole protocol; the messages are laid out in :mod:`silentswarm.agent.pipe.relaymsg`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from silentswarm.agent.errors import (
    FrameError,
    LinkError,
    PeerTimeoutError,
    RelayGapError,
    SlowReceiverError,
)
from silentswarm.agent.pipe import relaymsg
from silentswarm.agent.pipe.base import Parts

log = logging.getLogger(__name__)

CONTROL_BACKLOG = 64  # control messages kept for the handshake; older ones are dropped
DROP_LOG_EVERY_S = 5.0  # what a peer sends that is dropped: a log line every 5 s at most
# The slowest a receiver may take a frame (1 Mbit/s): a frame's send is given its timeout
# plus its size at this rate, however the credit trickles in.
MIN_SEND_BYTES_PER_S = 128 << 10
MAX_PARTS = 64  # parts in one frame
MAX_FRAME_BYTES = 1 << 30  # the largest frame a receiver allocates for (a peer cannot ask more)
TICK_S = 0.25  # how often a link looks whether it must probe its peer
PROBE_AFTER_S = 1.0  # a sender that waits and has heard nothing for this long probes
RESEND_EVERY_S = 0.5  # resend requests for the same missing chunk, at most this often
DONE_EVERY_S = 0.25  # DONE is said again this often until the peer confirms it
DONE_TIMEOUT_S = 60.0  # ... or until this long has passed (the waiter's peer timeout)
PENDING_SLACK_BYTES = 1 << 20  # beside the data: grants, probes, handshake messages
REANSWER_EVERY_S = 0.1  # a late HELLO is answered again at most this often
# Chunks taken but not acknowledged yet are acknowledged this late at most (a grant goes out
# at once every window / 4 chunks): one credit message for several small frames, not one each.
ACK_DELAY_S = 0.05

T = TypeVar("T")


# --- frames: parts <-> bytes ------------------------------------------------------------------


def frame_views(parts: Sequence[bytes | memoryview]) -> list[memoryview]:
    """A frame as flat byte views, no copy: its header (the part count and each part's size)
    and then each part. A part that is not C-contiguous is copied (``tobytes``)."""
    views = [_flat(p) for p in parts]
    if len(views) > MAX_PARTS:
        raise LinkError(f"a relay frame has at most {MAX_PARTS} parts, got {len(views)}")
    head = struct.pack(f">I{len(views)}Q", len(views), *(v.nbytes for v in views))
    return [memoryview(head), *views]


def _flat(part: bytes | memoryview) -> memoryview:
    view = memoryview(part)
    if view.ndim == 1 and view.itemsize == 1 and view.c_contiguous:
        return view
    if view.c_contiguous:
        with contextlib.suppress(TypeError):  # a view with a zero in its shape cannot cast
            return view.cast("B")
    return memoryview(view.tobytes())


def serialize_parts(parts: Sequence[bytes | memoryview]) -> bytes:
    """The frame as one blob: what the chunks of a frame, put together, hold."""
    return b"".join(frame_views(parts))


def chunk_frame(views: Sequence[memoryview], chunk_bytes: int) -> list[list[memoryview]]:
    """The frame split into chunks of ``chunk_bytes`` (the last one shorter), each chunk as
    the slices of the parts it spans: nothing is copied until a chunk becomes a message."""
    chunks: list[list[memoryview]] = []
    current: list[memoryview] = []
    room = chunk_bytes
    for view in views:
        offset = 0
        while offset < view.nbytes:
            take = min(room, view.nbytes - offset)
            current.append(view[offset : offset + take])
            offset += take
            room -= take
            if room == 0:
                chunks.append(current)
                current, room = [], chunk_bytes
    if current or not chunks:
        chunks.append(current)
    return chunks


def deserialize_parts(blob: bytes | bytearray | memoryview) -> Parts:
    """The parts of a frame blob, as views of it (no copy)."""
    view = memoryview(blob)
    if len(view) < 4:
        raise FrameError("relay frame shorter than its header")
    (count,) = struct.unpack_from(">I", view, 0)
    offset = 4 + 8 * count
    if count > MAX_PARTS or len(view) < offset:
        raise FrameError("relay frame header is corrupt")
    lengths = struct.unpack_from(f">{count}Q", view, 4)
    parts: Parts = []
    for length in lengths:
        if offset + length > len(view):
            raise FrameError("relay frame is truncated")
        parts.append(view[offset : offset + length])
        offset += length
    if offset != len(view):
        raise FrameError("relay frame has trailing bytes")
    return parts


class FrameAssembler:
    """Puts a frame's chunks, taken in sequence order, together.

    A one-chunk frame's parts are views of that chunk's message (no copy). A longer frame is
    written into one buffer, allocated at its first chunk from the size every chunk carries
    (at most ``max_frame_bytes``: a peer cannot make this end allocate more), and its parts
    are views of that buffer. Every chunk is checked against the frame it belongs to; a
    frame that does not add up is an error for the receive, and the chunks after it are
    skipped until the next frame begins. Such an error is a :class:`FrameError` (the peer
    sent it, as it would a frame that does not decode), never a :class:`LinkError`: the link
    still works, and a ring takes it as that contribution lost, not as its own end.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer: memoryview | None = None
        self._next_index = 0
        self._count = 0
        self._size = 0
        self._offset = 0

    @property
    def assembling(self) -> bool:
        return self._buffer is not None

    def add(self, chunk: relaymsg.DataChunk) -> list[Parts | FrameError]:
        """What the chunk completes: a frame, errors, or nothing yet."""
        out: list[Parts | FrameError] = []
        if chunk.index == 0:
            if self._buffer is not None:
                out.append(FrameError(f"relay frame cut short at chunk {self._next_index}"))
                self._buffer = None
            error = self._begin(chunk)
            if error is not None:
                out.append(error)
                return out
            if chunk.count == 1:
                out.append(self._parts(chunk.chunk))
                return out
        elif self._buffer is None:
            return out  # the rest of a frame already failed (or never begun): skipped
        elif (chunk.index, chunk.count, chunk.frame_bytes) != (
            self._next_index,
            self._count,
            self._size,
        ):
            self._buffer = None
            out.append(FrameError("relay frame's chunks do not add up"))
            return out
        out.extend(self._write(chunk))
        return out

    def _begin(self, chunk: relaymsg.DataChunk) -> FrameError | None:
        size, count = chunk.frame_bytes, chunk.count
        if size > self.max_frame_bytes:
            return FrameError(
                f"relay frame of {size} bytes is over the limit of {self.max_frame_bytes}"
            )
        if count > size or (count == 1 and chunk.chunk.nbytes != size):
            return FrameError("relay frame's chunks do not add up")
        if count > 1:
            self._buffer = memoryview(np.empty(size, dtype=np.uint8)).cast("B")
            self._next_index, self._count, self._size, self._offset = 0, count, size, 0
        return None

    def _write(self, chunk: relaymsg.DataChunk) -> list[Parts | FrameError]:
        assert self._buffer is not None
        end = self._offset + chunk.chunk.nbytes
        last = chunk.index + 1 == self._count
        if end > self._size or (last and end != self._size) or chunk.chunk.nbytes == 0:
            self._buffer = None
            return [FrameError("relay frame's chunks do not add up")]
        self._buffer[self._offset : end] = chunk.chunk
        self._offset, self._next_index = end, chunk.index + 1
        if not last:
            return []
        buffer, self._buffer = self._buffer, None
        return [self._parts(buffer)]

    @staticmethod
    def _parts(blob: memoryview) -> Parts | FrameError:
        try:
            return deserialize_parts(blob)
        except FrameError as exc:
            return exc


# --- the loop thread --------------------------------------------------------------------------


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


@dataclass
class _Gap:
    """A chunk the receiver misses: since when, what came instead, how often it asked."""

    expected: int
    since: float
    got: int
    asked: int = 0
    asked_at: float = -math.inf


# --- the link ---------------------------------------------------------------------------------


class RelayLink:
    """Frames over two NATS subjects, chunked below the server's max_payload.

    Chunks carry a sequence number. The receiver grants credits, so at most ``window`` chunks
    are in flight and a fast sender cannot exhaust memory; grants pause while ``max_frames``
    whole frames wait unread and resume as the reader takes them, so a reader that keeps
    reading never stalls a sender, whatever the frame size. A grant also acknowledges every
    chunk received in order; the sender keeps each chunk until then (at most ``window``), so a
    chunk lost on the way (a NATS server that died, a reconnect) is sent again when the
    receiver asks for it: a gap is repaired, not fatal. Only a gap still open when the
    receive times out fails it (RelayGapError).

    With ``token`` (the boundary's relay secret) every message is tagged and checked (see
    :mod:`silentswarm.agent.pipe.relaymsg`). A message that fails the check, or is malformed,
    or repeats a chunk or a serial already seen, or names chunks never sent, is dropped and
    counted in ``dropped`` and ``dropped_by_reason``; it never fails the link. So are the
    authentic chunks after a gap (``gap``), which are asked for again.
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
        window: int = 32,
        max_frames: int = 4,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.name = name
        self.transport = "relay"
        self.bytes_sent = 0
        self.bytes_received = 0
        self.dropped = 0
        self.dropped_by_reason: dict[str, int] = {}
        self.resent = 0  # chunks sent again at the peer's request
        self.resend_requests = 0  # the peer's requests to send again (none may be owed)
        self.resends_held = 0  # chunks asked for again within RESEND_EVERY_S of their last
        self.reconnects = 0
        self.send_subject = send_subject
        self.recv_subject = recv_subject
        self._send_auth = relaymsg.RelayAuth(token, send_subject)
        self._recv_auth = relaymsg.RelayAuth(token, recv_subject)
        self._chunk = chunk_bytes
        self._window = max(1, window)
        self._grant_every = max(1, self._window // 4)
        self._max_frames = max_frames
        self._max_frame_bytes = max_frame_bytes
        self._cv = threading.Condition()
        # receiving
        self._frames: deque[Parts | FrameError] = deque()
        self._control: deque[bytes] = deque(maxlen=CONTROL_BACKLOG)
        self._assembler = FrameAssembler(max_frame_bytes)
        self._expected_seq = 0
        self._granted = 0  # chunks this end has granted its peer, in all
        self._deferred_grants = 0
        self._announced = (0, 0)  # the (granted, acked) this end last told its peer
        self._ack_timer: asyncio.TimerHandle | None = None  # the delayed acknowledgement
        self._gap: _Gap | None = None
        self._peer_done = False
        self._ack_body: bytes | None = None  # our handshake answer, said again to a late HELLO
        self._answered_at = -math.inf
        self._done_answered_at = -math.inf
        self._tasks: set[asyncio.Task[object]] = set()  # see _in_background
        # sending
        self._next_seq = 0  # the next chunk's seq (the caller's thread)
        self._published = 0  # every chunk below this one has been handed to NATS (the loop's)
        self._peer_granted = 0  # the largest total the peer has granted this end
        self._peer_acked = 0  # the peer has every chunk below this one
        self._retained: deque[tuple[int, bytes]] = deque()  # sent, not acknowledged yet
        self._outbox: deque[tuple[int, bytes]] = deque()  # made, not handed to NATS yet
        self._send_lock = threading.Lock()  # one frame's chunks at a time, in seq order
        self._resend_from: int | None = None
        # When each retained chunk was last sent again: a peer asking for the whole window
        # again and again (a few dozen bytes a request) gets it once per RESEND_EVERY_S, the
        # pace at which an honest receiver asks.
        self._resent_at: dict[int, float] = {}
        self._pump_idle = False
        self._pump_wake: asyncio.Event | None = None
        self._drained: asyncio.Event | None = None  # set when the pump has nothing left
        self._pump: asyncio.Task[None] | None = None
        self._waiting_credit = False
        self._active_at = time.monotonic()  # the last time the peer or this sender did anything
        self._done_seen = False
        # both
        self._serial = 0  # this end's C, R and P messages, counted
        self._peer_serial = 0  # the newest serial seen from the peer
        self._drop_logged_at: float | None = None
        self._drops_unlogged = 0
        self._io = LoopThread(f"relay-{name}")
        self._ticker: asyncio.Task[None] | None = None
        self._nc: Any = None
        try:
            self._run(self._connect(nats), timeout=connect_timeout_s)
        except BaseException:
            self._io.stop()
            raise

    @property
    def connected(self) -> bool:
        """Whether its NATS client is connected now (it reconnects on its own)."""
        return self._nc is not None and self._nc.is_connected

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
        self._pump_wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._nc = await nats.connect(
            **access,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            name=f"relay-{self.name}",
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
            error_cb=self._on_error,
        )
        # Chunks must fit the server's max_payload (1 MiB by default, smaller if configured).
        self._chunk = max(1024, min(self._chunk, self._nc.max_payload - 2 * relaymsg.OVERHEAD))
        # What nats-py may hold for this end before it sheds messages (and says so through
        # _on_error): an honest peer has at most the window in flight, resends included twice;
        # nats-py's default, 128 MiB a link, would let strangers on the subject fill it.
        await self._nc.subscribe(
            self.recv_subject,
            cb=self._on_message,
            pending_bytes_limit=4 * self._window * self._chunk + PENDING_SLACK_BYTES,
        )
        await self._nc.flush()
        loop = asyncio.get_running_loop()
        self._ticker = loop.create_task(self._tick())
        self._pump = loop.create_task(self._run_pump())

    async def _on_disconnected(self) -> None:
        log.info("%s: the relay lost NATS; it keeps what the peer has not acknowledged", self.name)

    async def _on_reconnected(self) -> None:
        """Both ends say where they are: whichever reconnects last is heard (nats-py has
        subscribed again before this runs), and the peer sends again what is missing."""
        self.reconnects += 1
        log.info(
            "%s: the relay reconnected to NATS; asking for chunks from %d, sent up to %d",
            self.name,
            self._expected_seq,
            self._published,
        )
        await self._announce(resend=True)
        await self._probe()

    async def _on_error(self, exc: Exception) -> None:
        """nats-py's errors: those of a connection (refused while the server is away, a
        socket that died) are expected and retried on their own; anything else is a bug."""
        import nats.errors

        if isinstance(exc, nats.errors.SlowConsumerError):
            self._drop(relaymsg.DropReason.SLOW_CONSUMER)  # lost chunks are asked for again
        elif isinstance(exc, OSError | asyncio.TimeoutError | nats.errors.Error):
            log.debug("%s: relay NATS client: %r", self.name, exc)
        else:
            log.error("%s: relay NATS client: %r", self.name, exc, exc_info=exc)

    async def _publish(self, payload: bytes) -> bool:
        """Publish; False if NATS would not take it (closed, reconnecting with a full buffer):
        what matters is sent again, as the protocol asks for it."""
        try:
            await self._nc.publish(self.send_subject, payload)
        except Exception as exc:  # nats-py's errors, or OSError from a dying socket
            log.debug("%s: relay publish failed: %r", self.name, exc)
            return False
        self.bytes_sent += len(payload)
        return True

    def _next_serial(self) -> int:
        self._serial += 1
        return self._serial

    # --- receiving (NATS thread) ----------------------------------------------------------

    async def _on_message(self, msg: Any) -> None:
        data = msg.data
        reason = await self._take(relaymsg.parse_message(data, self._recv_auth))
        if reason is None:
            self.bytes_received += len(data)  # junk does not count: it would skew the ratios
        else:
            self._drop(reason)

    async def _take(
        self, message: relaymsg.Message | relaymsg.DropReason
    ) -> relaymsg.DropReason | None:
        """Act on a parsed message; why it is dropped instead, if it is."""
        if isinstance(message, relaymsg.DropReason):
            return message
        if isinstance(message, relaymsg.DataChunk):
            return await self._on_chunk(message)
        if isinstance(message, relaymsg.Credit):
            return self._on_credit(message)
        if isinstance(message, relaymsg.Probe):
            return await self._on_probe(message)
        return await self._on_control(message)

    async def _on_chunk(self, chunk: relaymsg.DataChunk) -> relaymsg.DropReason | None:
        if chunk.seq < self._expected_seq:  # seen already: a replay, or a resend
            return relaymsg.DropReason.STALE
        if chunk.seq > self._expected_seq:  # one was lost on the way: ask for it again
            await self._gap_seen(chunk.seq)
            return relaymsg.DropReason.GAP
        if chunk.seq >= self._window + self._granted:
            # Past the credit this end gave: an honest sender waits for it, and taking it
            # would let a peer queue frames here without bound.
            return relaymsg.DropReason.OVER_CREDIT
        self._expected_seq += 1
        self._gap = None
        try:
            done = self._assembler.add(chunk)
        except MemoryError:  # the frame's buffer, of the size its first chunk claims
            self._assembler = FrameAssembler(self._max_frame_bytes)
            done = [FrameError(f"no memory for a frame of {chunk.frame_bytes} bytes")]
        with self._cv:
            if len(self._frames) < self._max_frames:
                self._granted += 1
            else:
                self._deferred_grants += 1
            for item in done:
                if isinstance(item, FrameError):
                    item = FrameError(f"{self.name}: {item}")
                self._frames.append(item)
            if done:
                self._cv.notify_all()
        await self._announce()
        if self._owes_ack and self._ack_timer is None:
            self._ack_timer = self._io.loop.call_later(ACK_DELAY_S, self._ack_due)
        return None

    @property
    def _owes_ack(self) -> bool:
        """Whether chunks were taken or grants made since the peer was last told."""
        return self._announced != (self._granted, self._expected_seq)

    def _ack_due(self) -> None:
        """The delayed acknowledgement (on the loop): what came since the last one."""
        self._ack_timer = None
        if self._owes_ack:
            self._in_background(self._announce(force=True))

    async def _gap_seen(self, got: int, *, urgent: bool = False) -> None:
        """Chunk ``got`` (or a probe) shows the one expected is missing: ask for a resend
        from it, at most every ``RESEND_EVERY_S`` (the chunks after a gap come in a burst),
        or at once when ``urgent`` (a probe, itself sent at most once a second)."""
        now = time.monotonic()
        gap = self._gap
        if gap is None or gap.expected != self._expected_seq:
            gap = self._gap = _Gap(expected=self._expected_seq, since=now, got=got)
        gap.got = got
        if urgent or now - gap.asked_at >= RESEND_EVERY_S:
            gap.asked += 1
            gap.asked_at = now
            await self._announce(resend=True)

    async def _announce(self, *, resend: bool = False, force: bool = False) -> None:
        """Tell the peer what this end has (acked) and grants: every few chunks, when asked
        (``force``: the delayed acknowledgement, a probe, frames read), or with a resend
        request."""
        granted, acked = self._granted, self._expected_seq
        last_granted, last_acked = self._announced
        batch = self._grant_every
        if not (resend or force or granted - last_granted >= batch or acked - last_acked >= batch):
            return
        self._announced = (granted, acked)
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        serial = self._next_serial()
        await self._publish(self._send_auth.credit(serial, granted, acked, resend=resend))

    async def _on_probe(self, probe: relaymsg.Probe) -> relaymsg.DropReason | None:
        if probe.serial <= self._peer_serial:
            return relaymsg.DropReason.STALE
        if probe.next_seq < self._expected_seq:  # it cannot have sent less than arrived
            return relaymsg.DropReason.BAD_SEQ
        self._peer_serial = probe.serial
        if probe.next_seq > self._expected_seq:  # the last chunks were lost: none showed it
            await self._gap_seen(probe.next_seq - 1, urgent=True)
        else:
            await self._announce(force=True)
        return None

    async def _on_control(self, message: relaymsg.Control) -> relaymsg.DropReason | None:
        kind = message.kind
        if kind == relaymsg.DONE:
            with self._cv:
                self._peer_done = True
                self._cv.notify_all()
            # Each DONE asks for an answer: at most one per REANSWER_EVERY_S, or a peer
            # repeating it would have this end publish as fast as it does (an honest one says
            # it every DONE_EVERY_S until it hears the answer).
            now = time.monotonic()
            if now - self._done_answered_at < REANSWER_EVERY_S:
                return relaymsg.DropReason.STALE
            self._done_answered_at = now
            await self._publish(self._send_auth.message(relaymsg.DONE_SEEN))
        elif kind == relaymsg.DONE_SEEN:
            with self._cv:
                self._done_seen = True
                self._cv.notify_all()
        elif kind == relaymsg.HELLO and self._ack_body is not None:
            # The handshake is over here, but the peer still says HELLO: our ACK was lost
            # (say, to a NATS restart). Answer again, as ZeroMQ's end does.
            now = time.monotonic()
            if now - self._answered_at >= REANSWER_EVERY_S:
                self._answered_at = now
                await self._publish(self._send_auth.message(relaymsg.ACK, self._ack_body))
        else:  # HELLO, ACK: for the handshake
            with self._cv:
                self._control.append(kind + message.body)
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

    def _in_background(self, coroutine: Coroutine[Any, Any, object]) -> None:
        """Run ``coroutine`` as a task on the loop, kept referenced until it ends (the loop
        holds its tasks weakly: an unreferenced one may vanish, and a grant with it)."""
        task = self._io.loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _release_deferred(self, n: int) -> None:
        """The reader took frames: the grants held back go out (on the loop)."""
        self._granted += n
        self._in_background(self._announce(force=True))

    # --- sending (NATS thread) ------------------------------------------------------------

    def _on_credit(self, credit: relaymsg.Credit) -> relaymsg.DropReason | None:
        if credit.serial <= self._peer_serial:
            return relaymsg.DropReason.STALE
        if not self._peer_acked <= credit.acked <= self._published:
            return relaymsg.DropReason.BAD_SEQ  # acks chunks never sent, or goes back
        self._peer_serial = credit.serial
        self._active_at = time.monotonic()
        if credit.acked > self._peer_acked or credit.granted > self._peer_granted:
            with self._cv:  # the sender waits for grants, send_done for acknowledgements
                self._peer_granted = max(self._peer_granted, credit.granted)
                self._peer_acked = credit.acked
                while self._retained and self._retained[0][0] < credit.acked:
                    self._resent_at.pop(self._retained.popleft()[0], None)
                self._cv.notify_all()
        if credit.resend:
            self.resend_requests += 1
            if credit.acked < self._published:
                start = self._resend_from
                self._resend_from = credit.acked if start is None else min(credit.acked, start)
                self._wake_pump()
        return None

    def _wake_pump(self) -> None:
        """From the loop: the pump has chunks to send (again)."""
        self._pump_idle = False
        assert self._pump_wake is not None
        self._pump_wake.set()

    async def _run_pump(self) -> None:
        """The one task that publishes chunks: those the caller made, in order, and those the
        peer asked for again, which go first (in order too: a resend never interleaves)."""
        assert self._pump_wake is not None and self._drained is not None
        while True:
            self._pump_idle = True  # before the last look: a caller that adds then wakes it
            if not (self._outbox or self._resend_from is not None):
                self._drained.set()
                await self._pump_wake.wait()
            self._pump_wake.clear()
            self._pump_idle = False
            if self._resend_from is not None:
                await self._resend()
            elif self._outbox:
                seq, payload = self._outbox.popleft()
                self._published = seq + 1
                if self._nc.is_connected:  # otherwise it waits for the peer to ask
                    await self._publish(payload)

    async def _resend(self) -> None:
        """Send again every kept chunk from the one asked for that was sent already, but
        none sent again less than ``RESEND_EVERY_S`` ago (counted in ``resends_held``): the
        receiver asks again after that long if it still lacks it."""
        start, self._resend_from = self._resend_from, None
        assert start is not None
        for seq, payload in list(self._retained):
            if not self._nc.is_connected:
                return  # the reconnect will ask again
            if not start <= seq < self._published:
                continue
            now = time.monotonic()
            if now - self._resent_at.get(seq, -math.inf) < RESEND_EVERY_S:
                self.resends_held += 1
                continue
            if await self._publish(payload):
                self._resent_at[seq] = now
                self.resent += 1
        self._active_at = time.monotonic()

    async def _probe(self) -> None:
        self._active_at = time.monotonic()
        await self._publish(self._send_auth.probe(self._next_serial(), self._published))

    async def _tick(self) -> None:
        """A sender that waits (for credit, or for acknowledgements) and has heard nothing for
        ``PROBE_AFTER_S`` says how far it got; the answer restarts what a lost grant,
        acknowledgement or tail of chunks stopped."""
        while True:
            await asyncio.sleep(TICK_S)
            waiting = bool(self._retained) or self._waiting_credit
            quiet = time.monotonic() - self._active_at >= PROBE_AFTER_S
            if waiting and quiet and self._nc.is_connected:
                await self._probe()

    # --- sending (caller thread) ----------------------------------------------------------

    def _wait_credit(self, timeout_s: float, deadline: float) -> None:
        """Until the next chunk is within the window: the first ``window`` chunks need no
        grant; each grant allows one more. At most ``timeout_s``, and not past ``deadline``
        (the frame's, on the monotonic clock). Called with ``_cv`` held."""
        if self._next_seq < self._window + self._peer_granted:
            return
        left = deadline - time.monotonic()
        self._waiting_credit = True
        try:
            if not self._cv.wait_for(
                lambda: self._next_seq < self._window + self._peer_granted,
                max(0.0, min(timeout_s, left)),
            ):
                if left < timeout_s:
                    raise SlowReceiverError(
                        f"{self.name}: the receiver took the frame at under "
                        f"{MIN_SEND_BYTES_PER_S >> 10} KiB/s (its credit came too slowly)"
                        f"{self._drops_note()}"
                    )
                raise PeerTimeoutError(
                    f"{self.name}: the receiver granted no credit for {timeout_s:.0f}s"
                    f"{self._drops_note()}"
                )
        finally:
            self._waiting_credit = False

    def send(self, parts: Sequence[bytes | memoryview], timeout_s: float = 60.0) -> None:
        """Send a frame: chunked from its parts (each chunk copied once, into its message),
        each chunk waiting for credit up to ``timeout_s``, the whole frame no longer than
        ``timeout_s`` plus its size at :data:`MIN_SEND_BYTES_PER_S` (a receiver that grants
        a chunk just before each timeout would hold a large frame's sender for hours).
        Returns once every chunk is made and queued: the loop thread publishes them (the
        caller may reuse ``parts`` at once)."""
        views = frame_views(parts)
        size = sum(v.nbytes for v in views)
        if size > self._max_frame_bytes:
            raise LinkError(
                f"{self.name}: a frame of {size} bytes is over the relay's limit of "
                f"{self._max_frame_bytes}"
            )
        chunks = chunk_frame(views, self._chunk)
        with self._send_lock:
            deadline = time.monotonic() + timeout_s + size / MIN_SEND_BYTES_PER_S
            for index, pieces in enumerate(chunks):
                with self._cv:
                    self._wait_credit(timeout_s, deadline)
                seq = self._next_seq
                payload = self._send_auth.data(seq, index, len(chunks), size, pieces)
                self._retained.append((seq, payload))
                self._outbox.append((seq, payload))
                self._next_seq = seq + 1
                self._active_at = time.monotonic()
                if self._pump_idle:
                    self._pump_idle = False
                    self._io.call_soon(self._wake_pump)

    def send_control(self, kind: bytes, body: bytes = b"") -> None:
        """Publish a handshake message. Not an error while NATS is away: the handshake says
        HELLO again until it is answered, and a late HELLO is answered again."""
        if kind == relaymsg.ACK:
            self._ack_body = body

        async def publish() -> None:
            await self._publish(self._send_auth.message(kind, body))
            with contextlib.suppress(Exception):
                await self._nc.flush(timeout=2)

        self._run(publish(), timeout=10)

    def send_done(self, timeout_s: float = DONE_TIMEOUT_S) -> bool:
        """The end of the run, once every chunk sent has arrived; said again until the peer
        confirms it (True) or ``timeout_s`` passes (False, and logged: the peer's own wait
        times out, this end has nothing more to do)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            if not self._cv.wait_for(lambda: not self._retained, timeout_s):
                log.warning(
                    "%s: %d chunk(s) still unacknowledged after %.0fs; saying DONE anyway",
                    self.name,
                    len(self._retained),
                    timeout_s,
                )
        done = self._send_auth.message(relaymsg.DONE)
        while True:
            with contextlib.suppress(PeerTimeoutError):
                self._run(self._publish(done), timeout=5)
            left = deadline - time.monotonic()
            with self._cv:
                if self._cv.wait_for(lambda: self._done_seen, min(DONE_EVERY_S, max(0, left))):
                    return True
            if left <= 0:
                log.warning("%s: the peer did not confirm DONE within %.0fs", self.name, timeout_s)
                return False

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
                raise self._timed_out(timeout_s)
            item = self._frames.popleft()
            deferred = 0
            if len(self._frames) < self._max_frames:
                deferred, self._deferred_grants = self._deferred_grants, 0
        if deferred:
            self._io.call_soon(self._release_deferred, deferred)
        if isinstance(item, FrameError):
            raise item
        return item

    def _timed_out(self, timeout_s: float) -> LinkError:
        gap = self._gap
        if gap is not None:
            return RelayGapError(
                f"{self.name}: relay gap: expected chunk {gap.expected}, got {gap.got}; "
                f"asked for it {gap.asked} time(s) over {time.monotonic() - gap.since:.0f}s "
                f"and it never came{self._drops_note()}"
            )
        return PeerTimeoutError(
            f"{self.name}: nothing received for {timeout_s:.0f}s{self._drops_note()}"
        )

    def close(self) -> None:
        async def shutdown() -> None:
            if self._ticker is not None:
                self._ticker.cancel()
            if self._outbox and self._drained is not None and self.connected:
                self._drained.clear()  # the pump hands the last chunks to NATS first
                self._wake_pump()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._drained.wait(), 4)
            if self._pump is not None:
                self._pump.cancel()
            if self._nc is not None:
                with contextlib.suppress(Exception):
                    await self._nc.drain()  # flushes what is still buffered

        with contextlib.suppress(Exception):
            self._run(shutdown(), timeout=5)
        self._io.stop()
