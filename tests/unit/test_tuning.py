"""The tuner: codecs and schedules chosen from measured links and stage costs (pure)."""

from __future__ import annotations

import pytest

from silentswarm.agent.runtime.tuning import (
    AUTO_CODECS,
    INPUT_GRAD_SHARE,
    StageCost,
    TuneInput,
    fit_cost,
    tune,
    undeferred_busy,
    wire_bytes_per_sample,
)
from silentswarm.compression import parse_wire_codec
from silentswarm.types.links import LinkStats

NONE, FP16, INT8, INT4 = AUTO_CODECS
SEQ, DIMS = 128, 256  # the speed model's boundary: 128 KiB of float32 per sample


def link(mbit: float, rtt_ms: float = 0.2, back_mbit: float | None = None) -> LinkStats:
    return LinkStats(
        boundary=0,
        step=2,
        rtt_ms=rtt_ms,
        fwd_mbit_s=mbit,
        bwd_mbit_s=mbit if back_mbit is None else back_mbit,
    )


def test_auto_codecs_are_ordered_from_least_to_most_lossy():
    assert [c.name for c in AUTO_CODECS] == ["none", "fp16", "fixed_int8", "fixed_int4"]
    sizes = [wire_bytes_per_sample(c, SEQ, DIMS) for c in AUTO_CODECS]
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] == SEQ * DIMS * 4
    assert sizes[2] == SEQ * DIMS + 2 * SEQ  # one byte a value, a bfloat16 scale a row


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        ([], None),
        ([(4, 0.8)], StageCost(per_step=0.8, explore=4)),
        ([(4, 0.8), (4, 0.9)], StageCost(per_step=0.85, explore=4)),
        ([(4, 0.8), (8, 1.0)], StageCost(per_step=0.6, per_micro=0.05)),
        ([(4, 0.8), (8, 0.7)], StageCost(per_step=0.75, per_micro=0.0)),  # faster at 8: no cost
        ([(4, 0.4), (8, 0.8)], StageCost(per_step=0.0, per_micro=0.1)),  # all per micro-batch
    ],
)
def test_a_stage_cost_is_fitted_to_its_measured_steps(points, expected):
    got = fit_cost(points)
    if expected is None:
        assert got is None
        return
    assert got.per_step == pytest.approx(expected.per_step)
    assert got.per_micro == pytest.approx(expected.per_micro)
    assert got.explore == expected.explore


def inp(**kw) -> TuneInput:
    base = {
        "batch_size": 16,
        "seq_len": SEQ,
        "dims": DIMS,
        "links": [link(10_000)],
        "busy": [[(4, 0.8)], [(4, 0.8)]],
        "codecs": [(NONE, NONE)],
        "auto_fwd": True,
        "auto_bwd": True,
        "micro_batches": 4,
        "in_flight": 1,
        "auto_micro_batches": True,
    }
    return TuneInput(**{**base, **kw})


def test_nothing_measured_keeps_what_is_in_force():
    got = tune(inp(busy=[[], [(4, 0.8)]], codecs=[(FP16, INT8)]))
    assert (got.codecs, got.micro_batches, got.in_flight) == ([(FP16, INT8)], 4, 1)
    assert got.predicted_step_s is None


def test_a_fast_link_keeps_full_precision():
    got = tune(inp())
    assert got.codecs == [(NONE, NONE)]
    assert got.predicted_step_s is not None


