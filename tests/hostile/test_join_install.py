"""Joining leaves no readable secret: a real fellow.sh install against a real leader, every
process it starts watched with strace.

The join token, the session secret and the fellow's NATS JWT and seed are in no process's
arguments (nor, past the installer itself, in any environment); every file that holds one is
0600 in a 0700 directory; join.json is gone afterwards, after a failed install too.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.conftest import leader_process, secure_env
from tests.helpers import REPO, child_env, kill_tree, wait_for
from tests.integration.test_bootstrap import SITE_PACKAGES, create_session, fetch_script

STRACE = shutil.which("strace")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


class ClaimRecorder(ThreadingHTTPServer):
    """A relay in front of the leader that keeps what each claim answered (the session
    secret and the NATS credentials: the leader keeps only hashes, the test needs them)."""

    def __init__(self, target: str) -> None:
        super().__init__(("127.0.0.1", 0), _Relay)
        self.target = target
        self.claims: list[dict] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Relay(BaseHTTPRequestHandler):
    server: ClaimRecorder

    def _relay(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        keep = ("content-type", "authorization")
        response = httpx.request(
            self.command,
            self.server.target + self.path,
            content=self.rfile.read(length) if length else None,
            headers={k: v for k, v in self.headers.items() if k.lower() in keep},
            timeout=120,
        )
        if self.path.endswith("/claim") and response.status_code == 200:
            self.server.claims.append(response.json())
        self.send_response(response.status_code)
        self.send_header("content-type", response.headers.get("content-type", "text/plain"))
        self.send_header("content-length", str(len(response.content)))
        self.end_headers()
        self.wfile.write(response.content)

    do_GET = do_POST = _relay

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def leader(procs, secure_nats, nats_authority, tmp_path):
    yield from leader_process(procs, secure_nats, tmp_path, **secure_env(nats_authority))


@pytest.fixture
def relay(leader) -> Iterator[ClaimRecorder]:
    server = ClaimRecorder(leader.url)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def install_args(script: Path, relay: ClaimRecorder, session: dict, prefix: Path, pip: str):
    # The token is not among them: SWARM_JOIN_TOKEN carries it (see fellow.sh's header).
    return [
        "sh",
        str(script),
        "--join",
        relay.url,
        session["session_id"],
        "--prefix",
        str(prefix),
        "--pip-args",
        pip,
        "--site-packages",
        SITE_PACKAGES,
        "--no-systemd",
    ]


def secrets_of(session: dict, claim: dict) -> dict[str, str]:
    creds = claim["nats_creds"]
    jwt = creds.split("-----BEGIN NATS USER JWT-----")[1].split("------END")[0].strip()
    seed = next(line for line in creds.splitlines() if line.startswith("SU"))
    return {
        "join token": session["token"],
        "session secret": claim["secret"],
        "jwt": jwt,
        "seed": seed,
    }


def exit_line(trace: Path, pid: str) -> str | None:
    # strace pads the pid column to the widest pid so far ("9682  +++" once a 5-digit pid
    # has appeared), so the pid and the marker are split on any run of spaces.
    ends = [
        line
        for line in trace.read_text().splitlines()
        if line.split(maxsplit=1)[:1] == [pid] and line.split(maxsplit=1)[1].startswith("+++")
    ]
    return ends[0] if ends else None


def private(path: Path, mode: int) -> None:
    assert stat.S_IMODE(path.stat().st_mode) == mode, f"{path}: {oct(path.stat().st_mode)}"


def check_prefix(prefix: Path, secrets: dict[str, str]) -> None:
    """0700 directories, 0600 files (the venv aside); no secret outside fellow.creds."""
    assert not (prefix / "join.json").exists() and not (prefix / "join.secret").exists()
    private(prefix, 0o700)
    private(prefix / "fellow.creds", 0o600)
    creds = (prefix / "fellow.creds").read_text()
    assert secrets["seed"] in creds and secrets["jwt"] in creds
    for path in prefix.rglob("*"):
        top = path.relative_to(prefix).parts[0]
        if top in ("venv", "dist") or path.is_symlink():
            continue
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, f"{path} is readable by others"
        if path.is_file() and path.name != "fellow.creds":
            text = path.read_text(errors="replace")
            leaked = [name for name, value in secrets.items() if value in text]
            assert not leaked, f"{path} holds the {leaked}"


@pytest.mark.skipif(STRACE is None, reason="needs strace (apt-get install strace)")
def test_an_install_puts_no_secret_in_any_argv_or_readable_file(leader, relay, tmp_path):
    script = fetch_script(leader, tmp_path)
    session = create_session(leader, fellow_name="private-1")
    prefix, trace = tmp_path / "prefix", tmp_path / "execve.trace"
    args = install_args(script, relay, session, prefix, "--no-deps --no-index")
    # -v: the environments too; seccomp-bpf: stops at execve only (pip runs at full speed).
    strace = [STRACE, "-f", "--seccomp-bpf", "-v", "-s", "65536", "-e", "trace=execve"]
    env = child_env(HOME=str(tmp_path), SWARM_JOIN_TOKEN=session["token"])
    out = tmp_path / "install.out"
    with out.open("wb") as sink:
        traced = subprocess.Popen(
            [*strace, "-o", str(trace), *args], stdout=sink, stderr=subprocess.STDOUT, env=env
        )
    pid_file = prefix / "fellow.pid"
    try:
        # strace runs on with the agent the script leaves running: wait for the script.
        installer = wait_for(
            lambda: trace.exists() and trace.read_text().split(" ", 1)[0],
            timeout=10,
            what="strace to start the installer",
        )

        def finished() -> str | None:
            line = exit_line(trace, installer)
            assert line or traced.poll() is None, f"strace ended early: {out.read_text()}"
            return line

        exited = wait_for(finished, timeout=240, what="fellow.sh to finish")
        log = (prefix / "join.log").read_text() if (prefix / "join.log").exists() else ""
        assert exited.endswith("exited with 0 +++"), out.read_text() + log
        leader.wait_status("private-1", "ready", timeout=60)
    finally:
        if pid_file.exists():
            kill_tree(int(pid_file.read_text()))
        try:
            traced.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(traced.pid)

    [claim] = relay.claims
    secrets = secrets_of(session, claim)
    execs = [line for line in trace.read_text().splitlines() if " execve(" in line]
    assert any('join-helper.py", "claim"' in line for line in execs)
    assert any('"-m", "pip", "install"' in line for line in execs)
    assert any("swarm-agent" in line for line in execs), "the agent was started"
    first, rest = execs[0], execs[1:]
    # The installer's own environment is where the token came in (same user only).
    token_env = f'"SWARM_JOIN_TOKEN={session["token"]}"'
    assert token_env in first
    for line in [first.replace(token_env, ""), *rest]:
        leaked = [name for name, value in secrets.items() if value in line]
        assert not leaked, f"the {leaked} in: {line[:300]}"
    check_prefix(prefix, secrets)
    private(prefix / "fellow.env", 0o600)
    private(prefix / "join.log", 0o600)
    private(prefix / "state", 0o700)


def test_a_failed_install_removes_join_json_and_tightens_an_older_install(leader, relay, tmp_path):
    script = fetch_script(leader, tmp_path)
    session = create_session(leader, fellow_name="private-2")
    prefix = tmp_path / "prefix"
    prefix.mkdir(mode=0o755)
    prefix.chmod(0o755)
    for name in ("fellow.creds", "join.log"):  # an older install's, world-readable
        (prefix / name).write_text("old\n")
        (prefix / name).chmod(0o644)
    # pip fails: after the claim, so the secrets were written and must still go.
    args = install_args(script, relay, session, prefix, "--no-index --no-such-pip-option")
    done = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=180,
        env=child_env(HOME=str(tmp_path), SWARM_JOIN_TOKEN=session["token"]),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "pip could not install" in done.stdout
    [claim] = relay.claims
    check_prefix(prefix, secrets_of(session, claim))
    private(prefix / "join.log", 0o600)
    state = leader.get(f"/api/v1/bootstrap/join-sessions/{session['session_id']}")
    assert state["status"] == "failed" and "pip could not install" in state["reason"]
    log = json.dumps(state)
    assert claim["secret"] not in log and session["token"] not in log


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a directory of another user's: needs root")
def test_the_installer_never_installs_into_a_directory_another_user_made(tmp_path):
    """Without HOME the install directory is never a shared /tmp one, and a directory that is
    a link or another user's (made first, as anyone can in /tmp) is refused before anything
    is written into it: its owner could swap the venv, the helper or the credentials."""
    script = str(REPO / "leader" / "scripts" / "fellow.sh")
    join = ["--join", "http://127.0.0.1:9", "s-1"]
    env = child_env(SWARM_JOIN_TOKEN="t")
    env.pop("HOME", None)
    homeless = subprocess.run(["sh", script, *join], capture_output=True, text=True, env=env)
    assert homeless.returncode == 2 and "--prefix" in homeless.stderr, homeless.stderr
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    theirs.chmod(0o777)
    shutil.chown(theirs, user="nobody")
    (tmp_path / "link").symlink_to(theirs)
    for prefix in (theirs, tmp_path / "link"):
        refused = subprocess.run(
            ["sh", script, *join, "--prefix", str(prefix)], capture_output=True, text=True, env=env
        )
        assert refused.returncode == 1 and "refusing" in refused.stderr, refused.stderr
        assert not list(theirs.iterdir()), "nothing written into it"
    # A link of one's own to a directory of one's own (a bigger disk) is taken: the install
    # goes on to the claim (which finds no leader here).
    mine = tmp_path / "mine"
    mine.mkdir()
    (tmp_path / "my-link").symlink_to(mine)
    taken = subprocess.run(
        ["sh", script, *join, "--prefix", str(tmp_path / "my-link")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert "refusing" not in taken.stderr and (mine / "join.log").exists(), taken.stderr
