"""Fellow names are the operator's: the rules a join claim and an enrollment follow (pure)."""

from __future__ import annotations

import itertools

import pytest

from silentswarm.leader.bootstrap import JoinSessions
from silentswarm.leader.errors import FellowNameError
from silentswarm.leader.naming import NameState, settle_fellow_name

KNOWN = {
    "live": NameState.ONLINE,
    "gone": NameState.OFFLINE,
    "held": NameState.RESERVED,
}
OK = None


def state_of(name: str) -> NameState:
    return KNOWN.get(name, NameState.FREE)


@pytest.mark.parametrize(
    ("operator", "proposed", "settled", "refused"),
    [
        # the operator's name: anything but a live fellow's, and it wins over the proposal
        ("new", None, "new", OK),
        ("new", "other", "new", OK),
        ("new", "live", "new", OK),
        ("gone", None, "gone", OK),
        ("gone", "other", "gone", OK),
        ("held", None, "held", OK),
        ("live", None, None, "FELLOW_ID_IN_USE"),
        ("live", "new", None, "FELLOW_ID_IN_USE"),
        # the host's proposal: only a name nobody has
        (None, "new", "new", OK),
        (None, "live", None, "FELLOW_ID_IN_USE"),
        (None, "gone", None, "FELLOW_NAME_KNOWN"),
        (None, "held", None, "FELLOW_NAME_RESERVED"),
        # neither: a fresh one
        (None, None, "fellow-0", OK),
    ],
)
def test_who_may_take_which_name(operator, proposed, settled, refused):
    fresh = (f"fellow-{i}" for i in itertools.count())
    call = dict(
        operator_name=operator,
        proposed_name=proposed,
        state_of=state_of,
        fresh=lambda: next(fresh),
    )
    if refused is OK:
        assert settle_fellow_name(**call) == settled
        return
    with pytest.raises(FellowNameError) as err:
        settle_fellow_name(**call)
    assert err.value.code == refused and err.value.http_status == 409
    assert err.value.to_dict()["field"] == "fellow_name"
    assert err.value.message.startswith("fellow_name: ")


def test_a_fresh_name_is_never_one_that_is_known():
    names = iter(["live", "gone", "held", "fellow-new"])
    got = settle_fellow_name(
        operator_name=None, proposed_name=None, state_of=state_of, fresh=lambda: next(names)
    )
    assert got == "fellow-new"


def test_an_enrollment_names_itself_and_follows_the_proposal_rules():
    assert settle_fellow_name(operator_name=None, proposed_name="new", state_of=state_of) == "new"
    for name, code in (("live", "FELLOW_ID_IN_USE"), ("gone", "FELLOW_NAME_KNOWN")):
        with pytest.raises(FellowNameError) as err:
            settle_fellow_name(
                operator_name=None, proposed_name=name, state_of=state_of, what="an enrollment"
            )
        assert err.value.code == code and "an enrollment" in err.value.message


def test_a_refused_claim_leaves_the_session_unused_and_sessions_reserve_their_names():
    joins = JoinSessions()
    named, named_token = joins.create(fellow_name="box-1", ttl_s=60)
    open_session, token = joins.create(fellow_name=None, ttl_s=60)
    live = {"live": NameState.ONLINE}
    with pytest.raises(FellowNameError):
        joins.claim(open_session.session_id, token, "live", lambda n: live.get(n, NameState.FREE))
    assert joins.get(open_session.session_id).status == "created"
    # The operator reserved box-1 for the other session: a host cannot propose it.
    with pytest.raises(FellowNameError) as err:
        joins.claim(open_session.session_id, token, "box-1")
    assert err.value.code == "FELLOW_NAME_RESERVED"
    session, _ = joins.claim(open_session.session_id, token, "box-2")
    assert (session.fellow_name, session.status) == ("box-2", "installing")
    # box-2 is being installed now; the named session still gets its own name.
    assert joins.holds("box-2") and joins.holds("box-1")
    session, _ = joins.claim(named.session_id, named_token, "box-2")
    assert session.fellow_name == "box-1"
