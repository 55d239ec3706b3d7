"""The systemd units and their env files: checked for meaning; the serve unit's command run as
systemd would."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from silentswarm.agent.serve.main import TOKEN_ENV as SERVE_TOKEN_ENV
from silentswarm.procs import free_port
from tests.helpers import REPO, child_env
from tests.integration.deploy import (
    GPU_UNITS,
    HARDENING,
    JOBS,
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
    # GPUs: /dev/nvidia* must stay visible (ProtectClock= would imply a device allow-list).
    no_devices = {"PrivateDevices", "DeviceAllow", "DevicePolicy", "ProtectClock"}
    if name in GPU_UNITS:
        assert not {k.split(".")[1] for k in unit} & no_devices, name
    else:
        assert unit["Service.PrivateDevices"] == ["yes"], name
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
    # Upgrades restart it if it runs; removal stops and disables it.
    unit_name = f"swarm-{name}.service"
    for script, verb in (("postinst.sh", "try-restart"), ("prerm.sh", "disable --now")):
        text = (REPO / "packaging" / "deb" / script).read_text()
        joined = re.sub(r"\\\n\s*", " ", text)  # backslash-continued lines as one
        assert re.search(rf"systemctl {verb} [^\n]*{re.escape(unit_name)}", joined), script


def test_the_repository_has_no_unit_the_tests_miss():
    assert sorted(p.name for p in SYSTEMD.glob("*.service")) == sorted(
        f"swarm-{n}.service" for n in UNITS
    )
    assert sorted(p.name for p in (SYSTEMD / "env").iterdir()) == sorted(f"{n}.env" for n in UNITS)
    assert sorted(p.name for p in NOMAD.iterdir()) == sorted(f"{n}.nomad.hcl" for n in JOBS)