@pytest.mark.parametrize(
    ("mbit", "rtt_ms", "back_mbit", "window", "expected"),
    [
        # 0.8 s of work per step of 16 samples per stage, 8 micro-batches all in flight.
        (10_000, 0.2, None, 8, ("none", "none")),
        # wan100: float32 both ways costs more than 3% against the fewest bytes; the forward
        # direction, whose turn comes first, keeps full precision, the backward takes fp16.
        (100, 50, None, 8, ("none", "fp16")),
        (20, 100, None, 8, ("fixed_int8", "fixed_int8")),  # wan20
        (20, 100, 10, 8, ("fixed_int8", "fixed_int4")),  # each direction on its own
        (20, 100, None, 1, ("fixed_int4", "fixed_int4")),  # 1F1B pays every transfer
        (2, 100, None, 8, ("fixed_int4", "fixed_int4")),  # nothing keeps up: fewest bytes
    ],
)
def test_each_direction_gets_the_least_lossy_codec_that_keeps_the_step_near_its_fastest(
    mbit, rtt_ms, back_mbit, window, expected
):
    got = tune(
        inp(
            links=[link(mbit, rtt_ms, back_mbit)],
            auto_micro_batches=False,
            micro_batches=8,
            in_flight=window,
        )
    )
    assert tuple(c.name for c in got.codecs[0]) == expected
    assert (got.micro_batches, got.in_flight) == (8, window)


def test_a_fixed_direction_keeps_its_codec():
    got = tune(inp(links=[link(2, rtt_ms=100)], auto_bwd=False, codecs=[(NONE, FP16)]))
    assert got.codecs == [(INT4, FP16)]


def test_latency_gets_more_micro_batches_in_flight_but_no_more_than_explored():
    got = tune(inp(links=[link(20, rtt_ms=100)]))
    # One count measured so far: at most twice it, and a window that covers the round trip.
    assert got.micro_batches == 8
    assert got.in_flight > 2
    fixed = tune(inp(links=[link(20, rtt_ms=100)], auto_micro_batches=False))
    assert got.predicted_step_s < fixed.predicted_step_s


def test_a_fitted_cost_per_micro_batch_stops_the_counts_from_growing():
    # At 16 micro-batches each costs 50 ms of fixed work: more than the bubble it saves.
    busy = [[(8, 0.8), (16, 1.2)], [(8, 0.8), (16, 1.2)]]
    got = tune(inp(busy=busy, micro_batches=16, in_flight=16))
    assert got.micro_batches < 16


def test_a_spec_count_is_kept_and_the_schedule_in_force_wins_a_near_tie():
    got = tune(inp(links=[link(20, rtt_ms=100)], auto_micro_batches=False))
    assert (got.micro_batches, got.in_flight) == (4, 1)
    # On loopback the bubble of 4 micro-batches is 5/4 against 9/8 for 8 (10% apart), but
    # the measured cost per micro-batch of 8 eats that up: 4 stays.
    busy = [[(4, 0.8), (8, 0.9)], [(4, 0.8), (8, 0.9)]]
    got = tune(inp(busy=busy))
    assert (got.micro_batches, got.in_flight) == (4, 1)


def test_a_window_cap_is_respected():
    got = tune(inp(links=[link(20, rtt_ms=100)], in_flight_cap=2))
    assert got.in_flight <= 2


def test_mismatched_input_is_refused():
    with pytest.raises(ValueError):
        tune(inp(links=[]))


def test_every_codec_name_parses_back():
    for codec in AUTO_CODECS:
        assert parse_wire_codec(codec.name) == codec


def test_no_boundary_of_a_long_chain_is_left_at_the_fewest_bytes_while_others_are_exact():
    links = [
        LinkStats(boundary=b, step=2, rtt_ms=50, fwd_mbit_s=100, bwd_mbit_s=100) for b in range(5)
    ]
    got = tune(
        inp(
            batch_size=64,
            links=links,
            busy=[[(8, 0.8), (16, 1.0)]] * 6,
            codecs=[(NONE, NONE)] * 5,
            micro_batches=8,
            in_flight=8,
            auto_micro_batches=False,
        )
    )
    ranks = [AUTO_CODECS.index(c) for pair in got.codecs for c in pair]
    assert max(ranks) - min(ranks) <= 1, got.codecs  # turns: one level apart at most


def test_the_overlap_schedule_is_predicted_as_such_and_needs_fewer_micro_batches():
    """Overlapped steps have no fill and drain to amortize: at 100 ms round trips the tuner
    predicts a faster step than the synchronous schedule's and settles for fewer
    micro-batches to get it."""
    busy = [[(4, 0.4), (8, 0.44)], [(4, 0.4), (8, 0.44)]]
    kw = dict(links=[link(100, rtt_ms=100)], busy=busy)
    sync = tune(inp(**kw))
    over = tune(inp(overlap=True, **kw))
    assert over.predicted_step_s < sync.predicted_step_s
    assert over.micro_batches <= sync.micro_batches


