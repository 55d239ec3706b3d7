"""The ``swarm`` CLI as a user runs it: real subprocesses, real cluster, real exit codes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import nats
import psutil
import pytest

from silentswarm.cli.cluster import ClusterManifest, _live
from silentswarm.procs import free_port, is_gone
from tests.helpers import REPO, busy_port, child_env, kill_tree, swarm_cli
from tests.helpers import run_swarm as swarm

pytestmark = pytest.mark.integration


@pytest.fixture
def state_dir(tmp_path: Path):
    """A cluster state dir; whatever start-cluster left running there is killed afterwards."""
    state = tmp_path / "state"
    yield state
    manifest_file = state / "run" / "cluster.json"
    if manifest_file.exists():
        manifest = msgspec.json.decode(manifest_file.read_bytes(), type=ClusterManifest)
        swarm("stop-cluster", "--state-dir", str(state))
        for proc in manifest.processes:
            if _live(proc) is not None:  # same pid and start time: still ours
                kill_tree(proc.pid)


async def _anonymous(url: str) -> None:
    nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0)
    await nc.close()


def test_start_list_stop_leaves_no_process(state_dir):
    port = free_port()
    # The default: NATS with authentication, a user per process (not dev mode).
    env = child_env(SWARM_STATE_DIR=str(state_dir), SWARM_DEV="0")
    started = swarm(
        "start-cluster", "--fellows", "2", "--leader-port", str(port), "--nats-port", "0", env=env
    )
    assert started.returncode == 0, started.stderr + started.stdout
    assert "cluster ready" in started.stdout and "a NATS user per process" in started.stdout
    auth = state_dir / "nats-auth"
    assert sorted(p.name for p in (auth / "fellows").iterdir()) == [
        "fellow-1.creds",
        "fellow-2.creds",
    ]

    manifest = msgspec.json.decode(
        (state_dir / "run" / "cluster.json").read_bytes(), type=ClusterManifest
    )
    roles = sorted(p.role for p in manifest.processes)
    assert roles == ["fellow", "fellow", "leader", "nats"]
    for proc in manifest.processes:
        assert (state_dir / "run" / f"{proc.name}.pid").read_text().strip() == str(proc.pid)
        assert (state_dir / "runtime-logs" / f"{proc.name}.log").exists()
    nats_pid = next(p.pid for p in manifest.processes if p.role == "nats")
    assert "nats-server" in psutil.Process(nats_pid).name(), "NATS runs as its own process"

    # No --leader-url: the CLI finds the leader of the cluster in SWARM_STATE_DIR.
    listed = swarm("fellows", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    fellows = json.loads(listed.stdout)
    assert sorted(f["fellow_id"] for f in fellows) == ["fellow-1", "fellow-2"]
    assert all(f["status"] == "ready" for f in fellows)
    # Each fellow has its own data port and its own sync port (for replicas).
    addresses = [a for f in fellows for a in (f["data_address"], f["sync_address"])]
    assert all(a.startswith("tcp://127.0.0.1:") for a in addresses)
    assert len(set(addresses)) == 4

    table = swarm("--leader-url", manifest.leader_url, "fellows")
    assert table.returncode == 0 and "fellow-1" in table.stdout and "ready" in table.stdout
    nodes = json.loads(swarm("nodes", "--json", env=env).stdout)
    assert nodes[0]["cpu_cores"] >= 1 and nodes[0]["fellows"] == ["fellow-1", "fellow-2"]
    info = json.loads(swarm("info", "--json", env=env).stdout)
    assert info["nats_url"] == manifest.nats_url and info["fellows"]["ready"] == 2
    assert info["nats_auth"] == "jwt"
    with pytest.raises(Exception, match="Authorization Violation"):
        asyncio.run(_anonymous(manifest.nats_url))

    procs = [psutil.Process(p.pid) for p in manifest.processes]
    stopped = swarm("stop-cluster", env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert all(is_gone(p) for p in procs), "stop-cluster left a process behind"
    assert not (state_dir / "run" / "cluster.json").exists()
    assert not list((state_dir / "run").glob("*.pid"))

    again = swarm("stop-cluster", env=env)
    assert again.returncode == 0 and "no cluster running" in again.stdout


def test_second_start_refuses_while_the_first_runs(state_dir):
    env = child_env(SWARM_STATE_DIR=str(state_dir))
    args = (
        "start-cluster",
        "--fellows",
        "1",
        "--leader-port",
        str(free_port()),
        "--nats-port",
        "0",
    )
    assert swarm(*args, env=env).returncode == 0
    second = swarm(*args, env=env)
    assert second.returncode == 1
    assert "already running" in second.stderr and "swarm stop-cluster" in second.stderr


@pytest.mark.parametrize(
    ("busy", "setting", "flag"),
    [("leader", "SWARM_LEADER_PORT", "--leader-port"), ("nats", "SWARM_NATS_PORT", "--nats-port")],
)
def test_busy_port_is_a_clear_error_and_starts_nothing(state_dir, busy, setting, flag):
    with busy_port() as port:
        ports = {"leader": free_port(), "nats": 0, busy: port}
        result = swarm(
            "start-cluster",
            "--fellows",
            "1",
            "--leader-port",
            str(ports["leader"]),
            "--nats-port",
            str(ports["nats"]),
            env=child_env(SWARM_STATE_DIR=str(state_dir)),
        )
    assert result.returncode == 2
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert f"port {port}" in line and setting in line and flag in line
    assert not (state_dir / "run" / "cluster.json").exists()


def test_unreachable_leader_is_one_line_and_exit_3():
    url = f"http://127.0.0.1:{free_port()}"
    for command in ("info", "fellows", "nodes"):
        result = swarm("--leader-url", url, command)
        assert result.returncode == 3, result
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert url in result.stderr and result.stderr.startswith("swarm: error:")


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (("info",), {"SWARM_LEADER_PORT": "eighty"}, "SWARM_LEADER_PORT"),
        (("start-cluster", "--fellows", "0"), {}, "--fellows"),
        (("no-such-command",), {}, "no-such-command"),
    ],
)
def test_bad_input_exits_2_without_a_traceback(argv, env, needle, tmp_path):
    result = swarm(*argv, env=child_env(SWARM_STATE_DIR=str(tmp_path), **env))
    assert result.returncode == 2, result
    assert needle in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_agent_without_nats_url_exits_2():
    result = subprocess.run(
        [sys.executable, "-m", "silentswarm.agent.main", "--name", "x"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "SWARM_NATS_URL" in result.stderr and "Traceback" not in result.stderr


def test_job_commands_report_errors_clearly(leader, tmp_path):
    url = ("--leader-url", leader.url)
    env = child_env(SWARM_API_TOKEN=leader.token)
    bad = tmp_path / "bad.json"
    bad.write_text('{"steps": 10, "model": {"nheads": 2}}')
    result = swarm(*url, "submit", str(bad), timeout=30, env=env)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == f"swarm: error: {bad}: model.nheads: unknown field"
    missing = swarm(*url, "submit", str(tmp_path / "nope.json"), timeout=30, env=env)
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    assert "Traceback" not in missing.stderr + result.stderr
    unknown = swarm(*url, "cancel", "no-such-job", timeout=30, env=env)
    assert unknown.returncode == 1 and "no job 'no-such-job'" in unknown.stderr
    waiting = tmp_path / "waits.json"
    waiting.write_text(json.dumps({"name": "waits", "stages": 3, "model": {"n_layers": 3}}))
    job_id = swarm(
        *url, "submit", str(waiting), "--partition", "weighted", timeout=30, env=env
    ).stdout
    job_id = job_id.strip()
    assert leader.get(f"/api/v1/jobs/{job_id}")["spec"]["partition"] == "weighted"
    wrong = swarm(*url, "submit", str(waiting), "--partition", "random", timeout=30, env=env)
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr
    listed = swarm(*url, "jobs", timeout=30, env=env)
    assert job_id in listed.stdout and "PENDING" in listed.stdout
    assert "waiting for 3 ready fellows; 0 available" in listed.stdout
    as_json = json.loads(swarm(*url, "--json", "jobs", timeout=30, env=env).stdout)
    assert [j["job_id"] for j in as_json] == [job_id]
    cancelled = swarm(*url, "cancel", job_id, timeout=30, env=env)
    assert cancelled.returncode == 0 and cancelled.stdout.strip() == f"job {job_id} CANCELLED"
    busy = swarm(*url, "checkpoint", job_id, timeout=30, env=env)
    assert busy.returncode == 1 and "only a RUNNING job can checkpoint" in busy.stderr
    assert swarm(*url, "pending-purges", timeout=30, env=env).stdout.strip() == "no pending purges"
    gone = swarm(*url, "release", "--fellow-id", "ghost", timeout=30, env=env)
    assert gone.returncode == 1 and "no fellow 'ghost'" in gone.stderr


def test_unknown_fellows_and_jobs_are_one_line_and_exit_1(leader):
    for argv, what in [
        (("logs", "nope"), "no fellow 'nope'"),
        (("logs", "nope", "--json"), "no fellow 'nope'"),
        (("logs", "nope", "--follow"), "no fellow 'nope'"),
        (("release", "nope"), "no fellow 'nope'"),
        (("update", "nope"), "no fellow 'nope'"),
        (("job", "nope"), "no job 'nope'"),
        (("job", "nope", "--no-json"), "no job 'nope'"),
        (("watch", "nope"), "no job 'nope'"),
        (("cancel", "nope"), "no job 'nope'"),
        (("checkpoint", "nope"), "no job 'nope'"),
    ]:
        result = swarm_cli(leader, *argv, timeout=30)
        assert result.returncode == 1, (argv, result)
        assert result.stdout == "", (argv, result.stdout)
        assert result.stderr.startswith(f"swarm: error: {what}"), (argv, result.stderr)
        assert result.stderr.count("\n") == 1, (argv, result.stderr)


def test_job_views_and_jobs_all(leader, tmp_path):
    waiting = tmp_path / "waits.json"
    waiting.write_text(json.dumps({"name": "waits", "stages": 2, "model": {"n_layers": 2}}))
    job_id = swarm_cli(leader, "submit", str(waiting), timeout=30).stdout.strip()
    as_json = swarm_cli(leader, "job", job_id, timeout=30)
    assert json.loads(as_json.stdout)["job_id"] == job_id  # JSON is this command's default
    readable = swarm_cli(leader, "job", job_id, "--no-json", timeout=30)
    assert readable.returncode == 0, readable.stderr
    with pytest.raises(ValueError):
        json.loads(readable.stdout)
    assert f"job       {job_id} (waits)" in readable.stdout
    assert "state     PENDING: waiting for 2 ready fellows; 0 available" in readable.stdout
    # --all asks for archived jobs too (?all=true); a leader without archival ignores it.
    listed = json.loads(swarm_cli(leader, "jobs", "--all", "--json", timeout=30).stdout)
    assert [(j["job_id"], j["archived"]) for j in listed] == [(job_id, False)]
    # The options are the same before and after the command name.
    before = swarm_cli(leader, "--json", "jobs", timeout=30)
    assert json.loads(before.stdout) == json.loads(swarm_cli(leader, "jobs", "--json").stdout)


def _follower(leader, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "silentswarm.cli.app", "--leader-url", leader.url, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(SWARM_API_TOKEN=leader.token or ""),
        cwd=REPO,
    )


def test_watch_and_submit_watch_show_the_same_lines_without_repeats(leader, tmp_path):
    """One follow view for both: on a pipe, each line once, when it changed."""
    waiting = tmp_path / "waits.json"
    waiting.write_text(json.dumps({"name": "waits", "stages": 2, "model": {"n_layers": 2}}))
    submitter = _follower(leader, "submit", "--watch", str(waiting))
    watcher = None
    try:
        submitted = submitter.stdout.readline()
        assert submitted.startswith("submitted "), submitted
        job_id = submitted.split()[1]
        settled = f"{job_id} PENDING waiting for 2 ready fellows; 0 available\n"
        first = submitter.stdout.readline()
        if first != settled:  # submitted before the leader's first placement round
            assert first == f"{job_id} PENDING waiting to be placed\n", first
            first = submitter.stdout.readline()
        assert first == settled
        watcher = _follower(leader, "watch", job_id)
        assert watcher.stdout.readline() == first
        assert leader.request("DELETE", f"/api/v1/jobs/{job_id}").status_code == 200
        submit_out, submit_err = submitter.communicate(timeout=60)
        watch_out, watch_err = watcher.communicate(timeout=60)
    finally:
        for proc in (submitter, watcher):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert submitter.returncode == watcher.returncode == 1
    assert submit_out == watch_out, (submit_out, watch_out)
    lines = [first.rstrip("\n"), *watch_out.splitlines()]
    assert len(lines) == len(set(lines)), lines
    assert lines[-1].startswith(f"job {job_id} CANCELLED: ")
    for err in (submit_err, watch_err):
        assert err.startswith(f"swarm: error: job {job_id} CANCELLED") and err.count("\n") == 1
