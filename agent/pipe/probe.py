"""Measuring a boundary's link: round trip and bandwidth each way, over the link itself.

Both ends run their half at the same point of their streams (after the handshake, and
between training steps when the stages recalibrate), so probe messages never mix with frames.
A probe message is a two-part message ``[CALIB, msgpack body]`` (a tagged union, below) or a
piece of a burst, ``[CALIB_DATA, zeros]``. Over ZeroMQ and the relay alike:

1. **Round trip**: the upstream end sends :data:`PINGS` pings, one at a time, each with a
   random number; the downstream end echoes each at once; the median round trip counts.
2. **Bandwidth, forward then backward**: the receiving end says Go with a random number; the
   sending end sends bursts of growing size (from :data:`FIRST_BURST`, at least doubling,
   sized to last about :data:`BURST_TARGET_S` at the last rate, at most :data:`MAX_BURST`),
   each carrying the number the receiver last gave (Go, then each Rate) and cut in pieces of
   :data:`CHUNK` bytes; the receiving end times each from the arrival of its first piece to
   its last and answers the rate with the next number; the rounds stop when a rate is less than
   :data:`RAMP` times the one before (TCP's window has opened) or after :data:`MAX_ROUNDS`. The
   best round that lasted at least :data:`MIN_MEASURE_S` counts (:func:`link_rate`). A cold
   connection starts small (slow start), hence the ramp.
3. The upstream end sends what it measured so that both ends hold the same numbers.

A peer's probe message is checked like a frame: a wrong kind, size, count, order or number
raises FrameError (the attempt fails as it would on a bad frame); the sizes the peer asks for
are bounded by :data:`MAX_BURST`. The numbers keep a peer from answering a ping before it has
it or sending a burst before the receiver asked (both would time as a faster link than the
path is), which an idle link probe between strangers relies on (:mod:`silentswarm.agent.linkprobe`).
"""

from __future__ import annotations

import math
import secrets
import statistics
import time
from collections.abc import Sequence
from typing import Annotated, Protocol, TypeVar

import msgspec

from silentswarm.agent.errors import FrameError
from silentswarm.agent.pipe.base import Parts
from silentswarm.types.links import LinkStats, Tuning

CALIB = b"\x00swarm-calib"
CALIB_DATA = b"\x00swarm-calib-data"
PINGS = 5
CHUNK = 16 * 1024  # small pieces: enough arrival times for a robust rate on a slow path
FIRST_BURST = 256 * 1024
MAX_BURST = 8 * 1024 * 1024
BURST_TARGET_S = 0.2
MAX_ROUNDS = 5
RAMP = 1.2
MIN_MEASURE_S = 0.1  # a shorter burst only sizes the next: a few pieces' jitter is its rate
CLUMP_S = 0.0005  # pieces read this close together were read in one go
MAX_RATE_MBIT_S = 10_000_000.0  # LinkStats' bound: a burst faster than the clock can tell
_ZEROS = bytes(CHUNK)

Seq = Annotated[int, msgspec.Meta(ge=0, le=1024)]
# Random numbers an answer must echo (pings) or a burst must carry (the receiver's go-ahead):
# a peer cannot answer, or send, before it has the message that asked.
MAX_NONCE = 2**31 - 1
Nonce = Annotated[int, msgspec.Meta(ge=0, le=MAX_NONCE)]
# One stage's (micro-batch count, seconds of work per step) points.
Busy = Annotated[
    list[
        tuple[
            Annotated[int, msgspec.Meta(ge=1, le=2**16)],
            Annotated[float, msgspec.Meta(ge=0.0, le=1e6)],
        ]
    ],
    msgspec.Meta(max_length=64),
]
Links = Annotated[list[LinkStats], msgspec.Meta(max_length=4096)]


class _Msg(msgspec.Struct, frozen=True, tag_field="kind"):
    pass


class Ping(_Msg, tag="ping"):
    seq: Nonce


class Pong(_Msg, tag="pong"):
    seq: Nonce


class Go(_Msg, tag="go"):
    """The receiving end is ready for the first burst, which must carry ``nonce``."""

    nonce: Nonce


