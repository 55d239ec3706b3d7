"""Bringing remote machines in: ``join-session create`` and ``join-session list``."""

from __future__ import annotations

from typing import Annotated

import cyclopts
from cyclopts import Parameter

from silentswarm.cli import render
from silentswarm.cli.context import Ctx
from silentswarm.cli.options import LEADER, LeaderOptions


def create(
    *,
    name: Annotated[
        str | None, Parameter(help="The new fellow's id (default: its host name)")
    ] = None,
    ttl: Annotated[float, Parameter(help="Seconds the one-time token stays valid")] = 3600.0,
    options: LeaderOptions = LEADER,
    ctx: Ctx,
) -> None:
    """Create a join session and print the one command the remote host runs."""
    with ctx.client() as client:
        session = client.create_join_session(name, ttl)
    ctx.emit(
        session,
        f"join session {session.session_id} (valid {ttl:.0f}s, single use); "
        f"on the new host run:\n  {session.command}",
    )


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
