"""The fleet: ``fellows``, ``nodes``, the measured ``links``, a fellow's ``logs``,
``update``, ``release`` and the purges that wait for an offline fellow (``pending-purges``,
``retry-purge``)."""

from __future__ import annotations

import json
from typing import Annotated
from urllib.parse import quote

import cyclopts
import msgspec
from cyclopts import Parameter
from rich.console import Group
from rich.text import Text

from silentswarm.cli import render, sse
from silentswarm.cli.client import LeaderClient, decode_answer
from silentswarm.cli.context import CliContext, Ctx
from silentswarm.cli.options import LEADER, LeaderOptions
from silentswarm.errors import ErrorCode, LeaderResponseError
from silentswarm.pools import format_labels
from silentswarm.types.fleet import LogEntry
from silentswarm.types.links import MeasuredPair

# A fellow's id, the same kind of parameter in every command: positional (FELLOW_ID), or
# --fellow-id ID as release and update took it before.
FELLOW_ID = Parameter(help="The fellow's id (as swarm fellows lists it)")
SOME_FELLOW = Parameter(help="Only this fellow (default: all)")


def cores_text(cores: int, quota: float | None) -> str:
    """The cores a fellow may use, and its container's quota where one limits it."""
    return str(cores) if quota is None else f"{cores} (quota {quota:g})"


def ram_text(available: int, limit: int | None) -> str:
    """The memory a fellow offers, and its container's limit where one holds it."""
    free = render.gib(available)
    return free if limit is None else f"{free} (limit {render.gib(limit)})"


def fellows(*, options: LeaderOptions = LEADER, ctx: Ctx) -> None:
    """Every fellow the leader knows: status, host, pool and labels, hardware, last heartbeat."""
    with ctx.client() as client:
        records = client.fellows()
    rows = [
        [
            f.fellow_id,
            f.status,
            f.hostname,
            f.pool,
            format_labels(f.labels) or "-",
            len(f.hardware.gpus) or "cpu",
            cores_text(f.hardware.cpu_cores, f.hardware.cpu_quota),
            ram_text(f.hardware.ram_available_bytes, f.hardware.ram_limit_bytes),
            f.job_id,
            render.ago(f.last_heartbeat_age_s),
        ]
        for f in records
    ]
    headers = [
        "FELLOW",
        "STATUS",
        "HOST",
        "POOL",
        "LABELS",
        "GPUS",
        "CORES",
        "RAM FREE",
        "JOB",
        "LAST HEARTBEAT",
    ]
    ctx.emit(records, render.table(headers, rows) if rows else "no fellows registered")


def links(*, options: LeaderOptions = LEADER, ctx: Ctx) -> None:
    """The links measured between fellows (by their jobs' boundaries, or probed while they
    were idle): what "partition": "balanced" places along. A pair not listed is a guess."""
    with ctx.client() as client:
        records = client.fellows()
    pairs = sorted(
        (
            MeasuredPair(
                upstream=f.fellow_id,
                downstream=peer,
                mbit_s=m.mbit_s,
                rtt_ms=m.rtt_ms,
                measured_at=m.measured_at,
            )
            for f in records
            for peer, m in f.links.items()
        ),
        key=lambda p: (p.upstream, p.downstream),
    )
    rows = [
        [
            p.upstream,
            p.downstream,
            f"{p.mbit_s:,.1f}",
            f"{p.rtt_ms:.2f}",
            "-" if p.measured_at is None else f"{render.since(p.measured_at)} ago",
        ]
        for p in pairs
    ]
    headers = ["UPSTREAM", "DOWNSTREAM", "MBIT/S", "RTT MS", "MEASURED"]
    ctx.emit(pairs, render.table(headers, rows) if rows else "no links measured yet")


def nodes(*, options: LeaderOptions = LEADER, ctx: Ctx) -> None:
    """Hosts with their CPU cores, RAM and GPUs (total/free VRAM)."""
    with ctx.client() as client:
        hosts = client.nodes()
    rows = []
    for n in hosts:
        gpus = ", ".join(
            f"{g.index}:{g.name} {render.gib(g.memory_free_bytes)}/"
            f"{render.gib(g.memory_total_bytes)}"
            for g in n.gpus
        )
        rows.append(
            [
                n.hostname,
                "online" if n.online else "offline",
                n.cpu_cores,
                f"{render.gib(n.ram_available_bytes)}/{render.gib(n.ram_total_bytes)}",
                gpus or "none",
                ",".join(n.fellows),
            ]
        )
    headers = ["HOST", "STATE", "CORES", "RAM FREE/TOTAL", "GPUS (FREE/TOTAL)", "FELLOWS"]
    warnings = [Text(f"{n.hostname}: {n.gpu_warning}") for n in hosts if n.gpu_warning]
    ctx.emit(hosts, Group(render.table(headers, rows), *warnings) if rows else "no nodes")


