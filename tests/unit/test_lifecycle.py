import itertools

import pytest

from silentswarm.errors import IllegalTransitionError
from silentswarm.lifecycle import TRANSITIONS, FellowEvent, next_status
from silentswarm.protocol import FellowStatus as S

# The ARCHITECTURE.md lifecycle, plus: every live status goes offline when stale, and
# checkpointing ends the two ways training does (job terminal, runtime failure).
EXPECTED = {
    (S.REGISTERING, FellowEvent.REGISTERED): S.READY,
    (S.READY, FellowEvent.START): S.TRAINING,
    (S.TRAINING, FellowEvent.CHECKPOINT): S.CHECKPOINTING,
    (S.CHECKPOINTING, FellowEvent.CHECKPOINT_WRITTEN): S.TRAINING,
    (S.CHECKPOINTING, FellowEvent.FINAL_CHECKPOINT_WRITTEN): S.READY,
    (S.TRAINING, FellowEvent.JOB_TERMINAL): S.READY,
    (S.READY, FellowEvent.UPDATE): S.REGISTERING,
    (S.TRAINING, FellowEvent.FAILURE): S.FAILED,
    (S.CHECKPOINTING, FellowEvent.JOB_TERMINAL): S.READY,
    (S.CHECKPOINTING, FellowEvent.FAILURE): S.FAILED,
    (S.FAILED, FellowEvent.RECOVERED): S.READY,
    (S.OFFLINE, FellowEvent.RECONNECT): S.REGISTERING,
    **{(s, FellowEvent.HEARTBEAT_STALE): S.OFFLINE for s in S if s is not S.OFFLINE},
}


def test_table_is_exactly_the_documented_lifecycle():
    assert TRANSITIONS == EXPECTED


@pytest.mark.parametrize(("status", "event"), list(itertools.product(S, FellowEvent)))
def test_every_pair_is_either_a_documented_edge_or_rejected(status, event):
    if (status, event) in EXPECTED:
        assert next_status(status, event) is EXPECTED[(status, event)]
    else:
        with pytest.raises(IllegalTransitionError) as err:
            next_status(status, event)
        assert status.value in err.value.message and event.value in err.value.message
        assert err.value.code == "ILLEGAL_TRANSITION"


def test_every_status_is_reachable_and_offline_is_recoverable():
    reachable = {S.REGISTERING}
    frontier = [S.REGISTERING]
    while frontier:
        current = frontier.pop()
        for (src, _), dst in TRANSITIONS.items():
            if src is current and dst not in reachable:
                reachable.add(dst)
                frontier.append(dst)
    assert reachable == set(S)
