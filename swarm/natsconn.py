"""One way to connect to NATS, for the leader and the fellows alike.

nats-py gives up reconnecting after 60 attempts (about two minutes) by default; a swarm of
volunteer machines must outlive longer outages, so we reconnect forever with a short wait,
keep the outgoing buffer bounded, and ping often enough to notice a dead server.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats
from nats.aio.client import Client

log = logging.getLogger(__name__)

RECONNECT_WAIT_S = 0.5
PING_INTERVAL_S = 5
MAX_OUTSTANDING_PINGS = 2
# Bounded buffer for what is published while disconnected; past it publishes fail fast.
PENDING_BYTES = 4 * 1024 * 1024

Hook = Callable[[], Awaitable[None]]


class NatsAccess(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How one identity reaches NATS: the URL, its credentials file (a NATS user JWT and
    seed) and, for a TLS listener, the CA and an optional client certificate."""

    url: str
    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect``."""
        options: dict[str, Any] = {"servers": [self.url]}
        if self.creds:
            options["user_credentials"] = self.creds
        if self.tls_ca or self.tls_cert or self.url.startswith(("tls://", "wss://")):
            context = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key)
            options["tls"] = context
            host = self.url.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
            options["tls_hostname"] = host
        return options


async def connect_forever(
    access: NatsAccess | str,
    *,
    name: str,
    inbox_prefix: str = "_INBOX",
    on_disconnected: Hook | None = None,
    on_reconnected: Hook | None = None,
) -> Client:
    """Connect, retrying forever (also for the first connection), and stay connected."""
    if isinstance(access, str):
        access = NatsAccess(url=access)
    url = access.url
    outage = {"reported": False}

    async def error_cb(exc: Exception) -> None:
        if "authorization violation" in str(exc).lower():
            log.error(
                "NATS %s refused our credentials (%s): check SWARM_NATS_CREDS%s",
                url,
                access.creds or "none given",
                "" if access.creds else ", or run the leader with --dev",
            )
        elif "permissions violation" in str(exc).lower():
            log.error("NATS %s: %s", url, exc)
        elif not outage["reported"]:
            log.warning(
                "NATS %s: %s (retrying every %.1fs)",
                url,
                exc or type(exc).__name__,
                RECONNECT_WAIT_S,
            )
            outage["reported"] = True
        else:
            log.debug("NATS %s: %s", url, exc)

    async def disconnected_cb() -> None:
        log.warning("disconnected from NATS %s", url)
        if on_disconnected is not None:
            await on_disconnected()

    async def reconnected_cb() -> None:
        outage["reported"] = False
        log.info("reconnected to NATS %s", url)
        if on_reconnected is not None:
            await on_reconnected()

    nc = await nats.connect(
        **access.connect_options(),
        name=name,
        inbox_prefix=inbox_prefix,
        allow_reconnect=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=RECONNECT_WAIT_S,
        connect_timeout=2,
        ping_interval=PING_INTERVAL_S,
        max_outstanding_pings=MAX_OUTSTANDING_PINGS,
        pending_size=PENDING_BYTES,
        error_cb=error_cb,
        disconnected_cb=disconnected_cb,
        reconnected_cb=reconnected_cb,
    )
    outage["reported"] = False
    log.info("connected to NATS %s as %s", url, name)
    return nc
