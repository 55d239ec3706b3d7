"""Public access through one address: a host that reaches the leader only through the HTTPS
proxy profile (packaging/proxy/Caddyfile, run as shipped) joins with the command
``swarm join-session create`` prints, trains over the relay and ships its logs.

The "NAT host" is a network namespace one veth pair away. The leader, nats-server (its plain
and WebSocket ports) and the other fellow listen on the root namespace's loopback, which the
namespace cannot route to; the only address it reaches is the proxy's one port (Caddy
listens there, with a certificate a private CA signed, which the host is told to trust). The
test first checks that the direct ports are indeed closed to it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from silentswarm.natsauth import NatsAuthority
from silentswarm.procs import free_port
from tests.conftest import NatsControl, leader_process, secure_env, start_agent
from tests.helpers import (
    Leader,
    Processes,
    bench_module,
    child_env,
    kill_tree,
    shaped_paths_unavailable,
    swarm_cli,
    wait_for,
)
from tests.integration.test_bootstrap import SITE_PACKAGES
from tests.integration.test_jobs import tiny

REPO = Path(__file__).resolve().parents[2]
CADDYFILE = REPO / "packaging" / "proxy" / "Caddyfile"
PROXY_NAME = "swarm-proxy.test"  # .test: a reserved name, resolved only inside the namespace
NAT_FELLOW = "nat-1"


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a network namespace for the NAT host)"
    for tool in ("caddy", "curl", "openssl"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (apt-get install caddy curl openssl; .ci/run installs them)"
    return shaped_paths_unavailable()


pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.skipif((why := _unavailable()) is not None, reason=f"{why}"),
]


class NatHost:
    """The namespace, its name for the proxy (/etc/netns/<ns>/hosts, which ``ip netns exec``
    mounts over /etc/hosts) and how to run things in it."""

    def __init__(self, far) -> None:
        self.far = far
        self.etc = Path("/etc/netns") / far.namespace

    def __enter__(self) -> NatHost:
        self.etc.mkdir(parents=True)
        self.etc.joinpath("hosts").write_text(
            f"127.0.0.1 localhost\n{self.far.near_ip} {PROXY_NAME}\n"
        )
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.etc, ignore_errors=True)

    def run(self, argv: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*self.far.prefix, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **kwargs,
        )

    def connects(self, host: str, port: int) -> bool:
        """Whether a TCP connection from the namespace to host:port is accepted."""
        code = (
            "import socket,sys\n"
            "try:\n"
            f"    socket.create_connection(({host!r}, {port}), timeout=3).close()\n"
            "except OSError:\n"
            "    sys.exit(1)\n"
        )
        return self.run([sys.executable, "-c", code], timeout=30).returncode == 0


@pytest.fixture
def nat_host() -> Iterator[NatHost]:
    linkemu = bench_module("linkemu")
    open_path = linkemu.Profile("open")  # unshaped: only the namespace and the veth pair
    with linkemu.FarSide(open_path) as far, NatHost(far) as host:
        yield host


def certificates(directory: Path, name: str) -> tuple[Path, Path, Path]:
    """A private CA and a certificate for ``name`` that it signed (openssl)."""
    ca_key, ca, key, csr, cert = (
        directory / n for n in ("ca.key", "ca.pem", "site.key", "site.csr", "site.pem")
    )
    ext = directory / "san.ext"
    ext.write_text(f"subjectAltName=DNS:{name}\n")
    new_key = ["-newkey", "rsa:2048", "-nodes", "-days", "1"]
    signed = ["-out", cert, "-days", "1", "-extfile", ext]
    for args in (
        ["req", "-x509", *new_key, "-keyout", ca_key, "-out", ca, "-subj", "/CN=swarm-test-ca"],
        ["req", *new_key[:3], "-keyout", key, "-out", csr, "-subj", f"/CN={name}"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", *signed],
    ):
        done = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    return ca, cert, key


class Proxy:
    def __init__(self, port: int, ca: Path) -> None:
        self.port = port
        self.ca = ca
        self.url = f"https://{PROXY_NAME}:{port}"


def start_proxy(
    procs: Processes, tmp_path: Path, port: int, leader_port: int, websocket_port: int
) -> Proxy:
    """Caddy with the shipped Caddyfile, configured only through its environment."""
    certs = tmp_path / "certs"
    certs.mkdir()
    ca, cert, key = certificates(certs, PROXY_NAME)
    home = tmp_path / "caddy"
    env = child_env(
        HOME=str(home),
        XDG_DATA_HOME=str(home / "data"),
        XDG_CONFIG_HOME=str(home / "config"),
        SWARM_PROXY_SITE=f"https://{PROXY_NAME}:{port}",
        SWARM_PROXY_TLS=f"tls {cert} {key}",
        SWARM_PROXY_LEADER=f"127.0.0.1:{leader_port}",
        SWARM_PROXY_NATS=f"127.0.0.1:{websocket_port}",
        SWARM_PROXY_ADMIN="off",  # no fixed port
        SWARM_PROXY_OPTIONS="auto_https disable_redirects",  # no port 80
    )
    argv = ["caddy", "run", "--config", str(CADDYFILE), "--adapter", "caddyfile"]
    procs.start("caddy", argv, env)
    return Proxy(port, ca)


def curl(host: NatHost, proxy: Proxy, path: str) -> subprocess.CompletedProcess:
    """The status of a GET through the proxy, from the NAT host (stdout: the code)."""
    argv = ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert", str(proxy.ca)]
    return host.run([*argv, f"{proxy.url}{path}"], timeout=30)


def stream_for(host: NatHost, proxy: Proxy, path: str, token: str, seconds: int) -> str:
    """What an event stream through the proxy sent within ``seconds`` (curl then gives up:
    a buffering proxy would have passed nothing on by then)."""
    argv = ["curl", "-sS", "-N", "--max-time", str(seconds), "--cacert", str(proxy.ca)]
    argv += ["-H", f"authorization: Bearer {token}", f"{proxy.url}{path}"]
    return host.run(argv, timeout=seconds + 30).stdout


def join_command(leader: Leader, proxy: Proxy) -> str:
    """The command ``swarm join-session create`` prints (once the package is ready)."""
    wait_for(
        lambda: leader.request("GET", "/api/v1/bootstrap/manifest").status_code == 200,
        timeout=120,
        what="the package to be ready",
    )
    done = swarm_cli(leader, "join-session", "create", "--name", NAT_FELLOW, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"and NATS at wss://{PROXY_NAME}:{proxy.port}/nats" in done.stdout, done.stdout
    command = done.stdout.split("on the new host run:\n", 1)[1].strip()
    assert command.startswith(f"curl -fsSL {proxy.url}/api/v1/bootstrap/fellow.sh | "), command
    return command


@pytest.fixture
def proxy_port() -> int:
    return free_port()


@pytest.fixture
def leader(procs, secure_nats, nats_authority, tmp_path, proxy_port) -> Iterator[Leader]:
    """A leader on loopback whose public address is the proxy's."""
    public = f"https://{PROXY_NAME}:{proxy_port}"
    env = secure_env(nats_authority)
    yield from leader_process(procs, secure_nats, tmp_path, **env, SWARM_PUBLIC_URL=public)


