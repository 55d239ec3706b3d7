"""Links between adjacent stages: ZeroMQ point to point, or a relay through NATS subjects.

Each boundary has two ends. The upstream stage *connects* (it sends activations and receives
gradients); the downstream stage *binds* its advertised data address (it receives
activations and sends gradients). Before any frame, the ends shake hands: the connector
says HELLO until the binder answers ACK, which is also how ``auto`` picks a transport.

Everything outside this package is injected: addresses, relay subjects, the NATS URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import zmq
from zmq.auth.thread import ThreadAuthenticator

from agent.pipe import relaymsg
from agent.pipe.wire import frame_nbytes

log = logging.getLogger(__name__)

Parts = list[bytes | memoryview]
HELLO = b"\x00swarm-hello"
ACK = b"\x00swarm-ack"
DONE = b"\x00swarm-done"  # the downstream end finished the run: the upstream may close
_OK = b"ok"
CLOSE_LINGER_MS = 2000  # let the last queued messages (DONE, final frames) leave on close
HELLO_EVERY_S = 0.25


class LinkError(Exception):
    """The link cannot deliver: the message names the boundary and the peer."""


class PeerTimeoutError(LinkError):
    pass


class RelayGapError(LinkError):
    pass


class TransportKind(enum.StrEnum):
    AUTO = "auto"
    P2P = "p2p"
    TUNNEL = "tunnel"


class Link(Protocol):
    name: str
    transport: str
    bytes_sent: int
    bytes_received: int

    def send(self, parts: Sequence[bytes | memoryview], timeout_s: float = 60.0) -> None: ...

    def recv(self, timeout_s: float) -> Parts: ...

    def send_done(self) -> None: ...

    def wait_done(self, timeout_s: float) -> bool: ...

    def close(self) -> None: ...


def _is_control(parts: Sequence[bytes | memoryview]) -> bool:
    return len(parts) == 2 and bytes(parts[0]) in (HELLO, ACK, DONE)


# --- ZeroMQ ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CurveKeys:
    """CURVE for one end of a boundary (Z85 text): its own keypair and the one peer key.

    The binding end is the CURVE server and accepts only the client whose public key is
    ``peer_public`` (a ZAP handler checks it); the connecting end is the client and trusts
    only a server whose public key is ``peer_public``.
    """

    public: str
    secret: str
    peer_public: str


class _OnlyThisPeer:
    """ZAP credentials: exactly one client key."""

    def __init__(self, allowed: str) -> None:
        self.allowed = allowed.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.allowed


class ZmqLink:
    """A DEALER socket: it reconnects by itself, and ZMTP heartbeats drop dead peers, so a
    replaced peer can take over the boundary. With ``curve`` the traffic is encrypted and
    only the placed neighbour can connect."""

    def __init__(
        self,
        *,
        name: str,
        bind: str | None = None,
        connect: str | None = None,
        context: zmq.Context | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        if (bind is None) == (connect is None):
            raise ValueError("give exactly one of bind or connect")
        self.name = name
        self.transport = "p2p"
        self.bytes_sent = 0
        self.bytes_received = 0
        self._auth = None
        if curve is not None and bind is not None:
            # ZAP is per context: a context of its own keeps this check to this socket.
            context = zmq.Context()
            self._auth = ThreadAuthenticator(context)
            self._auth.start()
            self._auth.configure_curve_callback("*", _OnlyThisPeer(curve.peer_public))
        self._own_context = curve is not None and bind is not None
        self._ctx = context or zmq.Context.instance()
        sock = self._ctx.socket(zmq.DEALER)
        if curve is not None:
            sock.curve_publickey = curve.public.encode()
            sock.curve_secretkey = curve.secret.encode()
            if bind is not None:
                sock.curve_server = True
            else:
                sock.curve_serverkey = curve.peer_public.encode()
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 10000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.setsockopt(zmq.SNDBUF, 4 * 1024 * 1024)
        sock.setsockopt(zmq.RCVBUF, 4 * 1024 * 1024)
        if bind is not None:
            _bind(sock, bind)
        else:
            sock.connect(connect)
        self.address = bind or connect
        self.peer_done = False
        self._sock = sock
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)

    def send(self, parts: Sequence[bytes | memoryview], timeout_s: float = 60.0) -> None:
        """Queue a message; PeerTimeoutError when no peer takes it within ``timeout_s``.

        A bound DEALER with no connected peer would block for ever without the timeout.
        """
        self._sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        try:
            self._sock.send_multipart(list(parts), copy=False)
        except zmq.Again:
            raise PeerTimeoutError(
                f"{self.name}: no peer took a message for {timeout_s:.0f}s"
            ) from None
        self.bytes_sent += frame_nbytes(parts)

    def poll(self, timeout_s: float) -> bool:
        return bool(self._poller.poll(max(0, int(timeout_s * 1000))))

    def recv_any(self, timeout_s: float) -> Parts | None:
        """The next message, control messages included; None on timeout."""
        if not self.poll(timeout_s):
            return None
        frames = self._sock.recv_multipart(copy=False)
        parts: Parts = [f.buffer for f in frames]
        self.bytes_received += frame_nbytes(parts)
        return parts

    def recv(self, timeout_s: float) -> Parts:
        deadline = time.monotonic() + timeout_s
        while True:
            parts = self.recv_any(max(0.0, deadline - time.monotonic()))
            if parts is None:
                raise PeerTimeoutError(f"{self.name}: nothing received for {timeout_s:.0f}s")
            if not _is_control(parts):
                return parts
            self._on_control(bytes(parts[0]))

    def _on_control(self, kind: bytes) -> None:
        if kind == HELLO:  # the peer missed our ACK: answer again
            self.send([ACK, _OK], timeout_s=1.0)
        elif kind == DONE:
            self.peer_done = True

    def send_done(self) -> None:
        self.send([DONE, b""], timeout_s=5.0)

    def wait_done(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.peer_done:
            parts = self.recv_any(max(0.0, deadline - time.monotonic()))
            if parts is None:
                return False
            if _is_control(parts):
                self._on_control(bytes(parts[0]))
        return True

    def close(self) -> None:
        self._sock.close(linger=CLOSE_LINGER_MS)
        if self._auth is not None:
            self._auth.stop()
        if self._own_context:
            self._ctx.term()


def _bind(sock: zmq.Socket, address: str) -> None:
    """Bind the advertised address; behind NAT it is not local, so fall back to all interfaces."""
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        if exc.errno != zmq.EADDRNOTAVAIL:
            raise LinkError(f"cannot bind {address}: {exc}") from None
        port = address.rsplit(":", 1)[1]
        sock.bind(f"tcp://*:{port}")


# --- NATS relay -----------------------------------------------------------------------------

_HELLO, _ACK, _DONE = relaymsg.HELLO, relaymsg.ACK, relaymsg.DONE
CONTROL_BACKLOG = 64  # control messages kept for the handshake; older ones are dropped
DROP_LOG_EVERY_S = 5.0


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


class RelayLink:
    """Frames over two NATS subjects, chunked below the server's max_payload.

    Chunks carry a sequence number: a gap (a chunk lost to a reconnect or a slow-consumer
    drop) fails the receive instead of corrupting a tensor. The receiver grants credits, so
    at most ``window`` chunks are in flight and a fast sender cannot exhaust memory. Grants
    pause while ``max_frames`` whole frames wait unread and resume as the reader takes them,
    so a reader that keeps reading never stalls a sender, whatever the frame size.

    With ``token`` (the boundary's relay secret) every message is tagged and checked (see
    :mod:`agent.pipe.relaymsg`). A message that fails the check, or is malformed, or repeats
    a chunk or a grant already seen, is dropped and counted in ``dropped`` and
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
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"relay-{name}")
        self._thread.daemon = True
        self._thread.start()
        self._credit_event: asyncio.Event | None = None
        self._nc = None
        try:
            self._run(self._connect(nats), timeout=connect_timeout_s)
        except BaseException:
            self._stop_loop()
            raise

    # --- thread bridging ------------------------------------------------------------------

    def _run(self, coro, timeout: float):
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
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
            if message.kind == _DONE:
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
            self._loop.create_task(self._nc.publish(self.send_subject, payload))

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
        self.send_control(_DONE)

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
            self._loop.call_soon_threadsafe(self._grant, deferred)
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
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()


