"""Faults of a local cluster as an operator meets them: a wall-clock step, a manifest that is
gone or wrong, a second cluster on the same store, a process stop-cluster may not stop, and
a NATS server that restarts. Real nats-server and leader processes; a "control plane" is a
cluster with no fellows (nats + leader), which is all these faults need."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import msgspec
import nats
import psutil
import pytest

from silentswarm.cli.cluster import (
    ClusterManifest,
    ClusterProcess,
    manifest_path,
    start_cluster,
)
from silentswarm.errors import PortInUseError, StoreInUseError
from silentswarm.natsd import PORT_FILE, pinned_port, start_nats_server, store_lock_state
from silentswarm.procs import (
    ProcessIdentity,
    boot_id,
    free_port,
    identity_of,
    is_gone,
    is_locked,
    port_in_use,
    same_process,
    stop_processes,
    wait_until,
)
from silentswarm.settings import Settings
from tests.helpers import REPO, Leader, child_env, wait_for
from tests.helpers import run_swarm as swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

StartPlane = Callable[..., tuple[Settings, ClusterManifest]]


@pytest.fixture
def control_plane(tmp_path: Path) -> Iterator[StartPlane]:
    """Starts nats + leader the way start-cluster does (detached); kills what is left after."""
    manifests: list[ClusterManifest] = []
    stores: list[Path] = []

    def start(state: Path | None = None) -> tuple[Settings, ClusterManifest]:
        settings = Settings(
            state_dir=(state or tmp_path / "state").resolve(),
            leader_port=free_port(),
            nats_port=0,
            dev=True,
        )
        stores.append(settings.nats_store_dir)
        manifest = start_cluster(settings, fellows=0, timeout=90, progress=lambda _: None)
        manifests.append(manifest)
        return settings, manifest

    try:
        yield start
    finally:
        left = [p for m in manifests for p in _running(m)]
        for store in stores:
            holder = store_lock_state(store, settle=0).holder
            if holder is not None and (server := same_process(holder.server)) is not None:
                left.append(server)
        for proc in left:
            proc.kill()
        wait_until(lambda: all(is_gone(p) for p in left), timeout=10)


def _running(manifest: ClusterManifest) -> list[psutil.Process]:
    found = (same_process(p.identity) for p in manifest.processes if p.identity is not None)
    return [p for p in found if p is not None]


def _pid(manifest: ClusterManifest, role: str) -> int:
    return next(p.pid for p in manifest.processes if p.role == role)


def _nats_servers_on(store: Path) -> list[int]:
    pids = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["status"] == psutil.STATUS_ZOMBIE or not cmdline:
            continue
        if Path(cmdline[0]).name == "nats-server" and str(store) in cmdline:
            pids.append(proc.pid)
    return pids


def _answers(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=5).status_code == 200


def _write(settings: Settings, manifest: ClusterManifest) -> None:
    manifest_path(settings).write_bytes(msgspec.json.encode(manifest))


def _env(settings: Settings) -> dict[str, str]:
    return child_env(SWARM_STATE_DIR=str(settings.state_dir))


# --- one store, one server -------------------------------------------------------------


@pytest.mark.parametrize("record", ["manifest kept", "manifest deleted"])
def test_a_second_start_cluster_on_a_live_store_is_refused_naming_the_running_cluster(
    control_plane, record
):
    settings, first = control_plane()
    nats_pid = _pid(first, "nats")
    if record == "manifest deleted":
        manifest_path(settings).unlink()
    for nats_port in (str(free_port()), "0"):
        other_leader = free_port()
        second = swarm(
            "start-cluster",
            "--fellows",
            "1",
            "--leader-port",
            str(other_leader),
            "--nats-port",
            nats_port,
            "--state-dir",
            str(settings.state_dir),
            env=child_env(),
        )
        assert second.returncode == 1, second
        err = second.stderr
        assert "Traceback" not in err and err.count("\n") == 1, err
        if record == "manifest kept":
            assert "already running" in err and f"nats pid {nats_pid}" in err, err
        else:
            assert f"nats-server pid {nats_pid} ({first.nats_url})" in err, err
            assert f"'swarm start-cluster' started from {settings.state_dir}" in err, err
            assert f"(leader {first.leader_url})" in err, err
            assert f"swarm stop-cluster --state-dir {settings.state_dir}" in err, err
        assert not port_in_use("127.0.0.1", other_leader), "the second start started a leader"
    assert _nats_servers_on(settings.nats_store_dir) == [nats_pid]
    assert _answers(first.leader_url), "the running cluster is untouched"


def test_a_bare_leader_on_a_cluster_store_is_refused(control_plane, tmp_path):
    settings, first = control_plane()
    nats_pid = _pid(first, "nats")
    leader_port = free_port()
    done = subprocess.run(
        [sys.executable, "-m", "silentswarm.leader.main"],
        env=child_env(
            SWARM_STATE_DIR=str(settings.state_dir),
            SWARM_LEADER_PORT=str(leader_port),
            SWARM_NATS_PORT="0",
        ),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 1, done
    assert f"nats-server pid {nats_pid}" in done.stderr and "stop-cluster" in done.stderr
    assert "Traceback" not in done.stderr
    # The same from the library, with any port: the store is taken, not the port.
    with pytest.raises(StoreInUseError, match=f"nats-server pid {nats_pid}"):
        start_nats_server(
            host="127.0.0.1",
            port=free_port(),
            store_dir=settings.nats_store_dir,
            log_path=tmp_path / "second-nats.log",
            tie_to_parent=True,
        )
    assert _nats_servers_on(settings.nats_store_dir) == [nats_pid]


_STARTER = """
import sys
from pathlib import Path
from silentswarm.natsd import start_nats_server
server = start_nats_server(
    host="127.0.0.1", port=0, store_dir=Path(sys.argv[1]), log_path=Path(sys.argv[2]),
    detach=True,
)
print(server.pid, server.url, flush=True)
"""


def test_the_store_lock_outlives_the_process_that_started_the_server(tmp_path):
    """start-cluster exits and its nats-server runs on: the server holds the lock itself
    (it inherited the locked file), and frees it by dying."""
    store = tmp_path / "store"
    starter = subprocess.run(
        [sys.executable, "-c", _STARTER, str(store), str(tmp_path / "nats.log")],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert starter.returncode == 0, starter.stderr
    pid, url = starter.stdout.split()
    server = psutil.Process(int(pid))
    try:
        assert not is_gone(server), "the starter has exited; its server runs"
        assert is_locked(store / "swarm.lock")
        holder = store_lock_state(store).holder
        assert holder is not None
        assert holder.server == identity_of(server.pid) and holder.url == url
        with pytest.raises(StoreInUseError) as refused:
            start_nats_server(
                host="127.0.0.1",
                port=free_port(),
                store_dir=store,
                log_path=tmp_path / "second.log",
                tie_to_parent=True,
            )
        assert f"nats-server pid {pid} ({url})" in refused.value.message
        assert _nats_servers_on(store) == [server.pid]
    finally:
        stop_processes([server])
    assert not is_locked(store / "swarm.lock"), "the lock died with the server"
    again = start_nats_server(
        host="127.0.0.1", port=0, store_dir=store, log_path=tmp_path / "n.log", tie_to_parent=True
    )
    try:
        assert again.url == url, "port 0 gives the store's kept port"
    finally:
        again.stop()


def test_stop_cluster_without_the_record_of_a_live_cluster_fails_and_touches_nothing(
    control_plane,
):
    settings, first = control_plane()
    manifest_path(settings).unlink()
    stopped = swarm("stop-cluster", "--state-dir", str(settings.state_dir))
    assert stopped.returncode == 1, stopped
    assert f"nats-server pid {_pid(first, 'nats')}" in stopped.stderr
    assert "no cluster is recorded" in stopped.stderr
    assert len(_running(first)) == len(first.processes), "nothing was stopped blindly"


# --- process identity: a clock step, a wrong record ---------------------------------------


@pytest.mark.parametrize("record", ["with identity", "old manifest, create_time only"])
def test_a_wall_clock_step_does_not_lose_the_cluster(control_plane, record):
    """The VM's clock stepped ~11 s: every recorded wall-clock start time is 11 s off. The
    cluster must still be found (info) and stopped (stop-cluster), nothing left running."""
    settings, first = control_plane()
    stepped = msgspec.structs.replace(
        first,
        processes=[
            msgspec.structs.replace(
                p,
                create_time=p.create_time + 11.0,
                identity=p.identity if record == "with identity" else None,
            )
            for p in first.processes
        ],
    )
    _write(settings, stepped)

    info = swarm("info", "--json", env=_env(settings))
    assert info.returncode == 0, info
    assert json.loads(info.stdout)["nats_url"] == first.nats_url

    stopped = swarm("stop-cluster", env=_env(settings))
    assert stopped.returncode == 0, stopped
    assert "stopped leader" in stopped.stdout and "stopped nats" in stopped.stdout
    assert "cluster stopped" in stopped.stdout
    assert _running(first) == [], "stop-cluster left a process behind"
    assert not manifest_path(settings).exists()
    assert not store_lock_state(settings.nats_store_dir).locked


def test_stop_cluster_never_signals_a_process_that_is_not_ours(procs, tmp_path):
    """A record whose pid now belongs to someone else (other start ticks; or, in an old
    manifest, the same wall-clock start time but another command) is forgotten, untouched."""
    victim = procs.start(
        "victim", [sys.executable, "-c", "import time; time.sleep(600)"], env=child_env()
    )
    identity = identity_of(victim.pid)
    assert identity is not None
    settings = Settings(state_dir=(tmp_path / "state").resolve())
    settings.run_dir.mkdir(parents=True)
    created = psutil.Process(victim.pid).create_time()
    records = [
        ClusterProcess(
            name="leader",
            role="leader",
            pid=victim.pid,
            log="leader.log",
            identity=ProcessIdentity(victim.pid, identity.start_ticks + 1, identity.boot_id),
        ),
        ClusterProcess(
            name="fellow-1", role="fellow", pid=victim.pid, log="f.log", create_time=created
        ),
    ]
    _write(settings, ClusterManifest(str(settings.state_dir), "nats://x:1", "http://x:1", records))
    stopped = swarm("stop-cluster", env=_env(settings))
    assert stopped.returncode == 0, stopped
    assert victim.poll() is None and same_process(identity) is not None, "the victim lives"
    assert not manifest_path(settings).exists()


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv, to run stop-cluster as another user",
)
def test_stop_cluster_keeps_the_record_of_what_it_cannot_stop(control_plane):
    """Started as root, stopped as 'nobody': nothing can be signalled. Every record stays, the
    command names each process and why and exits 1; root can stop them afterwards."""
    base = Path(tempfile.mkdtemp(prefix="swarm-other-user-"))
    base.chmod(0o755)  # pytest's tmp_path is root's only
    try:
        settings, first = control_plane(base / "state")
        before = manifest_path(settings).read_bytes()
        as_nobody = subprocess.run(
            [
                *("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"),
                *(sys.executable, "-m", "silentswarm.cli.app", "stop-cluster"),
                *("--state-dir", str(settings.state_dir)),
            ],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert as_nobody.returncode == 1, as_nobody
        err = as_nobody.stderr
        assert "could not stop" in err and "not allowed to signal" in err, err
        for role in ("leader", "nats"):
            assert f"{role} (pid {_pid(first, role)})" in err, err
        assert manifest_path(settings).read_bytes() == before, "every record is kept"
        assert len(_running(first)) == len(first.processes)

        info = swarm("info", "--json", env=_env(settings))
        assert info.returncode == 0, info

        stopped = swarm("stop-cluster", env=_env(settings))
        assert stopped.returncode == 0, stopped
        assert _running(first) == []
        assert not manifest_path(settings).exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_info_names_a_damaged_manifest_instead_of_trying_the_default_url(tmp_path):
    state = tmp_path / "state"
    (state / "run").mkdir(parents=True)
    (state / "run" / "cluster.json").write_text('{"state_dir": ')
    result = swarm("info", env=child_env(SWARM_STATE_DIR=str(state)))
    assert result.returncode == 1, result
    assert "cluster.json cannot be read" in result.stderr
    assert "cannot reach" not in result.stderr and "Traceback" not in result.stderr


def test_info_says_the_recorded_cluster_is_not_running(tmp_path):
    """A manifest whose leader is gone: say so, do not try http://127.0.0.1:8080."""
    settings = Settings(state_dir=(tmp_path / "state").resolve())
    settings.run_dir.mkdir(parents=True)
    me = identity_of(os.getpid())
    assert me is not None
    gone = ProcessIdentity(me.pid, me.start_ticks + 1, boot_id())  # this pid, another process
    leader = ClusterProcess(name="leader", role="leader", pid=me.pid, log="l.log", identity=gone)
    manifest = ClusterManifest(str(settings.state_dir), "nats://x:1", "http://x:1", [leader])
    _write(settings, manifest)
    result = swarm("info", env=_env(settings))
    assert result.returncode == 1, result
    assert "is not running" in result.stderr and f"leader (pid {me.pid})" in result.stderr
    assert "stop-cluster" in result.stderr and "cannot reach" not in result.stderr
    cleared = swarm("stop-cluster", env=_env(settings))
    assert cleared.returncode == 0 and "no cluster running" in cleared.stdout, cleared
    assert not manifest_path(settings).exists()