def test_a_host_behind_the_proxy_joins_trains_over_the_relay_and_ships_its_logs(
    procs: Processes,
    secure_nats: NatsControl,
    nats_authority: NatsAuthority,
    leader: Leader,
    proxy_port: int,
    nat_host: NatHost,
    tmp_path: Path,
):
    leader_port = int(leader.url.rsplit(":", 1)[1])
    assert secure_nats.websocket_port is not None
    proxy = start_proxy(procs, tmp_path, proxy_port, leader_port, secure_nats.websocket_port)

    # The NAT host reaches the proxy's port, and nothing else of this machine.
    wait_for(
        lambda: curl(nat_host, proxy, "/health").stdout == "200",
        timeout=30,
        what="the leader through the proxy, from the NAT host",
    )
    assert curl(nat_host, proxy, "/metrics").stdout == "404"
    # On loopback but public through the proxy: reads need the token.
    assert curl(nat_host, proxy, "/api/v1/jobs").stdout == "401"
    near = nat_host.far.near_ip
    for port in (leader_port, secure_nats.port, secure_nats.websocket_port):
        for address in (near, "127.0.0.1"):
            assert not nat_host.connects(address, port), f"{address}:{port} is open to it"
    assert nat_host.connects(near, proxy_port)

    creds = nats_authority.write_fellow_creds("swarm", "outside")
    start_agent(procs, secure_nats.url, "outside", SWARM_NATS_CREDS=str(creds))
    command = join_command(leader, proxy)

    prefix = tmp_path / "nat-prefix"
    options = [
        "--prefix",
        str(prefix),
        "--pip-args",
        "--no-deps --no-index",  # no index here: dependencies from this test's venv
        "--site-packages",
        SITE_PACKAGES,
        "--no-systemd",
    ]
    # What the operator of the NAT host runs: the printed command, trusting the private CA
    # (curl's CURL_CA_BUNDLE, SWARM_LEADER_CA for the installer and the agent).
    script = f"{command} {shlex.join(options)}"
    env = child_env(HOME=str(tmp_path), CURL_CA_BUNDLE=str(proxy.ca), SWARM_LEADER_CA=str(proxy.ca))
    pid_file = prefix / "fellow.pid"
    try:
        done = nat_host.run(["sh", "-c", script], timeout=240, env=env)
        log = (prefix / "join.log").read_text() if (prefix / "join.log").exists() else ""
        assert done.returncode == 0, done.stdout + done.stderr + log
        fellow_env = (prefix / "fellow.env").read_text()
        assert f"SWARM_NATS_URL=wss://{PROXY_NAME}:{proxy_port}/nats" in fellow_env
        assert f"SWARM_LEADER_CA={prefix}/leader-ca.pem" in fellow_env

        agent_log = prefix / "agent.log"
        for name in ("outside", NAT_FELLOW):
            try:
                leader.wait_status(name, "ready", timeout=90)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{agent_log.read_text()[-3000:]}") from None

        spec = tiny(name="public-access", steps=12, stages=2, transport="tunnel")
        job_id = leader.submit(**spec)["job_id"]
        try:
            job = leader.wait_job(job_id, "COMPLETED", timeout=150)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{agent_log.read_text()[-3000:]}") from None
        assert job["placement"]["transport"] == "tunnel"
        placed = sorted(s["fellow_id"] for s in job["placement"]["stages"])
        assert placed == sorted(["outside", NAT_FELLOW])
        assert job["final_loss"] is not None

        # Its logs reached the leader (over NATS, through the proxy).
        entries = wait_for(
            lambda: leader.get(f"/api/v1/workers/{NAT_FELLOW}/logs?limit=2000"),
            timeout=30,
            what="the NAT fellow's logs at the leader",
        )
        assert all(e["fellow_id"] == NAT_FELLOW for e in entries)
        assert any(job_id in e["message"] for e in entries), [e["message"] for e in entries]
        # The same logs as a server-sent event stream through the proxy, unbuffered.
        path = f"/api/v1/workers/{NAT_FELLOW}/logs/stream"
        events = stream_for(nat_host, proxy, path, leader.token or "", seconds=5)
        assert "data:" in events and job_id in events, events[:500]
    finally:
        if pid_file.exists():
            kill_tree(int(pid_file.read_text()))


