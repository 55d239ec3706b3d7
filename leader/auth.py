"""Tokens: the operator token and accounts' tokens, and what every request may do with them.

``SWARM_API_TOKEN`` sets it; without one the leader generates one on first start, stores it
in ``<state>/api-token`` (mode 0600, where the CLI finds it too) and shows it once when
started from a terminal. Requests
send ``Authorization: Bearer <token>`` (never in the URL); a missing token is 401, a wrong one
403, both with a JSON body that says what to do. The comparison takes constant time and the
token is never logged. A GET may instead carry ``?ticket=`` (a read ticket: see
:class:`ReadTickets`).

Accounts (:mod:`silentswarm.leader.accounts`) have tokens of their own; the guard resolves
the token to a :class:`~silentswarm.leader.permissions.Principal` (the operator, an admin,
or an account), decides with :mod:`silentswarm.leader.permissions` whether it may do what the
request does (403 ``ACCOUNT_FORBIDDEN`` naming the job's owner and the role needed), and puts
it on the request (:func:`principal_of`) for the routes that record or filter by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import sys
import time
from collections.abc import Callable
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from silentswarm.errors import ErrorCode
from silentswarm.leader.accounts import AccountBook
from silentswarm.leader.errors import AccountForbiddenError, ForbiddenError, UnauthorizedError
from silentswarm.leader.permissions import (
    ANONYMOUS,
    OPERATOR,
    READ_METHODS,
    Action,
    Principal,
    Request,
    classify,
    may,
)
from silentswarm.settings import Settings
from silentswarm.types.accounts import OPERATOR_ACCOUNT

log = logging.getLogger(__name__)
# Where the guard leaves the request's principal (an ASGI scope key: Litestar keeps the scope).
PRINCIPAL_KEY = "silentswarm.principal"
TICKET_ROUTE = "/api/v1/auth/read-ticket"
TICKET_TTL_S = 60.0
ACCOUNTS_LOAD_WAIT_S = 10.0  # an account's token on a leader that just started waits so long
# Headers a reverse proxy adds: a request carrying one came from beyond this machine.
PROXY_HEADERS = ("x-forwarded-for", "forwarded", "x-real-ip")
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
# Who owns a job (None: no such job); the guard asks for the per-job routes.
OwnerOf = Callable[[str], str | None]


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

    A ticket is ``<expiry>.<account>.<hmac>``: the HMAC-SHA256 of its expiry (whole seconds
    since the epoch), the account it was issued to and that account's token as it is then
    (``bound_to``: its SHA-256; the operator's: none), under a key derived from the operator
    token, so the leader keeps no state, a restart with the same token keeps them valid, and
    a new operator token voids them all. A ticket opens the GET routes its account may read,
    until it expires (TICKET_TTL_S), the account is revoked or its token rotated."""

    def __init__(
        self,
        token: str,
        *,
        ttl_s: float = TICKET_TTL_S,
        wall: Callable[[], float] = time.time,
        bound_to: Callable[[str], str] = lambda _account: "",
    ) -> None:
        self._key = hmac.new(token.encode(), b"silentswarm read ticket v3", hashlib.sha256).digest()
        self.ttl_s = ttl_s
        self._wall = wall
        self._bound_to = bound_to

    def issue(self, account: str = OPERATOR_ACCOUNT) -> tuple[str, int]:
        expires = int(self._wall() + self.ttl_s)
        return f"{expires}.{account}.{self._sign(expires, account)}", expires

    def check(self, ticket: str) -> str:
        """The account the ticket was issued to; UnauthorizedError (expired) or
        ForbiddenError (not one this leader issued)."""
        stamp, _, rest = ticket.partition(".")
        account, _, mac = rest.rpartition(".")
        if (
            not stamp.isdigit()
            or len(stamp) > 12
            or not account
            or not hmac.compare_digest(mac.encode(), self._sign(int(stamp), account).encode())
        ):
            raise ForbiddenError(
                "this read ticket is not one this leader issued (or its account's token was "
                "rotated since)"
            )
        if int(stamp) < self._wall():
            raise UnauthorizedError(
                f"this read ticket expired; get a new one: POST {TICKET_ROUTE} "
                "(with 'Authorization: Bearer <token>')",
                code=ErrorCode.TICKET_EXPIRED,
            )
        return account

    def _sign(self, expires: int, account: str) -> str:
        message = f"{expires}.{account}.{self._bound_to(account)}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()


def principal_of(connection: ASGIConnection[Any, Any, Any, Any]) -> Principal:
    """Who the guard found the request comes from (anonymous on a route it leaves open)."""
    return connection.scope.get(PRINCIPAL_KEY, ANONYMOUS)  # type: ignore[return-value]