# --- one store, one port --------------------------------------------------------------------


def test_nats_port_0_stays_the_clusters_port_across_a_restart(control_plane):
    settings, first = control_plane()
    port = int(first.nats_url.rsplit(":", 1)[1])
    assert json.loads((settings.nats_store_dir / PORT_FILE).read_text()) == {"port": port}
    stopped = swarm("stop-cluster", env=_env(settings))
    assert stopped.returncode == 0, stopped
    _, second = control_plane(settings.state_dir)  # --nats-port 0 again
    assert second.nats_url == first.nats_url


def test_a_restarted_bare_leader_brings_nats_back_on_its_url_and_clients_reconnect(procs, tmp_path):
    port = free_port()
    env = child_env(
        SWARM_LEADER_PORT=str(port), SWARM_NATS_PORT="0", SWARM_STATE_DIR=str(tmp_path / "s")
    )
    leader = Leader(f"http://127.0.0.1:{port}")

    def serving() -> bool:
        return leader.get("/health")["nats"] == "connected"

    first = procs.python("leader", "silentswarm.leader.main", env=env)
    wait_for(serving, timeout=90, what="the leader and its nats-server")
    url = leader.get("/api/v1/info")["nats_url"]
    child = next(c for c in psutil.Process(first.pid).children() if "nats-server" in c.name())

    def restart() -> str:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        wait_for(lambda: is_gone(child), timeout=10, what="its nats-server to die with it")
        procs.python("leader", "silentswarm.leader.main", env=env)
        wait_for(serving, timeout=90, what="the restarted leader")
        return leader.get("/api/v1/info")["nats_url"]

    async def client_through_the_restart() -> bytes:
        reconnected = asyncio.Event()

        async def on_reconnect() -> None:
            reconnected.set()

        nc = await nats.connect(
            url, reconnected_cb=on_reconnect, max_reconnect_attempts=-1, reconnect_time_wait=0.1
        )
        try:
            assert await asyncio.to_thread(restart) == url
            await asyncio.wait_for(reconnected.wait(), timeout=30)
            sub = await nc.subscribe("probe.after")
            await nc.publish("probe.after", b"back")
            return (await sub.next_msg(timeout=10)).data
        finally:
            await nc.close()

    try:
        assert asyncio.run(client_through_the_restart()) == b"back"
    finally:
        leader.close()


def test_a_busy_kept_port_is_a_clear_error_not_a_quiet_new_port(tmp_path):
    store = tmp_path / "store"
    first = start_nats_server(
        host="127.0.0.1", port=0, store_dir=store, log_path=tmp_path / "n.log", tie_to_parent=True
    )
    port = first.port
    first.stop()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with pytest.raises(PortInUseError) as busy:
            start_nats_server(
                host="127.0.0.1", port=0, store_dir=store, log_path=tmp_path / "n.log"
            )
    message = busy.value.message
    assert f"port {port}" in message and PORT_FILE in message and "SWARM_NATS_PORT" in message
    assert not is_locked(store / "swarm.lock"), "a start that failed holds nothing"
    moved = start_nats_server(
        host="127.0.0.1",
        port=free_port(),
        store_dir=store,
        log_path=tmp_path / "n.log",
        tie_to_parent=True,
    )
    try:
        assert pinned_port(store) == moved.port, "an explicit port moves the server for good"
    finally:
        moved.stop()
