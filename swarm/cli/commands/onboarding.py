"""Bringing remote machines in: ``join-session create`` and ``join-session list``."""

from __future__ import annotations

from typing import Annotated

import cyclopts
from cyclopts import Parameter

from silentswarm.cli import render
from silentswarm.cli.context import Ctx
from silentswarm.cli.options import LEADER, LeaderOptions
from silentswarm.hosts import is_loopback, url_hosts
from silentswarm.types.onboarding import JoinSessionCreated


def create(
    *,
    name: Annotated[
        str | None, Parameter(help="The new fellow's id (default: its host name)")
    ] = None,
    ttl: Annotated[float, Parameter(help="Seconds the one-time token stays valid")] = 3600.0,
    options: LeaderOptions = LEADER,
    ctx: Ctx,
) -> None:
    """Create a join session and print the one command the remote host runs: with the
    leader's public address (SWARM_PUBLIC_URL, e.g. the HTTPS proxy of
    docs/deploy/public-access.md) when it has one."""
    with ctx.client() as client:
        session = client.create_join_session(name, ttl)
    ctx.emit(session, created_text(session, ttl))


def created_text(session: JoinSessionCreated, ttl: float) -> str:
    """What ``join-session create`` prints (pure): the command, where the new host will reach
    the leader and NATS, and a hint when that is only this machine."""
    lines = [f"join session {session.session_id} (valid {ttl:.0f}s, single use)"]
    if session.leader_url and session.nats_url:
        lines.append(
            f"the new host will reach the leader at {session.leader_url} "
            f"and NATS at {session.nats_url}"
        )
    local = [
        url
        for url in (session.leader_url, session.nats_url)
        if url and any(is_loopback(host) for _, host in url_hosts(url))
    ]
    if local:
        lines.append(
            f"note: {', '.join(local)} is loopback, which only this machine reaches; set "
            "SWARM_PUBLIC_URL on the leader (docs/deploy/public-access.md)"
        )
    lines.append(f"on the new host run:\n  {session.command}")
    return "\n".join(lines)


def list_sessions(*, options: LeaderOptions = LEADER, ctx: Ctx) -> None:
    """Join sessions and their status (created, installing, registered, failed)."""
    with ctx.client() as client:
        sessions = client.join_sessions()
    rows = [
        [
            s.session_id,
            s.status,
            s.fellow_name or "-",
            render.since(s.created_at),
            s.log_lines,
            s.reason or "-",
        ]
        for s in sessions
    ]
    headers = ["SESSION", "STATUS", "FELLOW", "AGE", "LOG LINES", "REASON"]
    ctx.emit(sessions, render.table(headers, rows) if rows else "no join sessions")


def register(app: cyclopts.App) -> None:
    join_session = cyclopts.App(name="join-session", help="Join sessions for remote machines.")
    join_session.command(create, name="create")
    join_session.command(list_sessions, name="list")
    app.command(join_session)
