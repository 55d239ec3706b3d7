"""A job's metrics: its stages' progress with the rates measured over its progress records.

Pure. One model of a job's progress: the stages' :class:`~swarm.types.views.StageProgress`
and the job view computed from them (:mod:`silentswarm.types.views`: the global step is the step
every stage has finished; loss, validation loss and the learning rate come from the last
stage, the only one that sees the targets). :func:`job_metrics` adds to them only what a
record cannot hold, the rates of a :class:`RateMeter`: throughput per boundary (the rate of
the bytes crossing it, activations down and gradients up, measured at its upstream end),
each fellow's bytes/s, steps/min and the ETA (over the last stage's recent steps).
A job with replicas has one set of boundaries per replica (each pipeline's own), and its
steps/min is replica 0's last stage's (allreduce keeps the replicas in step; diloco lets
them drift at most a sync interval).

- The **live** metrics of a job are its record's progress (kept by the JobManager) with the
  rates of a meter fed by the same progress messages (:mod:`silentswarm.leader.observe`).
- A **replay** of the progress stream (:class:`JobMetricsAggregator`: the SSE metrics
  stream, the loss curve) folds stored records into stages by the same rule as the record
  (:mod:`silentswarm.leader.progress`), so the two never disagree.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from silentswarm.leader.progress import apply_outcome, apply_step
from silentswarm.protocol import Progress, ProgressEvent
from silentswarm.types.metrics import BoundaryMetrics, FellowMetrics, HistoryPoint, JobMetrics
from silentswarm.types.views import (
    JobView,
    StageProgress,
    by_replica,
    is_last_stage,
    job_view,
    mean_of,
)

# Two records closer in time than this give no rate: their clocks are a fellow's, and a rate
# over a denormal interval would be infinite (JSON has no infinity).
MIN_ELAPSED_S = 1e-3
RATE_WINDOW = 50  # recent steps the rate and ETA are measured over
# The recent steps whose last stages' losses are kept per replica, so that with replicas a
# history point's loss is the mean of the replicas' that reported the step so far.
HEAD_STEPS_KEPT = 64


@dataclass
class _FellowRates:
    """One fellow's latest step record's time and counters, and the rates since the one
    before."""

    at: float
    bytes_sent: int
    bytes_received: int
    down_bytes: int  # both directions of its downstream boundary
    sent_per_s: float = 0.0
    received_per_s: float = 0.0
    down_per_s: float = 0.0
    transport: str | None = None


class RateMeter:
    """The rates one attempt's step records show. Holds no step or loss of its own: those
    are the stages' progress (the job's record, or a replay's fold)."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.attempt = 0
        self._fellows: dict[str, _FellowRates] = {}
        self._recent: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW)

    def apply(self, p: Progress, *, last_stage: bool) -> None:
        """Take one record (``last_stage``: its stage is the job's last); a newer attempt
        starts the meter afresh, an older one is ignored, as is what is not a step."""
        if p.job_id != self.job_id or p.attempt < self.attempt:
            return
        if p.attempt > self.attempt:
            self._fellows.clear()
            self._recent.clear()
            self.attempt = p.attempt
        if p.event is not ProgressEvent.STEP:
            return
        down = p.down_bytes_sent + p.down_bytes_received
        now = _FellowRates(
            at=p.at, bytes_sent=p.bytes_sent, bytes_received=p.bytes_received, down_bytes=down
        )
        before = self._fellows.get(p.fellow_id)
        if before is not None:
            now.transport = before.transport
            now.sent_per_s, now.received_per_s = before.sent_per_s, before.received_per_s
            if p.at >= before.at + MIN_ELAPSED_S:
                elapsed = p.at - before.at
                now.sent_per_s = max(0, p.bytes_sent - before.bytes_sent) / elapsed
                now.received_per_s = max(0, p.bytes_received - before.bytes_received) / elapsed
                now.down_per_s = max(0, down - before.down_bytes) / elapsed
        now.transport = p.down_transport or now.transport
        self._fellows[p.fellow_id] = now
        # The job's pace: each new step of any replica's last stage (replica 0 may be lost).
        if last_stage and p.loss is not None and (not self._recent or p.step > self._recent[-1][1]):
            self._recent.append((p.at, p.step))

    def steps_per_min(self) -> float | None:
        if len(self._recent) < 2:
            return None
        (t0, s0), (t1, s1) = self._recent[0], self._recent[-1]
        return (s1 - s0) / (t1 - t0) * 60 if t1 >= t0 + MIN_ELAPSED_S else None

    def fellow(self, stage: StageProgress) -> FellowMetrics:
        rates = self._fellows.get(stage.fellow_id)
        return FellowMetrics(
            fellow_id=stage.fellow_id,
            stage=stage.stage,
            step=stage.step,
            loss=stage.loss,
            step_time_s=stage.step_time_s,
            tokens_per_s=stage.tokens_per_s,
            bytes_sent=stage.bytes_sent,
            bytes_received=stage.bytes_received,
            sent_bytes_per_s=0.0 if rates is None else rates.sent_per_s,
            received_bytes_per_s=0.0 if rates is None else rates.received_per_s,
            result=stage.result,
            at=None if rates is None else rates.at,
            replica=stage.replica,
            sync_s=stage.sync_s,
            sync_bytes_sent=stage.sync_bytes_sent,
            sync_bytes_received=stage.sync_bytes_received,
        )

    def boundary(self, upstream: StageProgress, downstream: StageProgress) -> BoundaryMetrics:
        rates = self._fellows.get(upstream.fellow_id)
        return BoundaryMetrics(
            boundary=upstream.stage,
            upstream=upstream.fellow_id,
            downstream=downstream.fellow_id,
            bytes_per_s=0.0 if rates is None else round(rates.down_per_s, 1),
            bytes_total=0 if rates is None else rates.down_bytes,
            transport=None if rates is None else rates.transport,
            link=upstream.link,
            replica=upstream.replica,
        )