# --- handshakes: who talks to whom, and how -------------------------------------------------

RelayFactory = Callable[[], RelayLink]


class HandshakeError(LinkError):
    """The two ends cannot work together (for example their training data differ)."""


def _open_relay(
    name: str, transport: TransportKind, relay: RelayFactory | None
) -> RelayLink | None:
    """The relay end, if the transport allows one. Under ``auto`` an unreachable NATS only
    means the direct path must do; under ``tunnel`` it is an error."""
    if transport == TransportKind.P2P or relay is None:
        return None
    try:
        return relay()
    except Exception as exc:
        if transport == TransportKind.TUNNEL:
            raise LinkError(f"{name}: relay unavailable: {exc}") from None
        log.warning("%s: relay unavailable (%s); trying the direct path only", name, exc)
        return None


@dataclass
class _Candidates:
    zmq: ZmqLink | None = None
    relay: RelayLink | None = None
    chosen: Link | None = None


@contextlib.contextmanager
def _candidates(
    name: str,
    transport: TransportKind,
    make_zmq: Callable[[], ZmqLink] | None,
    relay: RelayFactory | None,
) -> Iterator[_Candidates]:
    """The links a handshake may pick from; every one not chosen is closed on the way out."""
    links = _Candidates()
    try:
        if transport != TransportKind.TUNNEL and make_zmq is not None:
            links.zmq = make_zmq()
        links.relay = _open_relay(name, transport, relay)
        if links.zmq is None and links.relay is None:
            raise LinkError(f"{name}: transport {transport} has no link to use")
        yield links
    finally:
        for link in (links.zmq, links.relay):
            if link is not None and link is not links.chosen:
                link.close()


