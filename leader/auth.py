"""The operator token: what every mutating REST route (and, if asked, every read) requires.

``SWARM_API_TOKEN`` sets it; without one the leader generates one on first start, stores it
in ``<state>/api-token`` (mode 0600, where the CLI finds it too) and shows it once when
started from a terminal. Requests
send ``Authorization: Bearer <token>``; a missing token is 401, a wrong one 403, both with a
JSON body that says what to do. The comparison takes constant time and the token is never
logged.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import secrets
import sys

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from swarm.errors import SwarmError
from swarm.settings import Settings

log = logging.getLogger(__name__)
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Never guarded: liveness, the UI's own files (it asks for the token itself), the API docs,
# what a joining host fetches (its join token, session secret or the fleet's enrollment
# token is checked instead), and shard files (a resumed stage's token is checked instead).
OPEN_PREFIXES = ("/health", "/ops", "/schema")
OPEN_PATHS = re.compile(
    r"^(/api/v1/bootstrap/(manifest|source|fellow\.sh|enroll"
    r"|join-sessions/[^/]+/(claim|logs|logs/stream))"
    r"|/api/v1/jobs/[^/]+/shards/\d+/[^/]+)/?$"
)


class UnauthorizedError(SwarmError):
    code = "UNAUTHORIZED"
    http_status = 401


class ForbiddenError(SwarmError):
    code = "FORBIDDEN"
    http_status = 403


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


def make_guard(token: str, *, public_reads: bool):
    """A Litestar guard enforcing the token on the routes that need it."""
    expected = token.encode()

    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        path = connection.scope["path"]
        if path.startswith(OPEN_PREFIXES) or OPEN_PATHS.match(path):
            return
        if public_reads and connection.scope.get("method", "GET") in READ_METHODS:
            return
        header = connection.headers.get("authorization", "")
        if not header and connection.query_params.get("access_token"):
            # A browser's EventSource cannot send headers (only for reads: see above).
            header = "Bearer " + connection.query_params["access_token"]
        scheme, _, given = header.partition(" ")
        if not header or scheme.lower() != "bearer" or not given.strip():
            raise UnauthorizedError(
                "this route needs the operator token: send 'Authorization: Bearer <token>' "
                "(SWARM_API_TOKEN, or the leader's <state>/api-token)"
            )
        if not hmac.compare_digest(given.strip().encode(), expected):
            raise ForbiddenError("the operator token is wrong")

    return guard
