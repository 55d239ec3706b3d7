"""Read tickets (a short-lived stand-in for a token on GET URLs: EventSource) and whoami."""

from __future__ import annotations

from litestar import Controller, Request, get, post
from litestar.status_codes import HTTP_200_OK

from silentswarm.leader.auth import TICKET_ROUTE, ReadTickets, principal_of
from silentswarm.types.account_api import WhoAmI
from silentswarm.types.api import ReadTicket


class AuthController(Controller):
    path = TICKET_ROUTE
    tags = ["auth"]

    @post(
        "/",
        status_code=HTTP_200_OK,
        summary="A read ticket (any token): GET routes accept it as ?ticket= until it expires "
        "(60 s), reading what the token's account may read",
    )
    async def read_ticket(self, request: Request) -> ReadTicket:
        tickets: ReadTickets = request.app.state["tickets"]
        ticket, expires_at = tickets.issue(principal_of(request).name)
        return ReadTicket(ticket=ticket, expires_at=expires_at, ttl_s=tickets.ttl_s)


class WhoAmIController(Controller):
    path = "/api/v1/auth/whoami"
    tags = ["auth"]

    @get("/", summary="The account the request's token (or read ticket) stands for, and its role")
    async def whoami(self, request: Request) -> WhoAmI:
        principal = principal_of(request)
        pools = None if principal.pools is None else list(principal.pools)
        return WhoAmI(
            name=principal.name, role=principal.role, pools=pools, operator=principal.is_operator
        )