def job_metrics(
    job_id: str, attempt: int, view: JobView, stages: Iterable[StageProgress], rates: RateMeter
) -> JobMetrics:
    """A job's metrics: its view and stages (one attempt's), with ``rates`` (of the same
    attempt; a fresh meter when there are none)."""
    pipelines = by_replica(stages)
    ordered = [s for pipeline in pipelines.values() for s in pipeline]
    fellows = [rates.fellow(s) for s in ordered]
    steps_per_min = rates.steps_per_min()
    step = view.step or 0
    eta = None
    if steps_per_min and view.total_steps is not None:
        eta = max(0, view.total_steps - step) / steps_per_min * 60
    return JobMetrics(
        job_id=job_id,
        attempt=attempt,
        step=step,
        total_steps=view.total_steps,
        loss=view.loss,
        val_loss=view.val_loss,
        lr=view.lr,
        steps_per_min=None if steps_per_min is None else round(steps_per_min, 2),
        step_time_s=view.step_time_s,
        tokens_per_s=view.tokens_per_s,
        eta_s=None if eta is None else round(eta, 1),
        bytes_sent=view.bytes_sent,
        bytes_received=view.bytes_received,
        boundaries=[
            rates.boundary(up, down)
            for pipeline in pipelines.values()
            for up, down in itertools.pairwise(pipeline)
        ],
        fellows=fellows,
        updated_at=max((f.at for f in fellows if f.at), default=None),
        tuning=max(
            (s.tuning for s in ordered if s.tuning is not None),
            key=lambda t: t.step,
            default=None,
        ),
    )


