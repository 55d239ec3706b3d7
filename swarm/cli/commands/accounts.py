"""Accounts on the leader (admin): ``swarm account create``, ``list``, ``rotate``,
``revoke``, and ``swarm whoami``. A token is printed once, by ``create`` or ``rotate``; the
leader keeps only its SHA-256."""

from __future__ import annotations

import time
from typing import Annotated

import cyclopts
from cyclopts import Parameter

from silentswarm.cli import render
from silentswarm.cli.context import Ctx
from silentswarm.cli.options import LEADER, LeaderOptions
from silentswarm.types.account_api import CreateAccount
from silentswarm.types.accounts import Role


def create(
    name: Annotated[str, Parameter(help="The account's name: a-z, 0-9, _ and -, up to 32")],
    *,
    role: Annotated[
        Role,
        Parameter(
            help="admin (everything), submitter (submits and controls its own jobs) "
            "or viewer (reads)"
        ),
    ],
    pool: Annotated[
        list[str] | None,
        Parameter(help="A pool its jobs may use (repeat for more; default: any pool)"),
    ] = None,
    options: LeaderOptions = LEADER,
    ctx: Ctx,
) -> None:
    """Create an account and print its API token, this once (the leader keeps only its hash).
    The account sends it as SWARM_API_TOKEN. Revoke a name, then create it again, to give it
    a new token: its jobs stay its own."""
    # The leader validates (a 400 naming the field, shown as one line).
    request = CreateAccount(name=name, role=role, pools=pool)
    with ctx.client() as client:
        created = client.create_account(request)
    account = created.account
    pools = "any pool" if account.pools is None else "pools " + ", ".join(account.pools)
    ctx.emit(
        created,
        f"account {account.name} ({account.role}, {pools}) created; its token, shown once:\n"
        f"{created.token}\n"
        f"use it as SWARM_API_TOKEN={created.token}",
    )


def list_accounts(*, options: LeaderOptions = LEADER, ctx: Ctx) -> None:
    """Every account: role, pools, age, revoked (never a token)."""
    with ctx.client() as client:
        records = client.accounts()
    rows = [
        [
            a.name,
            a.role,
            "any" if a.pools is None else ",".join(a.pools) or "none",
            render.since(a.created_at),
            "-"
            if a.revoked_at is None
            else time.strftime("%Y-%m-%d %H:%M", time.gmtime(a.revoked_at)),
        ]
        for a in records
    ]
    headers = ["NAME", "ROLE", "POOLS", "AGE", "REVOKED (UTC)"]
    ctx.emit(records, render.table(headers, rows) if rows else "no accounts")


def revoke(
    name: Annotated[str, Parameter(help="The account's name")],
    *,
    options: LeaderOptions = LEADER,
    ctx: Ctx,
) -> None:
    """Revoke an account: its token (and its read tickets) stop working at once. Its jobs
    stay; the record stays, listed as revoked."""
    with ctx.client() as client:
        account = client.revoke_account(name)
    ctx.emit(account, f"account {account.name} revoked; its token no longer works")


def rotate(
    name: Annotated[str, Parameter(help="The account's name")],
    *,
    options: LeaderOptions = LEADER,
    ctx: Ctx,
) -> None:
    """Give an account a new API token and print it, this once: the old token stops working
    at once (its open streams too); the account keeps its role, pools, limits and jobs."""
    with ctx.client() as client:
        created = client.rotate_account(name)
    ctx.emit(
        created,
        f"account {created.account.name}: new token, shown once (the old one no longer "
        f"works):\n{created.token}\nuse it as SWARM_API_TOKEN={created.token}",
    )


def whoami(*, options: LeaderOptions = LEADER, ctx: Ctx) -> None:
    """The account this CLI's token stands for, and its role."""
    with ctx.client() as client:
        me = client.whoami()
    what = "the operator token" if me.operator else f"account {me.name}"
    pools = "" if me.pools is None else f", pools {', '.join(me.pools) or 'none'}"
    ctx.emit(me, f"{what} ({me.role}{pools}) at {ctx.leader_url}")


def register(app: cyclopts.App) -> None:
    account = cyclopts.App(name="account", help="Accounts on the leader (admin).")
    account.command(create, name="create")
    account.command(list_accounts, name="list")
    account.command(rotate, name="rotate")
    account.command(revoke, name="revoke")
    app.command(account)
    app.command(whoami, name="whoami")
