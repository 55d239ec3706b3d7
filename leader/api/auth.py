"""Read tickets: a short-lived stand-in for the operator token on GET URLs (EventSource)."""

from __future__ import annotations

from litestar import Controller, Request, post
from litestar.status_codes import HTTP_200_OK

from silentswarm.leader.auth import TICKET_ROUTE, ReadTickets
from silentswarm.types.api import ReadTicket


class AuthController(Controller):
    path = TICKET_ROUTE
    tags = ["auth"]

    @post(
        "/",
        status_code=HTTP_200_OK,
        summary="A read ticket (operator token): GET routes accept it as ?ticket= until it "
        "expires (60 s)",
    )
    async def read_ticket(self, request: Request) -> ReadTicket:
        tickets: ReadTickets = request.app.state["tickets"]
        ticket, expires_at = tickets.issue()
        return ReadTicket(ticket=ticket, expires_at=expires_at, ttl_s=tickets.ttl_s)
