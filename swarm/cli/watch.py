"""The follow view of a job, one for ``swarm watch`` and ``swarm submit --watch``.

Where the numbers come from: the job's record while it is PENDING (its reason says what it
waits for), then its SSE stream of merged metrics (each event also carries the job's state)
until the stream's ``end`` event.

How they are shown: on a terminal, a rich ``Live`` block redrawn in place (the state, a
progress bar, the summary, a table of the fellows, the links and the schedule). Elsewhere (a
pipe, a log file, a test) the same view as plain lines: each line of the view is printed when
its text changed since it was last printed, at most every ``LINE_EVERY_S`` (at once on a
state change and at the end), so no line is ever printed twice in a row. A job with
replicas shows one line per stage per replica (``replica R stage S``) with the seconds its
latest step synced with the stage's other replicas and its bytes over their ring. The pure part
(:func:`view_lines`, :func:`changed_lines`) decides what to print; :class:`LineView` and
:class:`LiveView` print it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Protocol
from urllib.parse import quote

import msgspec
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.text import Text

from silentswarm.cli import render
from silentswarm.cli.client import LeaderClient, decode_answer
from silentswarm.errors import (
    ErrorCode,
    ExportMissingError,
    JobEndedBadlyError,
    LeaderResponseError,
    LeaderUnreachableError,
)
from silentswarm.types.jobs import JobEnd, JobRecord
from silentswarm.types.links import Tuning
from silentswarm.types.metrics import BoundaryMetrics, FellowMetrics, JobMetrics

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED"}
POLL_S = 0.5
LINE_EVERY_S = 2.0
# The leader may restart while a job runs (the job keeps going): keep asking this long.
UNREACHABLE_GRACE_S = 60.0


class WatchedEnd(JobEnd, kw_only=True):
    """How a watched job ended: the stream's end event and the record's ``export_error``
    (what ``swarm watch --json`` prints)."""

    export_error: str | None = None


class StreamedMetrics(JobMetrics, kw_only=True):
    """A ``metrics`` event of the stream: the merged view and the job's state then."""

    state: str | None = None


@dataclass(frozen=True)
class Snapshot:
    """What the follow view shows at one moment."""

    job_id: str
    state: str
    note: str = ""  # PENDING: why it waits; RUNNING without metrics yet: who starts
    metrics: JobMetrics | None = None


def check_export(job: JobRecord) -> None:
    """ExportMissingError when a COMPLETED job's record says its final model is missing."""
    if job.state == "COMPLETED" and job.export_error:
        raise ExportMissingError(
            f"job {job.job_id} COMPLETED without its export: {job.export_error}"
        )


def final_line(job: JobRecord | JobEnd) -> str:
    """How the job ended (with how long it ran, when the record says so)."""
    took = ""
    if isinstance(job, JobRecord) and job.started_at and job.finished_at:
        took = f" in {job.finished_at - job.started_at:.0f}s"
    if job.state == "COMPLETED":
        loss, val = job.final_loss, job.final_val_loss
        text = f"job {job.job_id} COMPLETED{took}: final loss "
        text += "-" if loss is None else f"{loss:.4f}"
        if val is not None:
            text += f" (validation {val:.4f})"
        return text
    return f"job {job.job_id} {job.state}{took}: {job.reason or 'no reason given'}"


# --- what to show: pure --------------------------------------------------------------------


def record_snapshot(job: JobRecord) -> Snapshot:
    """The view of a job's record (before its metrics stream has anything)."""
    note = job.reason if job.state == "PENDING" else ""
    if job.state == "RUNNING" and not job.current_view().step:
        fellows = [s.fellow_id for s in (job.placement.stages if job.placement else [])]
        note = "stages starting" + (f" on {', '.join(fellows)}" if fellows else "")
    return Snapshot(job.job_id, str(job.state), note)


def bar(done: int, total: int | None, width: int = 30) -> str:
    if not total:
        return "[" + " " * width + "]"
    filled = min(width, int(width * done / total))
    return (
        "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total} {100 * done / total:3.0f}%"
    )


def view_lines(snap: Snapshot) -> dict[str, str]:
    """The view as keyed lines, in order: ``job`` (state and progress), ``summary``,
    ``fellow:ID``, ``link:N``, ``schedule``. A key's line is what :func:`changed_lines`
    compares."""
    if snap.metrics is None:
        return {"job": " ".join(p for p in (snap.job_id, snap.state, snap.note) if p)}
    view = snap.metrics
    lines = {
        "job": f"{snap.job_id} {snap.state} " + bar(view.step, view.total_steps),
        "summary": summary_line(view),
    }
    replicated = has_replicas(view)
    for f in view.fellows:
        lines[f"fellow:{f.fellow_id}"] = fellow_line(f, replicated)
    for b in view.boundaries:
        if b.link is not None:
            key = f"link:{b.replica}-{b.boundary}" if replicated else f"link:{b.boundary}"
            lines[key] = link_line(b, replicated)
    if view.tuning is not None:
        t = view.tuning
        lines["schedule"] = (
            f"  schedule {t.micro_batches} micro-batches, {t.in_flight} in flight"
            + (" (auto)" if t.auto else "")
            + (", steps overlap" if t.overlap else "")
            + deferral_text(t)
            + f" since step {t.step}"
        )
    return lines


