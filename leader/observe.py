"""Observability services: job metrics (live, history, SSE) and fellow logs (snapshot, SSE).

History and tails are read from the JetStream streams (:mod:`silentswarm.leader.streams`); SSE event
ids are stream sequence numbers, so a client that reconnects with ``Last-Event-ID`` continues
exactly where it stopped. Streams end when the leader shuts down (``stopping``), with a
keep-alive comment while idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import msgspec
from litestar.response import ServerSentEventMessage
from nats.aio.client import Client

from silentswarm import subjects as topics
from silentswarm.errors import ProtocolError, SwarmError
from silentswarm.leader import streams
from silentswarm.leader.admission import Verdict
from silentswarm.leader.aggregate import (
    HistoryFold,
    JobMetricsAggregator,
    RateMeter,
    job_metrics,
)
from silentswarm.leader.bus import LeaderBus
from silentswarm.leader.errors import StreamsUnavailableError
from silentswarm.leader.jobs import JobManager
from silentswarm.leader.logs import FellowLogBuffer, entries
from silentswarm.protocol import LogBatch, Progress
from silentswarm.redact import redact
from silentswarm.types.fleet import LogEntry
from silentswarm.types.jobs import JobEnd, JobRecord
from silentswarm.types.metrics import HistoryPoint, JobMetrics
from silentswarm.types.views import is_last_stage

log = logging.getLogger(__name__)
KEEPALIVE_S = 15.0
LIVE_JOBS = 64  # rate meters kept in memory (the most recently active jobs)
POLL_S = 1.0  # how often an idle stream checks whether its job has ended


class Observability:
    def __init__(self, *, bus: LeaderBus, jobs: JobManager, prefix: str) -> None:
        self.bus = bus
        self.jobs = jobs
        self.prefix = prefix
        self.progress = streams.progress_stream(prefix)
        self.logs_stream = streams.log_stream(prefix)
        self.logs = FellowLogBuffer()
        # Job id -> the rates of its current attempt's progress. A job's numbers (step,
        # loss...) are its record's, kept by the JobManager: not copied here.
        self.live: dict[str, RateMeter] = {}
        self.stopping = asyncio.Event()
        self.ready = asyncio.Event()

    # --- start-up --------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the streams, then keep the log buffer filled (backfilled after a restart)."""
        nc = self._nc()
        for spec in (self.progress, self.logs_stream):
            await streams.ensure_stream(nc, spec)
        self.ready.set()
        async for record in streams.follow(
            nc, self.logs_stream.name, self.logs_stream.subject, stop=self.stopping
        ):
            if record is None:
                continue
            batch = self._decode_log(record)
            if batch is not None:
                self.logs.add(record.seq, batch)

    def _nc(self) -> Client:
        assert self.bus.nc is not None, "start() runs once the bus is connected"
        return self.bus.nc

    def check_stream(self, job_id: str | None = None) -> None:
        """What an SSE endpoint must check before it answers 200 (a generator runs later)."""
        self._require_ready()
        if job_id is not None:
            self.jobs.get(job_id)

    def _require_ready(self) -> Client:
        if not self.ready.is_set() or self.bus.nc is None:
            raise StreamsUnavailableError("the leader's streams are not ready yet; try again")
        return self.bus.nc

    # --- live progress (called for every progress message) ----------------------------------

    def on_progress(self, progress: Progress) -> None:
        """An admitted progress message: its rates (the job's record takes its numbers)."""
        meter = self.live.pop(progress.job_id, None) or RateMeter(progress.job_id)
        self.live[progress.job_id] = meter  # most recently updated last
        while len(self.live) > LIVE_JOBS:
            del self.live[next(iter(self.live))]
        try:
            stages = self.jobs.get(progress.job_id).progress
        except SwarmError:  # admitted progress has a job; without one, no stage is last
            stages = []
        meter.apply(progress, last_stage=bool(stages) and is_last_stage(progress.stage, stages))
        log.info(
            "progress job=%s fellow=%s attempt=%d %s step=%d loss=%s latency=%.3fs "
            "bytes_sent=%d bytes_received=%d",
            progress.job_id,
            progress.fellow_id,
            progress.attempt,
            progress.event.value,
            progress.step,
            "-" if progress.loss is None else f"{progress.loss:.4f}",
            max(0.0, time.time() - progress.at),
            progress.bytes_sent,
            progress.bytes_received,
        )

    def metrics(self, job_id: str) -> JobMetrics:
        """The job's live metrics: its record's progress and view, with the rates of its
        current attempt (none after a leader restart, or for an attempt with no step yet)."""
        job = self.jobs.get(job_id)  # 404 for an unknown job
        meter = self.live.get(job_id)
        if meter is None or meter.attempt != job.attempt:
            meter = RateMeter(job_id)
        return job_metrics(job.job_id, job.attempt, job.view, job.progress, meter)

    # --- history and SSE -------------------------------------------------------------------

    def _job_subject(self, job_id: str) -> str:
        return topics.PROGRESS.wildcard(self.prefix, job=job_id)

    async def history(self, job_id: str) -> list[HistoryPoint]:
        self.jobs.get(job_id)
        nc = self._require_ready()
        fold = HistoryFold(job_id)  # a record at a time: the stream may hold millions
        async for r in streams.read(nc, self.progress.name, self._job_subject(job_id)):
            if (p := self._decode_progress(r)) is not None and self._admitted(p):
                fold.add(p)
        return fold.points()

    async def metrics_events(
        self, job_id: str, last_event_id: int | None
    ) -> AsyncIterator[ServerSentEventMessage]:
        """Merged metrics after every record, then one ``end`` event once the job is over.

        Without ``Last-Event-ID`` it starts from each fellow's latest record (the current
        view); with it, right after that event.
        """
        self.jobs.get(job_id)
        nc = self._require_ready()
        aggregator = JobMetricsAggregator(job_id)
        records = streams.follow(
            nc,
            self.progress.name,
            self._job_subject(job_id),
            start_seq=None if last_event_id is None else last_event_id + 1,
            last_per_subject=last_event_id is None,
            idle_s=POLL_S,
            stop=self.stopping,
        )

        def on_record(record: streams.Record) -> ServerSentEventMessage | None:
            progress = self._decode_progress(record)
            if progress is None or not self._admitted(progress):
                return None
            aggregator.apply(progress)
            job = self.jobs.get(job_id)
            if job.placement is not None and job.attempt == aggregator.attempt:
                aggregator.retain(job.placement.fellow_ids)
            view = msgspec.to_builtins(aggregator.view())
            view["state"] = job.state.value
            data = msgspec.json.encode(view).decode()
            return ServerSentEventMessage(data=data, event="metrics", id=record.seq)

        def on_idle() -> ServerSentEventMessage | None:
            job = self.jobs.get(job_id)
            return _end_event(job) if job.terminal else None

        async for message in _sse(records, on_record, on_idle):
            yield message

    # --- logs ------------------------------------------------------------------------------

    def log_snapshot(self, fellow_id: str, limit: int) -> list[LogEntry]:
        return self.logs.snapshot(fellow_id, limit)

    async def log_events(
        self, fellow_id: str, last_event_id: int | None
    ) -> AsyncIterator[ServerSentEventMessage]:
        """Every stored batch of the fellow's logs after ``last_event_id``, then live."""
        nc = self._require_ready()
        records = streams.follow(
            nc,
            self.logs_stream.name,
            topics.LOG.subject(self.prefix, fellow=fellow_id),
            start_seq=None if last_event_id is None else last_event_id + 1,
            idle_s=POLL_S,
            stop=self.stopping,
        )

        def on_record(record: streams.Record) -> ServerSentEventMessage | None:
            batch = self._decode_log(record)
            if batch is None:
                return None
            data = msgspec.json.encode(entries(record.seq, batch)).decode()
            return ServerSentEventMessage(data=data, event="logs", id=record.seq)

        async for message in _sse(records, on_record, lambda: None):
            yield message

    # --- decoding --------------------------------------------------------------------------

    def _admitted(self, progress: Progress) -> bool:
        """The stream holds what fellows published; only what the placed stages of the
        job's current attempt sent is shown (leader.admission, as for live progress)."""
        return self.jobs.admit_progress(progress).verdict is Verdict.ADMIT

    def _decode_progress(self, record: streams.Record) -> Progress | None:
        """A stored progress record whose job and fellow are its subject's (the subject is
        what the server let its sender publish on: live progress is checked the same way,
        :meth:`LeaderBus.decode_job_message`); None otherwise, logged."""
        try:
            progress = topics.PROGRESS.decode(record.data)
            tokens = topics.PROGRESS.parse(self.prefix, record.subject)
        except ProtocolError as exc:
            log.warning(
                "skipped unreadable progress record %d on %s: %s", record.seq, record.subject, exc
            )
            return None
        if (progress.job_id, progress.fellow_id) != (tokens["job"], tokens["fellow"]):
            log.warning(
                "skipped progress record %d on %s: job or fellow id is not its subject's",
                record.seq,
                record.subject,
            )
            return None
        return progress

    def _decode_log(self, record: streams.Record) -> LogBatch | None:
        try:
            batch = topics.LOG.decode(record.data)
            sender = topics.LOG.parse(self.prefix, record.subject)["fellow"]
        except ProtocolError as exc:
            self.bus.dropped["log"] += 1
            log.warning("dropped log batch %d on %s: %s", record.seq, record.subject, exc)
            return None
        if batch.fellow_id != sender:
            self.bus.dropped["log"] += 1
            log.warning(
                "dropped log batch %d on %s: fellow id is not its subject's",
                record.seq,
                record.subject,
            )
            return None
        # Fellows redact before they ship; an older (or careless) one may not have.
        batch.records = [
            r
            if (clean := redact(r.message)) is r.message
            else msgspec.structs.replace(r, message=clean)
            for r in batch.records
        ]
        return batch


