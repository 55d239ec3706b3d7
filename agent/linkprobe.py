"""One end of a PROBE: the link to another fellow, measured while neither runs a stage.

The leader pairs two idle fellows on different hosts whose link no job has measured yet
(:mod:`silentswarm.leader.linkprobes`) and sends each a PROBE
(:class:`silentswarm.types.signals.ProbeArgs`). The binding end binds its data address (the
port its stages bind, so the path measured is the one a boundary would take, NAT and port
forwards included), the other connects to the address the leader gave it; both ends speak
CURVE with keys the leader made for this probe only, shake hands with the probe's id as the
fingerprint, and run the boundary probe (:mod:`silentswarm.agent.pipe.probe`: round trip,
then bursts each way), then the binder's own pings. Each end reports what it measured itself
(its round trip, the rate it received at) beside the rate its peer says it received at; the
leader keeps the slowest rate and the longest round trip of the two reports, so neither end
can make the link look better than the other measured it.

Blocking (ZeroMQ and the probe are synchronous): the agent runs it in a thread, and starts no
stage on the fellow until it has ended.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from silentswarm.agent.errors import FrameError, LinkError, PeerTimeoutError
from silentswarm.agent.pipe.base import Parts
from silentswarm.agent.pipe.link import (
    CurveKeys,
    Link,
    TransportKind,
    accept_upstream,
    connect_downstream,
)
from silentswarm.agent.pipe.probe import (
    ProbeLink,
    answer_pings,
    downstream_half,
    measure_as_upstream,
    ping_round,
)
from silentswarm.protocol import LinkProbeReport
from silentswarm.types.links import LinkStats
from silentswarm.types.signals import ProbeArgs

log = logging.getLogger(__name__)

# The probe's messages are the boundary probe's: bursts of at most 8 MiB, a few control
# messages. A larger message from the peer is a stranger's, and ZeroMQ drops it.
MAX_MESSAGE_BYTES = 9 * 2**20


def run_probe(args: ProbeArgs, *, bind: str | None) -> LinkProbeReport:
    """Measure the link to ``args.peer``; ``bind``: where this fellow binds (its data bind
    address) when ``args.bind``. Never raises for the link's or the peer's faults: they are
    the report's ``message``."""
    started = time.monotonic()
    link = None
    try:
        link = open_link(args, bind=bind)
        timed = _Deadline(link, started + args.timeout_s)
        if args.bind:
            half = downstream_half(timed, boundary=0, step=0, timeout_s=args.timeout_s)
            # What this end measured itself: the forward rate it timed, the round trip of
            # its own pings. The backward rate is the peer's word (the leader keeps the
            # slower of every rate either end reports).
            stats = LinkStats(
                boundary=0,
                step=0,
                rtt_ms=ping_round(timed, args.timeout_s),
                fwd_mbit_s=half.own_fwd_mbit_s,
                bwd_mbit_s=half.peer.bwd_mbit_s,
            )
        else:
            stats = measure_as_upstream(timed, boundary=0, step=0, timeout_s=args.timeout_s)
            answer_pings(timed, args.timeout_s)  # the binder's own round trip
    except (LinkError, FrameError) as exc:
        log.warning("link probe %s with %s failed: %s", args.probe_id, args.peer, exc)
        return _failed(args, exc.message)
    finally:
        if link is not None:
            link.close()
    log.info(
        "link probe %s with %s: %.1f Mbit/s forward, %.1f back, %.2f ms round trip (%.1f s)",
        args.probe_id,
        args.peer,
        stats.fwd_mbit_s,
        stats.bwd_mbit_s,
        stats.rtt_ms,
        time.monotonic() - started,
    )
    return LinkProbeReport(probe_id=args.probe_id, peer=args.peer, ok=True, stats=stats)


def open_link(args: ProbeArgs, *, bind: str | None) -> Link:
    """The probe's link, after the handshake: bound at ``bind`` and taken from the peer
    (``args.bind``), or connected to ``args.address``; CURVE with the probe's keys, the probe
    id as the fingerprint, ZeroMQ only. LinkError where there is nothing to bind or connect
    to, or no peer shakes hands within ``args.timeout_s``."""
    name = f"probe-{args.probe_id[:8]}"
    curve = CurveKeys(
        public=args.curve.public, secret=args.curve.secret, peer_public=args.curve.peer_public
    )
    fingerprint = args.probe_id.encode()
    if args.bind:
        if bind is None:
            raise LinkError("this fellow has no data address to bind")
        return accept_upstream(
            name=name,
            transport=TransportKind.P2P,
            bind=bind,
            relay=None,
            timeout_s=args.timeout_s,
            p2p_grace_s=0.0,
            fingerprint=fingerprint,
            curve=curve,
            max_message_bytes=MAX_MESSAGE_BYTES,
        )
    if args.address is None:
        raise LinkError("no address to connect to")
    return connect_downstream(
        name=name,
        transport=TransportKind.P2P,
        address=args.address,
        relay=None,
        timeout_s=args.timeout_s,
        fingerprint=fingerprint,
        curve=curve,
        max_message_bytes=MAX_MESSAGE_BYTES,
    )


class _Deadline:
    """``link`` with every wait cut at ``deadline`` (monotonic): a peer that answers each
    message just before its timeout cannot stretch the probe, which holds the data port the
    fellow's next stage binds, past the time the leader gave it."""

    def __init__(self, link: ProbeLink, deadline: float) -> None:
        self.link = link
        self.name = link.name
        self.deadline = deadline

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise PeerTimeoutError(f"{self.name}: the probe ran out of time")
        return left

    def send(self, parts: Sequence[bytes | memoryview], timeout_s: float = 60.0) -> None:
        self.link.send(parts, timeout_s=min(timeout_s, self._left()))

    def recv(self, timeout_s: float) -> Parts:
        return self.link.recv(min(timeout_s, self._left()))


def _failed(args: ProbeArgs, message: str) -> LinkProbeReport:
    return LinkProbeReport(probe_id=args.probe_id, peer=args.peer, ok=False, message=message[:512])


__all__ = ["MAX_MESSAGE_BYTES", "open_link", "run_probe"]
