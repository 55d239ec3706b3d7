"""Every NATS subject, each bound to the one Struct it carries.

All subjects are per fellow (or per job and fellow) so that NATS permissions can pin each
fellow to its own. The prefix (default ``swarm``) comes from settings.
"""

from __future__ import annotations

import functools
import re
import string
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from silentswarm import protocol as p
from silentswarm.errors import ProtocolError

T = TypeVar("T")
TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ENCODER = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class Topic(Generic[T]):
    """One subject family: its template after the prefix, its payload, its reply if any."""

    template: str
    schema: Any
    reply: Any = None

    @functools.cached_property
    def fields(self) -> tuple[str, ...]:
        return tuple(f for _, f, _, _ in string.Formatter().parse(self.template) if f)

    def subject(self, prefix: str, **tokens: str | int) -> str:
        """The concrete subject; every token must be a plain NATS token (no dots, no wildcards)."""
        missing = set(self.fields) - set(tokens)
        if missing:
            raise ValueError(f"{self.template}: missing {sorted(missing)}")
        for name, value in tokens.items():
            if not TOKEN_RE.match(str(value)):
                raise ProtocolError(f"{name}={value!r} is not a valid subject token")
        return f"{prefix}.{self.template.format(**tokens)}"

    def wildcard(self, prefix: str, **tokens: str | int) -> str:
        """A subscription subject; tokens not given become ``*``."""
        filled = {f: str(tokens.get(f, "*")) for f in self.fields}
        return f"{prefix}.{self.template.format(**filled)}"

    def parse(self, prefix: str, subject: str) -> dict[str, str]:
        """The tokens of a concrete subject; ProtocolError when it is not of this family."""
        parts = subject.split(".")
        template = [prefix, *self.template.split(".")]
        if len(parts) != len(template):
            raise ProtocolError(f"subject {subject!r} does not match {prefix}.{self.template}")
        out: dict[str, str] = {}
        for part, pattern in zip(parts, template, strict=True):
            if pattern.startswith("{"):
                out[pattern.strip("{}")] = part
            elif part != pattern:
                raise ProtocolError(f"subject {subject!r} does not match {prefix}.{self.template}")
        return out

    def decode(self, data: bytes) -> T:
        return _decode(self.schema, data)

    def decode_reply(self, data: bytes) -> Any:
        if self.reply is None:
            raise ProtocolError(f"{self.template} has no reply")
        return _decode(self.reply, data)


def encode(message: msgspec.Struct) -> bytes:
    return _ENCODER.encode(message)


@functools.cache
def _decoder(schema: Any) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(schema)


def _decode(schema: Any, data: bytes) -> Any:
    if schema is bytes:
        return data
    try:
        return _decoder(schema).decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"cannot decode {_schema_name(schema)}: {exc}") from None


def _schema_name(schema: Any) -> str:
    return getattr(schema, "__name__", None) or str(schema)


REGISTER: Topic[p.RegisterMessage] = Topic("register.{fellow}", p.RegisterMessage, p.RegisterReply)
HEARTBEAT: Topic[p.Heartbeat] = Topic("hb.{fellow}", p.Heartbeat)
SIGNAL: Topic[p.Signal] = Topic("sig.{fellow}", p.Signal, p.SignalAck)
LOG: Topic[p.LogBatch] = Topic("log.{fellow}", p.LogBatch)
PROGRESS: Topic[p.Progress] = Topic("progress.{job}.{fellow}", p.Progress)
SHARD: Topic[p.ShardChunk] = Topic("shard.{job}.{fellow}", p.ShardChunk, p.ShardAck)
# Relay frames are opaque bytes to everyone but agent/pipe, which owns their layout.
RELAY: Topic[bytes] = Topic("relay.{job}.{attempt}.{boundary}.{direction}", bytes)


def relay_link(boundary: int, replica: int = 0) -> str:
    """The ``boundary`` token of a pipeline boundary's relay subjects: the boundary index for
    replica 0 (the subjects of a job without replicas), ``r<replica>-<boundary>`` for the
    others."""
    return str(boundary) if replica == 0 else f"r{replica}-{boundary}"


def sync_link(segment: int, sender: int) -> str:
    """The ``boundary`` token of the relay subjects of a replicas' ring link: the link of
    the ring of the segment whose first layer is ``segment`` (:mod:`silentswarm.rings`)
    from replica ``sender`` to the next one."""
    return f"g{segment}-{sender}"


ALL_TOPICS: tuple[Topic[Any], ...] = (REGISTER, HEARTBEAT, SIGNAL, LOG, PROGRESS, SHARD, RELAY)


# The leader's own reply inbox, outside ``_INBOX``: a fellow may read ``_INBOX.<its id>.>``,
# and the leader's default inbox ``_INBOX.<nuid>`` shows in every signal's reply subject, so
# a fellow that got itself named after that nuid would read every answer the leader gets
# (fellows' acks, JetStream's, the records in its KV store).
LEADER_INBOX = "_SWARM_LEADER_INBOX"


def inbox_prefix(fellow_id: str) -> str:
    """Each fellow gets its own reply inbox, so permissions can pin it there."""
    if not TOKEN_RE.match(fellow_id):
        raise ProtocolError(f"fellow id {fellow_id!r} is not a valid subject token")
    return f"_INBOX.{fellow_id}"


def reply_allowed(reply: str, fellow_id: str) -> bool:
    """Whether a responder may answer a fellow's request on ``reply``.

    A request's reply subject is chosen by its sender, and the leader's user may publish
    anywhere: answering an arbitrary reply subject would let a fellow make the leader write
    into a KV bucket, purge a stream or reach another fellow's inbox (a confused deputy). So
    the leader answers only under the sender's own inbox, where the sender's NATS user is
    the only one that can listen.
    """
    if not TOKEN_RE.match(fellow_id):
        return False
    inbox = f"_INBOX.{fellow_id}."
    return (
        reply.startswith(inbox)
        and len(reply) <= 256
        and all(TOKEN_RE.match(part) for part in reply[len(inbox) :].split("."))
    )
