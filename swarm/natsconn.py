"""One way to connect to NATS, for the leader and the fellows alike.

nats-py gives up reconnecting after 60 attempts (about two minutes) by default; a swarm of
volunteer machines must outlive longer outages, so we reconnect forever with a short wait,
keep the outgoing buffer bounded, and ping often enough to notice a dead server.
"""

from __future__ import annotations

import logging
import ssl
import time
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
# An exception a message handler raised (nats-py hands those to the error callback, beside
# the connection's own errors): a bug, logged with its traceback at most this often.
HANDLER_ERROR_LOG_EVERY_S = 10.0
# What the connection itself raises (a failed connect, a dropped socket, a server's -ERR):
# an outage, or a refusal, not a handler's failure.
CONNECTION_ERRORS = (nats.errors.Error, OSError, TimeoutError, EOFError)


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


class ErrorReport:
    """nats-py's error callback for one connection, which hears two kinds of error: the
    connection's own (an outage is warned of once until it reconnects; refused credentials
    or permissions are errors) and those a subscription's handler raised (a bug: its message
    is lost; ``on_handler_error`` is told of each, and each is logged as an error with its
    traceback, at most once every :data:`HANDLER_ERROR_LOG_EVERY_S` per exception type)."""

    def __init__(
        self, access: NatsAccess, on_handler_error: Callable[[Exception], None] | None = None
    ) -> None:
        self.access = access
        self.on_handler_error = on_handler_error
        self.outage_reported = False
        self._handler_logged: dict[type, float] = {}

    async def report(self, exc: Exception) -> None:
        """nats-py's ``error_cb`` (it takes only a coroutine function)."""
        if not isinstance(exc, CONNECTION_ERRORS):
            self.handler_failed(exc)
        else:
            self.connection_failed(exc)

    def handler_failed(self, exc: Exception) -> None:
        if self.on_handler_error is not None:
            self.on_handler_error(exc)
        now = time.monotonic()
        last = self._handler_logged.get(type(exc), float("-inf"))
        if now - last >= HANDLER_ERROR_LOG_EVERY_S:
            self._handler_logged[type(exc)] = now
            log.error("a NATS message handler failed: %r", exc, exc_info=exc)

    def connection_failed(self, exc: Exception) -> None:
        url, creds = self.access.url, self.access.creds
        if "authorization violation" in str(exc).lower():
            log.error(
                "NATS %s refused our credentials (%s): check SWARM_NATS_CREDS%s",
                url,
                creds or "none given",
                "" if creds else ", or run the leader with --dev",
            )
        elif "permissions violation" in str(exc).lower():
            log.error("NATS %s: %s", url, exc)
        elif not self.outage_reported:
            log.warning(
                "NATS %s: %s (retrying every %.1fs)",
                url,
                exc or type(exc).__name__,
                RECONNECT_WAIT_S,
            )
            self.outage_reported = True
        else:
            log.debug("NATS %s: %s", url, exc)


async def connect_forever(
    access: NatsAccess | str,
    *,
    name: str,
    inbox_prefix: str = "_INBOX",
    on_disconnected: Hook | None = None,
    on_reconnected: Hook | None = None,
    on_handler_error: Callable[[Exception], None] | None = None,
) -> Client:
    """Connect, retrying forever (also for the first connection), and stay connected.
    ``on_handler_error``: see :class:`ErrorReport`."""
    if isinstance(access, str):
        access = NatsAccess(url=access)
    url = access.url
    errors = ErrorReport(access, on_handler_error)

    async def disconnected_cb() -> None:
        log.warning("disconnected from NATS %s", url)
        if on_disconnected is not None:
            await on_disconnected()

    async def reconnected_cb() -> None:
        errors.outage_reported = False
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
        error_cb=errors.report,
        disconnected_cb=disconnected_cb,
        reconnected_cb=reconnected_cb,
    )
    errors.outage_reported = False
    log.info("connected to NATS %s as %s", url, name)
    return nc