def test_the_proxy_publishes_no_metrics_and_no_open_reads(procs: Processes, nats_server, tmp_path):
    """A leader on loopback whose operator set only the public NATS address (no
    SWARM_PUBLIC_URL): reads stay open to this machine, never to the proxy's clients, and
    the proxy keeps the metrics inside."""
    proxy_port = free_port()
    public_nats = f"wss://{PROXY_NAME}:{proxy_port}/nats"
    leader = next(leader_process(procs, nats_server, tmp_path, SWARM_PUBLIC_NATS_URL=public_nats))
    leader_port = int(leader.url.rsplit(":", 1)[1])
    proxy = start_proxy(procs, tmp_path, proxy_port, leader_port, free_port())

    def status(path: str) -> str:
        argv = ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert", str(proxy.ca)]
        argv += ["--resolve", f"{PROXY_NAME}:{proxy_port}:127.0.0.1", f"{proxy.url}{path}"]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout

    wait_for(lambda: status("/health") == "200", timeout=30, what="the leader through the proxy")
    with httpx.Client(base_url=leader.url, timeout=5.0) as local:
        assert local.get("/api/v1/jobs").status_code == 200  # open on this machine
        assert local.get("/api/v1/metrics").status_code == 200
    for path in ("/api/v1/metrics", "/api/v1/metrics/", "/API/v1/Metrics", "/metrics"):
        assert status(path) == "404", path
    for path in ("/api/v1/jobs", "/api/v1/workers", f"/api/v1/workers/{NAT_FELLOW}/logs"):
        assert status(path) == "401", path
