"""Relay messages: their layout on a NATS subject, their authentication, and their parsing.

Every message a :class:`~agent.pipe.relay.RelayLink` publishes is::

    kind (1 byte) | tag (16 bytes) | body

``kind`` is ``D`` (a data chunk), ``C`` (a credit grant), ``H`` (hello), ``A`` (ack) or ``E``
(the end of the run, "done"). The bodies:

- ``D``: ``>QII`` (chunk sequence number, index of the chunk within its frame, chunks in the
  frame), then the chunk's bytes;
- ``C``: ``>Q``, the *cumulative* number of chunks the receiver has granted so far (a grant
  received twice, or late, grants nothing more);
- ``H``, ``A``, ``E``: free bytes (the handshake's fingerprint or answer; empty for ``E``).

The tag authenticates the message with the boundary's relay token, a random secret the
leader makes for every START (``relay_up_token``/``relay_down_token`` in the stage plan), so
only the two placed neighbours know it. It is keyed BLAKE2b with a 16-byte digest (BLAKE2's
own MAC mode; personalisation ``swarm-relay-v1``) of ``subject | 0x00 | kind | covered``
under the token, where ``covered`` is

- for ``D``: the ``>QII`` header and the chunk's length (``>I``), *not* the chunk's bytes;
- for every other kind: the whole body.

Why not the chunk's bytes: a MAC over a 512 KiB chunk runs at about 1 GB/s in CPython
(HMAC-SHA256; keyed BLAKE2b is slower still on large inputs here), once on each end, and
would cost the relay about a third of its throughput. The tag over the header costs ~1 us
a message on each end (the keyed state per subject is made once and copied; HMAC-SHA256
would be ~4 us), well under 1% of the ~2 ms a 512 KiB chunk spends on the loopback relay. What
it gives: a message from anyone without the token is dropped (so is anything malformed),
and since the tag binds the subject (hence job, attempt, boundary and direction), the kind
and the sequence number, a message seen on the bus cannot be replayed elsewhere, and one
replayed on its own subject is stale (its sequence number is behind) and dropped too. The
token itself never travels in a relay message, so a NATS user that may subscribe to the
subject still cannot forge the next chunk. What it leaves to the layers below: that nobody
alters a chunk's bytes on their way. That is TLS to the NATS server and the server's own
permissions (only the two neighbours of an attempt may use its relay subjects): a NATS user
cannot change another user's message in flight.

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
from dataclasses import dataclass

__all__ = [
    "ACK",
    "CONTROL_KINDS",
    "CREDIT",
    "DATA",
    "DATA_HEAD",
    "DONE",
    "HELLO",
    "OVERHEAD",
    "TAG_BYTES",
    "TOKEN_MAX_BYTES",
    "TOKEN_MIN_BYTES",
    "Control",
    "Credit",
    "DataChunk",
    "DropReason",
    "RelayAuth",
    "parse_message",
]

DATA, CREDIT, HELLO, ACK, DONE = b"D", b"C", b"H", b"A", b"E"
CONTROL_KINDS = frozenset((HELLO, ACK, DONE))
TAG_BYTES = 16
TOKEN_MIN_BYTES = 16
TOKEN_MAX_BYTES = 64  # BLAKE2b's largest key
_PERSON = b"swarm-relay-v1"
DATA_HEAD = struct.Struct(">QII")  # chunk seq, chunk index within the frame, chunks in frame
CREDIT_HEAD = struct.Struct(">Q")  # chunks granted so far, in all
_LENGTH = struct.Struct(">I")
OVERHEAD = 1 + TAG_BYTES + DATA_HEAD.size  # what a data message adds to its chunk
_NO_TAG = bytes(TAG_BYTES)


class DropReason(enum.StrEnum):
    """Why a relay message was dropped (the keys of ``RelayLink.dropped_by_reason``)."""

    UNKNOWN_KIND = "unknown_kind"  # empty, or a first byte that is no kind of ours
    TRUNCATED = "truncated"  # shorter than its kind's header
    MALFORMED = "malformed"  # a credit grant whose body is not 8 bytes
    BAD_TAG = "bad_tag"  # no valid tag: not from the boundary's peer (or a different token)
    STALE = "stale"  # authentic but already seen: a replayed chunk or credit grant


@dataclass(frozen=True, slots=True)
class DataChunk:
    seq: int
    index: int
    count: int
    chunk: memoryview


@dataclass(frozen=True, slots=True)
class Credit:
    total: int  # chunks granted so far, in all


@dataclass(frozen=True, slots=True)
class Control:
    kind: bytes  # HELLO, ACK or DONE
    body: bytes


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

    def data(self, seq: int, index: int, count: int, chunk: bytes | memoryview) -> bytes:
        head = DATA_HEAD.pack(seq, index, count)
        tag = self.tag(DATA, head + _LENGTH.pack(memoryview(chunk).nbytes))
        return b"".join((DATA, tag, head, chunk))

    def credit(self, total: int) -> bytes:
        return self.message(CREDIT, CREDIT_HEAD.pack(total))

    def message(self, kind: bytes, body: bytes = b"") -> bytes:
        """A credit or control message: the tag covers the whole body."""
        return kind + self.tag(kind, body) + body


_MIN_BODY = {DATA: DATA_HEAD.size, CREDIT: CREDIT_HEAD.size, HELLO: 0, ACK: 0, DONE: 0}


def parse_message(data: bytes, auth: RelayAuth) -> DataChunk | Credit | Control | DropReason:
    """A message as received on ``auth``'s subject, or why it must be dropped.

    Never raises on any input. A data chunk's bytes are a view of ``data`` (no copy).
    """
    kind = bytes(data[:1])
    need = _MIN_BODY.get(kind)
    if need is None:
        return DropReason.UNKNOWN_KIND
    if len(data) < 1 + TAG_BYTES + need:
        return DropReason.TRUNCATED
    view = memoryview(data)
    tag, body = view[1 : 1 + TAG_BYTES], view[1 + TAG_BYTES :]
    if kind == DATA:
        head = bytes(body[: DATA_HEAD.size])
        chunk = body[DATA_HEAD.size :]
        if not auth.check(tag, kind, head + _LENGTH.pack(chunk.nbytes)):
            return DropReason.BAD_TAG
        seq, index, count = DATA_HEAD.unpack(head)
        return DataChunk(seq=seq, index=index, count=count, chunk=chunk)
    covered = bytes(body)
    if not auth.check(tag, kind, covered):
        return DropReason.BAD_TAG
    if kind == CREDIT:
        if len(covered) != CREDIT_HEAD.size:
            return DropReason.MALFORMED
        return Credit(total=CREDIT_HEAD.unpack(covered)[0])
    return Control(kind=kind, body=covered)
