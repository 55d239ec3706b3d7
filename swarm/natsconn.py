"""One way to connect to NATS, for the leader and the fellows alike.

nats-py gives up reconnecting after 60 attempts (about two minutes) by default; a swarm of
volunteer machines must outlive longer outages, so we reconnect forever with a short wait,
keep the outgoing buffer bounded, and ping often enough to notice a dead server.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client

log = logging.getLogger(__name__)

RECONNECT_WAIT_S = 0.5
PING_INTERVAL_S = 5
MAX_OUTSTANDING_PINGS = 2
# Bounded buffer for what is published while disconnected; past it publishes fail fast.
PENDING_BYTES = 4 * 1024 * 1024

Hook = Callable[[], Awaitable[None]]


async def connect_forever(
    url: str,
    *,
    name: str,
    inbox_prefix: str = "_INBOX",
    on_disconnected: Hook | None = None,
    on_reconnected: Hook | None = None,
) -> Client:
    """Connect, retrying forever (also for the first connection), and stay connected."""
    outage = {"reported": False}

    async def error_cb(exc: Exception) -> None:
        if not outage["reported"]:
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
        servers=[url],
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
