"""The fellow's NATS session: register, heartbeat, answer signals, deregister on the way out.

The agent drives its own status through :mod:`swarm.lifecycle`. It reconnects to NATS
forever, and after every reconnect registers again (the leader may have restarted, or
judged it offline) without restarting the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections import OrderedDict

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from agent.hardware import HardwareProbe
from swarm import __version__
from swarm import subjects as topics
from swarm.errors import ProtocolError
from swarm.lifecycle import FellowEvent, next_status
from swarm.natsconn import connect_forever
from swarm.protocol import (
    DeregisterRequest,
    FellowIdentity,
    FellowStatus,
    Heartbeat,
    RegisterRequest,
    Signal,
    SignalAck,
)
from swarm.settings import Settings

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 2.0
RETRY_MIN_S = 0.25
RETRY_MAX_S = 1.0
SEEN_SIGNALS = 256


def default_fellow_id() -> str:
    """The host name, cut down to a valid subject token."""
    raw = socket.gethostname().split(".")[0]
    token = "".join(c if c.isalnum() or c in "-_" else "-" for c in raw)[:64]
    return token or "fellow"


class FellowAgent:
    def __init__(
        self,
        settings: Settings,
        *,
        nats_url: str,
        fellow_id: str,
        probe: HardwareProbe | None = None,
    ) -> None:
        self.settings = settings
        self.nats_url = nats_url
        self.prefix = settings.subject_prefix
        self.probe = probe or HardwareProbe()
        self.identity = FellowIdentity(
            fellow_id=fellow_id,
            instance_id=uuid.uuid4().hex[:16],
            hostname=self.probe.hostname,
            version=__version__,
            pid=os.getpid(),
            data_address=settings.data_address,
        )
        self.status = FellowStatus.REGISTERING
        self.heartbeat_interval_s = settings.heartbeat_interval_s
        self.nc: Client | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self._seq = 0
        self._registered = asyncio.Event()
        self._need_register = asyncio.Event()
        self._acks: OrderedDict[str, SignalAck] = OrderedDict()

    @property
    def fellow_id(self) -> str:
        return self.identity.fellow_id

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then deregister and close."""
        connect = asyncio.create_task(
            connect_forever(
                self.nats_url,
                name=f"swarm-fellow-{self.fellow_id}",
                inbox_prefix=topics.inbox_prefix(self.fellow_id),
                on_disconnected=self._on_disconnected,
                on_reconnected=self._on_reconnected,
            )
        )
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({connect, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not connect.done():
            connect.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await connect
            log.info("stopped before NATS %s was reachable", self.nats_url)
            return
        stopper.cancel()
        self.nc = connect.result()
        await self.nc.subscribe(
            topics.SIGNAL.subject(self.prefix, fellow=self.fellow_id), cb=self._on_signal
        )
        self._need_register.set()
        tasks = [
            asyncio.create_task(self._registrar(stop), name="registrar"),
            asyncio.create_task(self._heartbeats(stop), name="heartbeats"),
        ]
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._deregister()
            with contextlib.suppress(Exception):
                await self.nc.drain()
            self.probe.close()

    # --- registration ----------------------------------------------------------------------

    async def _on_disconnected(self) -> None:
        self._registered.clear()

    async def _on_reconnected(self) -> None:
        self._need_register.set()

    async def _registrar(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._need_register.wait()
            self._need_register.clear()
            await self._register_until_accepted(stop)

    async def _register_until_accepted(self, stop: asyncio.Event) -> None:
        self._registered.clear()
        delay, last_reason = RETRY_MIN_S, ""
        while not stop.is_set():
            reason = await self._try_register()
            if reason is None:
                if self.status is FellowStatus.REGISTERING:
                    self.status = next_status(self.status, FellowEvent.REGISTERED)
                self._registered.set()
                await self._send_heartbeat()
                return
            if reason != last_reason:
                log.warning("registration not accepted: %s (retrying)", reason)
                last_reason = reason
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def _try_register(self) -> str | None:
        """None when the leader accepted us, else why not."""
        assert self.nc is not None
        req = RegisterRequest(
            fellow=self.identity, hardware=self.probe.snapshot(), status=self.status
        )
        subject = topics.REGISTER.subject(self.prefix, fellow=self.fellow_id)
        try:
            msg = await self.nc.request(subject, topics.encode(req), timeout=REQUEST_TIMEOUT_S)
            reply = topics.REGISTER.decode_reply(msg.data)
        except (NatsError, TimeoutError) as exc:
            return f"no leader answered on {subject} ({type(exc).__name__})"
        except ProtocolError as exc:
            return str(exc)
        if not reply.accepted:
            return f"{reply.code}: {reply.message}"
        self.heartbeat_interval_s = reply.heartbeat_interval_s or self.heartbeat_interval_s
        log.info("registered as %s with leader %s", self.fellow_id, reply.leader_version)
        return None

    async def _deregister(self) -> None:
        if self.nc is None or not self.nc.is_connected or not self._registered.is_set():
            return
        req = DeregisterRequest(fellow_id=self.fellow_id, instance_id=self.identity.instance_id)
        subject = topics.REGISTER.subject(self.prefix, fellow=self.fellow_id)
        try:
            msg = await self.nc.request(subject, topics.encode(req), timeout=REQUEST_TIMEOUT_S)
            reply = topics.REGISTER.decode_reply(msg.data)
            log.info("deregistered: %s", reply.message or reply.code)
        except (NatsError, TimeoutError, ProtocolError) as exc:
            log.warning("could not deregister (%s); the leader will time us out", exc)

    # --- heartbeats ------------------------------------------------------------------------

    async def _heartbeats(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._registered.wait()
            await self._send_heartbeat()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.heartbeat_interval_s)

    async def _send_heartbeat(self) -> None:
        # Skipped while disconnected: a burst of stale heartbeats after a reconnect helps nobody.
        if self.nc is None or not self.nc.is_connected:
            return
        self._seq += 1
        hb = Heartbeat(
            fellow=self.identity,
            seq=self._seq,
            status=self.status,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            hardware=self.probe.snapshot(),
        )
        try:
            await self.nc.publish(
                topics.HEARTBEAT.subject(self.prefix, fellow=self.fellow_id), topics.encode(hb)
            )
        except NatsError as exc:
            log.debug("heartbeat not sent: %s", exc)

    # --- signals ---------------------------------------------------------------------------

    async def _on_signal(self, msg: Msg) -> None:
        try:
            sig = topics.SIGNAL.decode(msg.data)
        except ProtocolError as exc:
            log.warning("dropped malformed signal on %s: %s", msg.subject, exc)
            await self._respond(
                msg,
                SignalAck(
                    signal_id="",
                    fellow_id=self.fellow_id,
                    ok=False,
                    code=exc.code,
                    message=str(exc),
                ),
            )
            return
        seen = self._acks.get(sig.signal_id)
        if seen is not None:
            await self._respond(msg, _as_duplicate(seen))
            return
        ack = self._handle(sig)
        self._acks[sig.signal_id] = ack
        while len(self._acks) > SEEN_SIGNALS:
            self._acks.popitem(last=False)
        await self._respond(msg, ack)

    def _handle(self, sig: Signal) -> SignalAck:
        log.info("signal %s (%s) for job %s", sig.kind, sig.signal_id, sig.job_id)
        return SignalAck(
            signal_id=sig.signal_id,
            fellow_id=self.fellow_id,
            ok=False,
            code="UNSUPPORTED_SIGNAL",
            message=f"agent {__version__} does not run jobs yet; {sig.kind} ignored",
        )

    async def _respond(self, msg: Msg, ack: SignalAck) -> None:
        if msg.reply:
            with contextlib.suppress(NatsError):
                await msg.respond(topics.encode(ack))


def _as_duplicate(ack: SignalAck) -> SignalAck:
    return SignalAck(
        signal_id=ack.signal_id,
        fellow_id=ack.fellow_id,
        ok=ack.ok,
        code=ack.code,
        message=ack.message,
        duplicate=True,
    )
