"""``swarm submit --watch``: follow a job to its end, one progress line at a time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from swarm.cli.client import LeaderClient
from swarm.errors import (
    ErrorCode,
    ExportMissingError,
    JobEndedBadlyError,
    LeaderResponseError,
    LeaderUnreachableError,
)
from swarm.types.views import stage_records, view_of_record

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED"}
POLL_S = 0.5
LINE_EVERY_S = 2.0
# The leader may restart while a job runs (the job keeps going): keep asking this long.
UNREACHABLE_GRACE_S = 60.0


def check_export(job: dict[str, Any]) -> None:
    """ExportMissingError when a COMPLETED job's record says its final model is missing."""
    error = job.get("export_error")
    if job.get("state") == "COMPLETED" and error:
        raise ExportMissingError(f"job {job['job_id']} COMPLETED without its export: {error}")


def progress_line(job: dict[str, Any], elapsed: float) -> str:
    state = job["state"]
    if state == "PENDING":
        return f"[{elapsed:5.0f}s] PENDING    {job.get('reason') or ''}".rstrip()
    stages = stage_records(job)
    if not stages:
        return f"[{elapsed:5.0f}s] {state}"
    view = view_of_record(job)
    if not view.step and all(p.loss is None and not p.step_time_s for p in stages):
        return f"[{elapsed:5.0f}s] {state:<10} stages starting on {', '.join(view.fellows)}"
    parts = [f"[{elapsed:5.0f}s] {state:<10} step {view.step:>5}/{view.total_steps}"]
    if view.loss is not None:
        parts.append(f"loss {view.loss:.4f}")
    if view.tokens_per_s:
        parts.append(f"{view.tokens_per_s:.0f} tok/s")
    parts.append("(" + ", ".join(f"{p.fellow_id}: {p.step}" for p in stages) + ")")
    return "  ".join(parts)


def final_line(job: dict[str, Any]) -> str:
    took = ""
    if job.get("started_at") and job.get("finished_at"):
        took = f" in {job['finished_at'] - job['started_at']:.0f}s"
    if job["state"] == "COMPLETED":
        loss = job.get("final_loss")
        val = job.get("final_val_loss")
        text = f"job {job['job_id']} COMPLETED{took}: final loss "
        text += "-" if loss is None else f"{loss:.4f}"
        if val is not None:
            text += f" (validation {val:.4f})"
        return text
    return f"job {job['job_id']} {job['state']}{took}: {job.get('reason') or 'no reason given'}"


def watch_job(
    client: LeaderClient,
    job_id: str,
    *,
    out: Callable[[str], None],
    timeout: float | None = None,
) -> dict[str, Any]:
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
        if job["state"] in TERMINAL:
            out(final_line(job))
            if job["state"] != "COMPLETED":
                raise JobEndedBadlyError(final_line(job))
            check_export(job)
            return job
        if job["state"] != last_state or now - last_printed >= LINE_EVERY_S:
            out(progress_line(job, now - started))
            last_state, last_printed = job["state"], now
        if timeout is not None and now - started > timeout:
            raise JobEndedBadlyError(f"job {job_id} still {job['state']} after {timeout:.0f}s")
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


def metrics_lines(view: dict[str, Any]) -> list[str]:
    """The merged view as a progress bar, a summary line and one row per fellow."""
    lines = [
        f"{view['job_id']} {view.get('state', '')} " + bar(view["step"], view.get("total_steps")),
        f"loss {_num(view.get('loss'), '.4f')}  val {_num(view.get('val_loss'), '.4f')}  "
        f"{_num(view.get('tokens_per_s'), ',.0f')} tok/s  "
        f"{_num(view.get('step_time_s'), '.3f')} s/step  "
        f"{_num(view.get('steps_per_min'), '.0f')} steps/min  ETA {_duration(view.get('eta_s'))}",
    ]
    for f in view.get("fellows", []):
        lines.append(
            f"  stage {f['stage']} {f['fellow_id']:<16} step {f['step']:>6}  "
            f"sent {_rate(f.get('sent_bytes_per_s'))}  recv {_rate(f.get('received_bytes_per_s'))}"
            + (f"  {f['result']}" if f.get("result") else "")
        )
    return lines


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
    fetch_job: Callable[[str], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Follow ``/metrics/stream`` to the end event; JobEndedBadlyError unless COMPLETED,
    ExportMissingError when it completed without its final model (the end event's
    ``export_error``, else the job record's, from ``fetch_job``)."""
    import json

    from swarm.cli import sse

    screen = Screen(out, tty)
    view: dict[str, Any] | None = None
    for event in sse.follow(base_url, f"/api/v1/jobs/{job_id}/metrics/stream", token=token):
        if event.event == "metrics":
            view = json.loads(event.data)
            screen.show(metrics_lines(view))
        elif event.event == "end":
            end = json.loads(event.data)
            if view is not None:
                view["state"] = end["state"]
                screen.show(metrics_lines(view), force=True)
            out(final_line({**end, "started_at": None}))
            if end["state"] != "COMPLETED":
                raise JobEndedBadlyError(final_line(end))
            if "export_error" not in end and fetch_job is not None:
                end["export_error"] = fetch_job(job_id).get("export_error")
            check_export(end)
            return end
    raise JobEndedBadlyError(f"the stream of {job_id} ended without its end event")
