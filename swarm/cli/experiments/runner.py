"""A sweep's run loop and its files (I/O): one point at a time over a leader client, each
point's row into ``results.csv`` (and the plot redrawn) as soon as it ends.

The loop takes the client as an argument (:class:`JobsClient`), so tests drive it with a fake.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import msgspec

from silentswarm.cli.experiments import plot
from silentswarm.cli.experiments.sweep import (
    Sweep,
    SweepPoint,
    merge_row,
    pending_points,
    progress_line,
    result_row,
)
from silentswarm.errors import ErrorCode, LeaderResponseError, LeaderUnreachableError
from silentswarm.protocol import JobState
from silentswarm.types.jobs import JobRecord

TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED"})
FP32_BYTES = 4


class JobsClient(Protocol):
    """What sweeps ask of the leader (:class:`silentswarm.cli.client.LeaderClient`; tests fake
    it)."""

    def submit(self, spec_json: bytes) -> JobRecord: ...

    def job(self, job_id: str) -> JobRecord: ...

    def jobs(self) -> list[JobRecord]: ...

    def cancel(self, job_id: str) -> JobRecord: ...


def read_rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def write_rows(path: Path, columns: Sequence[str], rows: Sequence[Mapping[str, str]]) -> None:
    """The whole CSV, replaced atomically: an interrupted sweep never leaves half a file."""
    known = list(columns)
    for r in rows:  # keep columns of rows from an earlier grid (e.g. --sweep-id reused)
        known += [k for k in r if k not in known]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=known, restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    _atomic_write(path, buf.getvalue().encode())


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def wait_for_end(
    client: JobsClient,
    job_id: str,
    *,
    poll_s: float = 2.0,
    timeout_s: float | None = None,
    on_poll: Callable[[JobRecord], None] | None = None,
    unreachable_grace_s: float = 60.0,
    sleep: Callable[[float], None] = time.sleep,
) -> JobRecord | None:
    """Poll ``GET /api/v1/jobs/{id}`` until the job ends; None after ``timeout_s``.

    A leader that is briefly unreachable (a restart) is waited out for
    ``unreachable_grace_s``; longer, and the error propagates. A state this version does
    not know (a newer leader's) is LEADER_RESPONSE_INVALID: whether the job ended cannot
    be told, and waiting could be forever.
    """
    started = time.monotonic()
    down_since: float | None = None
    while True:
        try:
            job = client.job(job_id)
            down_since = None
        except LeaderUnreachableError:
            now = time.monotonic()
            down_since = down_since or now
            if now - down_since > unreachable_grace_s:
                raise
            sleep(poll_s)
            continue
        if on_poll:
            on_poll(job)
        if job.state in TERMINAL_STATES:
            return job
        if not JobState.knows(job.state):
            raise LeaderResponseError(
                f"job {job_id} is {job.state.value}, a state this CLI does not know: it "
                "cannot tell whether the job ended; install the leader's version (swarm "
                "info shows it)",
                code=ErrorCode.LEADER_RESPONSE_INVALID,
            )
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            return None
        sleep(poll_s)


def _changes_only(
    progress: Callable[[str], None], index: int, total: int, point: SweepPoint
) -> Callable[[JobRecord], None]:
    """A poll callback that prints the point's progress line only when it changed."""
    last = [""]

    def on_poll(job: JobRecord) -> None:
        line = progress_line(index, total, point, job)
        if line != last[0]:
            last[0] = line
            progress(line)

    return on_poll


class _Started:
    """The job a point started, once the leader has said its id."""

    job_id: str | None = None


@contextlib.contextmanager
def cancelled_on_interrupt(
    client: JobsClient, point: SweepPoint, progress: Callable[[str], None], label: str
) -> Iterator[_Started]:
    """On Ctrl-C (KeyboardInterrupt) inside the block, cancel the job the point started, then
    let the interrupt go on. Interrupted inside the submit, before its id came back, the job
    is found by its name (``<sweep name>-<point id>``) among the jobs not ended. A second
    Ctrl-C while cancelling is ignored: leaving the job running is what this prevents.

    The point gets no row, so a resumed sweep runs it again."""
    started = _Started()
    try:
        yield started
    except KeyboardInterrupt:
        with _sigint_ignored():
            for job_id in _jobs_to_cancel(client, point, started.job_id):
                try:
                    client.cancel(job_id)
                except (LeaderResponseError, LeaderUnreachableError) as exc:
                    progress(f"{label} interrupted; could not cancel {job_id}: {exc.message}")
                else:
                    progress(f"{label} interrupted: cancelled {job_id} (it runs again on resume)")
        raise


def _jobs_to_cancel(client: JobsClient, point: SweepPoint, job_id: str | None) -> list[str]:
    if job_id is not None:
        return [job_id]
    try:
        jobs = client.jobs()
    except (LeaderResponseError, LeaderUnreachableError):
        return []
    return [j.job_id for j in jobs if j.name == point.spec.name and j.state not in TERMINAL_STATES]


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored for the block (only the main thread may change signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_sweep(
    client: JobsClient,
    sweep: Sweep,
    out_dir: Path,
    *,
    progress: Callable[[str], None] = print,
    poll_s: float = 2.0,
    point_timeout_s: float | None = None,
    retry_failed: bool = False,
    with_plot: bool = True,
) -> list[dict[str, str]]:
    """Run the pending points one after another, recording each as it ends.

    A point the leader refuses, or that fails or times out (it is cancelled), gets a row with
    its state and reason and the sweep goes on. After every point ``results.csv`` (and, with
    ``with_plot``, ``val_loss_vs_bytes.png``: matplotlib, :func:`plot.require_matplotlib`)
    is rewritten, so an interrupted sweep keeps what it has; Ctrl-C cancels the running
    point's job (:func:`cancelled_on_interrupt`).
    """
    csv_path = out_dir / "results.csv"
    rows = read_rows(csv_path)
    todo = pending_points(sweep, rows, retry_failed=retry_failed)
    total = len(sweep.points)
    skipped = total - len(todo)
    progress(
        f"sweep {sweep.sweep_id}: {total} point(s), {skipped} already in {csv_path}, "
        f"{len(todo)} to run"
    )
    _atomic_write(out_dir / "sweep.json", msgspec.json.format(msgspec.json.encode(sweep.config)))
    for point in todo:
        index = sweep.points.index(point) + 1
        job, reason = _run_point(
            client,
            point,
            f"[{index}/{total}] {point.point_id}",
            progress,
            poll_s,
            point_timeout_s,
            on_poll=_changes_only(progress, index, total, point),
        )
        row = result_row(sweep, point, job, reason=reason)
        rows = merge_row(rows, row)
        write_rows(csv_path, sweep.columns, rows)
        if with_plot:
            _atomic_write(out_dir / plot.PLOT_FILE, plot.scatter_png(plot.plot_points(rows)))
        progress(
            f"[{index}/{total}] {point.point_id} {row['state']}: loss {row['final_loss'] or '-'}"
            f" val {row['final_val_loss'] or '-'}, {row['bytes_per_step_per_boundary'] or '-'}"
            f" B/step/boundary" + (f" ({row['reason']})" if row["reason"] else "")
        )
    if with_plot:
        _atomic_write(out_dir / plot.PLOT_FILE, plot.scatter_png(plot.plot_points(rows)))
    if not csv_path.exists():
        write_rows(csv_path, sweep.columns, rows)
    return rows


def _run_point(
    client: JobsClient,
    point: SweepPoint,
    label: str,
    progress: Callable[[str], None],
    poll_s: float,
    timeout_s: float | None,
    *,
    on_poll: Callable[[JobRecord], None],
) -> tuple[JobRecord | None, str]:
    """Submit one point and wait for its job to end: the job (None: refused) and the reason
    to record (a refusal, a timeout), else ``""``."""
    with cancelled_on_interrupt(client, point, progress, label) as started:
        try:
            record = client.submit(point.spec_json)
        except LeaderResponseError as exc:
            reason = f"submit refused: {exc.code}: {exc.message}"
            progress(f"{label} FAILED ({reason})")
            return None, reason
        job_id = started.job_id = record.job_id
        progress(f"{label} submitted {job_id}")
        job = wait_for_end(client, job_id, poll_s=poll_s, timeout_s=timeout_s, on_poll=on_poll)
        if job is not None:
            return job, ""
        reason = f"timed out after {timeout_s:.0f}s; cancelled"
        try:
            return client.cancel(job_id), reason
        except LeaderResponseError:
            return client.job(job_id), reason
