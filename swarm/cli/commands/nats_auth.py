"""NATS users for a swarm whose nats-server the operator runs: ``nats-auth init`` and
``nats-auth fellow``. Local files only; no leader is asked."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import cyclopts
from cyclopts import Parameter

from silentswarm.cli.context import Ctx
from silentswarm.cli.options import JSON, JsonOptions
from silentswarm.errors import ConfigError
from silentswarm.natsauth import NatsAuthority
from silentswarm.subjects import TOKEN_RE

AUTH_DIR = Parameter(
    help="The authority directory [SWARM_NATS_AUTH_DIR, default <state>/nats-auth]"
)


def init(
    *,
    dir: Annotated[Path | None, AUTH_DIR] = None,
    options: JsonOptions = JSON,
    ctx: Ctx,
) -> None:
    """Create the keys (or keep existing ones), server.conf for nats-server and leader.creds."""
    authority = NatsAuthority.load_or_create(dir or ctx.settings.authority_dir)
    paths = {
        "dir": str(authority.dir),
        "server_config": str(authority.server_config_path),
        "leader_creds": str(authority.leader_creds_path),
        "account": authority.account_public,
    }
    ctx.emit(
        paths,
        f"NATS authority in {authority.dir} (account {authority.account_public})\n"
        f"  nats-server:  include {authority.server_config_path} in its config "
        "(or run it with --config)\n"
        f"  leader:       SWARM_NATS_CREDS={authority.leader_creds_path} "
        f"SWARM_NATS_AUTH_DIR={authority.dir}\n"
        "  each fellow:  swarm nats-auth fellow NAME",
    )


def fellow(
    name: str,
    *,
    dir: Annotated[Path | None, AUTH_DIR] = None,
    out: Annotated[
        Path | None, Parameter(help="Write the .creds here ('-': stdout; default: the authority)")
    ] = None,
    options: JsonOptions = JSON,
    ctx: Ctx,
) -> None:
    """Mint a fellow's own NATS user (it may publish only its own subjects)."""
    if not TOKEN_RE.match(name):
        raise ConfigError(f"{name!r} is not a fellow id (1-64 letters, digits, '-' or '_')")
    authority = NatsAuthority.load(dir or ctx.settings.authority_dir)
    prefix = ctx.settings.subject_prefix
    if out is not None and str(out) == "-":
        sys.stdout.write(authority.fellow_creds(prefix, name))
        return
    path = authority.write_fellow_creds(prefix, name, out)
    ctx.emit(
        {"fellow": name, "creds": str(path)},
        f"{path}: NATS user for fellow {name!r}; give it to that fellow as SWARM_NATS_CREDS",
    )


def register(app: cyclopts.App) -> None:
    nats_auth = cyclopts.App(
        name="nats-auth", help="NATS users for a swarm whose nats-server you run yourself."
    )
    nats_auth.command(init, name="init")
    nats_auth.command(fellow, name="fellow")
    app.command(nats_auth)
