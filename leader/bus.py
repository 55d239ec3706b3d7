"""The leader's NATS edge: decodes what fellows send and hands it to the registry.

Malformed messages are logged with their subject (rate-limited), counted, and dropped; they
never reach the registry and never take the leader down. Replies go only to the sender's own
inbox (:func:`silentswarm.subjects.reply_allowed`): a reply subject a fellow chose elsewhere is
refused, counted and logged, never answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from silentswarm import subjects as topics
from silentswarm.errors import ErrorCode, ProtocolError
from silentswarm.leader.admission import RateLimiter
from silentswarm.leader.registry import FellowRegistry
from silentswarm.natsconn import NatsAccess, connect_forever
from silentswarm.protocol import DeregisterRequest, RegisterReply, RegisterRequest
from silentswarm.text import loggable

log = logging.getLogger(__name__)
HEARTBEATS_PER_YIELD = 32
# A flood must not flood the leader's log: per subject, one warning per interval.
DROP_LOG_EVERY_S = 5.0
DROP_LOG_SUBJECTS = 1024
# Per fellow, before decoding: an honest one heartbeats once an interval (1 s by default;
# the limit is at least 5 per interval) and registers on (re)connect; a flood past these is
# dropped and counted (heartbeat_rate, register_rate).
HEARTBEATS_PER_S, HEARTBEAT_BURST = 10.0, 50.0
REGISTERS_PER_S, REGISTER_BURST = 2.0, 20.0


class LeaderBus:
    def __init__(self, *, nats: NatsAccess, prefix: str, registry: FellowRegistry) -> None:
        self.access = nats
        self.url = nats.url
        self.prefix = prefix
        self.registry = registry
        self.nc: Client | None = None
        self.dropped: Counter[str] = Counter()
        self._connect_task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()
        self._heartbeats = 0
        beats_per_s = max(HEARTBEATS_PER_S, 5 / registry.heartbeat_interval_s)
        self.heartbeat_limit = RateLimiter(beats_per_s, HEARTBEAT_BURST)
        self.register_limit = RateLimiter(REGISTERS_PER_S, REGISTER_BURST)
        # subject -> (monotonic time of its last warning, drops not logged since)
        self._drop_log: OrderedDict[str, tuple[float, int]] = OrderedDict()

    async def start(self) -> None:
        """Connect in the background: the HTTP API serves (and says so) while NATS is down."""
        self._connect_task = asyncio.create_task(self._connect(), name="leader-nats-connect")

    async def _connect(self) -> None:
        self.nc = await connect_forever(
            self.access,
            name="swarm-leader",
            inbox_prefix=topics.LEADER_INBOX,
            on_handler_error=self._handler_failed,
            on_disconnected=self._on_disconnected,
            on_reconnected=self._on_reconnected,
        )
        await self.nc.subscribe(topics.REGISTER.wildcard(self.prefix), cb=self._on_register)
        await self.nc.subscribe(topics.HEARTBEAT.wildcard(self.prefix), cb=self._on_heartbeat)
        await self.nc.flush()
        self.registry.bus_connected()
        self.connected.set()

    def _handler_failed(self, exc: Exception) -> None:
        """A handler raised (a bug): its message is lost, and counted as dropped."""
        self.dropped["handler_error"] += 1

    async def close(self) -> None:
        if self._connect_task is not None and not self._connect_task.done():
            self._connect_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._connect_task
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.drain()
        self.registry.bus_disconnected()
        self.connected.clear()

    @property
    def is_connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def _on_disconnected(self) -> None:
        self.registry.bus_disconnected()

    async def _on_reconnected(self) -> None:
        self.registry.bus_connected()

    # --- handlers --------------------------------------------------------------------------

    def decode_job_message(self, msg: Msg, topic: topics.Topic[Any]) -> Any | None:
        """The payload of a ``<kind>.<job>.<fellow>`` message whose ids match its subject;
        None (logged, counted, dropped) otherwise."""
        try:
            tokens = topic.parse(self.prefix, msg.subject)
            payload = topic.decode(msg.data)
        except ProtocolError as exc:
            self.drop(msg, str(exc))
            return None
        if (payload.job_id, payload.fellow_id) != (tokens["job"], tokens["fellow"]):
            self.drop(msg, "job or fellow id does not match the subject")
            return None
        return payload

    def drop(self, msg: Msg, reason: str, *, kind: str | None = None) -> None:
        """Count a refused message (by ``kind``: the subject's, unless given) and log it,
        at most once per subject every DROP_LOG_EVERY_S."""
        if kind is None:
            kind = msg.subject.split(".")[1] if "." in msg.subject else msg.subject
        self.dropped[kind] += 1
        now = time.monotonic()
        last, quiet = self._drop_log.pop(msg.subject, (float("-inf"), 0))
        if now - last < DROP_LOG_EVERY_S:
            self._drop_log[msg.subject] = (last, quiet + 1)
        else:
            more = f" ({quiet} more not logged)" if quiet else ""
            log.warning(
                "dropped message on %s: %s%s", loggable(msg.subject, 200), loggable(reason), more
            )
            self._drop_log[msg.subject] = (now, 0)
        while len(self._drop_log) > DROP_LOG_SUBJECTS:
            self._drop_log.popitem(last=False)

    async def respond(self, msg: Msg, sender: str, payload: bytes) -> bool:
        """Answer ``sender``'s request, but only in its own inbox; False when not sent."""
        if not msg.reply:
            return False
        if not topics.reply_allowed(msg.reply, sender):
            self.drop(
                msg, f"reply subject {msg.reply[:120]!r} is not {sender}'s inbox", kind="reply"
            )
            return False
        try:
            await msg.respond(payload)
        except Exception as exc:  # the requester resends on timeout
            log.debug("reply on %s lost: %s", msg.subject, exc)
            return False
        return True

    def _sender(self, topic: topics.Topic, msg: Msg) -> str | None:
        try:
            return topic.parse(self.prefix, msg.subject)["fellow"]
        except ProtocolError as exc:
            self.drop(msg, str(exc))
            return None

    async def _on_register(self, msg: Msg) -> None:
        sender = self._sender(topics.REGISTER, msg)
        if sender is None:
            return
        if not self.register_limit.allow(sender):
            self.drop(msg, "over the fellow's registration rate", kind="register_rate")
            return
        try:
            req = topics.REGISTER.decode(msg.data)
        except ProtocolError as exc:
            self.drop(msg, str(exc))
            reply = RegisterReply(accepted=False, code=exc.code, message=str(exc))
            await self._reply(msg, sender, reply)
            return
        claimed = req.fellow.fellow_id if isinstance(req, RegisterRequest) else req.fellow_id
        if claimed != sender:
            reason = f"fellow id {claimed!r} does not match its subject {msg.subject!r}"
            self.drop(msg, reason)
            reply = RegisterReply(accepted=False, code=ErrorCode.SUBJECT_MISMATCH, message=reason)
            await self._reply(msg, sender, reply)
            return
        if not msg.reply or not topics.reply_allowed(msg.reply, sender):
            # Registering changes the registry: only a request that can hear its answer may.
            await self._reply(msg, sender, RegisterReply(accepted=False))
            return
        if isinstance(req, DeregisterRequest):
            reply = self.registry.deregister(req)
        else:
            reply = self.registry.register(req)
        await self._reply(msg, sender, reply)

    async def _on_heartbeat(self, msg: Msg) -> None:
        sender = self._sender(topics.HEARTBEAT, msg)
        if sender is None:
            return
        if not self.heartbeat_limit.allow(sender):
            self.drop(msg, "over the fellow's heartbeat rate", kind="heartbeat_rate")
            return
        try:
            hb = topics.HEARTBEAT.decode(msg.data)
        except ProtocolError as exc:
            self.drop(msg, str(exc))
            return
        if hb.fellow.fellow_id != sender:
            self.drop(msg, f"fellow id {hb.fellow.fellow_id!r} does not match its subject")
            return
        self.registry.heartbeat(hb)
        # nats-py runs a subscription's backlog without yielding while its queue is not
        # empty: with thousands of fellows that starves the HTTP API. Yield now and then.
        self._heartbeats += 1
        if self._heartbeats % HEARTBEATS_PER_YIELD == 0:
            await asyncio.sleep(0)

    async def _reply(self, msg: Msg, sender: str, reply: RegisterReply) -> None:
        reply.leader_version = reply.leader_version or self.registry.leader_version
        await self.respond(msg, sender, topics.encode(reply))
