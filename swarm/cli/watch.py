"""``swarm submit --watch``: follow a job to its end, one progress line at a time."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from silentswarm.cli.client import LeaderClient, decode_answer
from silentswarm.errors import (
    ErrorCode,
    ExportMissingError,
    JobEndedBadlyError,
    LeaderResponseError,
    LeaderUnreachableError,
)
from silentswarm.types.jobs import JobEnd, JobRecord
from silentswarm.types.metrics import BoundaryMetrics, JobMetrics

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED"}
POLL_S = 0.5
LINE_EVERY_S = 2.0
# The leader may restart while a job runs (the job keeps going): keep asking this long.
UNREACHABLE_GRACE_S = 60.0


class WatchedEnd(JobEnd, kw_only=True):
    """How a watched job ended: the stream's end event and the record's ``export_error``
    (what ``swarm watch --json`` prints)."""

    export_error: str | None = None


def check_export(job: JobRecord) -> None:
    """ExportMissingError when a COMPLETED job's record says its final model is missing."""
    if job.state == "COMPLETED" and job.export_error:
        raise ExportMissingError(
            f"job {job.job_id} COMPLETED without its export: {job.export_error}"
        )


def progress_line(job: JobRecord, elapsed: float) -> str:
    state = job.state
    if state == "PENDING":
        return f"[{elapsed:5.0f}s] PENDING    {job.reason}".rstrip()
    stages = job.stages()
    if not stages:
        return f"[{elapsed:5.0f}s] {state}"
    view = job.current_view()
    if not view.step and all(p.loss is None and not p.step_time_s for p in stages):
        return f"[{elapsed:5.0f}s] {state:<10} stages starting on {', '.join(view.fellows)}"
    parts = [f"[{elapsed:5.0f}s] {state:<10} step {view.step:>5}/{view.total_steps}"]
    if view.loss is not None:
        parts.append(f"loss {view.loss:.4f}")
    if view.tokens_per_s:
        parts.append(f"{view.tokens_per_s:.0f} tok/s")
    parts.append("(" + ", ".join(f"{p.fellow_id}: {p.step}" for p in stages) + ")")
    return "  ".join(parts)


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


def watch_job(
    client: LeaderClient,
    job_id: str,
    *,
    out: Callable[[str], None],
    timeout: float | None = None,
) -> JobRecord:
    """Poll the job until it ends; raise JobEndedBadlyError unless it COMPLETED, and
    ExportMissingError if it did without its final model in the export."""
    started = time.monotonic()
    last_state, last_printed, unreachable_since = "", 0.0, None
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
        now = time.monotonic()
        if job.state in TERMINAL:
            out(final_line(job))
            if job.state != "COMPLETED":
                raise JobEndedBadlyError(final_line(job))
            check_export(job)
            return job
        if job.state != last_state or now - last_printed >= LINE_EVERY_S:
            out(progress_line(job, now - started))
            last_state, last_printed = job.state, now
        if timeout is not None and now - started > timeout:
            raise JobEndedBadlyError(f"job {job_id} still {job.state} after {timeout:.0f}s")
        time.sleep(POLL_S)


# --- swarm watch: the SSE stream of merged metrics --------------------------------------------


def bar(done: int, total: int | None, width: int = 30) -> str:
    if not total:
        return "[" + " " * width + "]"
    filled = min(width, int(width * done / total))
    return (
        "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total} {100 * done / total:3.0f}%"
    )


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def metrics_lines(view: JobMetrics, state: str = "") -> list[str]:
    """The merged view as a progress bar, a summary line and one row per fellow; ``state``:
    the job's, once the stream's end event said it."""
    lines = [
        f"{view.job_id} {state} " + bar(view.step, view.total_steps),
        f"loss {_num(view.loss, '.4f')}  val {_num(view.val_loss, '.4f')}  "
        f"{_num(view.tokens_per_s, ',.0f')} tok/s  "
        f"{_num(view.step_time_s, '.3f')} s/step  "
        f"{_num(view.steps_per_min, '.0f')} steps/min  ETA {_duration(view.eta_s)}",
    ]
    for f in view.fellows:
        lines.append(
            f"  stage {f.stage} {f.fellow_id:<16} step {f.step:>6}  "
            f"sent {_rate(f.sent_bytes_per_s)}  recv {_rate(f.received_bytes_per_s)}"
            + (f"  {f.result}" if f.result else "")
        )
    lines.extend(link_line(b) for b in view.boundaries if b.link is not None)
    if view.tuning is not None:
        t = view.tuning
        lines.append(
            f"  schedule {t.micro_batches} micro-batches, {t.in_flight} in flight"
            + (" (auto)" if t.auto else "")
            + (", steps overlap" if t.overlap else "")
            + f" since step {t.step}"
        )
    return lines


def link_line(b: BoundaryMetrics) -> str:
    """One boundary as its ends last measured it: round trip, rate each way, codecs."""
    link = b.link
    assert link is not None
    return (
        f"  link {b.boundary} {b.upstream} -> {b.downstream} {b.transport or '-'}  "
        f"rtt {link.rtt_ms:.1f} ms  {_mbit(link.fwd_mbit_s)} down / {_mbit(link.bwd_mbit_s)} up  "
        f"{link.fwd_codec}/{link.bwd_codec}  {_rate(b.bytes_per_s)}  (step {link.step})"
    )


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


class Screen:
    """Redraws a block of lines in place on a terminal; on a pipe, prints every few seconds."""

    def __init__(self, out: Callable[[str], None], tty: bool) -> None:
        self.out = out
        self.tty = tty
        self.drawn = 0
        self.last = 0.0

    def show(self, lines: list[str], *, force: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            if self.drawn:
                self.out(f"\x1b[{self.drawn}A\x1b[J" + "\n".join(lines))
            else:
                self.out("\n".join(lines))
            self.drawn = len(lines)
        elif force or now - self.last >= LINE_EVERY_S:
            self.out("\n".join(lines))
            self.last = now


def watch_stream(
    base_url: str,
    job_id: str,
    *,
    out: Callable[[str], None],
    tty: bool,
    token: str | None = None,
    fetch_job: Callable[[str], JobRecord] | None = None,
) -> WatchedEnd:
    """Follow ``/metrics/stream`` to the end event; JobEndedBadlyError unless COMPLETED,
    ExportMissingError when it completed without its final model (the job record's
    ``export_error``, from ``fetch_job``)."""
    from silentswarm.cli import sse

    screen = Screen(out, tty)
    view: JobMetrics | None = None
    stream = f"/api/v1/jobs/{job_id}/metrics/stream"
    for event in sse.follow(base_url, stream, token=token):
        if event.event == "metrics":
            view = decode_answer(event.data, JobMetrics, stream)
            screen.show(metrics_lines(view))
        elif event.event == "end":
            end = decode_answer(event.data, JobEnd, stream)
            if view is not None:
                screen.show(metrics_lines(view, end.state), force=True)
            out(final_line(end))
            if end.state != "COMPLETED":
                raise JobEndedBadlyError(final_line(end))
            watched = WatchedEnd(**msgspec.structs.asdict(end))
            if fetch_job is not None:
                record = fetch_job(job_id)
                check_export(record)
                watched.export_error = record.export_error
            return watched
    raise JobEndedBadlyError(f"the stream of {job_id} ended without its end event")