class Burst(_Msg, tag="burst"):
    """``nbytes`` in ``chunks`` pieces of :data:`CHUNK` bytes (the last one the rest) follow;
    0 bytes: the rounds are over. ``nonce``: the one the receiver's last Go or Rate asked
    for, so no burst leaves before the receiver is ready to time it (pieces queued ahead
    would be read together, which times as an instant link)."""

    round: Seq
    nbytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_BURST)]
    chunks: Annotated[int, msgspec.Meta(ge=0, le=MAX_BURST // CHUNK)]
    nonce: Nonce = 0


class Rate(_Msg, tag="rate"):
    """The rate a burst arrived at, and the nonce the next burst must carry."""

    round: Seq
    mbit_s: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_RATE_MBIT_S)]
    nonce: Nonce = 0


class Measured(_Msg, tag="measured"):
    stats: LinkStats


class ChainForward(_Msg, tag="chain"):
    """Down the chain: every boundary measured so far and each stage's work per step at
    the micro-batch counts it has run."""

    links: Links
    busy: Annotated[list[Busy], msgspec.Meta(max_length=4097)]


class ChainBack(_Msg, tag="tuned"):
    """Up the chain: the last stage's decision, every boundary with its codecs."""

    links: Links
    tuning: Tuning


class ProbeLink(Protocol):
    """What a probe needs of a link (:class:`silentswarm.agent.pipe.link.Link` has it)."""

    name: str

    def send(self, parts: Sequence[bytes | memoryview], timeout_s: float = 60.0) -> None: ...

    def recv(self, timeout_s: float) -> Parts: ...


ProbeMsg = Ping | Pong | Go | Burst | Rate | Measured | ChainForward | ChainBack
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ProbeMsg)
M = TypeVar("M", bound=_Msg)


def send_msg(link: ProbeLink, msg: ProbeMsg, timeout_s: float) -> None:
    link.send([CALIB, _encoder.encode(msg)], timeout_s=timeout_s)


def recv_msg(link: ProbeLink, kind: type[M], timeout_s: float) -> M:
    """The next message, which must be a probe message of ``kind``; FrameError otherwise."""
    parts = link.recv(timeout_s)
    if len(parts) != 2 or bytes(parts[0]) != CALIB:
        raise FrameError(f"{link.name}: expected a link probe message ({kind.__name__.lower()})")
    try:
        msg = _decoder.decode(parts[1])
    except msgspec.DecodeError as exc:
        raise FrameError(f"{link.name}: bad link probe message: {exc}") from None
    if not isinstance(msg, kind):
        raise FrameError(f"{link.name}: expected {kind.__name__}, got {type(msg).__name__}")
    return msg


def measure_as_upstream(
    link: ProbeLink, *, boundary: int, step: int, timeout_s: float
) -> LinkStats:
    """The connecting end's half: pings, bursts forward, bursts back; both ends' result."""
    rtts = round_trips(link, nonces(PINGS), timeout_s)
    fwd = send_bursts(link, timeout_s)
    bwd = receive_bursts(link, timeout_s)
    stats = LinkStats(
        boundary=boundary,
        step=step,
        rtt_ms=round(statistics.median(rtts) * 1000, 3),
        fwd_mbit_s=round(fwd, 3),
        bwd_mbit_s=round(bwd, 3),
    )
    send_msg(link, Measured(stats), timeout_s)
    return stats


def measure_as_downstream(
    link: ProbeLink, *, boundary: int, step: int, timeout_s: float
) -> LinkStats:
    """The binding end's half: answer the pings, time the bursts forward, send bursts back;
    the figures the upstream end sends, which both ends then hold."""
    return downstream_half(link, boundary=boundary, step=step, timeout_s=timeout_s).peer


class DownstreamHalf(msgspec.Struct, frozen=True, kw_only=True):
    """What the binding end has after its half: the upstream end's figures (``peer``), and
    the forward rate it timed itself, which no peer can make look faster than the path is
    (pieces cannot arrive faster than the link carries them, and a burst is at least
    :data:`FIRST_BURST`)."""

    peer: LinkStats
    own_fwd_mbit_s: float