def deferral_text(t: Tuning) -> str:
    """The deferred weight passes in force, and the measured steps that kept them."""
    text = f", {t.deferred} weight passes deferred" if t.deferred else ""
    v = t.deferral
    if v is not None:
        text = text or ", no weight passes deferred"
        text += f" (measured {v.kept_step_s:.3f} s a step; {v.other}: {v.other_step_s:.3f} s)"
    return text


def changed_lines(printed: dict[str, str], lines: dict[str, str]) -> list[str]:
    """The lines of ``lines`` whose text differs from what was last printed for their key
    (``printed``), in the view's order: what a pipe gets for a change."""
    return [text for key, text in lines.items() if printed.get(key) != text]


def metrics_lines(view: JobMetrics, state: str = "") -> list[str]:
    """The merged view as lines (the job's ``state`` once the stream's end said it)."""
    return list(view_lines(Snapshot(view.job_id, state, metrics=view)).values())


def has_replicas(view: JobMetrics) -> bool:
    """Whether the job runs more than one copy of its pipeline."""
    return any(f.replica for f in view.fellows) or any(b.replica for b in view.boundaries)


def fellow_line(f: FellowMetrics, replicated: bool = False) -> str:
    """One stage's line; with replicas its replica, and its sync with the stage's other
    replicas: the latest step's seconds and the bytes each way over their ring."""
    where = f"replica {f.replica} stage {f.stage}" if replicated else f"stage {f.stage}"
    line = (
        f"  {where} {f.fellow_id:<16} step {f.step:>6}  "
        f"sent {_rate(f.sent_bytes_per_s)}  recv {_rate(f.received_bytes_per_s)}"
    )
    if replicated:
        line += (
            f"  sync {_num(f.sync_s, '.3f')} s {render.size(f.sync_bytes_sent)} sent"
            f" / {render.size(f.sync_bytes_received)} recv"
        )
    return line + (f"  {f.result}" if f.result else "")


def summary_line(view: JobMetrics) -> str:
    return (
        f"  loss {_num(view.loss, '.4f')}  val {_num(view.val_loss, '.4f')}  "
        f"{_num(view.tokens_per_s, ',.0f')} tok/s  "
        f"{_num(view.step_time_s, '.3f')} s/step  "
        f"{_num(view.steps_per_min, '.0f')} steps/min  ETA {_duration(view.eta_s)}"
    )


def link_line(b: BoundaryMetrics, replicated: bool = False) -> str:
    """One boundary as its ends last measured it: round trip, rate each way, codecs."""
    link = b.link
    assert link is not None
    which = f"replica {b.replica} link {b.boundary}" if replicated else f"link {b.boundary}"
    line = (
        f"  {which} {b.upstream} -> {b.downstream} {b.transport or '-'}  "
        f"rtt {link.rtt_ms:.1f} ms  {_mbit(link.fwd_mbit_s)} down / {_mbit(link.bwd_mbit_s)} up  "
        f"{link.fwd_codec}/{link.bwd_codec}  {_rate(b.bytes_per_s)}  (step {link.step})"
    )
    return render.terminal_safe(line)  # a fellow's words (an older leader checked fewer of them)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _mbit(mbit_s: float) -> str:
    if mbit_s >= 1000:
        return f"{mbit_s / 1000:,.1f} Gbit/s"
    return f"{mbit_s:.1f} Mbit/s"


def _rate(bps: float | None) -> str:
    if not bps:
        return "0 B/s"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if bps < 1024 or unit == "GiB":
            return f"{bps:.1f} {unit}/s" if unit != "B" else f"{bps:.0f} B/s"
        bps /= 1024
    return f"{bps:.1f} GiB/s"


# --- how to show it: a pipe's lines, a terminal's live block ---------------------------------


class View(Protocol):
    def show(self, snap: Snapshot, *, force: bool = False) -> None: ...

    def close(self) -> None: ...


@dataclass
class LineView:
    """Plain lines: each line of the view when its text changed (see the module's doc)."""

    out: IO[str]
    every_s: float = LINE_EVERY_S
    printed: dict[str, str] = field(default_factory=dict)
    state: str = ""
    last: float = float("-inf")

    def show(self, snap: Snapshot, *, force: bool = False) -> None:
        now = time.monotonic()
        if not (force or snap.state != self.state or now - self.last >= self.every_s):
            return
        lines = view_lines(snap)
        for text in changed_lines(self.printed, lines):
            print(text, file=self.out, flush=True)
        self.printed.update(lines)
        self.state, self.last = snap.state, now

    def close(self) -> None:
        pass


class LiveView:
    """A block redrawn in place on a terminal (rich ``Live``)."""

    def __init__(self, console: Console) -> None:
        self.live = Live(console=console, refresh_per_second=4, transient=False)
        self.live.start()

    def show(self, snap: Snapshot, *, force: bool = False) -> None:
        self.live.update(live_renderable(snap), refresh=True)

    def close(self) -> None:
        self.live.stop()