def test_the_targets_each_forward_frame_carries_count_in_the_prediction():
    """Every forward frame also carries its micro-batch's target ids: on a slow link the
    prediction pays for their bytes, forward only."""
    slow = [link(2.0)]
    fixed = {"auto_fwd": False, "auto_bwd": False, "auto_micro_batches": False}
    without = tune(inp(links=slow, codecs=[(INT8, INT8)], **fixed))
    with_ids = tune(inp(links=slow, codecs=[(INT8, INT8)], target_bytes=4, **fixed))
    extra_s = 16 * SEQ * 4 / (2.0 * 1e6 / 8)  # a step's ids at 2 Mbit/s
    assert with_ids.predicted_step_s > without.predicted_step_s
    assert with_ids.predicted_step_s - without.predicted_step_s <= extra_s * 1.01


# The speed model over wan100 as measured (2026-12-05): stage 0 is the slower stage (45 ms of
# work per micro-batch against the last stage's 35), the link 51 ms round trip, 97 Mbit/s.
SPEED_BUSY = [[(8, 0.36)], [(8, 0.28)]]
SPEED_FIXED = {"auto_fwd": False, "auto_bwd": False, "auto_micro_batches": False}


def speed_inp(rtt_ms: float, mbit: float, **kw) -> TuneInput:
    fields = {
        "links": [link(mbit, rtt_ms)],
        "busy": SPEED_BUSY,
        "codecs": [(INT8, INT8)],
        "micro_batches": 8,
        "in_flight": 8,
        **SPEED_FIXED,
    }
    return inp(**{**fields, **kw})


@pytest.mark.parametrize(
    ("rtt_ms", "mbit", "chosen"),
    [
        (0.3, 10_000, 0),  # loopback: nothing waits for the last gradient, so nothing defers
        (51, 97, 3),  # wan100: the last gradient's round trip is a sixth of the step
    ],
    ids=["loopback", "wan100"],
)
def test_deferred_weight_passes_are_chosen_where_the_step_waits_on_the_round_trip(
    rtt_ms, mbit, chosen
):
    got = tune(speed_inp(rtt_ms, mbit, auto_deferred=True))
    undeferred = tune(speed_inp(rtt_ms, mbit))
    assert got.deferred == chosen
    assert undeferred.deferred == 0
    if chosen:
        assert got.predicted_step_s < undeferred.predicted_step_s * 0.97
    else:
        assert got.predicted_step_s == pytest.approx(undeferred.predicted_step_s)


def test_a_jobs_own_deferral_is_kept_below_the_count_and_overlap_defers_nothing():
    got = tune(speed_inp(51, 97, deferred=20))
    assert got.deferred == 7  # m - 1: the step's last micro-batch defers, not a later one
    assert tune(speed_inp(51, 97, deferred=2)).deferred == 2
    assert tune(speed_inp(51, 97, auto_deferred=True, overlap=True)).deferred == 0
    nothing = tune(speed_inp(51, 97, busy=[[], [(8, 0.28)]], deferred=2))
    assert (nothing.deferred, nothing.predicted_step_s) == (2, None)


@pytest.mark.parametrize(
    ("busy", "m", "deferred", "expected"),
    [
        (0.40, 8, 0, 0.40),  # nothing deferred: as measured
        (8 * 0.03 + 3 * 0.67 * 0.03, 8, 3, 8 * 0.03),  # three input-gradient calls taken out
        (1.0, 1, 0, 1.0),
    ],
)
def test_a_last_stages_sample_is_fitted_without_its_deferred_passes_extra_calls(
    busy, m, deferred, expected
):
    """The model adds deferral's cost itself (INPUT_GRAD_SHARE of a call per deferred
    micro-batch): a sample that keeps it would count it twice."""
    assert INPUT_GRAD_SHARE == 0.67
    assert undeferred_busy(busy, m, deferred) == pytest.approx(expected)
