import itertools

import pytest

from silentswarm.agent.runtime.schedule import (
    Op,
    Step,
    bubble_fraction,
    gpipe,
    ideal_speedup,
    lr_at,
    max_in_flight,
    one_f_one_b,
    simulate,
)


@pytest.mark.parametrize(("p", "m"), list(itertools.product([1, 2, 3, 4, 6], [1, 2, 3, 4, 8])))
@pytest.mark.parametrize("schedule", [one_f_one_b, gpipe])
def test_every_stage_runs_each_micro_batch_once_each_way_and_never_deadlocks(schedule, p, m):
    schedules = [schedule(s, p, m) for s in range(p)]
    for steps in schedules:
        assert sorted(i for op, i in steps if op is Op.FORWARD) == list(range(m))
        assert sorted(i for op, i in steps if op is Op.BACKWARD) == list(range(m))
        for i in range(m):
            assert steps.index(Step(Op.FORWARD, i)) < steps.index(Step(Op.BACKWARD, i))
    slots = simulate(schedules)
    assert slots >= 2 * m


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 8), (4, 4)])
def test_1f1b_bounds_activations_by_depth_and_gpipe_does_not(p, m):
    for s in range(p):
        assert max_in_flight(one_f_one_b(s, p, m)) == min(p - s, m)
        assert max_in_flight(gpipe(s, p, m)) == m


def test_last_stage_alternates_and_first_stage_warms_up():
    assert one_f_one_b(1, 2, 3) == [
        Step(Op.FORWARD, 0),
        Step(Op.BACKWARD, 0),
        Step(Op.FORWARD, 1),
        Step(Op.BACKWARD, 1),
        Step(Op.FORWARD, 2),
        Step(Op.BACKWARD, 2),
    ]
    assert [op for op, _ in one_f_one_b(0, 3, 4)][:2] == [Op.FORWARD, Op.FORWARD]


def test_a_deadlocking_order_is_caught():
    bad = [[Step(Op.BACKWARD, 0), Step(Op.FORWARD, 0)], one_f_one_b(1, 2, 1)]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(bad)


def test_ideal_speedup_and_bubble():
    assert ideal_speedup(2, 4, 2) == pytest.approx(2 * 4 / 5)
    assert ideal_speedup(4, 4, 2) == pytest.approx(2 * 4 / 7)
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)


def test_lr_warms_up_then_decays_to_the_floor():
    kw = {"base": 1.0, "warmup": 10, "total": 110, "min_ratio": 0.1}
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert lr_at(500, **kw) == pytest.approx(0.1)
    values = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))