def connect_downstream(
    *,
    name: str,
    transport: TransportKind,
    address: str | None,
    relay: RelayFactory | None,
    timeout_s: float,
    fingerprint: bytes = b"",
    curve: CurveKeys | None = None,
) -> Link:
    """The upstream end: say HELLO on every allowed transport until the binder ACKs one.

    The binder decides (see :func:`accept_upstream`), so both ends always agree. HELLO carries
    ``fingerprint`` (what must be equal on both ends, such as the training data); a binder
    with another fingerprint refuses, and this raises HandshakeError.
    """
    make_zmq = (lambda: ZmqLink(name=name, connect=address, curve=curve)) if address else None
    with _candidates(name, transport, make_zmq, relay) as links:
        deadline = time.monotonic() + timeout_s
        while links.chosen is None:
            if time.monotonic() >= deadline:
                raise PeerTimeoutError(
                    f"{name}: no ACK from the downstream peer within {timeout_s:.0f}s "
                    f"(tried {', '.join(_tried(links.zmq, links.relay))})"
                )
            if links.zmq is not None:
                with contextlib.suppress(PeerTimeoutError):
                    links.zmq.send([HELLO, fingerprint], timeout_s=HELLO_EVERY_S)
            if links.relay is not None:
                links.relay.send_control(_HELLO, fingerprint)
            links.chosen = _await_ack(name, links.zmq, links.relay, HELLO_EVERY_S)
    log.info("%s: using %s", name, links.chosen.transport)
    return links.chosen


