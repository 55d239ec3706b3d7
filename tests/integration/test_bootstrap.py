"""Remote onboarding for real: the served fellow.sh installs the served wheel into a prefix,
starts the agent, and the fellow joins with its own NATS user; bad tokens and a tampered
package install nothing; UPDATE reinstalls a newer package."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sysconfig
import zipfile
from pathlib import Path

import httpx
import psutil
import pytest
from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from silentswarm.leader.bootstrap import find_or_build_wheel
from tests.conftest import leader_process, secure_env
from tests.helpers import child_env, kill_tree, swarm_cli, wait_for
from tests.integration.nats_client import with_nats

pytestmark = pytest.mark.timeout(240)
SITE_PACKAGES = sysconfig.get_paths()["purelib"]
# The last wheel of the old layout (top-level swarm, leader, agent): `git archive 073549c`
# built with `pip wheel --no-deps`. Its fellows must be able to UPDATE to this package.
OLD_LAYOUT_WHEEL = (
    Path(__file__).resolve().parents[1] / "data" / "silentswarm-0.1.0-py3-none-any.whl"
)


def create_session(leader, **body):
    response = leader.request("POST", "/api/v1/bootstrap/join-sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def run_script(leader, script: Path, session: dict, prefix: Path, home: Path):
    """The join command, with the network left out: the wheel's dependencies come from this
    test environment (a .pth file) instead of an index."""
    pipe, args = session["command"].split("sh -s -- ", 1)
    # The command hands the token to sh in its environment (`... | SWARM_JOIN_TOKEN=T sh`).
    token = pipe.rsplit("SWARM_JOIN_TOKEN=", 1)[1].split()[0]
    return subprocess.run(
        [
            "sh",
            str(script),
            *args.split(),
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
        env=child_env(HOME=str(home), SWARM_JOIN_TOKEN=token),
    )


@pytest.fixture
def leader(procs, secure_nats, nats_authority, tmp_path):
    """A leader on an authenticated NATS: each joining fellow gets its own NATS user."""
    yield from leader_process(procs, secure_nats, tmp_path, **secure_env(nats_authority))


@pytest.fixture
def script(leader, tmp_path):
    return fetch_script(leader, tmp_path)


def fetch_script(leader, tmp_path: Path) -> Path:
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
        # Its own NATS user (the server admits nothing else), private to the fellow.
        assert f"SWARM_NATS_CREDS={prefix}/fellow.creds" in env
        assert stat.S_IMODE((prefix / "fellow.creds").stat().st_mode) == 0o600
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
    # The join token goes in sh's environment, never its arguments (`ps` shows those).
    assert "fellow.sh | SWARM_JOIN_TOKEN=" in created.stdout
    assert " sh -s -- --join " in created.stdout
    listed = swarm("join-session", "list")
    assert "cli-joined" in listed.stdout and "created" in listed.stdout
    bad = swarm("join-session", "create", "--name", "no spaces allowed")
    assert bad.returncode == 1 and "fellow_name" in bad.stderr


@pytest.fixture
def wheels(tmp_path):
    """A directory the leader serves its newest wheel from (SWARM_BOOTSTRAP_WHEEL)."""
    directory = tmp_path / "wheels"
    find_or_build_wheel(directory)
    return directory


def test_update_takes_an_old_layout_fellow_to_this_package_and_this_one_to_a_newer(
    procs, secure_nats, nats_authority, tmp_path, wheels
):
    """0.1 (top-level `agent`, tests/data's wheel) -> this version -> a newer build, on one
    fellow that fellow.sh installed and started as a bare background process."""
    served = tmp_path / "served"
    served.mkdir()
    shutil.copy2(OLD_LAYOUT_WHEEL, served / OLD_LAYOUT_WHEEL.name)
    env = {**secure_env(nats_authority), "SWARM_BOOTSTRAP_WHEEL": str(served)}
    started = leader_process(procs, secure_nats, tmp_path, **env)
    leader = next(started)
    script = fetch_script(leader, tmp_path)
    session = create_session(leader, fellow_name="rolling-1")
    prefix = tmp_path / "prefix"
    pid_file = prefix / "fellow.pid"
    try:
        done = run_script(leader, script, session, prefix, tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert leader.wait_status("rolling-1", "ready", timeout=60)["version"] == "0.1.0"
        pid = int(pid_file.read_text())

        # The old agent re-execs `python -P -m agent.main`: the wheel's legacy module.
        [current] = wheels.glob("*.whl")
        version = current.name.split("-")[1]
        update_to(leader, served, current, version, prefix)
        assert psutil.Process(pid).cmdline()[1:4] == ["-P", "-m", "agent.main"], "same pid"

        # This agent re-execs its own module.
        newer = with_version(current, f"{version}.post7", tmp_path)
        update_to(leader, served, newer, f"{version}.post7", prefix)
        assert psutil.Process(pid).cmdline()[1:4] == ["-P", "-m", "silentswarm.agent.main"]
        assert not list((prefix / "venv").glob("lib/python*/site-packages/leader"))
    finally:
        if pid_file.exists():
            kill_tree(int(pid_file.read_text()))
        started.close()


def update_to(leader, served: Path, wheel: Path, version: str, prefix: Path) -> None:
    """Serve ``wheel`` (the newest in ``served``), UPDATE rolling-1, wait for ``version``."""
    target = served / wheel.name
    if wheel != target:
        shutil.copy2(wheel, target)
    newest = max(p.stat().st_mtime_ns for p in served.iterdir())
    os.utime(target, ns=(newest + 1_000_000, newest + 1_000_000))
    updated = swarm_cli(leader, "update", "--fellow-id", "rolling-1", timeout=30)
    assert updated.returncode == 0, updated.stderr
    assert f"reinstalling {wheel.name}" in updated.stdout
    # It registers with its new version first, then is ready once its checks are done.
    wait_for(
        lambda: (
            (w := leader.workers()["rolling-1"])["version"] == version and w["status"] == "ready"
        ),
        timeout=150,
        what=f"the fellow to come back ready with {version}",
    )
    assert (prefix / "dist" / wheel.name).exists()


def with_version(wheel: Path, version: str, out_dir: Path) -> Path:
    """A copy of ``wheel`` that says it is ``version`` (metadata, dist-info and RECORD)."""
    old = wheel.name.split("-")[1]
    old_info, new_info = f"silentswarm-{old}.dist-info/", f"silentswarm-{version}.dist-info/"
    files: dict[str, bytes] = {}
    with zipfile.ZipFile(wheel) as zin:
        for name in zin.namelist():
            data = zin.read(name)
            if name == old_info + "METADATA":
                data = data.replace(
                    f"\nVersion: {old}\n".encode(), f"\nVersion: {version}\n".encode()
                )
            files[name.replace(old_info, new_info)] = data
    record = new_info + "RECORD"
    lines = []
    for name, data in files.items():
        if name != record:
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            lines.append(f"{name},sha256={digest.decode()},{len(data)}")
    files[record] = ("\n".join([*lines, f"{record},,"]) + "\n").encode()
    out = out_dir / wheel.name.replace(f"-{old}-", f"-{version}-")
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for name, data in files.items():
            zout.writestr(name, data)
    return out


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_join_sessions_outlive_a_leader_restart(procs, secure_nats, nats_authority, tmp_path):
    """An operator hands out a join command, the leader crashes, and the host runs it after:
    the token still works once; a host that was installing goes on logging with its secret
    (its lines numbered on, the ones before the crash still shown); its used token stays
    used; the store holds hashes, never a token or a secret."""
    env = secure_env(nats_authority)
    first = leader_process(procs, secure_nats, tmp_path, **env)
    leader = next(first)
    fetch_script(leader, tmp_path)  # the package is ready: a claim hands it out
    waiting = create_session(leader, fellow_name="after-restart")
    started = create_session(leader, fellow_name="before-restart")
    base = "/api/v1/bootstrap/join-sessions"
    claim = leader.request(
        "POST", f"{base}/{started['session_id']}/claim", json={"token": started["token"]}
    )
    assert claim.status_code == 200, claim.text
    secret = claim.json()["secret"]

    def log(session_id: str, line: str, *, failed: bool = False) -> httpx.Response:
        return httpx.post(
            f"{leader.url}{base}/{session_id}/logs",
            json={"lines": [line], "failed": failed},
            headers={"Authorization": f"Bearer {secret}"},
            timeout=10,
        )

    # The claim was saved before it was answered; the log's count by the next flush.
    assert b'"installing"' in _kv_value(secure_nats, nats_authority, started["session_id"])
    assert log(started["session_id"], "unpacking").json() == {"lines": 1}
    wait_for(
        lambda: b'"log_lines":1' in _kv_value(secure_nats, nats_authority, started["session_id"]),
        timeout=20,
        what="the log's count in the store",
    )
    assert b'"unpacking"' in _kv_value(secure_nats, nats_authority, started["session_id"])
    process = procs.started[-1]
    process.kill()  # a crash: nothing more is flushed
    process.wait(timeout=20)
    first.close()

    second = leader_process(procs, secure_nats, tmp_path, **env)
    leader = next(second)
    sessions = {s["session_id"]: s for s in leader.get(base)}
    assert sessions[waiting["session_id"]]["status"] == "created"
    assert sessions[started["session_id"]]["status"] == "installing"
    assert sessions[started["session_id"]]["log_lines"] == 1
    # The installer goes on: its secret still works and its lines number on.
    assert log(started["session_id"], "installed").json() == {"lines": 2}
    again = leader.request(
        "POST", f"{base}/{started['session_id']}/claim", json={"token": started["token"]}
    )
    assert again.status_code == 410, again.text
    wrong = leader.request(
        "POST", f"{base}/{waiting['session_id']}/claim", json={"token": started["token"]}
    )
    assert wrong.status_code == 401, wrong.text
    late = leader.request(
        "POST", f"{base}/{waiting['session_id']}/claim", json={"token": waiting["token"]}
    )
    assert late.status_code == 200, late.text
    assert late.json()["fellow_name"] == "after-restart"
    assert log(started["session_id"], "gave up", failed=True).json() == {"lines": 3}
    with httpx.stream(
        "GET", f"{leader.url}{base}/{started['session_id']}/logs/stream", timeout=30
    ) as response:
        events = [json.loads(x[5:]) for x in response.iter_lines() if x.startswith("data:")]
    shown = [(e["seq"], e["line"]) for e in events[:-1]]
    assert shown == [(1, "unpacking"), (2, "installed"), (3, "gave up")], events
    assert events[-1]["status"] == "failed"
    ids = (waiting["session_id"], started["session_id"])
    stored = b"".join(_kv_value(secure_nats, nats_authority, s) for s in ids)
    for secret_text in (waiting["token"], started["token"], secret):
        assert secret_text.encode() not in stored
    second.close()


def _kv_value(nats, authority, session_id: str) -> bytes:
    """A join session's record as the leader's store holds it (b"" while none)."""

    async def read(nc) -> bytes:
        bucket = await nc.jetstream().key_value("swarm_joins")
        try:
            return (await bucket.get(session_id)).value or b""
        except (KeyNotFoundError, BucketNotFoundError):
            return b""

    return with_nats(nats.url, read, user_credentials=str(authority.leader_creds_path))