def downstream_half(
    link: ProbeLink, *, boundary: int, step: int, timeout_s: float
) -> DownstreamHalf:
    """:func:`measure_as_downstream`, keeping this end's own forward rate too."""
    answer_pings(link, timeout_s)
    fwd = receive_bursts(link, timeout_s)
    send_bursts(link, timeout_s)
    stats = recv_msg(link, Measured, timeout_s).stats
    if (stats.boundary, stats.step) != (boundary, step):
        raise FrameError(
            f"{link.name}: the peer measured boundary {stats.boundary} at step {stats.step}, "
            f"not boundary {boundary} at step {step}"
        )
    return DownstreamHalf(peer=stats, own_fwd_mbit_s=round(fwd, 3))


def ping_round(link: ProbeLink, timeout_s: float) -> float:
    """The median round trip of :data:`PINGS` pings this end sends, ms. Each carries a random
    number the answer must echo, so a peer cannot answer before it has the ping (answers
    sent ahead fail the round): a round trip no shorter than the path's."""
    return round(statistics.median(round_trips(link, nonces(PINGS), timeout_s)) * 1000, 3)


def nonces(n: int) -> list[int]:
    return [secrets.randbelow(MAX_NONCE + 1) for _ in range(n)]


def round_trips(link: ProbeLink, seqs: Sequence[int], timeout_s: float) -> list[float]:
    """Ping with each of ``seqs`` in turn, each answered before the next; the seconds each
    took. FrameError for an answer that echoes another number."""
    rtts = []
    for seq in seqs:
        started = time.perf_counter()
        send_msg(link, Ping(seq), timeout_s)
        pong = recv_msg(link, Pong, timeout_s)
        if pong.seq != seq:
            raise FrameError(f"{link.name}: pong {pong.seq} answers no ping (expected {seq})")
        rtts.append(time.perf_counter() - started)
    return rtts


def answer_pings(link: ProbeLink, timeout_s: float) -> None:
    """The other end of :func:`ping_round`: answer each ping with its number."""
    for _ in range(PINGS):
        ping = recv_msg(link, Ping, timeout_s)
        send_msg(link, Pong(ping.seq), timeout_s)


def send_bursts(link: ProbeLink, timeout_s: float) -> float:
    """Send growing bursts until the peer's rate stops rising; the link's rate, Mbit/s."""
    nonce = recv_msg(link, Go, timeout_s).nonce
    size, rates, sizes = FIRST_BURST, [], []
    for round_ in range(MAX_ROUNDS):
        chunks = math.ceil(size / CHUNK)
        send_msg(link, Burst(round_, size, chunks, nonce), timeout_s)
        left = size
        for _ in range(chunks):
            piece = min(CHUNK, left)
            link.send([CALIB_DATA, memoryview(_ZEROS)[:piece]], timeout_s=timeout_s)
            left -= piece
        rate = recv_msg(link, Rate, timeout_s)
        if rate.round != round_:
            raise FrameError(f"{link.name}: rate of round {rate.round}, expected {round_}")
        nonce = rate.nonce
        rates.append(rate.mbit_s)
        sizes.append(size)
        if len(rates) >= 2 and rates[-1] < RAMP * rates[-2]:
            break
        wanted = rate.mbit_s * 1e6 / 8 * BURST_TARGET_S
        size = min(MAX_BURST, max(2 * size, math.ceil(wanted / CHUNK) * CHUNK))
    send_msg(link, Burst(len(rates), 0, 0), timeout_s)
    return link_rate(list(zip(sizes, rates, strict=True)))


def link_rate(rounds: Sequence[tuple[int, float]]) -> float:
    """The link's rate, Mbit/s, from its bursts' ``(bytes, Mbit/s)``: the best burst that
    lasted :data:`MIN_MEASURE_S` or more, or the best of all where none did (a fast link).

    Both ends apply it to the same rounds, so they agree. A short burst's rate rests on a few
    pieces, and a few milliseconds of a loaded reader's jitter move it by a tenth: on a
    40 Mbit/s emulated path under load the 256 KiB first burst read 33-40 Mbit/s and the
    ~1 MiB one after 36.7-39.6; the best of all rounds keeps such an outlier (CI once read
    44.8)."""
    if not rounds:
        return 0.0
    long = [
        rate for nbytes, rate in rounds if rate > 0 and nbytes * 8 / (rate * 1e6) >= MIN_MEASURE_S
    ]
    return max(long or [rate for _, rate in rounds])


