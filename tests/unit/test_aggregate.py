"""Merging per-fellow progress into a job view, the history curve, the log buffer and the
log shipper's bounded queue: pure logic."""

import logging

from agent.logship import FellowLogShipper
from leader.aggregate import JobMetricsAggregator, history
from leader.logs import WorkerLogBuffer
from swarm.protocol import LogBatch, LogRecord, Progress, ProgressEvent, StageOutcome, StageResult


def step(fellow, stage, n, at, *, loss=None, attempt=1, sent=0, down=0, total=100):
    return Progress(
        job_id="j",
        fellow_id=fellow,
        attempt=attempt,
        stage=stage,
        step=n,
        total_steps=total,
        loss=loss,
        step_time_s=0.5,
        tokens_per_s=1000.0,
        bytes_sent=sent,
        bytes_received=sent,
        down_bytes_sent=down,
        at=at,
    )


def test_merged_view_takes_the_slowest_step_and_the_last_stages_loss():
    agg = JobMetricsAggregator("j")
    for i in range(1, 11):
        agg.apply(step("a", 0, i, 100.0 + i, sent=1000 * i, down=1000 * i))
        agg.apply(step("b", 1, i - 1, 100.5 + i, loss=5.0 - i / 10, sent=1000 * i))
    view = agg.view()
    assert view.step == 9 and view.total_steps == 100
    assert view.loss == 5.0 - 1.0 and view.fellows[1].fellow_id == "b"
    assert view.steps_per_min == 60.0  # one step a second
    assert view.eta_s == 91 * 1.0
    [boundary] = view.boundaries
    assert (boundary.upstream, boundary.downstream, boundary.bytes_per_s) == ("a", "b", 1000.0)
    assert view.bytes_sent == 10_000 + 10_000


def test_an_empty_view_is_valid():
    view = JobMetricsAggregator("j").view()
    assert view.step == 0 and view.boundaries == [] and view.fellows == []


def test_a_new_attempt_starts_afresh_and_old_ones_are_ignored():
    agg = JobMetricsAggregator("j")
    agg.apply(step("a", 0, 50, 1.0, loss=2.0))
    agg.apply(step("a", 0, 3, 2.0, loss=4.0, attempt=2))
    assert agg.view().step == 3 and agg.view().attempt == 2
    assert agg.apply(step("a", 0, 60, 3.0, loss=1.0)) is None
    ended = Progress(
        job_id="j",
        fellow_id="a",
        attempt=2,
        step=3,
        event=ProgressEvent.ENDED,
        outcome=StageOutcome(job_id="j", attempt=2, result=StageResult.FAILED),
    )
    agg.apply(ended)
    assert agg.view().fellows[0].result is StageResult.FAILED


def test_history_is_one_point_per_finished_step_of_the_latest_attempt():
    records = [step("b", 1, 1, 1.0, loss=9.0, attempt=1)]  # an attempt that failed
    records += [step("a", 0, i, 10.0 + i, attempt=2) for i in range(1, 4)]
    records += [step("b", 1, i, 10.5 + i, loss=5.0 - i, attempt=2) for i in (1, 2, 2, 3)]
    points = history(records, "j")
    assert [p.step for p in points] == [1, 2, 3]
    assert [p.loss for p in points] == [4.0, 3.0, 2.0]


def test_log_buffer_is_bounded_per_fellow_and_skips_replays():
    buffer = WorkerLogBuffer(per_fellow=3)
    batch = LogBatch(
        fellow_id="f",
        records=[LogRecord(ts=i, level="INFO", logger="x", message=str(i)) for i in range(5)],
    )
    buffer.add(1, batch)
    buffer.add(1, batch)  # the same stream record again
    assert [e.message for e in buffer.snapshot("f", 10)] == ["2", "3", "4"]
    assert [e.message for e in buffer.snapshot("f", 1)] == ["4"]
    assert buffer.snapshot("nobody", 5) == [] and buffer.snapshot("f", 0) == []


def test_the_shipper_never_blocks_drops_the_oldest_and_batches_within_bounds():
    shipper = FellowLogShipper("f", capacity=5)
    logger = logging.getLogger("test.shipper")
    logger.addHandler(shipper)
    logger.setLevel(logging.INFO)
    try:
        for i in range(8):
            logger.info("line %d", i)
    finally:
        logger.removeHandler(shipper)
    assert shipper.dropped == 3
    batch = shipper.take()
    assert [r.message for r in batch] == [f"line {i}" for i in range(3, 8)]
    shipper.give_back(batch)  # a failed publish keeps them for the next try
    assert [r.message for r in shipper.take()] == [f"line {i}" for i in range(3, 8)]
    shipper.add("INFO", "big", "x" * 100_000)
    assert len(shipper.take()[0].message) == 4000
