"""Jobs: ``jobs``, ``job``, ``submit`` (and ``--watch``), ``watch``, ``cancel`` and
``checkpoint``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import cyclopts
from cyclopts import Parameter

from silentswarm.cli import render
from silentswarm.cli.context import Ctx
from silentswarm.cli.watch import watch_job, watch_stream
from silentswarm.errors import ConfigError
from silentswarm.jobspec import decode_job_spec


def jobs(*, ctx: Ctx) -> None:
    """Every job: state, steps, loss, fellows."""
    with ctx.client() as client:
        records = client.jobs()
    rows = []
    for j in records:
        view = j.current_view()
        rows.append(
            [
                j.job_id,
                j.state,
                f"{view.step if view.step is not None else '-'}/{j.spec.steps}",
                "-" if view.loss is None else f"{view.loss:.4f}",
                ",".join(view.fellows) or "-",
                render.since(j.created_at),
                j.reason[:60],
            ]
        )
    headers = ["JOB", "STATE", "STEP", "LOSS", "FELLOWS", "AGE", "REASON"]
    ctx.emit(records, render.table(headers, rows) if rows else "no jobs")


def job(job_id: str, *, ctx: Ctx) -> None:
    """One job in full (JSON): spec, placement, progress, signals, history."""
    with ctx.client() as client:
        record = client.job(job_id)
    print(render.dumps(record))


def submit(
    config: Annotated[Path, Parameter(help="Job spec (JSON), e.g. exp/configs/quickstart.json")],
    *,
    watch: Annotated[bool, Parameter(help="Follow the job until it ends")] = False,
    partition: Annotated[
        Literal["equal", "weighted"] | None,
        Parameter(help="Override the spec's partition: equal layers, or weighted by memory"),
    ] = None,
    ctx: Ctx,
) -> None:
    """Submit a job; prints its id. With --watch, follows it to its end: exit 0 when it
    COMPLETED with its final model exported, 1 when it failed or was cancelled, 4 when it
    completed but its final model is not in the export (the job's export_error is printed)."""
    body = read_config(config)
    if partition is not None:
        body = override_fields(body, config, partition=partition)
    try:
        decode_job_spec(body)  # the leader's own checks, here first: the path, field, reason
    except ConfigError as exc:
        raise ConfigError(f"{config}: {exc.message}") from None
    with ctx.client() as client:
        record = client.submit(body)
        if not watch:
            ctx.emit(record, record.job_id)
            return
        ctx.progress(
            f"submitted {record.job_id} ({record.name}); following it (Ctrl-C stops "
            f"following, not the job)"
        )
        final = watch_job(client, record.job_id, out=ctx.progress)
    if ctx.json:
        print(render.dumps(final))


def watch(job_id: str, *, ctx: Ctx) -> None:
    """Live merged metrics of a job (SSE): progress bar, loss, tokens/s, step time, ETA and a
    row per fellow, until it ends. Exit 0 if it COMPLETED with its final model exported, 1 if
    it failed or was cancelled, 4 if it completed but its final model is not in the export
    (the job's export_error is printed)."""
    with ctx.client() as client:
        end = watch_stream(
            ctx.leader_url,
            job_id,
            out=ctx.progress,
            tty=sys.stdout.isatty() and not ctx.json,
            token=ctx.token,
            fetch_job=client.job,
        )
    if ctx.json:
        print(render.dumps(end))


def cancel(job_id: str, *, ctx: Ctx) -> None:
    """Cancel a pending or running job (its fellows stop and return to ready)."""
    with ctx.client() as client:
        record = client.cancel(job_id)
    ctx.emit(record, f"job {record.job_id} {record.state}")


def checkpoint(job_id: str, *, ctx: Ctx) -> None:
    """Ask every fellow of a running job to write a checkpoint at the same step."""
    with ctx.client() as client:
        record = client.checkpoint(job_id)
    acked = sum(1 for s in record.stages if s.acknowledged)
    ctx.emit(
        record,
        f"checkpoint {record.checkpoint_id} at step {record.at_step}: "
        f"{acked}/{len(record.stages)} fellows acknowledged "
        f"(see 'swarm job {job_id}' for the paths)",
    )


def read_config(path: Path) -> bytes:
    """A config file's bytes; ConfigError naming it and why it cannot be read."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None


def override_fields(body: bytes, config: Path, **fields: Any) -> bytes:
    """The spec with some top-level fields replaced (the leader still checks all of it)."""
    try:
        spec = json.loads(body)
    except ValueError as exc:
        raise ConfigError(f"{config} is not valid JSON ({exc})") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"{config}: a job spec is a JSON object")
    return json.dumps({**spec, **fields}).encode()


def register(app: cyclopts.App) -> None:
    app.command(jobs)
    app.command(job)
    app.command(submit)
    app.command(watch)
    app.command(cancel)
    app.command(checkpoint)
