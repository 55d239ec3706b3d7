"""Links between adjacent stages: the interface, and the factory that opens one.

Each boundary has two ends. The upstream stage *connects* (it sends activations and receives
gradients); the downstream stage *binds* its advertised data address (it receives
activations and sends gradients). A link is ZeroMQ point to point
(:mod:`silentswarm.agent.pipe.zmq`) or a relay through NATS subjects
(:mod:`silentswarm.agent.pipe.relay`); :func:`connect_downstream` and
:func:`accept_upstream` open every link the transport allows, shake hands over them
(:mod:`silentswarm.agent.pipe.handshake`) and return the one both ends picked, closing the others.

Everything outside this package is injected: addresses, relay subjects, the NATS URL.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from silentswarm.agent.errors import LinkError
from silentswarm.agent.pipe import handshake
from silentswarm.agent.pipe.base import Parts
from silentswarm.agent.pipe.handshake import ACK, DONE, HELLO, HELLO_EVERY_S
from silentswarm.agent.pipe.relay import RelayLink, deserialize_parts, serialize_parts
from silentswarm.agent.pipe.zmq import CLOSE_LINGER_MS, CurveKeys, ZmqLink

__all__ = [
    "ACK",
    "CLOSE_LINGER_MS",
    "DONE",
    "HELLO",
    "HELLO_EVERY_S",
    "CurveKeys",
    "Link",
    "Parts",
    "RelayFactory",
    "RelayLink",
    "TransportKind",
    "ZmqLink",
    "accept_upstream",
    "connect_downstream",
    "deserialize_parts",
    "serialize_parts",
]

log = logging.getLogger(__name__)


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


RelayFactory = Callable[[], RelayLink]


def connect_downstream(
    *,
    name: str,
    transport: TransportKind,
    address: str | None,
    relay: RelayFactory | None,
    timeout_s: float,
    fingerprint: bytes = b"",
    curve: CurveKeys | None = None,
    max_message_bytes: int | None = None,
    max_queued: int | None = None,
) -> Link:
    """The upstream end: say HELLO on every allowed transport until the binder ACKs one.

    The binder decides (see :func:`accept_upstream`), so both ends always agree. HELLO carries
    ``fingerprint`` (what must be equal on both ends, such as the model config); a binder
    with another fingerprint refuses, and this raises HandshakeError. ``max_queued``: see
    :class:`ZmqLink`.
    """
    make_zmq = (
        (
            lambda: ZmqLink(
                name=name,
                connect=address,
                curve=curve,
                max_message_bytes=max_message_bytes,
                max_queued=max_queued,
            )
        )
        if address
        else None
    )
    with _candidates(name, transport, make_zmq, relay) as links:
        links.chosen = handshake.say_hello(
            name, links.zmq, links.relay, timeout_s=timeout_s, fingerprint=fingerprint
        )
    log.info("%s: using %s", name, links.chosen.transport)
    return links.chosen


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
    max_message_bytes: int | None = None,
) -> Link:
    """The downstream end: wait for HELLO; answer ACK on the transport it chose.

    Under ``auto`` a p2p HELLO wins at once; a relay HELLO wins only if no p2p HELLO follows
    within ``p2p_grace_s`` (the connector says HELLO on both at the same time). A HELLO whose
    fingerprint differs from ours is refused on its transport and raises HandshakeError.
    """
    make_zmq = (
        (lambda: ZmqLink(name=name, bind=bind, curve=curve, max_message_bytes=max_message_bytes))
        if bind
        else None
    )
    with _candidates(name, transport, make_zmq, relay) as links:
        links.chosen = handshake.answer_hello(
            name,
            links.zmq,
            links.relay,
            timeout_s=timeout_s,
            p2p_grace_s=p2p_grace_s,
            fingerprint=fingerprint,
        )
    log.info("%s: using %s", name, links.chosen.transport)
    return links.chosen


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
