"""Jobs: ``jobs``, ``job``, ``submit`` (and ``--watch``), ``watch``, ``cancel`` and
``checkpoint``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import cyclopts
from cyclopts import Parameter
from rich.console import Group, RenderableType
from rich.text import Text

from silentswarm.cli import render
from silentswarm.cli.client import LeaderClient
from silentswarm.cli.context import CliContext, Ctx
from silentswarm.cli.options import JSON_BY_DEFAULT, LEADER, JsonByDefaultOptions, LeaderOptions
from silentswarm.cli.watch import WatchedEnd, follow_job, make_view, stdout_or_stderr
from silentswarm.errors import ConfigError
from silentswarm.jobspec import decode_job_spec
from silentswarm.types.jobs import JobRecord, MembershipChange

# A job's id, the same kind of parameter in every command: positional (JOB_ID), or --job-id.
JOB_ID = Parameter(help="The job's id (as swarm submit printed it; swarm jobs lists them)")


def jobs(
    *,
    all: Annotated[bool, Parameter(help="Also archived jobs")] = False,
    owner: Annotated[str | None, Parameter(help="Only this account's jobs")] = None,
    options: LeaderOptions = LEADER,
    ctx: Ctx,
) -> None:
    """Every job: owner, state, steps, loss, fellows."""
    with ctx.client() as client:
        records = client.jobs(all=all, owner=owner)
    rows = []
    for j in records:
        view = j.current_view()
        rows.append(
            [
                j.job_id,
                j.owner,
                j.state + (" (archived)" if j.archived else ""),
                f"{view.step if view.step is not None else '-'}/{j.spec.steps}",
                "-" if view.loss is None else f"{view.loss:.4f}",
                ",".join(view.fellows) or "-",
                render.since(j.created_at),
                j.reason,
            ]
        )
    headers = ["JOB", "OWNER", "STATE", "STEP", "LOSS", "FELLOWS", "AGE", "REASON"]
    ctx.emit(records, render.table(headers, rows) if rows else "no jobs")


def job(
    job_id: Annotated[str, JOB_ID],
    *,
    options: JsonByDefaultOptions = JSON_BY_DEFAULT,
    ctx: Ctx,
) -> None:
    """One job in full, as JSON: spec, placement, progress, signals, history. --no-json: a
    readable summary instead."""
    with ctx.client() as client:
        record = client.job(job_id)
    if ctx.json_flag is False:
        render.show(ctx.console(), job_summary(record))
    else:
        print(render.dumps(record), flush=True)


def job_summary(job: JobRecord) -> RenderableType:
    """The record the way a person reads it: state, progress, placement, the latest signals
    and transitions (``swarm job ID`` without --no-json has all of it, as JSON)."""
    view = job.current_view()
    step = "-" if view.step is None else view.step
    lines = [
        f"job       {job.job_id} ({job.name})",
        f"state     {job.state}" + (f": {job.reason}" if job.reason else ""),
        f"attempt   {job.attempt}" + (" (archived)" if job.archived else ""),
        f"step      {step}/{view.total_steps or job.spec.steps}",
        "loss      "
        + ("-" if view.loss is None else f"{view.loss:.4f}")
        + ("" if view.val_loss is None else f" (validation {view.val_loss:.4f})"),
        f"created   {render.since(job.created_at)} ago",
    ]
    if job.export_dir:
        lines.append(f"export    {job.export_dir}")
    if job.export_error:
        lines.append(f"export error  {job.export_error}")
    parts: list[RenderableType] = [Text("\n".join(lines))]
    stages = job.placement.stages if job.placement else []
    if stages:
        parts.append(stage_table(job))
    changes = [m for m in job.membership if m.attempt == job.attempt]
    if changes:
        parts.append(membership_table(changes))
    if job.history:
        rows = [[h.to_state, render.since(h.at) + " ago", h.reason or "-"] for h in job.history]
        parts.append(render.table(["STATE", "WHEN", "WHY"], rows))
    return Group(*parts)


def membership_table(changes: list[MembershipChange]) -> RenderableType:
    """Elastic membership: a row per replica lost, placed in a lost one's slot, or joined."""
    rows = [
        [
            m.kind,
            m.replica,
            ", ".join(m.fellows),
            "-" if m.epoch is None else f"{m.epoch} from step {m.at_step}",
            render.since(m.at) + " ago",
            m.reason or "-",
        ]
        for m in changes
    ]
    return render.table(["REPLICA CHANGE", "REPLICA", "FELLOWS", "RING", "WHEN", "WHY"], rows)


