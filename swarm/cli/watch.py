"""``swarm submit --watch``: follow a job to its end, one progress line at a time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from swarm.cli.client import LeaderClient
from swarm.errors import LeaderResponseError, LeaderUnreachableError, SwarmError

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED"}
POLL_S = 0.5
LINE_EVERY_S = 2.0
# The leader may restart while a job runs (the job keeps going): keep asking this long.
UNREACHABLE_GRACE_S = 60.0


class JobEndedBadlyError(SwarmError):
    code = "JOB_NOT_COMPLETED"
    exit_code = 1


def progress_line(job: dict[str, Any], elapsed: float) -> str:
    state = job["state"]
    if state == "PENDING":
        return f"[{elapsed:5.0f}s] PENDING    {job.get('reason') or ''}".rstrip()
    stages = sorted(job.get("progress") or [], key=lambda p: p["stage"])
    if not stages:
        return f"[{elapsed:5.0f}s] {state}"
    total = stages[0].get("total_steps") or job["spec"]["steps"]
    step = min(p["step"] for p in stages)
    last = stages[-1]
    if step == 0 and all(p.get("loss") is None and not p.get("step_time_s") for p in stages):
        fellows = ", ".join(p["fellow_id"] for p in stages)
        return f"[{elapsed:5.0f}s] {state:<10} stages starting on {fellows}"
    parts = [f"[{elapsed:5.0f}s] {state:<10} step {step:>5}/{total}"]
    if last.get("loss") is not None:
        parts.append(f"loss {last['loss']:.4f}")
    if last.get("tokens_per_s"):
        parts.append(f"{last['tokens_per_s']:.0f} tok/s")
    parts.append("(" + ", ".join(f"{p['fellow_id']}: {p['step']}" for p in stages) + ")")
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
    """Poll the job until it ends; raise JobEndedBadlyError unless it COMPLETED."""
    started = time.monotonic()
    last_state, last_printed, unreachable_since = "", 0.0, None
    while True:
        try:
            job = client.job(job_id)
            unreachable_since = None
        except (LeaderUnreachableError, LeaderResponseError) as exc:
            if isinstance(exc, LeaderResponseError) and exc.code != "LEADER_NOT_READY":
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
            return job
        if job["state"] != last_state or now - last_printed >= LINE_EVERY_S:
            out(progress_line(job, now - started))
            last_state, last_printed = job["state"], now
        if timeout is not None and now - started > timeout:
            raise JobEndedBadlyError(f"job {job_id} still {job['state']} after {timeout:.0f}s")
        time.sleep(POLL_S)