def burst_rate(arrivals: Sequence[float], sizes: Sequence[int]) -> float:
    """The rate a burst's pieces arrived at, Mbit/s, from each piece's arrival time and size.

    The clock starts at the piece a quarter of the way in: what came before it passed a
    shaper's bucket at the line's speed, or a cold window's slow start. Pieces read within
    :data:`CLUMP_S` of that one were read in one go (a reader that stalled finds a backlog) and
    start the clock with it; the rate is the bytes that arrived after over the time they took.
    A stall further on only delays pieces whose backlog is then read at once, which leaves the
    span from there to the last piece as it was (one just before the last piece can only make
    the link look slower); the span from the first piece to the last would have counted a
    stall at the start as speed. Pieces that arrived together (a fast link read
    in a batch) give :data:`MAX_RATE_MBIT_S`.
    """
    if not arrivals:
        return MAX_RATE_MBIT_S
    start = quarter = len(arrivals) // 4
    while start + 1 < len(arrivals) and arrivals[start + 1] - arrivals[quarter] <= CLUMP_S:
        start += 1
    elapsed = arrivals[-1] - arrivals[start]
    if elapsed <= 0:
        return MAX_RATE_MBIT_S
    return min(MAX_RATE_MBIT_S, sum(sizes[start + 1 :]) * 8 / elapsed / 1e6)


def receive_bursts(link: ProbeLink, timeout_s: float) -> float:
    """Time the peer's bursts and answer each one's rate; the link's rate, Mbit/s. Each
    burst must carry the nonce this end sent for it and come in the pieces it announced,
    each :data:`CHUNK` bytes but the last: a peer can neither send a burst ahead of time nor
    make its pieces small, which would both time as a faster link than the path is."""
    rounds: list[tuple[int, float]] = []
    nonce = nonces(1)[0]
    send_msg(link, Go(nonce), timeout_s)
    for round_ in range(MAX_ROUNDS + 1):
        burst = recv_msg(link, Burst, timeout_s)
        if burst.round != round_:
            raise FrameError(f"{link.name}: burst round {burst.round}, expected {round_}")
        if burst.nbytes == 0:
            return link_rate(rounds)
        if burst.nbytes < FIRST_BURST:  # every burst send_bursts sends is at least this
            raise FrameError(f"{link.name}: a probe burst of {burst.nbytes} bytes")
        if burst.nonce != nonce:
            raise FrameError(f"{link.name}: a probe burst this end did not ask for (nonce)")
        if burst.chunks != math.ceil(burst.nbytes / CHUNK):
            raise FrameError(
                f"{link.name}: a burst of {burst.nbytes} bytes in {burst.chunks} pieces"
            )
        arrivals: list[float] = []
        sizes: list[int] = []
        for index in range(burst.chunks):
            parts = link.recv(timeout_s)
            now = time.perf_counter()
            if len(parts) != 2 or bytes(parts[0]) != CALIB_DATA:
                raise FrameError(f"{link.name}: expected piece {index} of a probe burst")
            size = memoryview(parts[1]).nbytes
            expected = min(CHUNK, burst.nbytes - index * CHUNK)
            if size != expected:
                raise FrameError(
                    f"{link.name}: probe piece {index} of {size} bytes, expected {expected}"
                )
            arrivals.append(now)
            sizes.append(size)
        mbit_s = round(burst_rate(arrivals, sizes), 3)
        rounds.append((burst.nbytes, mbit_s))
        nonce = nonces(1)[0]
        send_msg(link, Rate(round_, mbit_s, nonce), timeout_s)
    raise FrameError(f"{link.name}: more than {MAX_ROUNDS} probe bursts")


__all__ = [
    "CALIB",
    "CALIB_DATA",
    "ChainBack",
    "ChainForward",
    "DownstreamHalf",
    "Go",
    "answer_pings",
    "burst_rate",
    "downstream_half",
    "link_rate",
    "measure_as_downstream",
    "measure_as_upstream",
    "nonces",
    "ping_round",
    "recv_msg",
    "round_trips",
    "send_msg",
]