def stage_table(job: JobRecord) -> RenderableType:
    """A row per placed stage: its fellow's step, loss and result; with replicas a row per
    stage per replica, with the seconds its latest step synced with the stage's other
    replicas and its bytes over their ring."""
    assert job.placement is not None
    progress = {p.fellow_id: p for p in job.progress}
    replicated = job.placement.n_replicas > 1
    rows = []
    for s in sorted(job.placement.stages, key=lambda s: (s.replica, s.stage)):
        p = progress.get(s.fellow_id)
        row: list[Any] = [s.stage, s.fellow_id]
        result = p and (p.result or (f"joining ({p.joining})" if p.joining else None))
        row += ["-", "-", None] if p is None else [p.step, _loss(p.loss), result]
        if replicated:
            sync = ["-", "-", "-"]
            if p is not None:
                sync = [
                    "-" if p.sync_s is None else f"{p.sync_s:.3f}",
                    render.size(p.sync_bytes_sent),
                    render.size(p.sync_bytes_received),
                ]
            row = [s.replica, *row[:4], *sync, row[4]]
        rows.append(row)
    headers = ["STAGE", "FELLOW", "STEP", "LOSS", "RESULT"]
    if replicated:
        headers = ["REPLICA", *headers[:4], "SYNC S", "SYNC SENT", "SYNC RECEIVED", "RESULT"]
    return render.table(headers, rows)


def _loss(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"


def submit(
    config: Annotated[Path, Parameter(help="Job spec (JSON), e.g. exp/configs/quickstart.json")],
    *,
    watch: Annotated[
        bool, Parameter(help="Follow the job until it ends (the view of swarm watch)")
    ] = False,
    partition: Annotated[
        Literal["equal", "weighted", "balanced"] | None,
        Parameter(
            help="Override the spec's partition: equal layers, weighted by memory, or "
            "balanced by measured speed"
        ),
    ] = None,
    options: LeaderOptions = LEADER,
    ctx: Ctx,
) -> None:
    """Submit a job; prints its id. With --watch, follows it to its end as swarm watch does:
    exit 0 when it COMPLETED with its final model exported, 1 when it failed or was cancelled,
    4 when it completed but its final model is not in the export (the job's export_error is
    printed)."""
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
        _, final = _follow(ctx, client, record.job_id)
    if ctx.json:
        print(render.dumps(final), flush=True)


def watch(job_id: Annotated[str, JOB_ID], *, options: LeaderOptions = LEADER, ctx: Ctx) -> None:
    """Follow a job until it ends: its state (PENDING: why it waits), a progress bar, loss,
    tokens/s, step time, ETA, a row per fellow, the links and the schedule (the job's SSE
    stream of merged metrics). Exit 0 when it COMPLETED with its final model exported, 1 when
    it failed or was cancelled, 4 when it completed but its final model is not in the export
    (the job's export_error is printed)."""
    with ctx.client() as client:
        end, _ = _follow(ctx, client, job_id)
    if ctx.json:
        print(render.dumps(end), flush=True)


def _follow(ctx: CliContext, client: LeaderClient, job_id: str) -> tuple[WatchedEnd, JobRecord]:
    """The one follow view (:mod:`silentswarm.cli.watch`): live on a terminal, plain lines
    elsewhere, on stderr with --json."""
    out = stdout_or_stderr(ctx.json)
    return follow_job(
        client,
        job_id,
        view=make_view(out, tty=ctx.tty and not ctx.json),
        say=ctx.progress,
        token=ctx.token,
    )


def cancel(job_id: Annotated[str, JOB_ID], *, options: LeaderOptions = LEADER, ctx: Ctx) -> None:
    """Cancel a pending or running job (its fellows stop and return to ready)."""
    with ctx.client() as client:
        record = client.cancel(job_id)
    ctx.emit(record, f"job {record.job_id} {record.state}")


def checkpoint(
    job_id: Annotated[str, JOB_ID], *, options: LeaderOptions = LEADER, ctx: Ctx
) -> None:
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
