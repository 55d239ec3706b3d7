"""Relay messages: their layout on a NATS subject, their authentication, and their parsing.

Every message a :class:`~agent.pipe.relay.RelayLink` publishes is::

    kind (1 byte) | tag (16 bytes) | body

The kinds and their bodies:

- ``D``, a data chunk: ``>QIIQ`` (chunk sequence number, index of the chunk within its frame,
  chunks in the frame, the frame's bytes in all), then the chunk's bytes. Every chunk of a
  frame carries the frame's size, so the receiver can allocate the frame once, at its first
  chunk, and check each chunk against it (bounded by the receiver's largest frame);
- ``C``, a credit grant and acknowledgement, and ``R``, a resend request: ``>QQQ`` (serial,
  chunks granted so far in all, chunks received so far in order). ``acked`` is cumulative:
  "I have every chunk below this one", so the sender may forget them; ``R`` also asks the
  sender to send again every chunk from ``acked`` on (the receiver saw a gap, or came back
  from a reconnect). ``granted`` never exceeds ``acked``: a receiver grants only for chunks it
  has;
- ``P``, a probe: ``>QQ`` (serial, the sender's next sequence number). A sender that waits
  (for credit, or for the acknowledgement of what it sent) and has heard nothing for a while
  says how far it got; the receiver answers ``C``, or ``R`` if chunks are missing;
- ``H``, ``A``, ``E``, ``F``: hello, ack (the handshake's fingerprint or answer), done (the
  end of the run; empty) and "done received" (empty), which stops the ``E`` being sent again.

The serial counts every ``C``, ``R`` and ``P`` one end publishes on its subject (one counter
for the three): a message whose serial is not above the last one seen is stale, so each of
them is acted on once, however often it is replayed, and an answer to an old probe never
undoes a newer grant.

The tag authenticates the message with the boundary's relay token, a random secret the
leader makes for every START (``relay_up_token``/``relay_down_token`` in the stage plan), so
only the two placed neighbours know it. It is keyed BLAKE2b with a 16-byte digest (BLAKE2's
own MAC mode; personalisation ``swarm-relay-v1``) of ``subject | 0x00 | kind | covered``
under the token, where ``covered`` is

- for ``D``: the ``>QIIQ`` header and the chunk's length (``>I``), *not* the chunk's bytes;
- for every other kind: the whole body.

Why not the chunk's bytes: a MAC over a 512 KiB chunk runs at about 1 GB/s in CPython
(HMAC-SHA256; keyed BLAKE2b is slower still on large inputs here), once on each end, and
would cost the relay about a third of its throughput. The tag over the header costs ~1 us
a message on each end (the keyed state per subject is made once and copied; HMAC-SHA256
would be ~4 us), well under 1% of the ~2 ms a 512 KiB chunk spends on the loopback relay. What
it gives: a message from anyone without the token is dropped (so is anything malformed),
and since the tag binds the subject (hence job, attempt, boundary and direction), the kind
and the sequence number or serial, a message seen on the bus cannot be replayed elsewhere,
and one replayed on its own subject is stale (its sequence number or serial is behind) and
dropped too. The token itself never travels in a relay message, so a NATS user that may
subscribe to the subject still cannot forge the next chunk. What it leaves to the layers
below: that nobody alters a chunk's bytes on their way. That is TLS to the NATS server and
the server's own permissions (only the two neighbours of an attempt may use its relay
subjects): a NATS user cannot change another user's message in flight.

A link without a token (plans made without a leader: ``swarm-stage --plan`` files,
benchmarks) sends a zero tag and accepts any tag, as the relay did before tokens existed;
malformed messages are still dropped, not fatal.

Pure: the standard library only (hashlib, hmac for the constant-time compare); no NATS.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ACK",
    "CONTROL_KINDS",
    "CREDIT",
    "DATA",
    "DATA_HEAD",
    "DONE",
    "DONE_SEEN",
    "FEEDBACK_HEAD",
    "HELLO",
    "OVERHEAD",
    "PROBE",
    "PROBE_HEAD",
    "RESEND",
    "TAG_BYTES",
    "TOKEN_MAX_BYTES",
    "TOKEN_MIN_BYTES",
    "Control",
    "Credit",
    "DataChunk",
    "DropReason",
    "Probe",
    "RelayAuth",
    "parse_message",
]

DATA, CREDIT, RESEND, PROBE = b"D", b"C", b"R", b"P"
HELLO, ACK, DONE, DONE_SEEN = b"H", b"A", b"E", b"F"
CONTROL_KINDS = frozenset((HELLO, ACK, DONE, DONE_SEEN))
TAG_BYTES = 16
TOKEN_MIN_BYTES = 16
TOKEN_MAX_BYTES = 64  # BLAKE2b's largest key
_PERSON = b"swarm-relay-v1"
# chunk seq, chunk index within the frame, chunks in the frame, the frame's bytes
DATA_HEAD = struct.Struct(">QIIQ")
FEEDBACK_HEAD = struct.Struct(">QQQ")  # serial, chunks granted in all, chunks received in order
PROBE_HEAD = struct.Struct(">QQ")  # serial, the sender's next chunk seq
_LENGTH = struct.Struct(">I")
OVERHEAD = 1 + TAG_BYTES + DATA_HEAD.size  # what a data message adds to its chunk
_NO_TAG = bytes(TAG_BYTES)


class DropReason(enum.StrEnum):
    """Why a relay message was dropped (the keys of ``RelayLink.dropped_by_reason``)."""

    UNKNOWN_KIND = "unknown_kind"  # empty, or a first byte that is no kind of ours
    TRUNCATED = "truncated"  # shorter than its kind's header
    MALFORMED = "malformed"  # a body of the wrong size, or fields that contradict each other
    BAD_TAG = "bad_tag"  # no valid tag: not from the boundary's peer (or a different token)
    STALE = "stale"  # authentic but already seen: a replayed or resent chunk, an old serial
    GAP = "gap"  # an authentic chunk ahead of the one expected (one was lost): asked again
    BAD_SEQ = "bad_seq"  # names chunks never sent (an ack, a resend request, a probe)
    OVER_CREDIT = "over_credit"  # a chunk past the credit granted: its sender ignores it
    SLOW_CONSUMER = "slow_consumer"  # shed by nats-py: more pending than the link allows


@dataclass(frozen=True, slots=True)
class DataChunk:
    seq: int
    index: int
    count: int
    frame_bytes: int  # the whole frame's size, in every chunk of it
    chunk: memoryview


@dataclass(frozen=True, slots=True)
class Credit:
    """``C`` (``resend`` false) or ``R`` (true): the receiver's state, as of ``serial``."""

    serial: int
    granted: int  # chunks granted so far, in all
    acked: int  # every chunk below this one has arrived
    resend: bool = False  # R: send every chunk from ``acked`` on again


