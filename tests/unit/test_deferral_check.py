"""The last stage's check of a proposed count of deferred weight-gradient passes."""

from __future__ import annotations

import pytest

from silentswarm.agent.runtime.deferral import DeferralCheck, verdict

S = ("m8", "w8", "int8")  # a schedule setting


@pytest.mark.parametrize(
    ("a", "a_s", "b", "b_s", "kept", "other"),
    [
        (3, [0.36, 0.35, 0.37], 0, [0.39, 0.40, 0.38], 3, 0),  # deferring pays: kept
        (3, [0.41, 0.42, 0.40], 0, [0.39, 0.40, 0.38], 0, 3),  # it costs: the fewer kept
        (3, [0.399, 0.399], 0, [0.400, 0.400], 0, 3),  # 0.25% faster: inside the margin
        (0, [0.40, 0.40], 2, [0.30, 0.30], 2, 0),  # either order of arguments
        (2, [0.30], 5, [0.30], 2, 5),  # a tie: the fewer deferred passes
    ],
)
def test_verdict_keeps_more_deferred_passes_only_when_measurably_faster(
    a, a_s, b, b_s, kept, other
):
    v = verdict(10, a, a_s, b, b_s, margin=0.005)
    assert (v.kept, v.other, v.step) == (kept, other, 10)
    medians = {a: sorted(a_s)[len(a_s) // 2], b: sorted(b_s)[len(b_s) // 2]}
    if len(a_s) % 2 == 0:
        medians[a] = sum(sorted(a_s)[len(a_s) // 2 - 1 : len(a_s) // 2 + 1]) / 2
    if len(b_s) % 2 == 0:
        medians[b] = sum(sorted(b_s)[len(b_s) // 2 - 1 : len(b_s) // 2 + 1]) / 2
    assert v.kept_step_s == pytest.approx(medians[kept])
    assert v.other_step_s == pytest.approx(medians[other])


def run(check: DeferralCheck, step: int, seconds_by_count: dict[int, float], count: int, n: int):
    """``n`` steps from ``step``, each running what the check answers (starting at
    ``count``): the counts run, the verdicts taken, the next step and count."""
    ran, verdicts = [], []
    for s in range(step, step + n):
        ran.append(count)
        out = check.after_step(s, count, seconds_by_count[count])
        if out.verdict is not None:
            verdicts.append(out.verdict)
        count = out.next_count
    return ran, verdicts, step + n, count


def test_a_start_tries_the_proposal_then_the_count_before_it_then_keeps_the_faster():
    check = DeferralCheck(0, S, samples=4)
    times = {0: 0.40, 3: 0.36}
    _, _, step, count = run(check, 0, {0: 1.2}, 0, 2)  # the warm-up: slow, and untimed
    count = check.propose(3, S, most=7)
    assert count == 3
    ran, verdicts, step, count = run(check, step, times, count, 11)
    # 3 for one untimed step and four timed; 0 as long; then the verdict, and the kept
    # count runs on.
    assert ran == [3] * 5 + [0] * 5 + [3]
    assert len(verdicts) == 1
    v = verdicts[0]
    assert (v.kept, v.other, v.step) == (3, 0, 12)
    assert (v.kept_step_s, v.other_step_s) == (0.36, 0.40)
    assert check.current == 3 and check.trial is None and count == 3


def test_a_proposal_that_measures_slower_is_dropped():
    check = DeferralCheck(0, S, samples=3)
    times = {0: 0.40, 5: 0.42}
    check.propose(0, S, most=7)  # a calibration that keeps 0
    _, _, step, count = run(check, 0, times, 0, 5)  # enough steps with 0 since
    count = check.propose(5, S, most=7)
    ran, verdicts, step, count = run(check, step, times, count, 6)
    assert ran == [5, 5, 5, 5, 0, 0]  # no second look at 0: its latest steps are timed
    assert [(v.kept, v.other) for v in verdicts] == [(0, 5)]
    assert count == 0 and check.current == 0


def test_a_proposal_equal_to_the_current_count_starts_no_trial():
    check = DeferralCheck(2, S, samples=3)
    run(check, 0, {2: 0.3}, 2, 4)
    assert check.propose(2, S, most=7) == 2
    assert check.trial is None
    ran, verdicts, _, _ = run(check, 4, {2: 0.3}, 2, 5)
    assert ran == [2] * 5 and verdicts == []


def test_a_new_setting_forgets_every_measurement():
    check = DeferralCheck(0, S, samples=2)
    run(check, 0, {0: 0.5}, 0, 6)
    count = check.propose(4, ("m4", "w4", "int8"), most=7)  # another micro-batch count
    ran, verdicts, _, _ = run(check, 6, {0: 0.5, 4: 0.45}, count, 7)
    # the new setting's first step is untimed, and 0 is measured again under it
    assert ran == [4, 4, 4, 0, 0, 0, 4]
    assert [(v.kept, v.step) for v in verdicts] == [(4, 12)]


def test_only_the_latest_steps_count():
    check = DeferralCheck(0, S, samples=2)
    # 0 ran slowly long ago, then fast: the trial compares with the fast steps
    check.propose(0, S, most=7)
    for s, t in enumerate([0.9, 0.9, 0.9, 0.30, 0.30]):
        check.after_step(s, 0, t)
    count = check.propose(1, S, most=7)
    ran, verdicts, _, _ = run(check, 5, {0: 0.30, 1: 0.31}, count, 3)
    assert ran == [1, 1, 1]
    assert [(v.kept, v.kept_step_s) for v in verdicts] == [(0, 0.30)]


def test_a_second_proposal_of_the_same_count_continues_the_trial_another_restarts_it():
    check = DeferralCheck(0, S, samples=2)
    check.propose(0, S, most=7)
    run(check, 0, {0: 0.4}, 0, 4)
    count = check.propose(3, S, most=7)
    _, _, step, count = run(check, 4, {0: 0.4, 3: 0.3}, count, 2)  # one untimed, one timed
    assert check.propose(3, S, most=7) == 3 and check.trial == (3, 0)
    _, verdicts, step, count = run(check, step, {0: 0.4, 3: 0.3}, count, 1)
    assert [v.kept for v in verdicts] == [3]
    count = check.propose(1, S, most=7)  # the model changed its mind: a new trial against 3
    assert check.trial == (1, 3) and count == 1


def test_a_smaller_micro_batch_count_caps_the_count_in_force():
    """At 8 micro-batches 5 were kept; at 4 at most 3 can be: the check compares the
    proposal with the 3 the stage really runs, and ends."""
    check = DeferralCheck(5, S, samples=2)
    count = check.propose(1, ("m4", "w4", "int8"), most=3)
    assert check.trial == (1, 3)
    ran, verdicts, _, _ = run(check, 10, {1: 0.2, 3: 0.3}, count, 6)
    assert ran == [1, 1, 1, 3, 3, 3]
    assert [(v.kept, v.other) for v in verdicts] == [(1, 3)]


@pytest.mark.integration  # builds TensorFlow stage models
def test_only_the_last_stage_counts_deferred_passes_and_shrinks_its_busy_samples():
    """The agreed count is every stage's, but only the last runs the extra input-gradient
    calls: stage 0's busy samples stay what it measured (before 15c5f7e they were scaled
    down too), the last stage's lose the deferred calls' share."""
    from silentswarm.agent.runtime.stage import StageRunner
    from silentswarm.agent.runtime.tuning import INPUT_GRAD_SHARE
    from silentswarm.plan import ModelConfig, TrainConfig, chain_plans

    model = ModelConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16)
    train = TrainConfig(steps=4, batch_size=8, micro_batches=8, defer_weight_grads=3)
    plans = chain_plans(
        job_id="defer", model=model, train=train, addresses=[None, "tcp://127.0.0.1:1"]
    )
    first, last = (StageRunner(plan, lambda event: None) for plan in plans)
    assert (first.tuning.deferred, last.tuning.deferred) == (3, 3)  # the agreed count
    assert (first.deferred, last.deferred) == (0, 3)  # the passes each runs
    for runner in (first, last):
        for busy_s in (9.9, 0.8):  # the first step's (it compiles) is not kept
            runner._sample_compute(busy_s)
    assert first.busy_points() == [(8, 0.8)]
    ((m, busy),) = last.busy_points()
    assert m == 8 and busy == pytest.approx(0.8 * 8 / (8 + INPUT_GRAD_SHARE * 3))
