"""When the stages calibrate, and which decisions of a neighbour they refuse (pure)."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from silentswarm.agent.errors import FrameError
from silentswarm.agent.pipe.probe import ChainBack
from silentswarm.agent.runtime.calibrate import Rules, check, next_due
from silentswarm.types.links import LinkStats, Tuning


@pytest.mark.parametrize(
    ("step", "start", "every", "changed", "expected"),
    [
        (0, 0, 100, False, 2),  # the start: again after the warm-up
        (40, 40, 100, False, 42),  # a resumed attempt starts at its own step
        (2, 0, 100, False, 102),  # then every probe_every steps
        (2, 0, 100, True, 4),  # a new micro-batch count: measured once it has compiled
        (2, 0, 0, False, None),  # 0: no more
        (2, 0, 0, True, 4),
    ],
)
def test_next_calibration(step, start, every, changed, expected):
    assert next_due(step, start_step=start, probe_every=every, changed=changed) == expected


AUTO = ["none", "fp16", "fixed_int8", "fixed_int4"]
RULES = Rules(
    n_stages=3, batch_size=16, fwd_codecs=AUTO, bwd_codecs=["none"], max_in_flight=8, fixed=None
)


def decision(**kw) -> ChainBack:
    links = [
        LinkStats(boundary=b, step=5, rtt_ms=1, fwd_mbit_s=10, bwd_mbit_s=10) for b in range(2)
    ]
    back = ChainBack(links=links, tuning=Tuning(step=5, micro_batches=8, in_flight=4))
    tuning = msgspec.structs.replace(back.tuning, **kw.pop("tuning", {}))
    return msgspec.structs.replace(back, tuning=tuning, **kw)


def test_an_allowed_decision_passes():
    check(decision(), RULES, step=5, name="b")


@pytest.mark.parametrize(
    ("back", "rules", "complaint"),
    [
        (decision(links=decision().links[:1]), RULES, "boundaries"),
        (decision(tuning={"step": 4}), RULES, "not for step 5"),
        (
            decision(
                links=[msgspec.structs.replace(x, bwd_codec="fp16") for x in decision().links]
            ),
            RULES,
            "not allowed",
        ),
        (decision(tuning={"micro_batches": 3}), RULES, "do not divide"),
        (decision(tuning={"in_flight": 9}), RULES, "outside 1..8"),
        (decision(tuning={"in_flight": 6}), dataclasses.replace(RULES, max_in_flight=5), "outside"),
        (decision(), dataclasses.replace(RULES, fixed=(4, 1)), "schedule is"),
        (decision(tuning={"overlap": True}), RULES, "steps do not overlap"),
        (decision(), dataclasses.replace(RULES, overlap=True), "steps overlap"),
        (decision(tuning={"deferred": 2}), RULES, "defers 0 weight-gradient passes, not 2"),
        (
            decision(tuning={"deferred": 3}),
            dataclasses.replace(RULES, deferred=2),
            "defers 2 weight-gradient passes, not 3",
        ),
        (
            decision(tuning={"deferred": 8}),
            dataclasses.replace(RULES, deferred=None),
            "not below 8 micro-batches",
        ),
    ],
)
def test_a_neighbour_decision_outside_the_plan_is_refused(back, rules, complaint):
    with pytest.raises(FrameError, match=complaint):
        check(back, rules, step=5, name="b")


@pytest.mark.parametrize(
    ("deferred", "rule"),
    [(0, 0), (7, None), (3, None), (7, 7), (7, 100)],  # a job's count is capped at m - 1
    ids=["none", "chosen-most", "chosen", "fixed", "fixed-capped"],
)
def test_deferred_passes_the_job_allows_pass(deferred, rule):
    back = decision(tuning={"deferred": deferred})
    check(back, dataclasses.replace(RULES, deferred=rule), step=5, name="b")