@dataclass(frozen=True, slots=True)
class Probe:
    serial: int
    next_seq: int  # the sender has sent every chunk below this one


@dataclass(frozen=True, slots=True)
class Control:
    kind: bytes  # HELLO, ACK, DONE or DONE_SEEN
    body: bytes


Message = DataChunk | Credit | Probe | Control


class RelayAuth:
    """Tags and checks the messages of one subject with a boundary's token (or none)."""

    def __init__(self, token: bytes | None, subject: str) -> None:
        self._keyed = None
        if token is not None:
            if not TOKEN_MIN_BYTES <= len(token) <= TOKEN_MAX_BYTES:
                raise ValueError(
                    f"a relay token needs {TOKEN_MIN_BYTES} to {TOKEN_MAX_BYTES} bytes, "
                    f"got {len(token)}"
                )
            # The keyed state after the subject, made once: each tag copies it.
            self._keyed = hashlib.blake2b(
                subject.encode() + b"\x00", digest_size=TAG_BYTES, key=token, person=_PERSON
            )

    @property
    def enabled(self) -> bool:
        return self._keyed is not None

    def tag(self, kind: bytes, covered: bytes) -> bytes:
        if self._keyed is None:
            return _NO_TAG
        mac = self._keyed.copy()
        mac.update(kind + covered)
        return mac.digest()

    def check(self, tag: bytes | memoryview, kind: bytes, covered: bytes) -> bool:
        """Constant time; always true without a token."""
        return self._keyed is None or hmac.compare_digest(tag, self.tag(kind, covered))

    # --- sealing --------------------------------------------------------------------------

    def data(
        self,
        seq: int,
        index: int,
        count: int,
        frame_bytes: int,
        chunk: bytes | memoryview | Sequence[bytes | memoryview],
    ) -> bytes:
        """A data message; ``chunk`` may be given as pieces (slices of a frame's parts),
        which are copied once, into the message."""
        pieces = [chunk] if isinstance(chunk, bytes | bytearray | memoryview) else list(chunk)
        size = sum(memoryview(p).nbytes for p in pieces)
        head = DATA_HEAD.pack(seq, index, count, frame_bytes)
        tag = self.tag(DATA, head + _LENGTH.pack(size))
        return b"".join((DATA, tag, head, *pieces))

    def credit(self, serial: int, granted: int, acked: int, *, resend: bool = False) -> bytes:
        body = FEEDBACK_HEAD.pack(serial, granted, acked)
        return self.message(RESEND if resend else CREDIT, body)

    def probe(self, serial: int, next_seq: int) -> bytes:
        return self.message(PROBE, PROBE_HEAD.pack(serial, next_seq))

    def message(self, kind: bytes, body: bytes = b"") -> bytes:
        """A message other than data: the tag covers the whole body."""
        return kind + self.tag(kind, body) + body


