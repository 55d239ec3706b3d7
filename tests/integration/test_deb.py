"""The two .debs: built, checked by lintian, installed (base, then fellow), the fellow
removed, the base upgraded to a newer revision (state, edited conffiles and enabled units
stay), both purged cleanly."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
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

BASE_UNITS = ("leader", "nats")
FELLOW_UNITS = ("fellow", "serve")
PROGRAMS = ("swarm", "swarm-agent", "swarm-leader", "swarm-stage")
WANTS = Path("/etc/systemd/system/multi-user.target.wants")
FIND_TF = "import importlib.util as u; print(u.find_spec('tensorflow') is not None)"
CADDYFILE = "/usr/share/silentswarm/proxy/Caddyfile"  # docs/deploy/public-access.md
# lintian reads silentswarm-fellow without the upstream wheels under its site-packages (2 GB,
# nearly all of the package; lintian took 2.5 minutes on them, the critical path of this test,
# and what it can say of them is overridden or a warning): the package's own layer (control,
# maintainer scripts, units, conffiles, overrides, docs, the .pth, constraints.txt, the console
# scripts build.sh rewrites) gets every check. The one thing build.sh changes in the upstream
# trees, their modes, is checked on the installed files (`check_modes`). The base package,
# upstream files and all, gets every check.
UPSTREAM_TREE = "./opt/silentswarm/fellow/site-packages"
SHARED_OBJECT = re.compile(r"\.so(\.|$)")


def lintian_errors(report: str) -> list[str]:
    return [line for line in report.splitlines() if line.startswith("E: ")]


def start_lintian(deb: Path, *options: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["lintian", "--tag-display-limit", "0", *options, str(deb)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def own_layer(deb: Path, tmp_path: Path) -> Path:
    """``deb`` rebuilt without the files under :data:`UPSTREAM_TREE` (its md5sums to match)."""
    root = tmp_path / f"own-{deb.stem}"
    root.mkdir()
    fsys = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE)
    try:
        untar = subprocess.run(
            ["tar", "-x", "-C", str(root), "--exclude", f"{UPSTREAM_TREE}/*"],
            stdin=fsys.stdout,
            capture_output=True,
            timeout=600,
        )
    finally:
        fsys.stdout.close()
        if fsys.poll() is None:
            fsys.kill()
    assert fsys.wait(timeout=60) == 0 and untar.returncode == 0, untar.stderr
    control = root / "DEBIAN"
    assert run("dpkg-deb", "--control", str(deb), str(control)).returncode == 0
    md5sums = control / "md5sums"
    kept = [line for line in md5sums.read_text().splitlines() if (root / line[34:]).is_file()]
    assert kept and len(kept) < len(md5sums.read_text().splitlines())
    md5sums.write_text("\n".join(kept) + "\n")
    out = tmp_path / f"own-{deb.name}"
    built = run("dpkg-deb", "-Zgzip", "-z1", "--build", str(root), str(out), timeout=300)
    assert built.returncode == 0, built.stderr
    return out


def check_modes(tree: Path) -> None:
    """What lintian says of the upstream trees as `executable-not-elf-or-script` and
    `shlib-with-executable-bit`: only programs (ELF or a script) keep an execute bit."""
    wrong = []
    for path in tree.rglob("*"):
        if path.is_symlink() or not path.is_file() or not path.stat().st_mode & 0o111:
            continue
        with path.open("rb") as file:
            head = file.read(4)
        if SHARED_OBJECT.search(path.name) or not (head == b"\x7fELF" or head.startswith(b"#!")):
            wrong.append(str(path))
    assert not wrong, wrong[:20]


def deb_info(deb: Path, tmp_path: Path) -> tuple[str, str, list[str]]:
    """``dpkg-deb --info``, ``--contents`` and the conffiles of ``deb``."""
    control = tmp_path / f"control-{deb.name}"
    assert run("dpkg-deb", "--control", str(deb), str(control)).returncode == 0
    conffiles = (control / "conffiles").read_text().split()
    info = run("dpkg-deb", "--info", str(deb)).stdout
    return info, run("dpkg-deb", "--contents", str(deb), timeout=600).stdout, sorted(conffiles)


def check_metadata(base: Path, fellow: Path, deb_version: str, tmp_path: Path) -> None:
    info, contents, conffiles = deb_info(base, tmp_path)
    assert "Package: silentswarm\n" in info and f"Version: {deb_version}\n" in info
    assert "Maintainer: SilentSwarm developers <maintainers@silentswarm.dev>" in info
    assert re.search(r"Depends: python3\.\d+, libc6 \(>= 2\.\d+\)\n", info), info
    for path in (
        "./opt/silentswarm/bin/python",
        "./opt/silentswarm/bin/swarm-agent",
        "./opt/silentswarm/bin/swarm-leader",
        "./opt/silentswarm/bin/nats-server",
        "./lib/systemd/system/swarm-leader.service",
        "./lib/systemd/system/swarm-nats.service",
        "./usr/share/doc/silentswarm/copyright",
        "./usr/share/doc/silentswarm/changelog.Debian.gz",
        "./usr/share/silentswarm/grafana/silentswarm.json",
        "./usr/share/silentswarm/grafana/provisioning/dashboards/silentswarm.yaml",
        "./usr/share/lintian/overrides/silentswarm",
        f".{CADDYFILE}",
    ):
        assert path in contents, path
    for program in PROGRAMS:
        assert f"./usr/bin/{program} -> /opt/silentswarm/bin/{program}" in contents, program
    assert "tensorflow" not in contents and "swarm-fellow.service" not in contents
    assert conffiles == [f"/etc/silentswarm/{n}.env" for n in BASE_UNITS]
    assert "__pycache__" not in contents and ".pyc" not in contents, "byte code is postinst's"

    info, contents, conffiles = deb_info(fellow, tmp_path)
    assert "Package: silentswarm-fellow\n" in info and f"Version: {deb_version}\n" in info
    assert f"Depends: silentswarm (= {deb_version})" in info, info
    for path in (
        "./opt/silentswarm/fellow/site-packages/tensorflow/__init__.py",
        "./opt/silentswarm/fellow/constraints.txt",
        "./lib/systemd/system/swarm-fellow.service",
        "./lib/systemd/system/swarm-serve.service",
        "./usr/share/doc/silentswarm-fellow/copyright",
        "./usr/share/doc/silentswarm-fellow/changelog.Debian.gz",
    ):
        assert path in contents, path
    assert re.search(
        r"\./opt/silentswarm/lib/python3\.\d+/site-packages/silentswarm-fellow\.pth$",
        contents,
        re.M,
    )
    # The token's file: root's alone (systemd reads it before it drops to the user).
    assert re.search(r"^-rw------- root/root .* \./etc/silentswarm/serve\.env$", contents, re.M)
    assert conffiles == [f"/etc/silentswarm/{n}.env" for n in FELLOW_UNITS]
    assert "__pycache__" not in contents and ".pyc" not in contents, "byte code is postinst's"


def check_base_installed() -> None:
    for program in PROGRAMS:
        assert shutil.which(program) == f"/usr/bin/{program}", program
    for program in ("swarm", "swarm-agent", "swarm-leader"):
        help_run = run(program, "--help", timeout=60)  # through PATH
        assert help_run.returncode == 0 and "Usage" in help_run.stdout, help_run.stderr
    assert run(VENV_PYTHON, "-c", FIND_TF).stdout.strip() == "False", "no TensorFlow yet"
    # A fellow started here says what to install, in one line.
    agent = run("swarm-agent", "--nats-url", "nats://127.0.0.1:1", timeout=60)
    assert agent.returncode == 1 and "Traceback" not in agent.stderr, agent.stderr
    assert "silentswarm-fellow" in agent.stderr and "silentswarm[fellow]" in agent.stderr
    assert list(
        Path("/opt/silentswarm/lib").glob("python3.*/site-packages/silentswarm/__pycache__/*.pyc")
    )
    units = sorted(str(p) for p in Path("/lib/systemd/system").glob("swarm-*.service"))
    assert units == [f"/lib/systemd/system/swarm-{n}.service" for n in BASE_UNITS]
    assert run("getent", "passwd", "silentswarm").returncode == 0
    assert run("dpkg", "-S", CADDYFILE).stdout.startswith("silentswarm: "), "the base's"
    # What swarm-nats.service runs first: the installed package makes the authority, and the
    # installed nats-server accepts its configuration.
    auth = Path("/var/lib/silentswarm/nats-auth")
    made = run("swarm", "nats-auth", "init", "--dir", str(auth))
    assert made.returncode == 0, made.stderr
    checked = run("/opt/silentswarm/bin/nats-server", "--config", str(auth / "server.conf"), "-t")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def check_fellow_installed() -> None:
    assert run(VENV_PYTHON, "-c", FIND_TF).stdout.strip() == "True"
    imported = run(VENV_PYTHON, "-c", "import tensorflow as tf; print(tf.__file__)", timeout=300)
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert imported.stdout.strip().startswith("/opt/silentswarm/fellow/site-packages/tensorflow/")
    assert list(Path("/opt/silentswarm/fellow/site-packages/tensorflow").glob("__pycache__/*.pyc"))
    units = sorted(str(p) for p in Path("/lib/systemd/system").glob("swarm-*.service"))
    assert units == [f"/lib/systemd/system/swarm-{n}.service" for n in sorted(UNITS)]
    serve_env = Path("/etc/silentswarm/serve.env").stat()
    assert (serve_env.st_uid, serve_env.st_mode & 0o777) == (0, 0o600)
    verify = run("systemd-analyze", "verify", *units)
    # It exits 0 on "Unknown key" warnings: read what it says.
    assert verify.returncode == 0 and verify.stdout + verify.stderr == "", verify.stderr
    # swarm-serve.service's program: the installed module, with its options.
    serve_help = run(VENV_PYTHON, "-m", "silentswarm.agent.serve", "--help", timeout=60)
    assert serve_help.returncode == 0 and "--model-dir" in serve_help.stdout, serve_help.stderr
    for name in UNITS:  # installed, never started or enabled
        unit_name = f"swarm-{name}.service"
        assert run("systemctl", "is-active", unit_name).stdout.strip() != "active", name
        assert not (WANTS / unit_name).exists(), f"{name} was enabled at install"


def check_fellow_removed() -> None:
    """Removing silentswarm-fellow takes TensorFlow out of the venv, and its units."""
    assert run(VENV_PYTHON, "-c", FIND_TF).stdout.strip() == "False"
    assert not list(
        Path("/opt/silentswarm/lib").glob("python3.*/site-packages/silentswarm-fellow.pth")
    )
    assert not Path("/opt/silentswarm/fellow").exists()
    units = sorted(str(p) for p in Path("/lib/systemd/system").glob("swarm-*.service"))
    assert units == [f"/lib/systemd/system/swarm-{n}.service" for n in BASE_UNITS]
    assert Path("/etc/silentswarm/fellow.env").exists(), "removal keeps the configuration"
    assert run("swarm", "--help").returncode == 0


def check_upgrade_keeps_state(newer: Path) -> None:
    """dpkg -i of a higher version: the state, an edited conffile and an enabled unit stay."""
    marker = Path("/var/lib/silentswarm/leader/kept")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("state")
    leader_env = Path("/etc/silentswarm/leader.env")
    edited = leader_env.read_text() + "SWARM_LOG_LEVEL=DEBUG\n"
    leader_env.write_text(edited)
    assert run("systemctl", "enable", "swarm-leader.service").returncode == 0
    upgraded = run("dpkg", "-i", str(newer), timeout=600)
    assert upgraded.returncode == 0, upgraded.stderr
    status = run("dpkg-query", "-W", "-f", "${Version}", "silentswarm").stdout
    assert status.endswith("-2"), status
    assert marker.read_text() == "state"
    assert leader_env.read_text() == edited
    assert Path("/var/lib/silentswarm/nats-auth/server.conf").exists()
    assert (WANTS / "swarm-leader.service").is_symlink(), "the operator's enable stays"
    pyc = "python3.*/site-packages/silentswarm/__pycache__/*.pyc"
    assert list(Path("/opt/silentswarm/lib").glob(pyc))
    assert run("swarm", "--help").returncode == 0


@pytest.mark.timeout(1500)
def test_the_debs_pass_lintian_install_upgrade_and_purge_cleanly(tmp_path):
    if os.geteuid() != 0 or not shutil.which("dpkg"):
        pytest.fail("this test installs the .debs: it needs root and dpkg (CI has both)")
    if not shutil.which("lintian"):
        pytest.fail(
            "this test checks the .debs with lintian: apt-get install lintian (.ci/run does)"
        )
    if Path("/opt/silentswarm").exists():
        pytest.fail("/opt/silentswarm exists: a SilentSwarm package is installed on this machine")
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        # lintian refuses an uncompressed data member; gzip's fastest level keeps it quick.
        "DEB_COMPRESSION": "gzip:1",
        "OUT": str(tmp_path / "dist"),
    }
    built = run("bash", str(REPO / "packaging" / "build.sh"), env=env, timeout=1200)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    dist = tmp_path / "dist"
    assert (dist / f"silentswarm-{version}-py3-none-any.whl").exists()
    assert (dist / f"silentswarm-{version}.tar.gz").exists()
    newer = tmp_path / "newer"
    base = dist / f"silentswarm_{version}-1_amd64.deb"
    fellow = dist / f"silentswarm-fellow_{version}-1_amd64.deb"
    # lintian runs while the packages are installed.
    fellow_own = own_layer(fellow, tmp_path)
    lintians = [start_lintian(base), start_lintian(fellow_own)]
    try:
        check_metadata(base, fellow, f"{version}-1", tmp_path)
        try:
            installed = run("dpkg", "-i", str(base), timeout=600)
            assert installed.returncode == 0, installed.stderr
            check_base_installed()
            installed = run("dpkg", "-i", str(fellow), timeout=900)
            assert installed.returncode == 0, installed.stderr
            check_fellow_installed()
            check_modes(Path("/opt/silentswarm/fellow"))
            removed = run("dpkg", "--remove", "silentswarm-fellow", timeout=600)
            assert removed.returncode == 0, removed.stderr
            check_fellow_removed()
            # The next Debian revision of the base package alone (quick: no TensorFlow).
            again = run(
                "bash",
                str(REPO / "packaging" / "build.sh"),
                env={**env, "DEB_RELEASE": "2", "PACKAGES": "silentswarm", "OUT": str(newer)},
                timeout=600,
            )
            assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
            check_upgrade_keeps_state(newer / f"silentswarm_{version}-2_amd64.deb")
        finally:
            purged = run("dpkg", "--purge", "silentswarm-fellow", "silentswarm", timeout=600)
        assert purged.returncode == 0, purged.stderr
        for gone in ("/opt/silentswarm", "/etc/silentswarm", "/var/lib/silentswarm"):
            assert not Path(gone).exists(), gone
        for gone in ("/usr/share/doc/silentswarm", "/usr/share/silentswarm", "/usr/bin/swarm"):
            assert not os.path.lexists(gone), gone
        assert not list(Path("/lib/systemd/system").glob("swarm-*.service"))
        assert not (WANTS / "swarm-leader.service").is_symlink(), "removal disables it"
        assert run("getent", "passwd", "silentswarm").returncode == 0, "the system user stays"
        reports = [lintian.communicate(timeout=1200)[0] for lintian in lintians]
    finally:
        for lintian in lintians:
            if lintian.poll() is None:
                lintian.kill()
                lintian.wait()
    for lintian, report in zip(lintians, reports, strict=True):
        assert lintian.returncode == 0 and not lintian_errors(report), report[-5000:]
        # build.sh takes the execute bits off what is no program (protobuf's modules ship 0755)
        assert "executable-not-elf-or-script" not in report, report[-5000:]
