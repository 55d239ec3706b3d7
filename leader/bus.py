"""The leader's NATS edge: decodes what fellows send and hands it to the registry.

Malformed messages are logged with their subject, counted, and dropped; they never reach
the registry and never take the leader down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from leader.registry import WorkerRegistry
from swarm import subjects as topics
from swarm.errors import ProtocolError
from swarm.natsconn import NatsAccess, connect_forever
from swarm.protocol import DeregisterRequest, RegisterReply, RegisterRequest

log = logging.getLogger(__name__)
HEARTBEATS_PER_YIELD = 32


class LeaderBus:
    def __init__(self, *, nats: NatsAccess, prefix: str, registry: WorkerRegistry) -> None:
        self.access = nats
        self.url = nats.url
        self.prefix = prefix
        self.registry = registry
        self.nc: Client | None = None
        self.dropped: Counter[str] = Counter()
        self._connect_task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()
        self._heartbeats = 0

    async def start(self) -> None:
        """Connect in the background: the HTTP API serves (and says so) while NATS is down."""
        self._connect_task = asyncio.create_task(self._connect(), name="leader-nats-connect")

    async def _connect(self) -> None:
        self.nc = await connect_forever(
            self.access,
            name="swarm-leader",
            on_disconnected=self._on_disconnected,
            on_reconnected=self._on_reconnected,
        )
        await self.nc.subscribe(topics.REGISTER.wildcard(self.prefix), cb=self._on_register)
        await self.nc.subscribe(topics.HEARTBEAT.wildcard(self.prefix), cb=self._on_heartbeat)
        await self.nc.flush()
        self.registry.bus_connected()
        self.connected.set()

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

    def drop(self, msg: Msg, reason: str) -> None:
        kind = msg.subject.split(".")[1] if "." in msg.subject else msg.subject
        self.dropped[kind] += 1
        log.warning("dropped message on %s: %s", msg.subject, reason)

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
        try:
            req = topics.REGISTER.decode(msg.data)
        except ProtocolError as exc:
            self.drop(msg, str(exc))
            await self._reply(msg, RegisterReply(accepted=False, code=exc.code, message=str(exc)))
            return
        claimed = req.fellow.fellow_id if isinstance(req, RegisterRequest) else req.fellow_id
        if claimed != sender:
            reason = f"fellow id {claimed!r} does not match its subject {msg.subject!r}"
            self.drop(msg, reason)
            await self._reply(
                msg, RegisterReply(accepted=False, code="SUBJECT_MISMATCH", message=reason)
            )
            return
        if isinstance(req, DeregisterRequest):
            reply = self.registry.deregister(req)
        else:
            reply = self.registry.register(req)
        await self._reply(msg, reply)

    async def _on_heartbeat(self, msg: Msg) -> None:
        sender = self._sender(topics.HEARTBEAT, msg)
        if sender is None:
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

    async def _reply(self, msg: Msg, reply: RegisterReply) -> None:
        if not msg.reply:
            return
        reply.leader_version = reply.leader_version or self.registry.leader_version
        with contextlib.suppress(Exception):
            await msg.respond(topics.encode(reply))