# A handshake message's body: a fingerprint (32 bytes), OK, or a refusal (about 200 bytes).
MAX_HANDSHAKE_BODY = 1024
# Each kind's body size, least and most (None: a data chunk's, bounded by the frame's limit).
# Checked before the tag: a message of the wrong size costs no copy and no MAC.
_BODY: dict[bytes, tuple[int, int | None]] = {
    DATA: (DATA_HEAD.size, None),
    CREDIT: (FEEDBACK_HEAD.size, FEEDBACK_HEAD.size),
    RESEND: (FEEDBACK_HEAD.size, FEEDBACK_HEAD.size),
    PROBE: (PROBE_HEAD.size, PROBE_HEAD.size),
    HELLO: (0, MAX_HANDSHAKE_BODY),
    ACK: (0, MAX_HANDSHAKE_BODY),
    DONE: (0, 0),
    DONE_SEEN: (0, 0),
}


def parse_message(data: bytes, auth: RelayAuth) -> Message | DropReason:
    """A message as received on ``auth``'s subject, or why it must be dropped.

    Never raises on any input. A data chunk's bytes are a view of ``data`` (no copy).
    """
    kind = bytes(data[:1])
    sizes = _BODY.get(kind)
    if sizes is None:
        return DropReason.UNKNOWN_KIND
    least, most = sizes
    if len(data) < 1 + TAG_BYTES + least:
        return DropReason.TRUNCATED
    if most is not None and len(data) > 1 + TAG_BYTES + most:
        return DropReason.MALFORMED
    view = memoryview(data)
    tag, body = view[1 : 1 + TAG_BYTES], view[1 + TAG_BYTES :]
    if kind == DATA:
        head = bytes(body[: DATA_HEAD.size])
        chunk = body[DATA_HEAD.size :]
        if not auth.check(tag, kind, head + _LENGTH.pack(chunk.nbytes)):
            return DropReason.BAD_TAG
        seq, index, count, frame_bytes = DATA_HEAD.unpack(head)
        if not index < count or chunk.nbytes > frame_bytes:
            return DropReason.MALFORMED
        return DataChunk(seq=seq, index=index, count=count, frame_bytes=frame_bytes, chunk=chunk)
    covered = bytes(body)
    if not auth.check(tag, kind, covered):
        return DropReason.BAD_TAG
    if kind in (CREDIT, RESEND):
        serial, granted, acked = FEEDBACK_HEAD.unpack(covered)
        if granted > acked:
            return DropReason.MALFORMED
        return Credit(serial=serial, granted=granted, acked=acked, resend=kind == RESEND)
    if kind == PROBE:
        serial, next_seq = PROBE_HEAD.unpack(covered)
        return Probe(serial=serial, next_seq=next_seq)
    return Control(kind=kind, body=covered)