def _await_ack(
    name: str, zlink: ZmqLink | None, rlink: RelayLink | None, window_s: float
) -> Link | None:
    end = time.monotonic() + window_s
    while (left := end - time.monotonic()) > 0:
        if zlink is not None:
            parts = zlink.recv_any(min(left, 0.05) if rlink else left)
            if parts is not None and _is_control(parts) and bytes(parts[0]) == ACK:
                _check_ack(name, bytes(parts[1]))
                return zlink
        if rlink is not None:
            control = rlink.recv_control(min(end - time.monotonic(), 0.05) if zlink else left)
            if control is not None and control[:1] == _ACK:
                _check_ack(name, control[1:])
                return rlink
    return None


def _check_ack(name: str, body: bytes) -> None:
    if body.startswith(b"!"):
        raise HandshakeError(f"{name}: the downstream peer refused: {body[1:].decode()}")


def _tried(zlink: ZmqLink | None, rlink: RelayLink | None) -> list[str]:
    out = []
    if zlink is not None:
        out.append(f"p2p {zlink.address}")
    if rlink is not None:
        out.append(f"relay {rlink.send_subject}")
    return out


def accept_upstream(
    *,
    name: str,
    transport: TransportKind,
    bind: str | None,
    relay: RelayFactory | None,
    timeout_s: float,
    p2p_grace_s: float,
    fingerprint: bytes = b"",
    curve: CurveKeys | None = None,
) -> Link:
    """The downstream end: wait for HELLO; answer ACK on the transport it chose.

    Under ``auto`` a p2p HELLO wins at once; a relay HELLO wins only if no p2p HELLO follows
    within ``p2p_grace_s`` (the connector says HELLO on both at the same time). A HELLO whose
    fingerprint differs from ours is refused on its transport and raises HandshakeError.
    """
    make_zmq = (lambda: ZmqLink(name=name, bind=bind, curve=curve)) if bind else None
    with _candidates(name, transport, make_zmq, relay) as links:
        zlink, rlink = links.zmq, links.relay
        deadline = time.monotonic() + timeout_s
        relay_hello_at: float | None = None
        while links.chosen is None:
            if time.monotonic() >= deadline:
                raise PeerTimeoutError(
                    f"{name}: no HELLO from the upstream peer within {timeout_s:.0f}s "
                    f"(listening on {', '.join(_tried(zlink, rlink))})"
                )
            if zlink is not None:
                parts = zlink.recv_any(0.05)
                if parts is not None and _is_control(parts) and bytes(parts[0]) == HELLO:
                    refusal = _refusal(fingerprint, bytes(parts[1]))
                    zlink.send([ACK, refusal or _OK], timeout_s=5.0)
                    if refusal:
                        raise HandshakeError(f"{name}: {refusal[1:].decode()}")
                    links.chosen = zlink
                    break
            if rlink is not None:
                control = rlink.recv_control(0.0 if zlink else 0.05)
                if control is not None and control[:1] == _HELLO and relay_hello_at is None:
                    refusal = _refusal(fingerprint, control[1:])
                    if refusal:
                        rlink.send_control(_ACK, refusal)
                        raise HandshakeError(f"{name}: {refusal[1:].decode()}")
                    relay_hello_at = time.monotonic()
                grace = 0.0 if zlink is None else p2p_grace_s
                if relay_hello_at is not None and time.monotonic() - relay_hello_at >= grace:
                    rlink.send_control(_ACK, _OK)
                    links.chosen = rlink
    log.info("%s: using %s", name, links.chosen.transport)
    return links.chosen


def _refusal(ours: bytes, theirs: bytes) -> bytes | None:
    if ours == theirs:
        return None
    return (
        b"!fingerprints differ (upstream "
        + theirs[:16].hex().encode()
        + b", downstream "
        + ours[:16].hex().encode()
        + b"): the two stages do not train on the same data and model"
    )
