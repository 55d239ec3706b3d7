"""The stage fork server (agent/runtime/forkserver.py): real stage runtimes forked from a
real server process, their exits, signals, environments and the server's own death."""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path

import psutil
import pytest

from silentswarm.agent.runtime import forkserver
from silentswarm.agent.runtime.launch import run_plans, stage_command, stage_env, steps, write_plans
from silentswarm.plan import ModelConfig, TrainConfig, Transport, chain_plans, single_process_plan
from silentswarm.procs import free_port
from tests.helpers import wait_for

pytestmark = pytest.mark.integration

TINY = ModelConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16)


@pytest.fixture(scope="module")
def server():
    server = forkserver.ForkServer(stage_env())
    yield server
    server.close()


def spawn(server: forkserver.ForkServer, command: list[str], tmp_path: Path, **env: str):
    with (
        open(tmp_path / "out", "wb") as out,
        open(tmp_path / "err", "wb") as err,
        open("/dev/null", "rb") as stdin,
    ):
        return server.spawn(
            command,
            env=stage_env(env),
            stdin=stdin.fileno(),
            stdout=out.fileno(),
            stderr=err.fileno(),
        )


def test_a_forked_stage_exits_as_a_started_one_with_its_message_in_its_stderr(server, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text("{not json")
    command = stage_command(plan)
    started = subprocess.run(command, env=stage_env(), capture_output=True, timeout=60)
    forked = spawn(server, command, tmp_path)
    assert forked.wait(timeout=30) == started.returncode == 2
    message = (tmp_path / "err").read_bytes()
    assert b"not valid JSON" in message and b"Traceback" not in message
    assert message.splitlines()[-1] == started.stderr.splitlines()[-1]


def test_a_forked_stage_trains_with_its_own_environment_and_dies_by_its_signal(server, tmp_path):
    """The compile cache it was told of (read after the fork) fills; SIGKILL through the pidfd
    is its end, -9 as Popen says it."""
    cache = tmp_path / "xla"
    train = TrainConfig(steps=10**6, batch_size=2, micro_batches=1, max_data_bytes=100_000)
    (path,) = write_plans([single_process_plan(job_id="fork", model=TINY, train=train)], tmp_path)
    stage = spawn(server, stage_command(path), tmp_path, SWARM_COMPILE_CACHE=str(cache))

    def stepped() -> bool:
        assert stage.poll() is None, f"it exited {stage.returncode}"
        return b'"event":"step"' in (tmp_path / "out").read_bytes()

    wait_for(stepped, timeout=60, what="a step of the forked stage")
    assert cache.is_dir() and any(cache.rglob("*")), "the stage's own compile cache"
    assert stage.poll() is None
    assert psutil.Process(stage.pid).name() == "swarm-stage"
    stage.kill()
    assert stage.wait(timeout=30) == -signal.SIGKILL


def test_a_dead_server_takes_its_stages_along_and_the_next_launch_gets_another(tmp_path):
    env = stage_env({"TF_FORKSERVER_TEST": "dead"})  # a key of its own: a server of its own
    first = forkserver.server_for(env)
    assert first is not None and forkserver.server_for(env) is first
    assert forkserver.server_for(stage_env()) is not first
    address = f"tcp://127.0.0.1:{free_port()}"
    plans = chain_plans(
        job_id="orphan",
        model=TINY,
        train=TrainConfig(steps=3, batch_size=2, micro_batches=1, max_data_bytes=100_000),
        addresses=[None, address],
        transport=Transport.P2P,
        peer_timeout_s=300,
    )
    _, path = write_plans(plans, tmp_path)
    waiting = spawn(first, stage_command(path), tmp_path)  # stage 1: waits for its peer
    first.proc.kill()
    assert waiting.wait(timeout=30) < 0
    wait_for(lambda: not first.alive(), timeout=10, what="the server's end to be seen")
    second = forkserver.server_for(env)
    try:
        assert second is not None and second is not first and second.alive()
    finally:
        if second is not None:
            second.close()  # its key is this test's own: no other test would use it


def test_threads_other_than_the_main_one_start_their_stages_from_scratch():
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(forkserver.server_for(stage_env())))
    thread.start()
    thread.join(timeout=30)
    assert got == [None]


def test_a_server_that_does_not_start_leaves_the_stage_to_start_from_scratch(
    tmp_path, monkeypatch, caplog
):
    """No Ready in time (here: none can come that soon): run_plans says so and starts the
    stage as a process of its own; the run goes on."""
    monkeypatch.setenv(forkserver.ENV_NAME, "1")
    monkeypatch.setattr(forkserver, "START_TIMEOUT_S", 0.001)
    env = {"TF_FORKSERVER_TEST": "late"}  # no server of this key exists yet
    train = TrainConfig(steps=1, batch_size=2, micro_batches=1, max_data_bytes=100_000)
    plan = single_process_plan(job_id="late", model=TINY, train=train)
    with caplog.at_level("WARNING", logger="launch"):
        (events,) = run_plans([plan], tmp_path, env=env)
    assert [e["step"] for e in steps(events)] == [0]
    assert "did not start" in caplog.text and "as a process of its own" in caplog.text