async def _sse(
    records: AsyncIterator[streams.Record | None],
    on_record: Callable[[streams.Record], ServerSentEventMessage | None],
    on_idle: Callable[[], ServerSentEventMessage | None],
) -> AsyncIterator[ServerSentEventMessage]:
    """SSE messages from stream records, a keep-alive comment every KEEPALIVE_S while idle.

    ``on_idle`` may return a final message (the job is over): it is sent and the stream ends.
    """
    idle, checked = 0.0, time.monotonic()
    try:
        async for record in records:
            if record is None or time.monotonic() - checked >= POLL_S:
                # Also while records flow: a straggler must not hold the end back.
                checked = time.monotonic()
                final = on_idle()
                if final is not None:
                    if record is not None and (message := on_record(record)) is not None:
                        yield message
                    yield final
                    return
            if record is None:
                idle += POLL_S
                if idle >= KEEPALIVE_S:
                    idle = 0.0
                    yield ServerSentEventMessage(comment="keep-alive", data=None)
                continue
            idle = 0.0
            message = on_record(record)
            if message is not None:
                yield message
    finally:
        with contextlib.suppress(Exception):
            await records.aclose()


def _end_event(job: JobRecord) -> ServerSentEventMessage:
    end = JobEnd(
        job_id=job.job_id,
        state=job.state,
        reason=job.reason,
        final_loss=job.final_loss,
        final_val_loss=job.final_val_loss,
    )
    return ServerSentEventMessage(data=msgspec.json.encode(end).decode(), event="end")
