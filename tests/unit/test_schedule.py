import itertools

import pytest

from silentswarm.agent.runtime.schedule import (
    DelayedUpdates,
    Op,
    OpTimes,
    PendingUpdate,
    Slot,
    Step,
    bubble_fraction,
    gpipe,
    ideal_speedup,
    lr_at,
    max_in_flight,
    one_f_one_b,
    overlapped,
    overlapped_period,
    simulate,
    step_period,
)
from silentswarm.plan import stage_in_flight


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


def _period(p: int, m: int, times: list[OpTimes]) -> float:
    return step_period([one_f_one_b(s, p, m) for s in range(p)], times)


@pytest.mark.parametrize(
    ("p", "m", "times", "expected"),
    [
        # one stage: m forwards and backwards, then its apply
        (1, 4, [OpTimes(1, 2, 0.5)], 4 * 3 + 0.5),
        # equal stages: (m + p - 1) slots of forward + backward, the 1F1B bubble
        (2, 4, [OpTimes(1, 1)] * 2, (4 + 1) * 2),
        (2, 8, [OpTimes(1, 1)] * 2, (8 + 1) * 2),
        (3, 8, [OpTimes(1, 1)] * 3, (8 + 2) * 2),
        # a fused last stage (all its work in the forward) three times the first's ops:
        # the first forward, m fused calls, the first stage's last backward
        (2, 4, [OpTimes(1, 1), OpTimes(3, 0)], 1 + 4 * 3 + 1),
        # the applies are on the critical path once per step
        (2, 4, [OpTimes(1, 1, 0.5), OpTimes(1, 1, 0.5)], 10.5),
    ],
)
def test_step_period_of_measured_op_times(p, m, times, expected):
    assert _period(p, m, times) == pytest.approx(expected)


def test_step_period_matches_the_ideal_speedup_for_an_even_split():
    """Halving a one-stage model's ops across 2 stages gives the formula's speedup."""
    m = 8
    one = _period(1, m, [OpTimes(2, 4)])
    two = _period(2, m, [OpTimes(1, 2)] * 2)
    assert one / two == pytest.approx(ideal_speedup(2, m, cores=2))


def test_step_period_refuses_mismatched_input():
    with pytest.raises(ValueError):
        step_period([one_f_one_b(0, 2, 4), one_f_one_b(1, 2, 4)], [OpTimes(1, 1)])
    with pytest.raises(ValueError):
        step_period([one_f_one_b(0, 1, 4)], [OpTimes(1, 1)], steps=1)


@pytest.mark.parametrize(("p", "m"), list(itertools.product([2, 3, 4], [1, 2, 4, 8])))
@pytest.mark.parametrize("window", [1, 2, 3, 5, 8])
def test_an_in_flight_window_never_deadlocks_and_bounds_activations(p, m, window):
    window = min(window, m)
    schedules = [one_f_one_b(s, p, m, window) for s in range(p)]
    simulate(schedules)
    for s, steps in enumerate(schedules):
        held = stage_in_flight(s, p, m, window)
        assert max_in_flight(steps) == held
        assert held == (1 if s == p - 1 else min(m, max(p - s, window)))
    helds = [stage_in_flight(s, p, m, window) for s in range(p)]
    assert helds == sorted(helds, reverse=True)  # never grows along the chain


def test_none_window_is_1f1b():
    for s in range(3):
        assert one_f_one_b(s, 3, 8, None) == one_f_one_b(s, 3, 8)


@pytest.mark.parametrize(
    ("link_ms", "window", "slower_than_loopback"),
    [(0, None, False), (25, None, True), (25, 8, False)],
)
def test_a_window_hides_link_latency(link_ms, window, slower_than_loopback):
    # The speed model's stage op times (ms): stage 0 tape, the fused last stage.
    times = [OpTimes(0.027, 0.048, 0.011), OpTimes(0.058, 0.0, 0.011)]
    base = step_period([one_f_one_b(s, 2, 8) for s in range(2)], times)
    period = step_period(
        [one_f_one_b(s, 2, 8, window) for s in range(2)], times, link_s=link_ms / 1e3
    )
    assert (period > 1.1 * base) is slower_than_loopback, (period, base)


def test_link_time_is_paid_per_crossing():
    times = [OpTimes(0.01, 0.01), OpTimes(0.01, 0.0)]
    one = [[Step(Op.FORWARD, 0), Step(Op.BACKWARD, 0)], [Step(Op.FORWARD, 0), Step(Op.BACKWARD, 0)]]
    # F0 (10) -> link -> last F (10) and B (0) -> link -> B0 (10): 30 ms of compute + 2 links.
    assert step_period(one, times, link_s=0.005) == pytest.approx(0.040)


def test_each_boundary_and_direction_has_its_own_link_time():
    times = [OpTimes(0.01, 0.01), OpTimes(0.01, 0.0)]
    one = [[Step(Op.FORWARD, 0), Step(Op.BACKWARD, 0)], [Step(Op.FORWARD, 0), Step(Op.BACKWARD, 0)]]
    # 30 ms of compute, 2 ms forward, 7 ms back.
    assert step_period(one, times, link_s=[(0.002, 0.007)]) == pytest.approx(0.039)
    assert step_period(one, times, link_s=[(0.005, 0.005)]) == step_period(one, times, link_s=0.005)
    with pytest.raises(ValueError, match="boundaries"):
        step_period(one, times, link_s=[(0.001, 0.001), (0.001, 0.001)])


