"""Read tickets: HMAC-signed expiries under a key derived from the operator token (pure)."""

from __future__ import annotations

import pytest

from silentswarm.leader.auth import ReadTickets
from silentswarm.leader.errors import ForbiddenError, UnauthorizedError
from tests.fakes import Clock


def test_a_ticket_opens_until_it_expires():
    clock = Clock(1_000_000.0)
    tickets = ReadTickets("the-token", wall=clock)
    ticket, expires = tickets.issue()
    assert expires == 1_000_060
    tickets.check(ticket)
    clock.now += 60
    tickets.check(ticket)
    clock.now += 1
    with pytest.raises(UnauthorizedError) as err:
        tickets.check(ticket)
    assert err.value.code == "TICKET_EXPIRED" and "read-ticket" in err.value.message


@pytest.mark.parametrize(
    "forged",
    ["", "garbage", "9999999999.", "9999999999.00", "-1.abc", "1e9.abc", "99999999999999.x"],
)
def test_forged_tickets_are_refused(forged):
    with pytest.raises(ForbiddenError):
        ReadTickets("the-token").check(forged)


def test_a_later_expiry_cannot_be_written_in_and_another_token_voids_it():
    tickets = ReadTickets("the-token")
    ticket, expires = tickets.issue()
    mac = ticket.partition(".")[2]
    with pytest.raises(ForbiddenError):
        tickets.check(f"{expires + 3600}.{mac}")
    with pytest.raises(ForbiddenError):
        ReadTickets("a-new-token").check(ticket)
    assert "the-token" not in ticket


def test_a_ticket_is_bound_to_its_accounts_token_as_it_was_when_issued():
    """Rotating an account's token (or revoking the name and creating it again) voids the
    tickets the old token took; the account's other tickets and the operator's stay good."""
    tokens = {"alice": "digest-1", "bob": "digest-b"}
    tickets = ReadTickets("the-token", bound_to=lambda name: tokens.get(name, ""))
    alice, _ = tickets.issue("alice")
    bob, _ = tickets.issue("bob")
    operator, _ = tickets.issue()
    assert tickets.check(alice) == "alice"
    tokens["alice"] = "digest-2"
    with pytest.raises(ForbiddenError) as err:
        tickets.check(alice)
    assert "rotated" in err.value.message
    assert tickets.check(tickets.issue("alice")[0]) == "alice", "a new ticket of the new token"
    assert (tickets.check(bob), tickets.check(operator)) == ("bob", "operator")
