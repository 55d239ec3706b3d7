"""The operator token: what every mutating REST route (and, off loopback, every read) requires.

``SWARM_API_TOKEN`` sets it; without one the leader generates one on first start, stores it
in ``<state>/api-token`` (mode 0600, where the CLI finds it too) and shows it once when
started from a terminal. Requests
send ``Authorization: Bearer <token>`` (never in the URL); a missing token is 401, a wrong one
403, both with a JSON body that says what to do. The comparison takes constant time and the
token is never logged. A GET may instead carry ``?ticket=`` (a read ticket: see
:class:`ReadTickets`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import sys
import time
from collections.abc import Callable

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from silentswarm.errors import ErrorCode
from silentswarm.leader.errors import ForbiddenError, UnauthorizedError
from silentswarm.settings import Settings

log = logging.getLogger(__name__)
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
TICKET_ROUTE = "/api/v1/auth/read-ticket"
TICKET_TTL_S = 60.0
# Never guarded: liveness, the UI's own files (it asks for the token itself), the API docs,
# what a joining host fetches (its join token, session secret or the fleet's enrollment
# token is checked instead), and shard and dataset files (a stage's token is checked instead).
OPEN_PREFIXES = ("/health", "/ops", "/schema")
OPEN_PATHS = re.compile(
    r"^(/api/v1/bootstrap/(manifest|source|fellow\.sh|enroll"
    r"|join-sessions/[^/]+/(claim|logs|logs/stream))"
    r"|/api/v1/jobs/[^/]+/shards/\d+/[^/]+|/api/v1/jobs/[^/]+/init/[^/]+"
    r"|/api/v1/jobs/[^/]+/datasets/[0-9a-f]{64})/?$"
)


def operator_token(settings: Settings) -> str:
    """The configured token, else the stored one, else a new one (stored 0600, shown once)."""
    if settings.api_token:
        return settings.api_token
    path = settings.api_token_file
    try:
        stored = path.read_text().strip()
    except FileNotFoundError:
        stored = ""
    if stored:
        return stored
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    # Shown once on a terminal; never written to a log (logs travel further than terminals).
    if sys.stderr.isatty():
        print(f"swarm-leader: operator token (also in {path}): {token}", file=sys.stderr)
    log.info("generated an operator token, stored in %s (mode 0600)", path)
    return token


class ReadTickets:
    """Short-lived read tickets for what cannot send a header (a browser's EventSource).

    A ticket is ``<expiry>.<hmac>``: the HMAC-SHA256 of its expiry (whole seconds since the
    epoch) under a key derived from the operator token, so the leader keeps no state, a
    restart with the same token keeps them valid, and a new token voids them all. A ticket
    opens GET routes only, until it expires (TICKET_TTL_S)."""

    def __init__(
        self, token: str, *, ttl_s: float = TICKET_TTL_S, wall: Callable[[], float] = time.time
    ) -> None:
        self._key = hmac.new(token.encode(), b"silentswarm read ticket v1", hashlib.sha256).digest()
        self.ttl_s = ttl_s
        self._wall = wall

    def issue(self) -> tuple[str, int]:
        expires = int(self._wall() + self.ttl_s)
        return f"{expires}.{self._sign(expires)}", expires

    def check(self, ticket: str) -> None:
        """Nothing when the ticket is good; UnauthorizedError (expired) or ForbiddenError."""
        stamp, _, mac = ticket.partition(".")
        if (
            not stamp.isdigit()
            or len(stamp) > 12
            or not hmac.compare_digest(mac.encode(), self._sign(int(stamp)).encode())
        ):
            raise ForbiddenError("this read ticket is not one this leader issued")
        if int(stamp) < self._wall():
            raise UnauthorizedError(
                f"this read ticket expired; get a new one: POST {TICKET_ROUTE} "
                "(with 'Authorization: Bearer <token>')",
                code=ErrorCode.TICKET_EXPIRED,
            )

    def _sign(self, expires: int) -> str:
        return hmac.new(self._key, str(expires).encode(), hashlib.sha256).hexdigest()


def make_guard(token: str, *, public_reads: bool, tickets: ReadTickets | None = None):
    """A Litestar guard enforcing the token on the routes that need it.

    The token is taken only from the ``Authorization: Bearer`` header: in a URL it would
    land in proxy logs, browser history and Referer headers, so ``?access_token=`` is
    refused everywhere. A GET may carry a read ticket instead (``?ticket=``)."""
    expected = token.encode()
    tickets = tickets or ReadTickets(token)

    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        query = connection.query_params
        if "access_token" in query:
            raise UnauthorizedError(
                "the operator token is never accepted in a URL (?access_token=): send "
                "'Authorization: Bearer <token>'; for a stream a browser opens, get a read "
                f"ticket (POST {TICKET_ROUTE}) and pass ?ticket=<ticket>"
            )
        path = connection.scope["path"]
        if path.startswith(OPEN_PREFIXES) or OPEN_PATHS.match(path):
            return
        is_read = connection.scope.get("method", "GET") in READ_METHODS
        header = connection.headers.get("authorization", "")
        ticket = query.get("ticket")
        if ticket is not None and not header:
            if not is_read:
                raise UnauthorizedError(
                    "a read ticket opens GET routes only: send 'Authorization: Bearer <token>'"
                )
            tickets.check(ticket)
            return
        if public_reads and is_read:
            return
        scheme, _, given = header.partition(" ")
        if not header or scheme.lower() != "bearer" or not given.strip():
            raise UnauthorizedError(
                "this route needs the operator token: send 'Authorization: Bearer <token>' "
                "(SWARM_API_TOKEN, or the leader's <state>/api-token)"
            )
        if not hmac.compare_digest(given.strip().encode(), expected):
            raise ForbiddenError("the operator token is wrong")

    return guard
