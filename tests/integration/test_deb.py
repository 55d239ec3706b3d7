"""The .deb: built, installed, verified, purged."""

from __future__ import annotations

import os
import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.integration.deploy import (
    UNITS,
    VENV_PYTHON,
    run,
)


@pytest.mark.timeout(900)
def test_the_deb_installs_verifies_runs_and_purges_cleanly(tmp_path):
    if os.geteuid() != 0 or not shutil.which("dpkg"):
        pytest.fail("this test installs the .deb: it needs root and dpkg (CI has both)")
    if Path("/opt/silentswarm").exists():
        pytest.fail("/opt/silentswarm exists: a SilentSwarm package is installed on this machine")
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "DEB_COMPRESSION": "none",
        "OUT": str(tmp_path / "dist"),
    }
    built = run("bash", str(REPO / "packaging" / "build.sh"), env=env, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    dist = tmp_path / "dist"
    assert (dist / f"silentswarm-{version}-py3-none-any.whl").exists()
    assert (dist / f"silentswarm-{version}.tar.gz").exists()
    deb = dist / f"silentswarm_{version}_amd64.deb"

    info = run("dpkg-deb", "--info", str(deb)).stdout
    assert "Package: silentswarm" in info and f"Version: {version}" in info
    assert re.search(r"Depends: python3\.\d+\n", info), info  # the venv's minor version
    contents = run("dpkg-deb", "--contents", str(deb)).stdout
    for path in (
        "./opt/silentswarm/bin/swarm-agent",
        "./opt/silentswarm/bin/swarm-leader",
        "./opt/silentswarm/bin/nats-server",
        "./opt/silentswarm/bin/python",
        "./lib/systemd/system/swarm-fellow.service",
        "./lib/systemd/system/swarm-serve.service",
        "./etc/silentswarm/fellow.env",
        "./etc/silentswarm/serve.env",
    ):
        assert path in contents, path
    # The token's file: root's alone (systemd reads it before it drops to the user).
    assert re.search(r"^-rw------- root/root .* \./etc/silentswarm/serve\.env$", contents, re.M)
    control = tmp_path / "control"
    assert run("dpkg-deb", "--control", str(deb), str(control)).returncode == 0
    conffiles = (control / "conffiles").read_text().split()
    assert sorted(conffiles) == [f"/etc/silentswarm/{n}.env" for n in sorted(UNITS)]

    try:
        installed = run("dpkg", "-i", str(deb), timeout=600)
        assert installed.returncode == 0, installed.stderr
        units = sorted(str(p) for p in Path("/lib/systemd/system").glob("swarm-*.service"))
        assert units == [f"/lib/systemd/system/swarm-{n}.service" for n in sorted(UNITS)]
        serve_env = Path("/etc/silentswarm/serve.env").stat()
        assert (serve_env.st_uid, serve_env.st_mode & 0o777) == (0, 0o600)
        verify = run("systemd-analyze", "verify", *units)
        # It exits 0 on "Unknown key" warnings: read what it says.
        assert verify.returncode == 0 and verify.stdout + verify.stderr == "", verify.stderr
        for program in ("swarm", "swarm-agent", "swarm-leader"):
            help_run = run(f"/opt/silentswarm/bin/{program}", "--help", timeout=60)
            assert help_run.returncode == 0 and "Usage" in help_run.stdout, help_run.stderr
        # swarm-serve.service's program: the installed module, with its options.
        serve_help = run(VENV_PYTHON, "-m", "silentswarm.agent.serve", "--help", timeout=60)
        assert serve_help.returncode == 0 and "--model-dir" in serve_help.stdout, serve_help.stderr
        assert run("getent", "passwd", "silentswarm").returncode == 0
        for name in UNITS:  # installed, never started or enabled
            unit_name = f"swarm-{name}.service"
            assert run("systemctl", "is-active", unit_name).stdout.strip() != "active", name
            assert run("systemctl", "is-enabled", unit_name).stdout.strip() != "enabled", name
        # What swarm-nats.service runs first: the installed package makes the authority, and
        # the installed nats-server accepts its configuration.
        auth = tmp_path / "nats-auth"
        made = run("/opt/silentswarm/bin/swarm", "nats-auth", "init", "--dir", str(auth))
        assert made.returncode == 0, made.stderr
        checked = run(
            "/opt/silentswarm/bin/nats-server", "--config", str(auth / "server.conf"), "-t"
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
    finally:
        purged = run("dpkg", "--purge", "silentswarm", timeout=300)
    assert purged.returncode == 0, purged.stderr
    for gone in ("/opt/silentswarm", "/etc/silentswarm", "/var/lib/silentswarm"):
        assert not Path(gone).exists(), gone
    assert not list(Path("/lib/systemd/system").glob("swarm-*.service"))
    assert run("getent", "passwd", "silentswarm").returncode == 0, "the system user stays"