def logs(
    fellow_id: Annotated[str, FELLOW_ID],
    *,
    follow: Annotated[bool, Parameter(help="Keep printing new records (SSE)")] = False,
    limit: Annotated[int, Parameter(help="How many of the latest records")] = 100,
    options: LeaderOptions = LEADER,
    ctx: Ctx,
) -> None:
    """A fellow's logs (its agent and its stage runtime), shipped to the leader. An unknown
    fellow (no logs, not registered) is an error, exit 1."""
    with ctx.client() as client:
        records = client.logs(fellow_id, limit=limit)
        if not records:
            require_fellow(client, fellow_id)
    for r in records:
        _print_log(ctx, r)
    if not follow:
        return
    last = str(records[-1].seq) if records else None
    for event in sse.follow(
        ctx.leader_url,
        f"/api/v1/workers/{quote(fellow_id, safe='')}/logs/stream",
        last_event_id=last,
        token=ctx.token,
    ):
        if event.event == "logs":
            for r in decode_answer(event.data, list[LogEntry], "the log stream"):
                _print_log(ctx, r)


def require_fellow(client: LeaderClient, fellow_id: str) -> None:
    """NotFound (exit 1, "no fellow 'x'") unless the leader knows the fellow: the log
    endpoints answer an empty list for any id, known or not."""
    try:
        client.fellow(fellow_id)
    except LeaderResponseError as exc:
        if exc.code == ErrorCode.NOT_FOUND:
            raise LeaderResponseError(
                f"no fellow {fellow_id!r} (no logs, and the leader has no such fellow)",
                code=ErrorCode.NOT_FOUND,
            ) from None
        raise


def _print_log(ctx: CliContext, r: LogEntry) -> None:
    if ctx.json:
        print(json.dumps(msgspec.to_builtins(r), sort_keys=True), flush=True)
        return
    level, logger, message = (render.terminal_safe(t) for t in (r.level, r.logger, r.message))
    print(f"{render.clock(r.ts)} {r.fellow_id} {level:<7} {logger}: {message}", flush=True)


def update(
    fellow_id: Annotated[str | None, SOME_FELLOW] = None,
    *,
    options: LeaderOptions = LEADER,
    ctx: Ctx,
) -> None:
    """Update idle fellows: joined ones reinstall the leader's package; all restart in place."""
    with ctx.client() as client:
        records = client.update(fellow_id)
    rows = [[r.fellow_id, "ok" if r.ok else r.code, r.message] for r in records]
    ctx.emit(records, render.table(["FELLOW", "RESULT", "MESSAGE"], rows) if rows else "no fellows")


def release(
    fellow_id: Annotated[str, FELLOW_ID],
    *,
    purge_install: Annotated[
        bool, Parameter(help="Also make it delete its local state (<state>/fellows/<id>)")
    ] = False,
    options: LeaderOptions = LEADER,
    ctx: Ctx,
) -> None:
    """Remove a fellow from the registry (its agent exits); --purge-install also wipes it."""
    with ctx.client() as client:
        result = client.release(fellow_id, purge_install=purge_install)
    purge = {
        None: "",
        "delivered": "; purge delivered",
        "pending": "; purge pending until it comes back (swarm pending-purges)",
    }[result.purge]
    ctx.emit(result, f"released {fellow_id}{purge}")


def pending_purges(*, options: LeaderOptions = LEADER, ctx: Ctx) -> None:
    """Purges waiting for their (offline) fellow to come back."""
    with ctx.client() as client:
        records = client.pending_purges()
    rows = [
        [p.fellow_id, render.since(p.requested_at), p.attempts, p.last_error or "-"]
        for p in records
    ]
    headers = ["FELLOW", "REQUESTED", "ATTEMPTS", "LAST ERROR"]
    ctx.emit(records, render.table(headers, rows) if rows else "no pending purges")


def retry_purge(
    fellow_id: Annotated[str | None, SOME_FELLOW] = None,
    *,
    options: LeaderOptions = LEADER,
    ctx: Ctx,
) -> None:
    """Try to deliver pending purges now."""
    with ctx.client() as client:
        results = client.retry_purges(fellow_id)
    rows = [
        [r.fellow_id, "delivered" if r.delivered else "pending", r.error or "-"] for r in results
    ]
    ctx.emit(
        results, render.table(["FELLOW", "PURGE", "ERROR"], rows) if rows else "nothing pending"
    )


def register(app: cyclopts.App) -> None:
    app.command(fellows)
    app.command(nodes)
    app.command(links)
    app.command(logs)
    app.command(update)
    app.command(release)
    app.command(pending_purges, name="pending-purges")
    app.command(retry_purge, name="retry-purge")
