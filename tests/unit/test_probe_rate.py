"""The rate of a probe burst from its pieces' arrival times (pure)."""

from __future__ import annotations

import pytest

from silentswarm.agent.pipe.probe import CHUNK, MAX_RATE_MBIT_S, burst_rate, link_rate

RATE = 2.0  # Mbit/s
PIECE_S = CHUNK * 8 / (RATE * 1e6)


def steady(pieces: int, free: int = 0) -> list[float]:
    """Arrival times at RATE; the first ``free`` pieces pass at once (a shaper's bucket)."""
    return [(k - free + 1) * PIECE_S if k >= free else 0.0 for k in range(pieces)]


def late(times: list[float], upto: int, until: float) -> list[float]:
    """Pieces up to ``upto`` read no earlier than ``until`` (a reader that stalled)."""
    return [max(t, until) if k <= upto else t for k, t in enumerate(times)]


CASES = {
    "steady": steady(16),
    "a shaper's bucket lets four pieces through at once": steady(16, free=4),
    "the first piece read late": late(steady(16), 0, 0.5 * 3 * PIECE_S),
    "the first three pieces read in one clump": late(steady(16), 2, 3 * PIECE_S),
    "a clump in the middle": late(steady(32), 12, 13 * PIECE_S),
    "a stall mid-burst, then the backlog at once": late(steady(32), 20, 20 * PIECE_S + 0.3),
}


@pytest.mark.parametrize("times", CASES.values(), ids=CASES.keys())
def test_the_rate_is_the_link_s_whatever_the_reader_did(times):
    assert burst_rate(times, [CHUNK] * len(times)) == pytest.approx(RATE, rel=0.02)


def test_the_span_from_first_to_last_would_have_counted_a_late_first_read_as_speed():
    """What the robust rate is for: the naive one is 17% high on the same arrivals."""
    times = late(steady(16), 2, 3 * PIECE_S)
    naive = CHUNK * 15 * 8 / (times[-1] - times[0]) / 1e6
    assert naive > 1.15 * RATE
    assert burst_rate(times, [CHUNK] * 16) == pytest.approx(RATE, rel=0.02)


def test_a_stall_before_the_last_piece_can_only_make_the_link_look_slower():
    times = steady(16)
    times[-1] += 2 * PIECE_S
    assert 0.8 * RATE < burst_rate(times, [CHUNK] * 16) < RATE


def test_pieces_read_together_are_faster_than_the_clock_can_tell():
    assert burst_rate([1.0] * 8, [CHUNK] * 8) == MAX_RATE_MBIT_S
    assert burst_rate([1.0], [CHUNK]) == MAX_RATE_MBIT_S


def test_a_short_last_piece_counts_its_own_bytes():
    times = steady(8)
    sizes = [CHUNK] * 7 + [CHUNK // 2]
    times[-1] = times[-2] + PIECE_S / 2
    assert burst_rate(times, sizes) == pytest.approx(RATE, rel=0.02)


def test_a_shaper_that_releases_four_pieces_at_a_time_measures_its_rate():
    """tbf lets a 64 KiB segment through when its tokens are there: pieces come in fours."""
    times = [(k // 4) * 4 * PIECE_S for k in range(32)]
    assert burst_rate(times, [CHUNK] * 32) == pytest.approx(RATE, rel=0.1)


def test_a_fast_link_read_in_batches_is_measured_over_the_batches():
    """1 Gbit/s, pieces read eight at a time: the span between batches carries the rate."""
    piece_s = CHUNK * 8 / 1e9
    times = [(k // 8) * 8 * piece_s + (k % 8) * 1e-6 for k in range(512)]
    assert burst_rate(times, [CHUNK] * 512) == pytest.approx(1000, rel=0.05)


MIB = 1024 * 1024
ROUNDS = {
    # (bytes, Mbit/s) per round -> the link's rate
    "a short first burst's outlier is not the link's rate": (
        [(MIB // 4, 44.8), (1200 * 1024, 38.3)],
        38.3,
    ),
    "the best of the bursts long enough to time": (
        [(MIB // 4, 9.6), (MIB // 2, 9.9), (MIB, 9.5)],
        9.9,
    ),
    "a fast link's bursts are all short: the best of them": (
        [(MIB // 4, 900.0), (8 * MIB, 2500.0)],
        2500.0,
    ),
    "a burst the reader could not time": ([(MIB // 4, 0.0), (MIB // 2, 40.0)], 40.0),
    "no rounds": ([], 0.0),
}


@pytest.mark.parametrize(("rounds", "rate"), ROUNDS.values(), ids=ROUNDS.keys())
def test_the_link_s_rate_comes_from_bursts_long_enough_to_time(rounds, rate):
    assert link_rate(rounds) == rate