def live_renderable(snap: Snapshot) -> RenderableType:
    head = Text.assemble(
        (snap.job_id, "bold"), " ", (snap.state, render.STYLES.get(snap.state, "")), " "
    )
    if snap.metrics is None:
        return head.append(snap.note)
    view = snap.metrics
    total = view.total_steps or None
    head.append(f"{view.step}/{view.total_steps or '?'}")
    parts: list[RenderableType] = [head, ProgressBar(total=total, completed=view.step, width=60)]
    parts.append(Text(summary_line(view).strip()))
    replicated = has_replicas(view)
    rows = [
        [
            *([f.replica] if replicated else []),
            f.stage,
            f.fellow_id,
            f.step,
            _num(f.loss, ".4f"),
            _rate(f.sent_bytes_per_s),
            _rate(f.received_bytes_per_s),
            *(
                [
                    _num(f.sync_s, ".3f"),
                    render.size(f.sync_bytes_sent),
                    render.size(f.sync_bytes_received),
                ]
                if replicated
                else []
            ),
            f.result,
        ]
        for f in view.fellows
    ]
    if rows:
        headers = ["STAGE", "FELLOW", "STEP", "LOSS", "SENT", "RECEIVED"]
        if replicated:
            headers = ["REPLICA", *headers, "SYNC S", "SYNC SENT", "SYNC RECEIVED"]
        parts.append(render.table([*headers, "RESULT"], rows))
    extra = [line for key, line in view_lines(snap).items() if key.startswith(("link:", "sch"))]
    parts.extend(Text(line) for line in extra)
    return Group(*parts)


def make_view(out: IO[str], *, tty: bool) -> View:
    return LiveView(render.console(out, tty=True)) if tty else LineView(out)


# --- following a job -------------------------------------------------------------------------


def follow_job(
    client: LeaderClient,
    job_id: str,
    *,
    view: View,
    say: Callable[[str], None],
    token: str | None = None,
) -> tuple[WatchedEnd, JobRecord]:
    """Show the job until it ends; return its end and its final record. JobEndedBadlyError
    unless it COMPLETED; ExportMissingError when it did without its final model."""
    try:
        first = _pending(client, job_id, view)
        end: JobEnd | None = None
        for snap, end in _streamed(client.base_url, job_id, token, first.spec.steps):
            if snap is not None:
                view.show(snap, force=end is not None)
    finally:
        view.close()
    if end is None:
        raise JobEndedBadlyError(f"the stream of {job_id} ended without its end event")
    record = client.job(job_id)
    say(final_line(end))
    if end.state != "COMPLETED":
        raise JobEndedBadlyError(final_line(end))
    check_export(record)
    return WatchedEnd(**msgspec.structs.asdict(end), export_error=record.export_error), record


def _pending(client: LeaderClient, job_id: str, view: View) -> JobRecord:
    """Show the job's record while it is PENDING; return the last one read. Read once
    whatever its state: an unknown job is the leader's 404 here, before any stream."""
    unreachable_since: float | None = None
    while True:
        try:
            job = client.job(job_id)
            unreachable_since = None
        except (LeaderUnreachableError, LeaderResponseError) as exc:
            if isinstance(exc, LeaderResponseError) and exc.code != ErrorCode.LEADER_NOT_READY:
                raise
            unreachable_since = unreachable_since or time.monotonic()
            if time.monotonic() - unreachable_since > UNREACHABLE_GRACE_S:
                raise
            time.sleep(POLL_S)
            continue
        if job.state in TERMINAL:
            return job
        view.show(record_snapshot(job))
        if job.state != "PENDING":
            return job
        time.sleep(POLL_S)


def _streamed(
    base_url: str, job_id: str, token: str | None, total_steps: int
) -> Iterator[tuple[Snapshot | None, JobEnd | None]]:
    """Snapshots from the metrics stream; the last with the stream's end event (and no
    snapshot when the job ended before any metrics: the final line says it all). Metrics
    that do not know the total (a stream replayed after the end) get the spec's."""
    from silentswarm.cli import sse

    path = f"/api/v1/jobs/{quote(job_id, safe='')}/metrics/stream"
    metrics: JobMetrics | None = None
    state = "RUNNING"
    for event in sse.follow(base_url, path, token=token):
        if event.event == "metrics":
            streamed = decode_answer(event.data, StreamedMetrics, path)
            if streamed.total_steps is None:
                streamed.total_steps = total_steps
            metrics, state = streamed, streamed.state or state
            yield Snapshot(job_id, state, metrics=metrics), None
        elif event.event == "end":
            end = decode_answer(event.data, JobEnd, path)
            final = None if metrics is None else Snapshot(job_id, str(end.state), metrics=metrics)
            yield final, end
            return


def stdout_or_stderr(json: bool) -> IO[str]:
    """Where the follow view goes: stdout, or stderr with --json (stdout keeps one
    document)."""
    return sys.stderr if json else sys.stdout
