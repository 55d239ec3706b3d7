"""ZeroMQ point to point: :class:`ZmqLink`, a DEALER socket per end, optionally with CURVE.

The binding end is the downstream stage (it binds its advertised data address); the
connecting end is the upstream one. A control message from the peer that arrives after the
handshake (a repeated HELLO, DONE) is answered or noted here, never handed to the caller.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

from silentswarm.agent.errors import LinkError, PeerTimeoutError
from silentswarm.agent.pipe.base import Parts
from silentswarm.agent.pipe.handshake import ACK, DONE, HELLO, OK, is_control
from silentswarm.agent.pipe.wire import frame_nbytes

CLOSE_LINGER_MS = 2000  # let the last queued messages (DONE, final frames) leave on close


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
        max_message_bytes: int | None = None,
        max_queued: int | None = None,
    ) -> None:
        """``max_message_bytes``: the largest message part the peer may send (ZeroMQ drops
        the connection of a peer that sends a larger part before it is in memory; it holds a
        message's parts until the last, and caps only each part); None: no limit.
        ``max_queued``: how many messages may wait here for a peer that reads none of them
        before :meth:`send` waits (and times out); None: ZeroMQ's 1,000. Each queued message
        holds its frame's memory (sends do not copy)."""
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
        if max_message_bytes is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if max_queued is not None:
            sock.setsockopt(zmq.SNDHWM, max_queued)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 10000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        # SNDBUF/RCVBUF stay at the OS default on purpose. Setting SO_SNDBUF/SO_RCVBUF locks
        # the buffer (Linux's TCP autotuning, up to net.ipv4.tcp_rmem's maximum, is off) and
        # the kernel caps the request at net.core.rmem_max: on a stock kernel (208 KiB) the
        # 4 MiB this used to ask for became a fixed 416 KiB window, about 8 MB/s at 50 ms of
        # round trip. On loopback (exp/bench/link.py's two processes, 4 MiB frames, 2 shared
        # cores) autotuned buffers beat a fixed 4 MiB in 16 of 21 paired rounds, medians
        # 0.85 against 0.72 of raw TCP in the quietest set.
        self._sock = sock
        try:
            if bind is not None:
                _bind(sock, bind)
            else:
                sock.connect(connect)
        except (LinkError, zmq.ZMQError) as exc:  # an address ZeroMQ will not take
            self.close()
            if isinstance(exc, LinkError):
                raise LinkError(f"{name}: {exc.message}") from None
            verb = "bind" if bind is not None else "connect to"
            raise LinkError(f"{name}: cannot {verb} {bind or connect!r}: {exc}") from None
        self.address = bind or connect
        self.peer_done = False
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)

    def send(self, parts: Sequence[bytes | memoryview], timeout_s: float = 60.0) -> None:
        """Queue a message; PeerTimeoutError when no peer takes it within ``timeout_s``.

        A bound DEALER with no connected peer would block for ever without the timeout.

        Parts of 64 KiB and more (pyzmq's ``copy_threshold``) are sent without a copy: ZeroMQ
        keeps a reference to the caller's buffer until its I/O thread has written it, so the
        buffer stays alive however soon the caller drops it, but its contents must not change
        until then. Every caller hands over a buffer it never writes again: a frame encoded
        from a fresh array (:func:`~silentswarm.agent.pipe.wire.encode_frame` says so), or
        constant control parts. Copying instead costs more than half the link's throughput
        at 1 and 4 MiB (a memcpy under the GIL per frame).
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
        """The next data message; PeerTimeoutError when none comes within ``timeout_s``, also
        while the peer sends control messages without end (each answered or noted)."""
        deadline = time.monotonic() + timeout_s
        while True:
            parts = self.recv_any(max(0.0, deadline - time.monotonic()))
            if parts is None:
                raise PeerTimeoutError(f"{self.name}: nothing received for {timeout_s:.0f}s")
            if not is_control(parts):
                return parts
            self._on_control(bytes(parts[0]))
            if time.monotonic() >= deadline:
                raise PeerTimeoutError(
                    f"{self.name}: only control messages received for {timeout_s:.0f}s"
                )

    def _on_control(self, kind: bytes) -> None:
        if kind == HELLO:  # the peer missed our ACK: answer again
            self.send([ACK, OK], timeout_s=1.0)
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
            if is_control(parts):
                self._on_control(bytes(parts[0]))
            if not self.peer_done and time.monotonic() >= deadline:
                return False  # a peer that keeps sending, but never DONE
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
        try:
            sock.bind(f"tcp://*:{port}")
        except zmq.ZMQError as again:  # e.g. the port still held by a socket just closed
            raise LinkError(f"cannot bind {address} (or tcp://*:{port}): {again}") from None
