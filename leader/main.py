"""``swarm-leader``: the leader process.

With ``SWARM_NATS_URL`` (or ``--nats-url``) it joins that NATS server. Without one it starts
a child nats-server for convenience: the child dies with the leader (PR_SET_PDEATHSIG) and
keeps its JetStream store under the state directory, so a restarted leader finds it again, on
the same port (with ``SWARM_NATS_PORT=0`` the port the store's server first got is kept), and
no second server can take that store while the child runs (see swarm.natsd).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Annotated

import cyclopts
import uvicorn

from silentswarm.entry import configure_logging, run_or_exit
from silentswarm.errors import ConfigError
from silentswarm.leader.app import create_app
from silentswarm.leader.auth import operator_token
from silentswarm.leader.exposure import exposure_warnings
from silentswarm.natsauth import NatsAuthority
from silentswarm.natsd import NatsServer, StoreOwner, start_nats_server
from silentswarm.procs import ensure_port_free
from silentswarm.sdnotify import notify
from silentswarm.settings import Settings

log = logging.getLogger("leader")
# How long an idle HTTP connection stays open for its next request. It must outlast the idle
# expiry of every client pool that reuses connections: httpx's 5 s (the CLI, the tests) and
# the shipped Caddyfile's 60 s upstream keep-alive. At uvicorn's own 5 s a request sent on a
# connection idle for about 5 s met the server closing it: "connection reset by peer".
KEEP_ALIVE_S = 75
app = cyclopts.App(name="swarm-leader", help="Run the SilentSwarm leader (REST API, registry).")


@app.default
def serve(
    *,
    host: Annotated[str | None, cyclopts.Parameter(help="Bind address [SWARM_LEADER_HOST]")] = None,
    port: Annotated[int | None, cyclopts.Parameter(help="HTTP port [SWARM_LEADER_PORT]")] = None,
    nats_url: Annotated[
        str | None, cyclopts.Parameter(help="NATS server URL; none starts a child [SWARM_NATS_URL]")
    ] = None,
    nats_port: Annotated[
        int | None,
        cyclopts.Parameter(
            help="Port of the child nats-server; 0: the port its store had before, else a "
            "free one, kept from then on [SWARM_NATS_PORT]"
        ),
    ] = None,
    state_dir: Annotated[
        Path | None, cyclopts.Parameter(help="State directory [SWARM_STATE_DIR]")
    ] = None,
    dev: Annotated[
        bool | None,
        cyclopts.Parameter(help="NATS without authentication, for a laptop [SWARM_DEV]"),
    ] = None,
    log_level: Annotated[str | None, cyclopts.Parameter(help="[SWARM_LOG_LEVEL]")] = None,
) -> None:
    settings = Settings.from_env().replace(
        dev=dev,
        leader_host=host,
        leader_port=port,
        nats_url=nats_url,
        nats_port=nats_port,
        state_dir=state_dir,
        log_level=log_level,
    )
    configure_logging(settings.log_level)
    run_leader(settings)


def run_leader(settings: Settings) -> None:
    ensure_port_free(
        settings.leader_host,
        settings.leader_port,
        what="leader HTTP",
        setting="SWARM_LEADER_PORT",
        flag="--port",
    )
    authority = nats_authority(settings)
    creds = settings.nats_creds or (authority.leader_creds_path if authority else None)
    if not settings.dev and creds is None:
        raise ConfigError(
            "NATS authentication is on (the leader is not in dev mode) but the leader has no "
            "credentials: set SWARM_NATS_CREDS to its .creds file (swarm nats-auth init writes "
            "one), or run with --dev / SWARM_DEV=1 for an unauthenticated local swarm"
        )
    if settings.dev:
        warn_dev_mode()
    elif authority is None:
        log.error(
            "this leader has NATS credentials but no NATS authority (%s): it cannot mint the "
            "per-attempt users that placed stages need, so fellows will refuse START; set "
            "SWARM_NATS_AUTH_DIR to the directory 'swarm nats-auth init' made",
            settings.authority_dir,
        )
    child: NatsServer | None = None
    url = settings.nats_url
    if url is None:
        child = start_nats_server(
            host=settings.nats_host,
            port=settings.nats_port,
            store_dir=settings.nats_store_dir,
            log_path=settings.logs_dir / "leader-nats.log",
            config=authority.server_config_path if authority else None,
            websocket_port=settings.nats_websocket_port,
            tie_to_parent=True,
            owner=StoreOwner(
                kind="leader",
                pid=os.getpid(),
                state_dir=str(settings.state_dir.resolve()),
                leader_url=settings.default_leader_url,
            ),
        )
        url = child.url
        log.info("started child nats-server %s (pid %d, store %s)", url, child.pid, child.store_dir)
    warn_exposure(settings, url)
    # uvicorn re-raises the SIGTERM it caught once it has shut down; with this handler that
    # becomes a clean exit (0) that still runs the finally below, as it does during start-up.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        app = create_app(
            settings,
            nats=settings.nats_access(url, creds),
            token=operator_token(settings),
            authority=authority,
        )
        server = _Server(
            uvicorn.Config(
                app,
                host=settings.leader_host,
                port=settings.leader_port,
                log_level=settings.log_level.lower(),
                access_log=False,
                log_config=None,
                lifespan="on",
                timeout_graceful_shutdown=5,
                timeout_keep_alive=KEEP_ALIVE_S,
            ),
            stopping=app.state["stopping"],
        )
        log.info("leader listening on http://%s:%d", settings.leader_host, settings.leader_port)
        server.run()
    finally:
        if child is not None:
            child.stop()


def nats_authority(settings: Settings) -> NatsAuthority | None:
    """The keys that mint fellows' NATS users. A leader that starts its own nats-server
    creates them on first start; with an external NATS they must already exist (made by
    ``swarm nats-auth init``, whose server.conf that server loads). None in dev mode."""
    if settings.dev:
        return None
    if settings.nats_url is None:
        return NatsAuthority.load_or_create(settings.authority_dir)
    if (settings.authority_dir / "account.nk").exists():
        return NatsAuthority.load(settings.authority_dir)
    return None


def warn_exposure(settings: Settings, nats_url: str) -> None:
    """Loud warnings for clear text off loopback; and who may read the API."""
    for warning in exposure_warnings(settings, nats_url):
        log.warning("=" * 78)
        log.warning("NO TLS: %s", warning)
        log.warning("=" * 78)
    if settings.reads_public:
        why = "on loopback" if settings.api_public_reads is None else "SWARM_API_PUBLIC_READS=1"
        log.info("reads (GET) are open without the operator token (%s)", why)
    else:
        log.info(
            "every read (GET) needs the operator token or a read ticket%s",
            " (the leader listens off loopback or has a SWARM_PUBLIC_URL; "
            "SWARM_API_PUBLIC_READS=1 opens them)"
            if settings.api_public_reads is None
            else "",
        )


def warn_dev_mode() -> None:
    for line in (
        "=" * 78,
        "DEV MODE: NATS runs WITHOUT authentication. Anyone who can reach it can pose as",
        "any fellow, read every message and send signals. Use it on a laptop, never on a",
        "network. Without --dev every process has its own NATS user.",
        "=" * 78,
    ):
        log.warning(line)


class _Server(uvicorn.Server):
    """Ends open SSE streams as soon as shutdown begins: uvicorn waits for open responses
    before it runs the app's shutdown, so the app must hear of it first."""

    def __init__(self, config: uvicorn.Config, *, stopping: asyncio.Event) -> None:
        super().__init__(config)
        self._stopping = stopping

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # listening, and the app's lifespan started
            notify("READY=1", "STATUS=serving the API")

    def handle_exit(self, sig: int, frame: object) -> None:
        notify("STOPPING=1")
        super().handle_exit(sig, frame)
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().call_soon_threadsafe(self._stopping.set)


def _exit_cleanly(signum: int, _frame: object) -> None:
    raise SystemExit(0)


def main() -> None:
    run_or_exit("swarm-leader", app)


if __name__ == "__main__":
    main()
