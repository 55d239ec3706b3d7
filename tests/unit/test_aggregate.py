"""Merging per-fellow progress into a job view, the history curve, the log buffer and the
log shipper's bounded queue: pure logic."""

import logging

import msgspec
import pytest

from silentswarm.agent.logship import FellowLogShipper
from silentswarm.jobspec import JobSpec
from silentswarm.leader.aggregate import JobMetricsAggregator, RateMeter, history, job_metrics
from silentswarm.leader.jobs import JobManager, plan_schedule
from silentswarm.leader.logs import FellowLogBuffer, entry_bytes
from silentswarm.leader.observe import Observability
from silentswarm.leader.placement import Candidate
from silentswarm.plan import ModelConfig
from silentswarm.protocol import (
    LogBatch,
    LogRecord,
    Progress,
    ProgressEvent,
    StageOutcome,
    StageResult,
)
from tests.fakes import Clock


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
    records.append(step("b", 1, 4, 20.0, loss=0.5, attempt=1))  # late, of the failed one
    points = history(iter(records), "j")  # a record at a time, as the stream is read
    assert [p.step for p in points] == [1, 2, 3]
    assert [p.loss for p in points] == [4.0, 3.0, 2.0]


def running(manager: JobManager) -> str:
    """A two-stage job running on fellows a and b (attempt 1): its id."""
    job = manager.submit(JobSpec(model=ModelConfig(n_layers=4), stages=2, steps=100))
    candidates = [
        Candidate(
            fellow_id=f,
            hostname="h",
            data_address=f"tcp://127.0.0.1:1{n}",
            cpu_cores=2,
            ram_available_bytes=8 << 30,
        )
        for n, f in enumerate(("a", "b"))
    ]
    [assignment], _ = plan_schedule(manager.pending(), candidates)
    manager.begin_start(job.job_id, assignment.placement)
    manager.start_succeeded(job.job_id)
    return job.job_id


def records(job_id: str, first: str, last: str) -> list[Progress]:
    """Ten steps of a two-stage pipeline (fellow ``first`` at stage 0, ``last`` at 1), and
    the last stage's end."""
    out = []
    for i in range(1, 11):
        out.append(step(first, 0, i, 100.0 + i, sent=1000 * i, down=1000 * i))
        out.append(step(last, 1, i - 1, 100.5 + i, loss=5.0 - i / 10, sent=1000 * i))
    out.append(
        Progress(
            job_id="j",
            fellow_id=last,
            attempt=1,
            stage=1,
            step=10,
            event=ProgressEvent.ENDED,
            outcome=StageOutcome(job_id=job_id, attempt=1, result=StageResult.FAILED, step=10),
            at=200.0,
        )
    )
    return [msgspec.structs.replace(r, job_id=job_id) for r in out]


def pipeline(manager: JobManager, job_id: str) -> tuple[str, str]:
    first, last = (s.fellow_id for s in manager.get(job_id).placement.stages)
    return first, last


@pytest.mark.parametrize("ended", [False, True])
def test_live_metrics_are_the_job_records_numbers_and_a_replay_agrees(ended):
    """One model of a job's progress: the live metrics read the JobManager's record (the
    observer keeps only rates), and a replay of the same records folds them by the same
    rule, so step and loss never disagree."""
    manager = JobManager(wall=Clock())
    job_id = running(manager)
    observe = Observability(bus=None, jobs=manager, prefix="swarm")  # type: ignore[arg-type]
    replay = JobMetricsAggregator(job_id)
    first, last = pipeline(manager, job_id)
    stream = records(job_id, first, last)
    for record in stream if ended else stream[:-1]:
        observe.on_progress(record)
        manager.record_progress(record)
        replay.apply(record)
    job = manager.get(job_id)
    live = observe.metrics(job_id)
    assert (live.step, live.loss, live.total_steps) == (job.view.step, job.view.loss, 100)
    assert live.step == (10 if ended else 9) and live.loss == 5.0 - 1.0
    replayed = replay.view()
    for name in ("step", "loss", "val_loss", "lr", "bytes_sent", "bytes_received", "eta_s"):
        assert getattr(live, name) == getattr(replayed, name), name
    assert live.steps_per_min == replayed.steps_per_min == 60.0
    assert [f.result for f in live.fellows] == [f.result for f in replayed.fellows]
    [boundary] = live.boundaries
    assert (boundary.upstream, boundary.downstream, boundary.bytes_per_s) == (first, last, 1000.0)
    assert live.boundaries == replayed.boundaries