class JobMetricsAggregator:
    """A replay of a job's progress records (from the stream): the stages folded by the
    job record's rule (:mod:`silentswarm.leader.progress`), with their rates; the latest
    attempt's."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.attempt = 0
        self._stages: dict[str, StageProgress] = {}
        self._rates = RateMeter(job_id)
        # step -> replica -> (loss, val_loss) of its last stage at that step (replicas only).
        self._heads: dict[int, dict[int, tuple[float, float | None]]] = {}

    def apply(self, p: Progress) -> HistoryPoint | None:
        """Take one record; a history point when it is a finished step of the last stage."""
        if p.job_id != self.job_id or p.attempt < self.attempt:
            return None
        if p.attempt > self.attempt:  # a new attempt starts the replay afresh
            self._stages.clear()
            self._heads.clear()
            self.attempt = p.attempt
        stage = self._stages.get(p.fellow_id)
        if stage is None:
            stage = self._stages[p.fellow_id] = StageProgress(
                stage=p.stage or 0, fellow_id=p.fellow_id, replica=p.replica
            )
        last = is_last_stage(p.stage, self._stages.values())
        self._rates.apply(p, last_stage=last)
        if p.event is not ProgressEvent.STEP:
            # An end or a checkpoint still says how far the stage got (a new stream starts
            # from each fellow's latest record, which may be one of these).
            stage.step = max(stage.step, p.step)
            if p.event is ProgressEvent.ENDED and p.outcome is not None:
                apply_outcome(stage, p.outcome, now=p.at)
            return None
        apply_step(stage, p, now=p.at)
        if not last or p.loss is None:
            return None
        loss, val_loss = self._head_losses(p, p.loss)
        return HistoryPoint(
            step=p.step,
            at=p.at,
            loss=loss,
            val_loss=val_loss,
            lr=p.lr,
            step_time_s=p.step_time_s,
            tokens_per_s=p.tokens_per_s,
            bytes_sent=sum(s.bytes_sent for s in self._stages.values()),
            bytes_received=sum(s.bytes_received for s in self._stages.values()),
        )

    def _head_losses(self, p: Progress, loss: float) -> tuple[float, float | None]:
        """The step's losses: the record's, or with replicas the mean of the replicas'
        last stages' that reported this step so far (swarm/types/views.py's rule)."""
        step = self._heads.setdefault(p.step, {})
        step[p.replica] = (loss, p.val_loss)
        while len(self._heads) > HEAD_STEPS_KEPT:
            del self._heads[min(self._heads)]
        losses = [v[0] for v in step.values()]
        return sum(losses) / len(losses), mean_of(v[1] for v in step.values())

    def retain(self, fellow_ids: Iterable[str]) -> None:
        """Keep only the stages of ``fellow_ids`` (the job's placed fellows now): a replica
        dropped while the replay runs leaves its view, as it leaves the job record's, so a
        stream that saw it before shows the same job as one started after."""
        keep = set(fellow_ids)
        for fellow_id in [f for f in self._stages if f not in keep]:
            del self._stages[fellow_id]

    def view(self) -> JobMetrics:
        stages = list(self._stages.values())
        return job_metrics(self.job_id, self.attempt, job_view(stages), stages, self._rates)


def history(records: Iterable[Progress], job_id: str) -> list[HistoryPoint]:
    """Every finished step of the job's latest attempt, one point per step, in step order."""
    fold = HistoryFold(job_id)
    for record in records:
        fold.add(record)
    return fold.points()


class HistoryFold:
    """:func:`history` a record at a time, as the stream is read: what it keeps is a point
    per step of the latest attempt seen, never the records (a job's stream holds up to
    100,000 per fellow)."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.attempt: int | None = None
        self._aggregator = JobMetricsAggregator(job_id)
        self._points: dict[int, HistoryPoint] = {}

    def add(self, record: Progress) -> None:
        if self.attempt is None or record.attempt > self.attempt:
            self.attempt = record.attempt
            self._aggregator = JobMetricsAggregator(self.job_id)
            self._points = {}
        if record.attempt == self.attempt:
            point = self._aggregator.apply(record)
            if point is not None:
                self._points[point.step] = point

    def points(self) -> list[HistoryPoint]:
        return [self._points[s] for s in sorted(self._points)]
