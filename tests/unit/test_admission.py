"""Who may report progress, and how much: leader.admission's rules as tables."""

from __future__ import annotations

import pytest

from silentswarm.jobspec import PlacedStage, Placement, Transport
from silentswarm.leader.admission import RateLimiter, Verdict, admit_progress
from silentswarm.protocol import Progress
from silentswarm.types.links import LinkStats
from tests.fakes import Clock

PLACEMENT = Placement(
    stages=[
        PlacedStage(stage=0, fellow_id="a", hostname="h", layer_start=0, layer_end=2),
        PlacedStage(stage=1, fellow_id="b", hostname="h", layer_start=2, layer_end=4),
    ],
    transport=Transport.AUTO,
)


def progress(fellow="b", stage=1, attempt=2, job="j1", replica=0, boundary=None):
    link = None
    if boundary is not None:
        link = LinkStats(boundary=boundary, step=0, rtt_ms=1.0, fwd_mbit_s=9.0, bwd_mbit_s=9.0)
    return Progress(
        job_id=job,
        fellow_id=fellow,
        attempt=attempt,
        stage=stage,
        step=1,
        replica=replica,
        down_link=link,
    )


@pytest.mark.parametrize(
    ("attempt", "placement", "record", "verdict", "reason"),
    [
        (2, PLACEMENT, progress(), Verdict.ADMIT, ""),
        (2, PLACEMENT, progress(fellow="a", stage=0), Verdict.ADMIT, ""),
        (None, None, progress(), Verdict.REFUSE, "no job"),
        (2, PLACEMENT, progress(fellow="mallory", stage=1), Verdict.REFUSE, "not placed"),
        (2, PLACEMENT, progress(fellow="a", stage=1), Verdict.REFUSE, "runs stage 0"),
        (2, PLACEMENT, progress(fellow="b", stage=None), Verdict.REFUSE, "runs stage 1"),
        (2, PLACEMENT, progress(replica=1), Verdict.REFUSE, "runs replica 0, not replica 1"),
        (2, PLACEMENT, progress(attempt=3), Verdict.REFUSE, "not the job's current attempt"),
        (2, PLACEMENT, progress(attempt=999), Verdict.REFUSE, "not the job's current attempt"),
        (2, None, progress(), Verdict.REFUSE, "not the job's current attempt"),
        (2, PLACEMENT, progress(attempt=1), Verdict.STALE, "is over"),
        (2, PLACEMENT, progress(fellow="a", stage=0, boundary=0), Verdict.ADMIT, ""),
        (2, PLACEMENT, progress(boundary=0), Verdict.REFUSE, "not the upstream end of boundary 0"),
    ],
)
def test_only_the_placed_stage_of_the_current_attempt_reports(
    attempt, placement, record, verdict, reason
):
    admission = admit_progress(attempt, placement, record)
    assert admission.verdict is verdict
    assert reason in admission.reason


def test_the_rate_limiter_admits_bursts_then_the_rate_per_key():
    clock = Clock(0.0)
    limiter = RateLimiter(rate=10.0, burst=5.0, clock=clock)
    assert [limiter.allow("a") for _ in range(7)] == [True] * 5 + [False] * 2
    assert limiter.allow("b")  # another fellow has its own bucket
    clock.advance(0.25)  # 2.5 tokens back
    assert [limiter.allow("a") for _ in range(3)] == [True, True, False]
    clock.advance(100.0)  # never more than the burst
    assert sum(limiter.allow("a") for _ in range(10)) == 5


def test_the_rate_limiter_forgets_the_least_recent_keys():
    limiter = RateLimiter(rate=1.0, burst=1.0, max_keys=3, clock=lambda: 0.0)
    for key in "abcd":
        assert limiter.allow(key)
    assert len(limiter._buckets) == 3
    assert limiter.allow("a")  # forgotten: starts again full
    assert not limiter.allow("d")