def test_live_metrics_without_rates_still_show_the_records_numbers():
    """After a leader restart the meters are gone; the record (from the store) is not."""
    manager = JobManager(wall=Clock())
    job_id = running(manager)
    for record in records(job_id, *pipeline(manager, job_id))[:-1]:
        manager.record_progress(record)
    observe = Observability(bus=None, jobs=manager, prefix="swarm")  # type: ignore[arg-type]
    live = observe.metrics(job_id)
    assert (live.step, live.loss, live.steps_per_min) == (9, 5.0 - 1.0, None)
    assert [f.fellow_id for f in live.fellows] == list(pipeline(manager, job_id))


def test_a_meter_of_another_attempt_gives_no_rates():
    meter = RateMeter("j")
    meter.apply(step("a", 0, 1, 1.0, loss=1.0, sent=10), last_stage=True)
    meter.apply(step("a", 0, 2, 2.0, loss=1.0, sent=20), last_stage=True)
    assert meter.steps_per_min() == 60.0
    meter.apply(step("a", 0, 1, 3.0, loss=1.0, attempt=2), last_stage=True)
    assert meter.attempt == 2 and meter.steps_per_min() is None
    meter.apply(step("a", 0, 9, 4.0, loss=1.0, attempt=1), last_stage=True)  # older: ignored
    assert meter.attempt == 2 and meter.steps_per_min() is None


def test_job_metrics_of_a_job_with_no_stages_yet():
    from silentswarm.types.views import JobView

    view = job_metrics("j", 0, JobView(), [], RateMeter("j"))
    assert view.step == 0 and view.fellows == [] and view.boundaries == []


def test_log_buffer_is_bounded_per_fellow_and_skips_replays():
    buffer = FellowLogBuffer(per_fellow=3)
    batch = LogBatch(
        fellow_id="f",
        records=[LogRecord(ts=i, level="INFO", logger="x", message=str(i)) for i in range(5)],
    )
    buffer.add(1, batch)
    buffer.add(1, batch)  # the same stream record again
    assert [e.message for e in buffer.snapshot("f", 10)] == ["2", "3", "4"]
    assert [e.message for e in buffer.snapshot("f", 1)] == ["4"]
    assert buffer.snapshot("nobody", 5) == [] and buffer.snapshot("f", 0) == []


def test_log_buffer_is_bounded_in_bytes_per_fellow_and_over_all_fellows():
    """A fellow's records of 8 KiB each weighed 63 MiB at 2000 records, and every name ever
    enrolled kept its own: now at most per_fellow_bytes each, total_bytes in all, the
    fellows written to least recently leaving first."""
    buffer = FellowLogBuffer(per_fellow_bytes=100_000, total_bytes=250_000)
    big = "\U0001f600" * 8192

    def flood(fellow: str, seq: int, n: int = 50) -> None:
        records = [LogRecord(ts=i, level="INFO", logger="x", message=big) for i in range(n)]
        buffer.add(seq, LogBatch(fellow_id=fellow, records=records))

    flood("evil", 1)
    kept = buffer.snapshot("evil", 2000)
    assert len(kept) == 100_000 // entry_bytes(kept[0]) and entry_bytes(kept[0]) > 4 * 8192
    assert buffer.bytes <= 100_000
    hi = LogRecord(ts=1, level="INFO", logger="x", message="hi")
    buffer.add(2, LogBatch(fellow_id="honest", records=[hi]))
    flood("evil-2", 3)
    flood("evil-3", 4)
    assert buffer.bytes <= 250_000
    assert buffer.snapshot("evil", 5) == [], "the least recently written went first"
    assert [e.message for e in buffer.snapshot("honest", 5)] == ["hi"]
    assert buffer.snapshot("evil-3", 1)


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


