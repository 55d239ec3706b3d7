"""JobMetricsAggregator: per-fellow progress records merged into one view of a job. Pure.

The global step is the step every stage has finished; loss, validation loss and the learning
rate come from the last stage (the only one that sees the targets): the rules of
:mod:`swarm.types.views`. Throughput per boundary
is the rate of the bytes crossing it (activations down, gradients up), measured at its
upstream end; steps/min and the ETA come from the last stage's recent steps.
"""

from __future__ import annotations

import itertools
from collections import deque

from swarm.protocol import Progress, ProgressEvent
from swarm.types.metrics import BoundaryMetrics, FellowMetrics, HistoryPoint, JobMetrics
from swarm.types.views import is_last_stage, pipeline_step

RATE_WINDOW = 50  # recent steps the rate and ETA are measured over


class JobMetricsAggregator:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.attempt = 0
        self.total_steps: int | None = None
        self._fellows: dict[str, FellowMetrics] = {}
        self._down: dict[str, tuple[int, float]] = {}  # fellow -> (down bytes, rate)
        self._transport: dict[str, str] = {}  # fellow -> transport of its downstream boundary
        self._last: Progress | None = None  # the last stage's latest step record
        self._val_loss: float | None = None
        self._recent: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW)

    def apply(self, p: Progress) -> HistoryPoint | None:
        """Take one record; a history point when it is a finished step of the last stage."""
        if p.job_id != self.job_id or p.attempt < self.attempt:
            return None
        if p.attempt > self.attempt:  # a new attempt starts the view afresh
            self.__init__(self.job_id)  # type: ignore[misc]
            self.attempt = p.attempt
        fellow = self._fellows.get(p.fellow_id)
        if fellow is None:
            fellow = self._fellows[p.fellow_id] = FellowMetrics(
                fellow_id=p.fellow_id, stage=p.stage or 0
            )
        if p.event is not ProgressEvent.STEP:
            # An end or a checkpoint still says how far the stage got (a new stream starts
            # from each fellow's latest record, which may be one of these).
            fellow.step = max(fellow.step, p.step)
            if p.event is ProgressEvent.ENDED and p.outcome is not None:
                fellow.result = p.outcome.result
                if p.outcome.val_loss is not None:
                    self._val_loss = p.outcome.val_loss
            return None
        self._measure(fellow, p)
        self.total_steps = p.total_steps or self.total_steps
        if p.val_loss is not None:
            self._val_loss = p.val_loss
        if not is_last_stage(p.stage, self._fellows.values()) or p.loss is None:
            return None
        self._last = p
        self._recent.append((p.at, p.step))
        sent, received = self._bytes()
        return HistoryPoint(
            step=p.step,
            at=p.at,
            loss=p.loss,
            val_loss=p.val_loss,
            lr=p.lr,
            step_time_s=p.step_time_s,
            tokens_per_s=p.tokens_per_s,
            bytes_sent=sent,
            bytes_received=received,
        )

    def _measure(self, fellow: FellowMetrics, p: Progress) -> None:
        if fellow.at is not None and p.at > fellow.at:
            elapsed = p.at - fellow.at
            fellow.sent_bytes_per_s = max(0, p.bytes_sent - fellow.bytes_sent) / elapsed
            fellow.received_bytes_per_s = max(0, p.bytes_received - fellow.bytes_received) / elapsed
            before, _ = self._down.get(p.fellow_id, (0, 0.0))
            down = p.down_bytes_sent + p.down_bytes_received
            self._down[p.fellow_id] = (down, max(0, down - before) / elapsed)
        else:
            self._down[p.fellow_id] = (p.down_bytes_sent + p.down_bytes_received, 0.0)
        if p.down_transport:
            self._transport[p.fellow_id] = p.down_transport
        fellow.step = max(fellow.step, p.step)
        fellow.loss = p.loss if p.loss is not None else fellow.loss
        fellow.step_time_s, fellow.tokens_per_s = p.step_time_s, p.tokens_per_s
        fellow.bytes_sent, fellow.bytes_received, fellow.at = p.bytes_sent, p.bytes_received, p.at

    def _bytes(self) -> tuple[int, int]:
        fellows = self._fellows.values()
        return sum(f.bytes_sent for f in fellows), sum(f.bytes_received for f in fellows)

    def view(self) -> JobMetrics:
        fellows = sorted(self._fellows.values(), key=lambda f: f.stage)
        last = self._last
        steps_per_min = None
        if len(self._recent) >= 2:
            (t0, s0), (t1, s1) = self._recent[0], self._recent[-1]
            if t1 > t0:
                steps_per_min = (s1 - s0) / (t1 - t0) * 60
        step = pipeline_step(fellows) or 0
        eta = None
        if steps_per_min and self.total_steps is not None:
            eta = max(0, self.total_steps - step) / steps_per_min * 60
        boundaries = []
        for upstream, downstream in itertools.pairwise(fellows):
            total, rate = self._down.get(upstream.fellow_id, (0, 0.0))
            boundaries.append(
                BoundaryMetrics(
                    boundary=upstream.stage,
                    upstream=upstream.fellow_id,
                    downstream=downstream.fellow_id,
                    bytes_per_s=round(rate, 1),
                    bytes_total=total,
                    transport=self._transport.get(upstream.fellow_id),
                )
            )
        sent, received = self._bytes()
        return JobMetrics(
            job_id=self.job_id,
            attempt=self.attempt,
            step=step,
            total_steps=self.total_steps,
            loss=last.loss if last else None,
            val_loss=self._val_loss,
            lr=last.lr if last else None,
            steps_per_min=None if steps_per_min is None else round(steps_per_min, 2),
            step_time_s=last.step_time_s if last else None,
            tokens_per_s=last.tokens_per_s if last else None,
            eta_s=None if eta is None else round(eta, 1),
            bytes_sent=sent,
            bytes_received=received,
            boundaries=boundaries,
            fellows=fellows,
            updated_at=max((f.at for f in fellows if f.at), default=None),
        )


def history(records: list[Progress], job_id: str) -> list[HistoryPoint]:
    """Every finished step of the job's latest attempt, one point per step, in step order."""
    if not records:
        return []
    latest = max(r.attempt for r in records)
    aggregator = JobMetricsAggregator(job_id)
    points: dict[int, HistoryPoint] = {}
    for record in records:
        if record.attempt == latest:
            point = aggregator.apply(record)
            if point is not None:
                points[point.step] = point
    return [points[s] for s in sorted(points)]
