"""Remote onboarding for real: the served fellow.sh installs the served wheel into a prefix,
starts the agent, and the fellow joins; bad tokens and a tampered package install nothing."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sysconfig
from pathlib import Path

import httpx
import psutil
import pytest

from tests.helpers import child_env, kill_tree, swarm_cli, wait_for

pytestmark = pytest.mark.timeout(240)
SITE_PACKAGES = sysconfig.get_paths()["purelib"]


def create_session(leader, **body):
    response = leader.request("POST", "/api/v1/bootstrap/join-sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def run_script(leader, script: Path, session: dict, prefix: Path, home: Path):
    """The join command, with the network left out: the wheel's dependencies come from this
    test environment (a .pth file) instead of an index."""
    args = session["command"].split("sh -s -- ", 1)[1].split()
    return subprocess.run(
        [
            "sh",
            str(script),
            *args,
            "--prefix",
            str(prefix),
            "--pip-args",
            "--no-deps --no-index",
            "--site-packages",
            SITE_PACKAGES,
            "--no-systemd",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=child_env(HOME=str(home)),
    )


@pytest.fixture
def script(leader, tmp_path):
    wait_for(
        lambda: leader.request("GET", "/api/v1/bootstrap/manifest").status_code == 200,
        timeout=120,
        what="the package to be ready",
    )
    path = tmp_path / "fellow.sh"
    response = leader.request("GET", "/api/v1/bootstrap/fellow.sh")
    assert response.headers["content-type"].startswith("text/x-shellscript")
    path.write_bytes(response.content)
    return path


def test_a_host_joins_with_one_command_and_its_install_log_streams(leader, script, tmp_path):
    manifest = leader.get("/api/v1/bootstrap/manifest")
    wheel = httpx.get(manifest["package"]["url"], timeout=30)
    assert wheel.status_code == 200
    assert hashlib.sha256(wheel.content).hexdigest() == manifest["package"]["sha256"]
    assert manifest["min_python"] == "3.11" and manifest["nats_urls"]

    anonymous = httpx.post(f"{leader.url}/api/v1/bootstrap/join-sessions", json={}, timeout=5)
    assert anonymous.status_code == 401
    session = create_session(leader, fellow_name="joined-1")
    assert session["status"] == "created" and session["token"] in session["command"]

    prefix = tmp_path / "prefix"
    pid_file = prefix / "fellow.pid"
    try:
        done = run_script(leader, script, session, prefix, tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert (prefix / "venv" / "bin" / "swarm-agent").exists()
        env = (prefix / "fellow.env").read_text()
        assert "SWARM_FELLOW_NAME=joined-1" in env and "SWARM_NATS_URL=nats://" in env
        record = leader.wait_status("joined-1", "ready", timeout=60)
        assert record["version"]
        state = wait_for(
            lambda: (
                (s := leader.get(f"/api/v1/bootstrap/join-sessions/{session['session_id']}"))
                and s["status"] == "registered"
                and s
            ),
            timeout=20,
            what="the session to see its fellow",
        )
        assert state["log_lines"] > 5
        with httpx.stream(
            "GET",
            f"{leader.url}/api/v1/bootstrap/join-sessions/{session['session_id']}/logs/stream",
            timeout=30,
        ) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data:")]
        logged = [json.loads(line[5:])["line"] for line in lines[:-1]]
        assert any("verified" in line for line in logged)
        assert any("started the agent in the background" in line for line in logged)
        assert json.loads(lines[-1][5:])["status"] == "registered"

        # The token worked once.
        again = run_script(leader, script, session, tmp_path / "again", tmp_path)
        assert again.returncode == 1 and "already used" in again.stderr + again.stdout
        assert not (tmp_path / "again" / "venv").exists()

        # Release with purge: the joined fellow removes its whole install and exits.
        pid = int(pid_file.read_text())
        released = leader.request(
            "POST", "/api/v1/workers/joined-1/release", json={"purge_install": True}
        )
        assert released.status_code == 200 and released.json()["purge"] == "delivered"
        wait_for(lambda: not psutil.pid_exists(pid) or _zombie(pid), timeout=30, what="exit")
        assert list(prefix.iterdir()) == [], "the prefix is left empty"
    finally:
        if pid_file.exists():
            kill_tree(int(pid_file.read_text()))


def test_expired_tokens_and_a_tampered_package_install_nothing(leader, script, tmp_path):
    expiring = create_session(leader, ttl_s=1)
    sid = expiring["session_id"]
    wait_for(
        lambda: leader.get(f"/api/v1/bootstrap/join-sessions/{sid}")["status"] == "failed",
        timeout=10,
        what="the session to expire",
    )
    expired = run_script(leader, script, expiring, tmp_path / "expired", tmp_path)
    assert expired.returncode == 1 and "expired" in expired.stderr + expired.stdout
    assert not (tmp_path / "expired" / "venv").exists()

    wrong = create_session(leader)
    forged = {**wrong, "command": wrong["command"].replace(wrong["token"], "forged-token")}
    refused = run_script(leader, script, forged, tmp_path / "forged", tmp_path)
    assert refused.returncode == 1 and "401" in refused.stderr + refused.stdout

    # Someone swaps the wheel after the leader announced its sha256.
    [wheel] = (tmp_path / "leader-state").glob("bootstrap/*.whl")
    wheel.write_bytes(wheel.read_bytes() + b"tampered")
    session = create_session(leader, fellow_name="tampered")
    tampered = run_script(leader, script, session, tmp_path / "tampered", tmp_path)
    assert tampered.returncode == 1
    assert "refusing it" in (tmp_path / "tampered" / "join.log").read_text()
    assert not (tmp_path / "tampered" / "venv").exists()
    state = leader.get(f"/api/v1/bootstrap/join-sessions/{session['session_id']}")
    assert state["status"] == "failed" and "nothing was installed" in state["reason"]


def test_the_cli_creates_and_lists_join_sessions(leader):
    def swarm(*args):
        return swarm_cli(leader, *args, timeout=30)

    created = swarm("join-session", "create", "--name", "cli-joined", "--ttl", "600")
    assert created.returncode == 0, created.stderr
    assert "fellow.sh | sh -s -- --join" in created.stdout
    listed = swarm("join-session", "list")
    assert "cli-joined" in listed.stdout and "created" in listed.stdout
    bad = swarm("join-session", "create", "--name", "no spaces allowed")
    assert bad.returncode == 1 and "fellow_name" in bad.stderr


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
