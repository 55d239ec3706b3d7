"""The handshake: who talks to whom, and over which transport.

Before any frame, the two ends of a boundary shake hands over every transport they may use:
the connector (upstream) says HELLO until the binder (downstream) answers ACK on the one it
picks, so both ends always agree. HELLO carries a fingerprint (what must be equal on both
ends: the job, the model config, the tokenizer and the training schedule; not the data, which
only stage 0 reads); a binder with another one answers ACK with a refusal (``!`` and the
reason) and both ends raise HandshakeError.

On ZeroMQ the control messages are two-part messages ``[HELLO|ACK|DONE, body]``; on the
relay they are relay messages of their own kind (:mod:`silentswarm.agent.pipe.relaymsg`). The links
are opened by :mod:`silentswarm.agent.pipe.link`; here they are only talked over.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from silentswarm.agent.errors import HandshakeError, PeerTimeoutError
from silentswarm.agent.pipe import relaymsg

if TYPE_CHECKING:
    from silentswarm.agent.pipe.link import Link
    from silentswarm.agent.pipe.relay import RelayLink
    from silentswarm.agent.pipe.zmq import ZmqLink

HELLO = b"\x00swarm-hello"
ACK = b"\x00swarm-ack"
DONE = b"\x00swarm-done"  # the downstream end finished the run: the upstream may close
OK = b"ok"
HELLO_EVERY_S = 0.25
REFUSAL_CHARS = 1024  # of a peer's refusal, what the error says


def is_control(parts: Sequence[bytes | memoryview]) -> bool:
    """Whether a ZeroMQ message is a control message (HELLO, ACK, DONE), not a frame."""
    return len(parts) == 2 and bytes(parts[0]) in (HELLO, ACK, DONE)


def say_hello(
    name: str,
    zlink: ZmqLink | None,
    rlink: RelayLink | None,
    *,
    timeout_s: float,
    fingerprint: bytes,
) -> Link:
    """The connector's side: HELLO on every link given until the binder ACKs one; that one.

    PeerTimeoutError when no ACK comes within ``timeout_s``; HandshakeError on a refusal.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if time.monotonic() >= deadline:
            raise PeerTimeoutError(
                f"{name}: no ACK from the downstream peer within {timeout_s:.0f}s "
                f"(tried {', '.join(_tried(zlink, rlink))})"
            )
        if zlink is not None:
            with contextlib.suppress(PeerTimeoutError):
                zlink.send([HELLO, fingerprint], timeout_s=HELLO_EVERY_S)
        if rlink is not None:
            rlink.send_control(relaymsg.HELLO, fingerprint)
        chosen = _await_ack(name, zlink, rlink, HELLO_EVERY_S)
        if chosen is not None:
            return chosen


def answer_hello(
    name: str,
    zlink: ZmqLink | None,
    rlink: RelayLink | None,
    *,
    timeout_s: float,
    p2p_grace_s: float,
    fingerprint: bytes,
) -> Link:
    """The binder's side: wait for HELLO; answer ACK on the link it chose; that link.

    With both links a p2p HELLO wins at once; a relay HELLO wins only if no p2p HELLO
    follows within ``p2p_grace_s`` (the connector says HELLO on both at the same time). A
    HELLO whose fingerprint differs from ours is refused on its transport and raises
    HandshakeError.
    """
    deadline = time.monotonic() + timeout_s
    relay_hello_at: float | None = None
    while True:
        if time.monotonic() >= deadline:
            raise PeerTimeoutError(
                f"{name}: no HELLO from the upstream peer within {timeout_s:.0f}s "
                f"(listening on {', '.join(_tried(zlink, rlink))})"
            )
        if zlink is not None:
            parts = zlink.recv_any(0.05)
            if parts is not None and is_control(parts) and bytes(parts[0]) == HELLO:
                refusal = _refusal(fingerprint, bytes(parts[1]))
                zlink.send([ACK, refusal or OK], timeout_s=5.0)
                if refusal:
                    raise HandshakeError(f"{name}: {refusal[1:].decode()}")
                return zlink
        if rlink is not None:
            control = rlink.recv_control(0.0 if zlink else 0.05)
            if control is not None and control[:1] == relaymsg.HELLO and relay_hello_at is None:
                refusal = _refusal(fingerprint, control[1:])
                if refusal:
                    rlink.send_control(relaymsg.ACK, refusal)
                    raise HandshakeError(f"{name}: {refusal[1:].decode()}")
                relay_hello_at = time.monotonic()
            grace = 0.0 if zlink is None else p2p_grace_s
            if relay_hello_at is not None and time.monotonic() - relay_hello_at >= grace:
                rlink.send_control(relaymsg.ACK, OK)
                return rlink


def _await_ack(
    name: str, zlink: ZmqLink | None, rlink: RelayLink | None, window_s: float
) -> Link | None:
    end = time.monotonic() + window_s
    while (left := end - time.monotonic()) > 0:
        if zlink is not None:
            parts = zlink.recv_any(min(left, 0.05) if rlink else left)
            if parts is not None and is_control(parts) and bytes(parts[0]) == ACK:
                _check_ack(name, bytes(parts[1]))
                return zlink
        if rlink is not None:
            control = rlink.recv_control(min(end - time.monotonic(), 0.05) if zlink else left)
            if control is not None and control[:1] == relaymsg.ACK:
                _check_ack(name, control[1:])
                return rlink
    return None


def _check_ack(name: str, body: bytes) -> None:
    if body.startswith(b"!"):
        why = body[1:REFUSAL_CHARS].decode(errors="replace")  # a stranger's words
        raise HandshakeError(f"{name}: the downstream peer refused: {why!r}")


def _tried(zlink: ZmqLink | None, rlink: RelayLink | None) -> list[str]:
    out = []
    if zlink is not None:
        out.append(f"p2p {zlink.address}")
    if rlink is not None:
        out.append(f"relay {rlink.send_subject}")
    return out


def _refusal(ours: bytes, theirs: bytes) -> bytes | None:
    if ours == theirs:
        return None
    return (
        b"!fingerprints differ (upstream "
        + theirs[:16].hex().encode()
        + b", downstream "
        + ours[:16].hex().encode()
        + b"): the two stages do not share the job, model config, tokenizer and training "
        b"schedule"
    )
