"""``swarm start-cluster`` / ``swarm stop-cluster``: a local swarm as background processes.

NATS runs as its own process; the leader and the fellows get its URL as ``SWARM_NATS_URL``.
Every process is written to ``<state>/run/cluster.json`` (pid and start time, so a reused pid
is never killed by mistake) and to ``<state>/run/<name>.pid`` as soon as it starts, so
stop-cluster can clean up even after a start that failed half way.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import psutil

from swarm.cli.client import LeaderClient
from swarm.errors import ClusterError, ConfigError, LeaderUnreachableError
from swarm.natsauth import NatsAuthority
from swarm.natsd import start_nats_server
from swarm.procs import ensure_port_free, free_port, spawn, stop_processes, tail, wait_until
from swarm.settings import Settings

MANIFEST = "cluster.json"
STOP_ORDER = ("fellow", "leader", "nats")  # fellows deregister while the leader still listens


class ClusterProcess(msgspec.Struct):
    name: str
    role: str  # nats | leader | fellow
    pid: int
    create_time: float
    log: str


class ClusterManifest(msgspec.Struct):
    state_dir: str
    nats_url: str
    leader_url: str
    processes: list[ClusterProcess] = msgspec.field(default_factory=list)


def manifest_path(settings: Settings) -> Path:
    return settings.run_dir / MANIFEST


def read_manifest(settings: Settings) -> ClusterManifest | None:
    path = manifest_path(settings)
    if not path.exists():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=ClusterManifest)
    except msgspec.DecodeError as exc:
        raise ClusterError(f"{path} is damaged ({exc}); remove it by hand") from None


def _write_manifest(settings: Settings, manifest: ClusterManifest) -> None:
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    tmp = manifest_path(settings).with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(manifest)))
    tmp.replace(manifest_path(settings))
    for proc in manifest.processes:
        (settings.run_dir / f"{proc.name}.pid").write_text(f"{proc.pid}\n")


def running_leader_url(settings: Settings) -> str | None:
    """The leader URL of the cluster started from this state directory, if it still runs."""
    try:
        manifest = read_manifest(settings)
    except ClusterError:
        return None
    if manifest is None:
        return None
    leaders = [p for p in manifest.processes if p.role == "leader"]
    return manifest.leader_url if leaders and _live(leaders[0]) is not None else None


def _live(proc: ClusterProcess) -> psutil.Process | None:
    """The process, if it is still the one we started (same pid and start time)."""
    try:
        p = psutil.Process(proc.pid)
        if abs(p.create_time() - proc.create_time) > 1.0 or p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except psutil.NoSuchProcess:
        return None


def _record(name: str, role: str, pid: int, log: Path) -> ClusterProcess:
    try:
        created = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        created = 0.0
    return ClusterProcess(name=name, role=role, pid=pid, create_time=created, log=str(log))


def start_cluster(
    settings: Settings,
    *,
    fellows: int,
    timeout: float,
    progress: Callable[[str], None],
) -> ClusterManifest:
    """Start NATS, the leader and ``fellows`` fellows; return once every fellow is ready."""
    if fellows < 1:
        raise ConfigError(f"--fellows {fellows}: a cluster needs at least 1 fellow")
    existing = read_manifest(settings)
    if existing is not None:
        alive = [p for p in existing.processes if _live(p) is not None]
        if alive:
            raise ClusterError(
                f"a cluster from {settings.state_dir} is already running "
                f"({', '.join(f'{p.name} pid {p.pid}' for p in alive)}); "
                "stop it with 'swarm stop-cluster'"
            )
        _remove_run_files(settings, existing)
    ensure_port_free(
        settings.leader_host,
        settings.leader_port,
        what="leader HTTP",
        setting="SWARM_LEADER_PORT",
        flag="--leader-port",
    )
    ensure_port_free(
        settings.nats_host,
        settings.nats_port,
        what="NATS",
        setting="SWARM_NATS_PORT",
        flag="--nats-port",
    )
    settings.logs_dir.mkdir(parents=True, exist_ok=True)
    leader_url = settings.default_leader_url
    manifest = ClusterManifest(
        state_dir=str(settings.state_dir), nats_url="", leader_url=leader_url
    )
    try:
        _start_all(settings, manifest, fellows=fellows, timeout=timeout, progress=progress)
    except BaseException:
        stop_cluster(settings, progress=lambda _: None)
        raise
    return manifest


def _start_all(
    settings: Settings,
    manifest: ClusterManifest,
    *,
    fellows: int,
    timeout: float,
    progress: Callable[[str], None],
) -> None:
    nats_log = settings.logs_dir / "nats.log"
    # Every process gets its own NATS user (keys kept in <state>/nats-auth), unless --dev.
    authority = None if settings.dev else NatsAuthority.load_or_create(settings.authority_dir)
    nats = start_nats_server(
        host=settings.nats_host,
        port=settings.nats_port,
        store_dir=settings.nats_store_dir,
        log_path=nats_log,
        config=authority.server_config_path if authority else None,
        websocket_port=settings.nats_websocket_port,
        detach=True,
    )
    manifest.nats_url = nats.url
    manifest.processes.append(_record("nats", "nats", nats.pid, nats_log))
    _write_manifest(settings, manifest)
    security = "DEV MODE, no authentication" if authority is None else "a NATS user per process"
    progress(f"nats     {nats.url} (pid {nats.pid}, {security})")

    child_settings = settings.replace(nats_url=nats.url, leader_url=manifest.leader_url)
    if authority is not None:
        child_settings = child_settings.replace(
            nats_auth_dir=authority.dir, nats_creds=authority.leader_creds_path
        )
    env = {**os.environ, **child_settings.as_env(), "PYTHONUNBUFFERED": "1"}
    started: dict[str, Any] = {}

    def fellow_creds(name: str) -> dict[str, str]:
        if authority is None:
            return {}
        path = authority.write_fellow_creds(settings.subject_prefix, name)
        return {"SWARM_NATS_CREDS": str(path)}

    def launch(name: str, role: str, argv: list[str], **extra_env: str) -> None:
        log = settings.logs_dir / f"{name}.log"
        proc = spawn(argv, log_path=log, env={**env, **extra_env}, detach=True)
        started[name] = (proc, log)
        manifest.processes.append(_record(name, role, proc.pid, log))
        _write_manifest(settings, manifest)

    launch("leader", "leader", [sys.executable, "-m", "leader.main"])
    deadline = time.monotonic() + timeout
    with LeaderClient(manifest.leader_url, timeout=2.0) as client:
        up = wait_until(
            lambda: _answers(client),
            timeout=max(0.0, deadline - time.monotonic()),
            abort=lambda: _exited(started),
        )
        if not up:
            raise ClusterError(
                _why_not(started, f"the leader did not answer at {manifest.leader_url}")
            )
        progress(f"leader   {manifest.leader_url} (pid {started['leader'][0].pid})")
    # Reads need the operator token when the leader listens off loopback; it exists now.
    with LeaderClient(manifest.leader_url, timeout=2.0, token=settings.client_token()) as client:
        names = [f"fellow-{i}" for i in range(1, fellows + 1)]
        for name in names:
            # Each fellow binds its own loopback port for tensors from its upstream stage.
            address = f"tcp://127.0.0.1:{free_port()}"
            launch(
                name,
                "fellow",
                [sys.executable, "-m", "agent.main", "--name", name],
                SWARM_DATA_ADDRESS=address,
                **fellow_creds(name),
            )
        progress(f"fellows  starting {', '.join(names)}")
        ready = wait_until(
            lambda: _all_ready(client, names),
            timeout=max(0.0, deadline - time.monotonic()),
            interval=0.1,
            abort=lambda: _exited(started),
        )
        if not ready:
            states = _states(client, names)
            raise ClusterError(
                _why_not(started, f"fellows not ready within {timeout:.0f}s ({states})")
            )
    for name in names:
        proc, _ = started[name]
        progress(f"fellow   {name} ready (pid {proc.pid})")


def _answers(client: LeaderClient) -> bool:
    try:
        client.health()
    except LeaderUnreachableError:
        return False
    return True


def _all_ready(client: LeaderClient, names: list[str]) -> bool:
    try:
        workers = {w["fellow_id"]: w["status"] for w in client.workers()}
    except LeaderUnreachableError:
        return False
    return all(workers.get(n) == "ready" for n in names)


def _states(client: LeaderClient, names: list[str]) -> str:
    try:
        workers = {w["fellow_id"]: w["status"] for w in client.workers()}
    except LeaderUnreachableError as exc:
        return exc.message
    return ", ".join(f"{n}: {workers.get(n, 'not registered')}" for n in names)


def _exited(started: dict[str, Any]) -> str | None:
    for name, (proc, _) in started.items():
        if proc.poll() is not None:
            return name
    return None


def _why_not(started: dict[str, Any], fallback: str) -> str:
    name = _exited(started)
    if name is None:
        return fallback + "; logs in " + str(next(iter(started.values()))[1].parent)
    proc, log = started[name]
    return f"{name} exited with code {proc.returncode}; log {log}:\n{tail(log, 15)}".rstrip()


def stop_cluster(settings: Settings, *, progress: Callable[[str], None]) -> list[str]:
    """Stop what start-cluster started, fellows first; idempotent. Returns what was stopped."""
    manifest = read_manifest(settings)
    if manifest is None:
        return []
    stopped: list[str] = []
    for role in STOP_ORDER:
        procs = [(p, _live(p)) for p in manifest.processes if p.role == role]
        live = [(p, lp) for p, lp in procs if lp is not None]
        stop_processes([lp for _, lp in live], timeout=15.0)
        for p, _ in live:
            progress(f"stopped {p.name} (pid {p.pid})")
            stopped.append(p.name)
    _remove_run_files(settings, manifest)
    return stopped


def _remove_run_files(settings: Settings, manifest: ClusterManifest) -> None:
    for proc in manifest.processes:
        (settings.run_dir / f"{proc.name}.pid").unlink(missing_ok=True)
    manifest_path(settings).unlink(missing_ok=True)