def test_the_measured_link_and_the_agreed_schedule_reach_the_metrics_and_swarm_watch():
    from silentswarm.cli.watch import metrics_lines
    from silentswarm.types.links import LinkStats, Tuning

    link = LinkStats(
        boundary=0,
        step=2,
        rtt_ms=101.7,
        fwd_mbit_s=19.4,
        bwd_mbit_s=2500.0,
        fwd_codec="fp16",
        bwd_codec="fixed_int8",
    )
    tuning = Tuning(step=2, micro_batches=8, in_flight=8, auto=True, predicted_step_s=0.8)
    agg = JobMetricsAggregator("j")
    agg.apply(msgspec.structs.replace(step("a", 0, 1, 100.0), down_link=link, tuning=tuning))
    agg.apply(msgspec.structs.replace(step("b", 1, 1, 100.1, loss=4.0), tuning=tuning))
    # A later record without them (an older fellow) keeps the latest measured.
    agg.apply(step("a", 0, 2, 101.0))
    view = agg.view()
    assert view.boundaries[0].link == link and view.tuning == tuning
    text = "\n".join(metrics_lines(view))
    assert "link 0 a -> b" in text and "rtt 101.7 ms" in text
    assert "19.4 Mbit/s down / 2.5 Gbit/s up" in text and "fp16/fixed_int8" in text
    assert "schedule 8 micro-batches, 8 in flight (auto) since step 2" in text


def test_watch_says_when_steps_overlap():
    from silentswarm.cli.watch import metrics_lines
    from silentswarm.types.links import Tuning

    agg = JobMetricsAggregator("j")
    tuning = Tuning(step=0, micro_batches=4, in_flight=2, overlap=True)
    agg.apply(msgspec.structs.replace(step("a", 0, 1, 100.0), tuning=tuning))
    text = "\n".join(metrics_lines(agg.view()))
    assert "schedule 4 micro-batches, 2 in flight, steps overlap since step 0" in text


def test_watch_says_how_many_weight_passes_the_last_stage_defers():
    from silentswarm.cli.watch import metrics_lines
    from silentswarm.types.links import Tuning

    agg = JobMetricsAggregator("j")
    tuning = Tuning(step=2, micro_batches=8, in_flight=8, deferred=3)
    agg.apply(msgspec.structs.replace(step("a", 0, 1, 100.0), tuning=tuning))
    text = "\n".join(metrics_lines(agg.view()))
    assert "schedule 8 micro-batches, 8 in flight, 3 weight passes deferred since step 2" in text


def test_watch_shows_the_measured_steps_behind_a_deferral():
    """The last stage's verdict (a later tuning than the calibration's) is what shows."""
    from silentswarm.cli.watch import metrics_lines
    from silentswarm.types.links import DeferralVerdict, Tuning

    agg = JobMetricsAggregator("j")
    proposed = Tuning(step=2, micro_batches=8, in_flight=8, deferred=3)
    kept = DeferralVerdict(step=11, kept=3, kept_step_s=0.353, other=0, other_step_s=0.3804)
    dropped = DeferralVerdict(step=11, kept=0, kept_step_s=0.371, other=5, other_step_s=0.392)
    agg.apply(msgspec.structs.replace(step("a", 0, 1, 100.0), tuning=proposed))
    verdict = msgspec.structs.replace(proposed, step=11, deferral=kept)
    agg.apply(msgspec.structs.replace(step("b", 1, 1, 100.1, loss=4.0), tuning=verdict))
    text = "\n".join(metrics_lines(agg.view()))
    assert "3 weight passes deferred (measured 0.353 s a step; 0: 0.380 s) since step 11" in text
    verdict = msgspec.structs.replace(proposed, step=11, deferred=0, deferral=dropped)
    agg.apply(msgspec.structs.replace(step("b", 1, 2, 100.2, loss=4.0), tuning=verdict))
    text = "\n".join(metrics_lines(agg.view()))
    assert "no weight passes deferred (measured 0.371 s a step; 5: 0.392 s) since step 11" in text
