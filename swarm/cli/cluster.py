"""``swarm start-cluster`` / ``swarm stop-cluster``: a local swarm as background processes.

NATS runs as its own process; the leader and the fellows get its URL as ``SWARM_NATS_URL``.
Every process is written to ``<state>/run/cluster.json`` and ``<state>/run/<name>.pid`` as
soon as it starts, so stop-cluster can clean up even after a start that failed half way.

A record names its process by pid, start time in clock ticks since boot and boot id
(``silentswarm.procs.ProcessIdentity``): a reused pid is never killed by mistake, and a step of the
wall clock does not make a live process look dead. Manifests from before that hold only a
wall-clock ``create_time``; such a record is taken to be ours when its pid runs the command
start-cluster gave it, for this state directory (``legacy_owned``), whatever the clock says.

stop-cluster forgets a record only once its process is gone: one it could not stop, or
cannot inspect, stays in the manifest and the command fails saying so. The CLI takes the
leader URL from the manifest, and says what is wrong with a manifest it cannot use rather
than quietly trying the default URL.

The nats-server holds the lock on its store for its life and keeps its port (swarm.natsd): a
second cluster on this state directory is refused even when the manifest is gone, and with
``--nats-port 0`` the port the first start got stays this state directory's NATS port.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import psutil

from silentswarm.cli.client import LeaderClient
from silentswarm.errors import ClusterError, ConfigError, ErrorCode, LeaderUnreachableError
from silentswarm.natsauth import NatsAuthority
from silentswarm.natsd import (
    StoreOwner,
    describe_store_use,
    start_nats_server,
    store_in_use_error,
    store_lock_state,
)
from silentswarm.procs import (
    ProcessIdentity,
    ensure_port_free,
    free_port,
    identity_of,
    same_process,
    spawn,
    stop_processes,
    tail,
    wait_until,
)
from silentswarm.settings import Settings

MANIFEST = "cluster.json"
STOP_ORDER = ("fellow", "leader", "nats")  # fellows deregister while the leader still listens


class ClusterProcess(msgspec.Struct):
    name: str
    role: str  # nats | leader | fellow
    pid: int
    log: str
    identity: ProcessIdentity | None = None  # None only in manifests from before it
    # Wall-clock start time, all that older manifests hold. Still written for older swarm
    # versions that read this file; never trusted here (a clock step moves it).
    create_time: float = 0.0


class ClusterManifest(msgspec.Struct):
    state_dir: str
    nats_url: str
    leader_url: str
    processes: list[ClusterProcess] = msgspec.field(default_factory=list)


@dataclass(frozen=True)
class Observed:
    """What runs now under a record's pid: ``process`` when it is ours; ``doubt`` (why)
    when something runs there but whether it is ours cannot be told; neither when gone."""

    record: ClusterProcess
    process: psutil.Process | None = None
    doubt: str | None = None

    @property
    def running(self) -> bool:
        return self.process is not None or self.doubt is not None


def manifest_path(settings: Settings) -> Path:
    return settings.run_dir / MANIFEST


def read_manifest(settings: Settings) -> ClusterManifest | None:
    path = manifest_path(settings)
    if not path.exists():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=ClusterManifest)
    except (OSError, msgspec.DecodeError) as exc:
        raise ClusterError(
            f"{path} cannot be read ({exc}); it lists the processes of the cluster started "
            f"from {settings.state_dir}: look for them ('ps -ef | grep {settings.state_dir}'), "
            "stop them, then remove the file by hand",
            code=ErrorCode.CLUSTER_MANIFEST_DAMAGED,
        ) from None


def _write_manifest(settings: Settings, manifest: ClusterManifest) -> None:
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    tmp = manifest_path(settings).with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(manifest)))
    tmp.replace(manifest_path(settings))
    for proc in manifest.processes:
        (settings.run_dir / f"{proc.name}.pid").write_text(f"{proc.pid}\n")


def running_leader_url(settings: Settings) -> str | None:
    """The leader URL of the cluster started from this state directory; None when there is
    no manifest. A manifest that cannot be read, or whose leader does not run, is a
    ClusterError that says so: the CLI must not quietly talk to whatever answers at the
    default URL instead."""
    manifest = read_manifest(settings)
    if manifest is None:
        return None
    leaders = [observe(p, manifest.state_dir) for p in manifest.processes if p.role == "leader"]
    if any(o.running for o in leaders):
        return manifest.leader_url
    if leaders:
        record = leaders[0].record
        what = f"its leader (pid {record.pid}) is not running; its log is {record.log}"
    else:
        what = "it records no leader (a start that failed half way)"
    raise ClusterError(
        f"the cluster recorded in {manifest_path(settings)} is not running: {what}. "
        "'swarm stop-cluster' clears the record and stops what is left of it; or pass "
        "--leader-url / set SWARM_LEADER_URL to reach another leader",
        code=ErrorCode.CLUSTER_NOT_RUNNING,
    )


def observe(record: ClusterProcess, state_dir: str) -> Observed:
    """Whether ``record``'s process still runs and is ours. The wall clock plays no part."""
    if record.identity is not None:
        try:
            return Observed(record, process=same_process(record.identity))
        except psutil.AccessDenied:
            return Observed(record, doubt=_denied(record))
    try:
        proc = psutil.Process(record.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return Observed(record)
        cmdline = proc.cmdline()
        environ = None if record.role == "nats" else proc.environ()
    except psutil.NoSuchProcess:
        return Observed(record)
    except psutil.AccessDenied:
        return Observed(record, doubt=_denied(record))
    owned = legacy_owned(
        role=record.role,
        name=record.name,
        state_dir=state_dir,
        cmdline=cmdline,
        environ=environ,
    )
    return Observed(record, process=proc if owned else None)


def _denied(record: ClusterProcess) -> str:
    return f"pid {record.pid} runs but may not be inspected (permission denied)"


def legacy_owned(
    *,
    role: str,
    name: str,
    state_dir: str,
    cmdline: Sequence[str],
    environ: Mapping[str, str] | None,
) -> bool:
    """Whether a process is the one an old manifest's record (no identity) describes: it
    runs the command start-cluster gives that role, for this state directory. Pure.

    Such manifests were written before 0.2, whose processes run the old layout's modules
    (``-m leader.main``, ``-m agent.main``); the one package's names count as well."""
    state = os.path.normpath(state_dir) if state_dir else None
    if state is None or not cmdline:
        return False
    if role == "nats":
        store = _flag(cmdline, "--store_dir")
        return (
            Path(cmdline[0]).name == "nats-server"
            and store is not None
            and os.path.normpath(store) == os.path.join(state, "nats")
        )
    ours = environ is not None and os.path.normpath(environ.get("SWARM_STATE_DIR", "")) == state
    if role == "leader":
        return ours and _flag(cmdline, "-m") in ("leader.main", "silentswarm.leader.main")
    if role == "fellow":
        return (
            ours
            and _flag(cmdline, "-m") in ("agent.main", "silentswarm.agent.main")
            and _flag(cmdline, "--name") == name
        )
    return False


def _flag(cmdline: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(cmdline[:-1]):
        if arg == flag:
            return cmdline[i + 1]
    return None


def _live(proc: ClusterProcess, state_dir: str = "") -> psutil.Process | None:
    """The record's process if it still runs and is ours (see ``observe``)."""
    return observe(proc, state_dir).process


def _record(
    name: str, role: str, pid: int, log: Path, identity: ProcessIdentity | None = None
) -> ClusterProcess:
    identity = identity or identity_of(pid)
    try:
        created = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        created = 0.0
    return ClusterProcess(
        name=name, role=role, pid=pid, log=str(log), identity=identity, create_time=created
    )


def start_cluster(
    settings: Settings,
    *,
    fellows: int,
    timeout: float,
    progress: Callable[[str], None],
) -> ClusterManifest:
    """Start NATS, the leader and ``fellows`` fellows; return once every fellow is ready.

    ``fellows`` 0 starts NATS and the leader only (fellows join from elsewhere). Refused
    while anything of a cluster from this state directory runs: a recorded process, or a
    nats-server on its store (also when the manifest is gone).
    """
    if fellows < 0:
        raise ConfigError(f"--fellows {fellows}: a number of fellows is 0 or more")
    existing = read_manifest(settings)
    if existing is not None:
        alive = [o for o in _observe_all(existing) if o.running]
        if alive:
            raise ClusterError(
                f"a cluster from {settings.state_dir} is already running "
                f"({', '.join(f'{o.record.name} pid {o.record.pid}' for o in alive)}); "
                "stop it with 'swarm stop-cluster'"
            )
        _remove_run_files(settings, existing)
    store = store_lock_state(settings.nats_store_dir)
    if store.locked:
        raise store_in_use_error(settings.nats_store_dir, store)
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
        _clean_up_failed_start(settings, progress)
        raise
    return manifest


def _clean_up_failed_start(settings: Settings, progress: Callable[[str], None]) -> None:
    """Stop what a failed start had started; a part that would not stop is said, not lost."""
    try:
        manifest = read_manifest(settings)
        if manifest is not None:
            _stop_recorded(settings, manifest, progress=lambda _: None)
    except ClusterError as exc:
        progress(f"cleaning up the failed start: {exc.message}")


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
        owner=StoreOwner(
            kind="cluster",
            pid=os.getpid(),
            state_dir=str(settings.state_dir),
            leader_url=manifest.leader_url,
        ),
    )
    manifest.nats_url = nats.url
    manifest.processes.append(_record("nats", "nats", nats.pid, nats_log, nats.identity))
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

    launch("leader", "leader", [sys.executable, "-m", "silentswarm.leader.main"])
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
            # Each fellow binds its own loopback port for tensors from its upstream stage,
            # and another for its stage's replicas (jobs with replicas).
            address = f"tcp://127.0.0.1:{free_port()}"
            sync = f"tcp://127.0.0.1:{free_port()}"
            launch(
                name,
                "fellow",
                [sys.executable, "-m", "silentswarm.agent.main", "--name", name],
                SWARM_DATA_ADDRESS=address,
                SWARM_SYNC_ADDRESS=sync,
                **fellow_creds(name),
            )
        if names:
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
        statuses = {f.fellow_id: f.status for f in client.fellows()}
    except LeaderUnreachableError:
        return False
    return all(statuses.get(n) == "ready" for n in names)


def _states(client: LeaderClient, names: list[str]) -> str:
    try:
        statuses = {f.fellow_id: f.status for f in client.fellows()}
    except LeaderUnreachableError as exc:
        return exc.message
    return ", ".join(f"{n}: {statuses.get(n, 'not registered')}" for n in names)


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
    """Stop what start-cluster started, fellows first; safe to run twice. Returns what was
    stopped.

    A ClusterError when something is left: a recorded process that could not be stopped or
    cannot be inspected (its record stays in the manifest, the rest are forgotten), or no
    manifest while a nats-server of a cluster still holds this state directory's store.
    """
    manifest = read_manifest(settings)
    if manifest is not None:
        return _stop_recorded(settings, manifest, progress=progress)
    store = store_lock_state(settings.nats_store_dir)
    if not store.locked:
        return []
    if store.holder is not None and store.holder.owner.kind == "leader":
        progress(
            f"note: {store.holder.owner.describe()} runs its own nats-server on this state "
            "directory; stop-cluster leaves it alone"
        )
        return []
    raise ClusterError(
        f"no cluster is recorded in {manifest_path(settings)}, but "
        f"{describe_store_use(settings.nats_store_dir, store)}. "
        "Without its record stop-cluster cannot tell that cluster's processes: stop them by "
        "hand (its leader and fellows run 'python -m silentswarm.leader.main' / "
        f"'silentswarm.agent.main' with SWARM_STATE_DIR={settings.state_dir})",
        code=ErrorCode.CLUSTER_RECORD_LOST,
    )


def _stop_recorded(
    settings: Settings, manifest: ClusterManifest, *, progress: Callable[[str], None]
) -> list[str]:
    stopped: list[str] = []
    kept: list[tuple[ClusterProcess, str]] = []
    roles = [r for r in {p.role for p in manifest.processes} if r not in STOP_ORDER]
    for role in (*roles, *STOP_ORDER):
        observed = [observe(p, manifest.state_dir) for p in manifest.processes if p.role == role]
        ours = [o for o in observed if o.process is not None]
        left = stop_processes([o.process for o in ours if o.process is not None], timeout=15.0)
        for o in ours:
            why = _why_alive(o.record.pid) if o.process in left else None
            if why is not None:
                kept.append((o.record, why))
            else:
                progress(f"stopped {o.record.name} (pid {o.record.pid})")
                stopped.append(o.record.name)
        kept.extend((o.record, o.doubt) for o in observed if o.doubt is not None)
    if not kept:
        _remove_run_files(settings, manifest)
        return stopped
    records = [record for record, _ in kept]
    if len(records) != len(manifest.processes):
        _remove_pid_files(settings, [p for p in manifest.processes if p not in records])
        manifest.processes = records
        _write_manifest(settings, manifest)
    raise ClusterError(
        "could not stop "
        + "; ".join(f"{r.name} (pid {r.pid}): {why}" for r, why in kept)
        + f". Their records stay in {manifest_path(settings)}; run 'swarm stop-cluster' "
        "again once that is resolved",
        code=ErrorCode.CLUSTER_NOT_STOPPED,
    )


def _why_alive(pid: int) -> str | None:
    """Why a process that would not stop still runs; None if it has gone after all."""
    try:
        os.kill(pid, 0)
    except PermissionError:
        return (
            "not allowed to signal it (another user's process: run stop-cluster as the user "
            "who started the cluster, or as root)"
        )
    except ProcessLookupError:
        return None
    return "it survived SIGTERM and SIGKILL (stuck in the kernel?)"


def _observe_all(manifest: ClusterManifest) -> list[Observed]:
    return [observe(p, manifest.state_dir) for p in manifest.processes]


def _remove_pid_files(settings: Settings, records: Sequence[ClusterProcess]) -> None:
    for proc in records:
        (settings.run_dir / f"{proc.name}.pid").unlink(missing_ok=True)


def _remove_run_files(settings: Settings, manifest: ClusterManifest) -> None:
    _remove_pid_files(settings, manifest.processes)
    manifest_path(settings).unlink(missing_ok=True)
