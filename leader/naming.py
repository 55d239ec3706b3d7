"""Fellow names are the operator's: who may take which name when a host joins or enrolls.

A join claim or an enrollment mints a NATS user bound to a fellow name; whoever holds that
user *is* that fellow. So (pure rules, one table test):

- a name whose fellow is online is never handed out (``FELLOW_ID_IN_USE``);
- a known name whose fellow is offline only when the operator put it in the join session
  (``FELLOW_NAME_KNOWN`` otherwise: a host cannot propose it, an enrollment cannot take it);
- a name another join session holds (being installed, or reserved by the operator) cannot be
  proposed or enrolled (``FELLOW_NAME_RESERVED``);
- the session's name, when the operator set one, wins over the host's proposal;
- without either, a fresh name nobody knows.

Refusals are 409s that name the field (``fellow_name``). A fellow that restarts with its own
credentials never comes here: it keeps its user.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from silentswarm.errors import ErrorCode
from silentswarm.leader.errors import FellowNameError

FIELD = FellowNameError.field


class NameState(enum.Enum):
    FREE = "free"  # no fellow of that name is known
    RESERVED = "reserved"  # another join session holds it
    OFFLINE = "offline"  # a known fellow, offline now
    ONLINE = "online"  # a known fellow with a fresh heartbeat


def settle_fellow_name(
    *,
    operator_name: str | None,
    proposed_name: str | None,
    state_of: Callable[[str], NameState],
    fresh: Callable[[], str] | None = None,
    what: str = "a join",
) -> str:
    """The name a join (or, with no ``operator_name``, an enrollment) gets, or
    FellowNameError. ``state_of`` says what the leader knows of a name now; ``fresh`` makes
    a new name when neither the operator nor the host gave one."""
    if operator_name is not None:
        if state_of(operator_name) is NameState.ONLINE:
            raise _online(operator_name, what)
        return operator_name
    if proposed_name is not None:
        state = state_of(proposed_name)
        if state is NameState.ONLINE:
            raise _online(proposed_name, what)
        if state is NameState.OFFLINE:
            raise FellowNameError(
                f"{FIELD}: {proposed_name!r} is a known fellow (offline now); {what} cannot "
                "take a known name unless the operator names it: create a join session with "
                f'{{"fellow_name": "{proposed_name}"}}, or forget the old fellow first '
                f"(swarm release {proposed_name})",
                code=ErrorCode.FELLOW_NAME_KNOWN,
            )
        if state is NameState.RESERVED:
            raise FellowNameError(
                f"{FIELD}: {proposed_name!r} is held by another join session; pick another",
                code=ErrorCode.FELLOW_NAME_RESERVED,
            )
        return proposed_name
    if fresh is None:
        raise FellowNameError(
            f"{FIELD}: {what} needs a fellow name", code=ErrorCode.FELLOW_NAME_MISSING
        )
    for _ in range(100):
        name = fresh()
        if state_of(name) is NameState.FREE:
            return name
    raise FellowNameError(
        f"{FIELD}: no free fellow name found; name it", code=ErrorCode.FELLOW_NAME_MISSING
    )


def _online(name: str, what: str) -> FellowNameError:
    return FellowNameError(
        f"{FIELD}: fellow {name!r} is online; {what} cannot take the name of a live fellow",
        code=ErrorCode.FELLOW_ID_IN_USE,
    )
