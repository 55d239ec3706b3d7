"""The cluster as a whole: ``info`` (the leader's view of it), ``start-cluster`` and
``stop-cluster`` (a local swarm as background processes; the mechanics are
:mod:`silentswarm.cli.cluster`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import cyclopts
import msgspec
from cyclopts import Parameter

from silentswarm import __version__
from silentswarm.cli import cluster
from silentswarm.cli.context import Ctx
from silentswarm.cli.options import JSON, LEADER, JsonOptions, LeaderOptions
from silentswarm.errors import ConfigError

STATE_DIR = Parameter(help="[SWARM_STATE_DIR, default ./.swarm]")


def info(*, options: LeaderOptions = LEADER, ctx: Ctx) -> None:
    """Leader version, NATS URL and fellow counts."""
    with ctx.client() as client:
        data = client.info()
    counts = ", ".join(f"{k} {v}" for k, v in data.fellows.items() if v) or "none"
    cli = f"cli       version {__version__}"
    if data.version != __version__:
        cli += f" (not the leader's: install {data.version} to read all it sends)"
    ctx.emit(
        data,
        "\n".join(
            [
                f"leader    {ctx.leader_url} (version {data.version})",
                cli,
                f"nats      {data.nats_url} "
                f"({'connected' if data.nats_connected else 'DISCONNECTED'})",
                f"fellows   {counts}",
                f"nodes     {data.nodes}",
                f"uptime    {data.uptime_s:.0f}s",
            ]
        ),
    )


def start_cluster(
    *,
    fellows: Annotated[int, Parameter(help="How many fellow agents to start")] = 2,
    leader_port: Annotated[int | None, Parameter(help="[SWARM_LEADER_PORT, default 8080]")] = None,
    nats_port: Annotated[
        int | None,
        Parameter(
            help="[SWARM_NATS_PORT, default 4222; 0 = the port this state directory's NATS "
            "had before, else a free one, kept from then on so clients keep the URL]"
        ),
    ] = None,
    state_dir: Annotated[Path | None, STATE_DIR] = None,
    timeout: Annotated[float, Parameter(help="Seconds to wait for every fellow")] = 60.0,
    dev: Annotated[
        bool | None,
        Parameter(
            help="NATS without authentication (default: a NATS user per process) [SWARM_DEV]"
        ),
    ] = None,
    options: JsonOptions = JSON,
    ctx: Ctx,
) -> None:
    """Start NATS, the leader and N fellows in the background; return when all are ready.

    Refused while a cluster from this state directory runs, even one whose record
    (run/cluster.json) is gone: its nats-server holds the NATS store for as long as it lives.
    """
    if fellows < 1:
        raise ConfigError(f"--fellows {fellows}: a cluster needs at least 1 fellow")
    settings = ctx.settings.replace(
        leader_port=leader_port, nats_port=nats_port, state_dir=state_dir, dev=dev
    )
    settings = settings.replace(state_dir=settings.state_dir.resolve())
    manifest = cluster.start_cluster(
        settings, fellows=fellows, timeout=timeout, progress=ctx.progress
    )
    ctx.emit(
        msgspec.to_builtins(manifest),
        f"cluster ready: {fellows} fellow(s); leader {manifest.leader_url}\n"
        f"logs in {settings.logs_dir}; stop with: swarm stop-cluster"
        + (f" --state-dir {settings.state_dir}" if state_dir else ""),
    )


def stop_cluster(
    *,
    state_dir: Annotated[Path | None, STATE_DIR] = None,
    options: JsonOptions = JSON,
    ctx: Ctx,
) -> None:
    """Stop exactly what start-cluster started; safe to run twice.

    A process it cannot stop (or cannot tell is the cluster's) keeps its record in
    run/cluster.json, and the command says which and exits 1.
    """
    settings = ctx.settings.replace(state_dir=state_dir)
    settings = settings.replace(state_dir=settings.state_dir.resolve())
    stopped = cluster.stop_cluster(settings, progress=ctx.progress)
    ctx.emit(
        {"stopped": stopped},
        "cluster stopped" if stopped else f"no cluster running from {settings.state_dir}",
    )


def register(app: cyclopts.App) -> None:
    app.command(info)
    app.command(start_cluster, name="start-cluster")
    app.command(stop_cluster, name="stop-cluster")
