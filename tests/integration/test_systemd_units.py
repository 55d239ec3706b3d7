"""The systemd units and their env files: checked for meaning; the serve unit's command run as
systemd would."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from silentswarm.agent.serve.main import TOKEN_ENV as SERVE_TOKEN_ENV
from silentswarm.procs import free_port
from tests.helpers import REPO, child_env
from tests.integration.deploy import (
    EXPOSURE_LIMITS,
    GPU_UNITS,
    HARDENING,
    JOBS,
    NO_GPU_HARDENING,
    NOMAD,
    READ,
    SERVE_GRACE_S,
    SERVE_TOKEN,
    SYSTEMD,
    UNITS,
    check_installed_program,
    check_serving,
    env_file,
    read_unit,
    run,
    seconds,
    shipped,
    systemd_argv,
    unit_environment,
)


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_the_serve_unit_with_its_env_file_serves_a_glued_model(procs, glued_model, tmp_path):
    """swarm-serve.service's command as systemd runs it: serve.env as the operator edits it
    (only the values its comments ask for), ${X} and $X expanded as systemd does."""
    unit = read_unit("serve")
    env = env_file(SYSTEMD / "env" / "serve.env")
    assert env[SERVE_TOKEN_ENV] == ""  # shipped without one: the operator's to set
    port = free_port()
    env |= {
        SERVE_TOKEN_ENV: SERVE_TOKEN,
        "SWARM_SERVE_MODEL_DIR": str(glued_model),
        "SWARM_SERVE_PORT": str(port),
        "SWARM_SERVE_ARGS": "--name deployed --max-waiting 8",
    }
    env |= {k: str(tmp_path / "state") for k in unit_environment(unit)}  # HOME
    [exec_start] = unit["Service.ExecStart"]
    argv = systemd_argv(exec_start, env)
    assert SERVE_TOKEN not in argv
    if not Path(argv[0]).exists():  # this environment's interpreter when nothing is installed
        argv[0] = sys.executable
    proc = procs.start("systemd-serve", argv, env=child_env(**env))
    stop_within = seconds(unit["Service.TimeoutStopSec"][0])
    assert stop_within > SERVE_GRACE_S
    assert check_serving(procs, proc, f"http://127.0.0.1:{port}", stop_within) == "deployed"


def test_the_serve_unit_refuses_to_start_without_its_token_and_stays_down(tmp_path):
    """The env file as shipped has no token: the server exits 2, which the unit does not
    restart (a restart would not mend it)."""
    unit = read_unit("serve")
    env = env_file(SYSTEMD / "env" / "serve.env") | {"HOME": str(tmp_path)}
    argv = systemd_argv(unit["Service.ExecStart"][0], env)
    argv[0] = argv[0] if Path(argv[0]).exists() else sys.executable
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=child_env(**env)
    )
    assert done.returncode == 2 and done.stderr.startswith("serve: error: "), done.stderr
    assert SERVE_TOKEN_ENV in done.stderr
    assert unit["Service.RestartPreventExitStatus"] == ["2"]


@pytest.mark.parametrize("name", UNITS)
def test_every_unit_runs_an_installed_program_with_variables_it_is_given(name):
    unit = read_unit(name)
    assert unit["Service.User"] == ["silentswarm"] and unit["Service.Group"] == ["silentswarm"]
    [env_path] = unit["Service.EnvironmentFile"]
    assert env_path == f"/etc/silentswarm/{name}.env"
    env = env_file(SYSTEMD / "env" / f"{name}.env") | unit_environment(unit)
    exec_lines = unit.get("Service.ExecStartPre", []) + unit["Service.ExecStart"]
    used = set()
    for line in exec_lines:
        check_installed_program(systemd_argv(line, env), name)
        used |= set(re.findall(r"\$\{?(\w+)", line))
    assert used <= env.keys(), f"{name}: {sorted(used - env.keys())} set nowhere"
    # Every SWARM_* in the env file (the commented examples too) is read by the process or
    # fills in the unit's command line.
    text = (SYSTEMD / "env" / f"{name}.env").read_text()
    for var in re.findall(r"^#?\s*(SWARM_\w+)=", text, flags=re.M):
        assert var in READ or var in used, f"{name}.env: {var} is read by nothing"
    for var in unit_environment(unit):
        assert not var.startswith("SWARM_") or var in READ, f"{name}: {var}"


@pytest.mark.parametrize("name", UNITS)
def test_every_unit_is_hardened_and_shipped_with_its_env_file(name):
    unit = read_unit(name)
    for key, value in HARDENING.items():
        assert unit.get(f"Service.{key}") == [value], f"{name}: {key}"
    keys = {k.split(".")[1] for k in unit}
    if name in GPU_UNITS:
        # /dev/nvidia* stays reachable (any device setting, ProtectClock= too, puts an
        # allow-list in front of it), XLA's JIT may map what it compiles executable, psutil,
        # NVML and CUDA read /proc beyond the processes, and the host's groups stay as they are.
        keeps = {"DeviceAllow", "DevicePolicy", "ProcSubset", *NO_GPU_HARDENING}
        assert not keys & keeps, f"{name}: {sorted(keys & keeps)}"
        # A deny list (the NVIDIA libraries may make calls no allow list names) that leaves
        # @resources (thread pinning, NUMA memory policies) allowed.
        [calls] = unit["Service.SystemCallFilter"]
        assert calls.startswith("~") and "@resources" not in calls, name
        assert {"@privileged", "@debug", "@mount", "@clock"} <= set(calls[1:].split()), name
    else:
        for key, value in NO_GPU_HARDENING.items():
            assert unit.get(f"Service.{key}") == [value], f"{name}: {key}"
        assert unit["Service.SystemCallFilter"] == ["@system-service", "~@privileged @resources"]
    # IP and Unix sockets (sd_notify), netlink where a unit says why; nothing else.
    [families] = unit["Service.RestrictAddressFamilies"]
    assert set(families.split()) - {"AF_NETLINK"} == {"AF_UNIX", "AF_INET", "AF_INET6"}, name
    assert unit["Install.WantedBy"] == ["multi-user.target"]
    files = shipped()
    assert files[f"/lib/systemd/system/swarm-{name}.service"]["src"] == (
        f"systemd/swarm-{name}.service"
    )
    env = files[f"/etc/silentswarm/{name}.env"]
    assert env["src"] == f"systemd/env/{name}.env" and env["type"] == "config|noreplace"
    # An env file that holds a secret's value is root's alone (systemd reads it as root).
    if SERVE_TOKEN_ENV in env_file(SYSTEMD / "env" / f"{name}.env"):
        assert env["mode"] == "0600", name
    # Upgrades restart it if it runs; removal stops and disables it (as debhelper does, in the
    # maintainer scripts of the package that ships it).
    unit_name = f"swarm-{name}.service"
    package = files[f"/lib/systemd/system/{unit_name}"]["package"]
    for script, call in (
        ("postinst.sh", "deb-systemd-invoke try-restart"),
        ("prerm.sh", "deb-systemd-invoke stop"),
        ("prerm.sh", "deb-systemd-helper disable"),
    ):
        text = (REPO / "packaging" / "deb" / package / script).read_text()
        joined = re.sub(r"\\\n\s*", " ", text)  # backslash-continued lines as one
        units = re.search(r'^UNITS="([^"]*)"$', joined, re.M)
        joined = joined.replace("$UNITS", units.group(1) if units else "")
        assert re.search(rf"{call} [^\n]*{re.escape(unit_name)}", joined), (script, call)


@pytest.mark.parametrize("name", UNITS)
def test_every_unit_is_exposed_no_more_than_its_limit(name):
    """systemd's own rating of the sandbox (0 is locked down, 10 is none): at most 3.0 for
    NATS and the leader, 4.5 for the GPU units (docs/deploy/systemd.md, Hardening)."""
    if not shutil.which("systemd-analyze"):
        pytest.fail("this test needs systemd-analyze (systemd 252 or newer; CI has it)")
    unit = SYSTEMD / f"swarm-{name}.service"
    done = run("systemd-analyze", "security", "--offline=true", "--no-pager", str(unit))
    assert done.returncode == 0, done.stdout + done.stderr
    m = re.search(rf"Overall exposure level for {unit.name}: (\d+\.\d+)", done.stdout)
    assert m, done.stdout + done.stderr
    assert float(m.group(1)) <= EXPOSURE_LIMITS[name], done.stdout


def test_the_repository_has_no_unit_the_tests_miss():
    assert sorted(p.name for p in SYSTEMD.glob("*.service")) == sorted(
        f"swarm-{n}.service" for n in UNITS
    )
    assert sorted(p.name for p in (SYSTEMD / "env").iterdir()) == sorted(f"{n}.env" for n in UNITS)
    assert sorted(p.name for p in NOMAD.iterdir()) == sorted(f"{n}.nomad.hcl" for n in JOBS)