def make_guard(
    token: str,
    *,
    public_reads: bool,
    tickets: ReadTickets | None = None,
    accounts: AccountBook | None = None,
    owner_of: OwnerOf = lambda _: None,
    public_reads_via_proxy: bool = True,
) -> Guard:
    """A Litestar guard enforcing tokens and accounts' permissions on the routes that need it.
    Without ``accounts``, only the operator token is known. ``public_reads_via_proxy``
    False: public reads are only for requests no reverse proxy forwarded (the default of a
    leader on loopback: open to this machine, not to whoever reaches a proxy in front)."""
    if accounts is None:
        accounts = AccountBook()
        accounts.restore([])
    return Guard(
        token,
        public_reads=public_reads,
        tickets=tickets or ReadTickets(token),
        accounts=accounts,
        owner_of=owner_of,
        public_reads_via_proxy=public_reads_via_proxy,
    )


class Guard:
    """Who a request comes from, and whether it may do what it does.

    The token is taken only from the ``Authorization: Bearer`` header: in a URL it would
    land in proxy logs, browser history and Referer headers, so ``?access_token=`` is
    refused everywhere. A GET may carry a read ticket instead (``?ticket=``)."""

    def __init__(
        self,
        token: str,
        *,
        public_reads: bool,
        tickets: ReadTickets,
        accounts: AccountBook,
        owner_of: OwnerOf,
        public_reads_via_proxy: bool = True,
    ) -> None:
        self._expected = token.encode()
        self.public_reads = public_reads
        self.public_reads_via_proxy = public_reads_via_proxy
        self.tickets = tickets
        self.accounts = accounts
        self.owner_of = owner_of

    async def __call__(self, connection: ASGIConnection, _: BaseRouteHandler) -> None:
        given = _bearer(connection)
        if given and not self.accounts.loaded.is_set() and not self._is_operator(given):
            # A leader that just started: an account's token waits for the accounts to load.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.accounts.loaded.wait(), ACCOUNTS_LOAD_WAIT_S)
        self.check(connection)

    def check(self, connection: ASGIConnection) -> None:
        """Raise unless the request may go on; leave its principal on it."""
        query = connection.query_params
        if "access_token" in query:
            raise UnauthorizedError(
                "the operator token is never accepted in a URL (?access_token=): send "
                "'Authorization: Bearer <token>'; for a stream a browser opens, get a read "
                f"ticket (POST {TICKET_ROUTE}) and pass ?ticket=<ticket>"
            )
        path = connection.scope["path"]
        method = connection.scope.get("method", "GET")
        header = connection.headers.get("authorization", "")
        given = _bearer(connection)
        request = classify(method, path)
        if path.startswith(OPEN_PREFIXES) or OPEN_PATHS.match(path):
            # A stage's own token opens these; an account's token on another's job does not.
            if given and request.action is Action.JOB_FILES:
                self._check(self._resolve(given), request)
            return
        is_read = method in READ_METHODS
        ticket = query.get("ticket")
        if ticket is not None and not header:
            if not is_read:
                raise UnauthorizedError(
                    "a read ticket opens GET routes only: send 'Authorization: Bearer <token>'"
                )
            self._check(self._ticket_principal(ticket), request, connection)
        elif self.public_reads and is_read and not header and self._may_read_openly(connection):
            self._check(ANONYMOUS, request, connection)
        elif not given:
            raise UnauthorizedError(
                "this route needs a token: send 'Authorization: Bearer <token>' "
                "(SWARM_API_TOKEN, the leader's <state>/api-token, or an account's token)"
            )
        else:
            self._check(self._resolve(given), request, connection)

    def _may_read_openly(self, connection: ASGIConnection) -> bool:
        """Whether public reads reach this request: always when they were asked for
        (SWARM_API_PUBLIC_READS=1); by default only when no reverse proxy forwarded it, so
        that a proxy in front of a leader on loopback never publishes its reads."""
        if self.public_reads_via_proxy:
            return True
        return not any(name in connection.headers for name in PROXY_HEADERS)

    def _is_operator(self, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self._expected)

    def _resolve(self, given: str) -> Principal:
        if self._is_operator(given):
            return OPERATOR
        principal = self.accounts.resolve(given)
        if principal is None:
            raise ForbiddenError("the token is wrong (neither the operator's nor an account's)")
        return principal

    def _ticket_principal(self, ticket: str) -> Principal:
        name = self.tickets.check(ticket)
        principal = OPERATOR if name == OPERATOR_ACCOUNT else self.accounts.principal(name)
        if principal is None:
            raise UnauthorizedError(
                f"account {name!r} of this read ticket is revoked or gone",
                code=ErrorCode.TOKEN_REVOKED,
            )
        return principal

    def _check(
        self, principal: Principal, request: Request, connection: ASGIConnection | None = None
    ) -> None:
        owner = self.owner_of(request.job_id) if request.job_id else None
        refusal = may(principal, request, owner)
        if refusal is not None:
            if principal is ANONYMOUS:
                raise UnauthorizedError(
                    "this route needs a token: send 'Authorization: Bearer <token>'"
                )
            raise AccountForbiddenError(
                refusal.message,
                account=principal.name,
                needed_role=refusal.needed_role,
                owner=refusal.owner,
            )
        if connection is not None:
            connection.scope[PRINCIPAL_KEY] = principal  # type: ignore[literal-required]


def _bearer(connection: ASGIConnection) -> str:
    """The token of an ``Authorization: Bearer`` header ("" for none or another scheme)."""
    scheme, _, given = connection.headers.get("authorization", "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else ""