@pytest.mark.parametrize("overlap", [False, True], ids=["1f1b", "overlap"])
def test_frames_queue_for_a_link_that_carries_less_than_the_stages_produce(overlap):
    """8 micro-batches of 10 ms work per stage and direction, frames that each take 40 ms of
    a 20 ms-delay link: the link sets the pace (8 x 40 ms each way, not one frame's time),
    and a link that keeps up costs only its delay."""
    times = [OpTimes(0.005, 0.005), OpTimes(0.005, 0.005)]

    def period(transfer: float) -> float:
        crossing, busy = [(0.02 + transfer,) * 2], [(transfer,) * 2]
        if overlap:
            return overlapped_period(2, 8, 8, times, link_s=crossing, transfer_s=busy)
        schedules = [one_f_one_b(s, 2, 8, 8) for s in range(2)]
        return step_period(schedules, times, link_s=crossing, transfer_s=busy)

    assert period(0.040) >= 8 * 0.040
    unqueued = step_period(
        [one_f_one_b(s, 2, 8, 8) for s in range(2)], times, link_s=[(0.06, 0.06)]
    )
    assert unqueued < 0.3 < period(0.040)  # without queueing the frames overlap on the link
    assert period(0.001) < 0.25


@pytest.mark.parametrize(
    ("p", "m", "window"), [(2, 4, None), (3, 4, 4), (4, 2, None), (2, 1, None)]
)
def test_the_overlap_schedule_is_1f1b_without_breaks_and_never_deadlocks(p, m, window):
    """Each step's micro-batches once each way, in order; the window is the step's; the next
    step's forwards start before this step's last backward wherever the window allows."""
    steps = 3
    schedules = [overlapped(s, p, m, steps, window) for s in range(p)]
    for s, slots in enumerate(schedules):
        for op in Op:
            assert [(k, i) for o, k, i in slots if o is op] == [
                (k, i) for k in range(steps) for i in range(m)
            ]
        live = peak = 0
        for slot in slots:
            live += 1 if slot.op is Op.FORWARD else -1
            peak = max(peak, live)
        assert peak == stage_in_flight(s, p, m, window)
        ahead = slots.index(Slot(Op.FORWARD, 1, 0)) < slots.index(Slot(Op.BACKWARD, 0, m - 1))
        assert ahead == (peak > 1)
    flat = [[Step(op, k * m + i) for op, k, i in slots] for slots in schedules]
    simulate(flat)  # raises on a deadlock


@pytest.mark.parametrize("link_ms", [0, 5, 25])
def test_overlapping_steps_hides_the_fill_the_drain_and_the_round_trip(link_ms):
    """A synchronous step pays the bubble and the round trip; overlapped steps with a window
    that covers the round trip run at the stages' own pace (4 micro-batches of 10 ms forward
    + 20 ms backward, and an update: 122 ms)."""
    times = [OpTimes(0.010, 0.020, 0.002)] * 2
    link = link_ms / 1e3
    for window in (None, 4):
        sync = step_period([one_f_one_b(s, 2, 4, window) for s in range(2)], times, link_s=link)
        over = overlapped_period(2, 4, window, times, steps=10, link_s=link)
        assert over < sync
    assert over == pytest.approx(0.122, rel=0.01)
    with pytest.raises(ValueError):
        overlapped_period(2, 4, None, times[:1])


@pytest.mark.parametrize(
    ("events", "applied", "pending"),
    [
        # stage 0 (window 2): the next step's first forward comes before this step's end
        ([("f", 0), ("f", 1), ("d", 0), ("f", 2), ("d", 1), ("f", 3), ("d", 2)], [0, 1], 2),
        # the last stage: a step ends before the next one's first forward
        ([("f", 0), ("d", 0), ("f", 1), ("d", 1), ("f", 2), ("d", 2)], [0, 1], 2),
        # resumed after step 4 holding step 3's gradient: applied before step 5's forward
        ([("held", 3), ("f", 4), ("f", 5), ("d", 4)], [3], 4),
        ([("held", 3), ("f", 4), ("d", 4), ("f", 5)], [3], 4),
        ([("f", 0), ("d", 0), ("flush", None)], [0], None),
    ],
)
def test_delayed_updates_apply_each_step_once_before_the_step_after_next(events, applied, pending):
    updates = DelayedUpdates()
    out = []
    for kind, k in events:
        if kind == "held":
            updates.pending = PendingUpdate(step=k, micro_batches=4)
        elif kind == "f":
            due = updates.before_forward(k)
            assert due is None or due.step <= k - 2, "step k runs the weights of updates to k - 2"
            out.append(due)
        elif kind == "d":
            out.append(updates.step_done(k, 4))
        else:
            out.append(updates.flush())
    assert [d.step for d in out if d is not None] == applied
    assert all(d.micro_batches == 4 for d in out if d is not None)
    assert (None if updates.pending is None else updates.pending.step) == pending
