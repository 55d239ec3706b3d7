"""The Nomad job specs: parsed and checked for meaning; the fellow and serve tasks rendered
and run."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from silentswarm.agent.serve.main import TOKEN_ENV as SERVE_TOKEN_ENV
from silentswarm.agent.supervisor import STOP_GRACE_S as FELLOW_STOP_GRACE_S
from silentswarm.leader.auth import operator_token
from silentswarm.natsauth import NatsAuthority, creds_user_name
from silentswarm.procs import free_port
from silentswarm.settings import Settings, env_name
from tests.conftest import leader_process, secure_env
from tests.helpers import child_env
from tests.integration.deploy import (
    JOBS,
    READ,
    SERVE_GRACE_S,
    SERVE_TOKEN,
    TEMPLATE_FUNCTIONS,
    blocks,
    check_installed_program,
    check_serving,
    load,
    render_template,
    seconds,
    task_config,
    tasks,
    template_blocks,
    templates,
    wait_healthy,
)


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
    serve = load("serve")
    [serve_service] = blocks(serve, "service")
    assert serve_service["name"] == "swarm-serve" and serve_service["port"] == "http"
    assert [c["path"] for c in serve_service["check"]] == ["/health"]  # answers without a token
    # /metrics wants the token, and lives elsewhere than the leader's: not the "prometheus" tag.
    assert "prometheus" not in serve_service.get("tags", [])


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
    leader_env = (secrets / "secrets/leader.env").read_text()
    assert "SWARM_ENROLL_TOKEN=fleet-secret" in leader_env
    assert "SWARM_API_TOKEN" not in leader_env  # no operator_token: the leader makes its own
    # The authority's config, its resolver moved onto the store volume (the later key wins).
    rendered = (secrets / "local/auth.conf").read_text()
    assert rendered.startswith(nats_var["server_conf"])
    assert 'dir: "/var/lib/swarm-nats/jwt"' in rendered.removeprefix(nats_var["server_conf"])
    [auth_conf] = [
        b for b in template_blocks(load("nats")) if b["destination"] == "local/auth.conf"
    ]
    with pytest.raises(AssertionError, match="waits for variable"):
        render_template(auth_conf["data"], {}, {})


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
        "NOMAD_IP_sync": "127.0.0.1",
        "NOMAD_PORT_sync": str(free_port()),
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
    assert record["sync_address"] == f"tcp://127.0.0.1:{nomad['NOMAD_PORT_sync']}"
    assert record["hardware"]["limits"]["max_memory_bytes"] == 3 * 2**30
    creds = tmp_path / "alloc" / "data" / "nats.creds"
    assert creds_user_name(creds.read_text()) == "nomad-client-1"
    started.close()


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_the_rendered_serve_task_serves_a_glued_model(procs, glued_model, tmp_path):
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
    nomad["NOMAD_TASK_DIR"] = str(tmp_path / "local")
    (tmp_path / "local").mkdir()
    env = {k: interpolate(v) for e in task["env"] for k, v in e.items()}
    proc = procs.start("nomad-serve", argv, env=child_env(**env, **template_env))
    check_serving(procs, proc, f"http://127.0.0.1:{port}", seconds(task["kill_timeout"]))


# --- the jobs' own expressions, evaluated as Nomad would ------------------------------------------

# How long each program takes to stop on SIGTERM: uvicorn's timeout_graceful_shutdown in
# leader/main.py and agent/serve/main.py, the agent's stage runtime grace; nats-server flushes
# JetStream at once. Nomad's client caps kill_timeout at max_kill_timeout (30 s by default).
GRACE_S = {"leader": 5, "serve": SERVE_GRACE_S, "fellow": FELLOW_STOP_GRACE_S, "nats": 0}
MAX_KILL_TIMEOUT_S = 30


def hcl_value(value: Any, scope: dict[str, Any]) -> Any:
    """A value as Nomad sees it once the job's variables are known (``var.x``, ``local.x``
    in ``scope``): the ``${...}`` our jobs use (literals, lists, comparisons, ``!``, ``&&``,
    ``||``, ``? :``, ``concat``) evaluated; runtime ones (``${NOMAD_PORT_http}``) kept."""
    if not isinstance(value, str) or "${" not in value:
        return value
    pieces = _template_pieces(value)
    if len(pieces) == 1 and isinstance(pieces[0], tuple):
        return _evaluate(pieces[0][0], scope, keep=value)
    return "".join(
        p if isinstance(p, str) else _text(_evaluate(p[0], scope, keep="${" + p[0] + "}"))
        for p in pieces
    )


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _template_pieces(text: str) -> list[str | tuple[str]]:
    """A string template split into literal text and ``(expression,)`` for each ``${...}``."""
    out: list[str | tuple[str]] = []
    i = 0
    while (start := text.find("${", i)) >= 0:
        out.append(text[i:start])
        end = _closing(text, start + 2)
        out.append((text[start + 2 : end],))
        i = end + 1
    out.append(text[i:])
    return [p for p in out if p != ""]


def _closing(text: str, i: int) -> int:
    """Where the ``}`` closing the ``${`` just before ``i`` is (strings and nesting skipped)."""
    depth, quoted = 1, False
    while True:
        c = text[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
            elif text.startswith("${", i):
                i = _closing(text, i + 2)
        elif c == '"':
            quoted = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1


def _tokens(expression: str) -> list[str]:
    out, i = [], 0
    while i < len(expression):
        c = expression[i]
        if c.isspace():
            i += 1
        elif c == '"':
            j = i + 1
            while expression[j] != '"':
                j = _closing(expression, j + 2) + 1 if expression.startswith("${", j) else j + 1
            out.append(expression[i : j + 1])
            i = j + 1
        elif m := re.match(r"\d+(?:\.\d+)?|[A-Za-z_][\w.]*|==|!=|>=|<=|&&|\|\||.", expression[i:]):
            out.append(m.group(0))
            i += len(m.group(0))
    return out


class _Runtime(Exception):
    """The expression needs what only the client knows (``NOMAD_*``, ``node.*``)."""


def _evaluate(expression: str, scope: dict[str, Any], keep: str) -> Any:
    try:
        return _Expression(_tokens(expression), scope).value()
    except _Runtime:
        return keep


class _Expression:
    """Recursive descent over one HCL expression's tokens."""

    LEVELS = (("||",), ("&&",), ("==", "!="), (">", "<", ">=", "<="))
    OPS = {
        "||": lambda a, b: a or b,
        "&&": lambda a, b: a and b,
        "==": lambda a, b: a == b,
        "!=": lambda a, b: a != b,
        ">": lambda a, b: a > b,
        "<": lambda a, b: a < b,
        ">=": lambda a, b: a >= b,
        "<=": lambda a, b: a <= b,
    }

    def __init__(self, tokens: list[str], scope: dict[str, Any]) -> None:
        self.tokens, self.scope, self.at = tokens, scope, 0

    def value(self) -> Any:
        out = self.conditional()
        assert self.at == len(self.tokens), f"unparsed: {self.tokens[self.at :]}"
        return out

    def peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.tokens[self.at]
        assert expected is None or token == expected, f"{expected} expected, got {token}"
        self.at += 1
        return token

    def conditional(self) -> Any:
        condition = self.binary(0)
        if self.peek() != "?":
            return condition
        self.take("?")
        yes = self.conditional()
        self.take(":")
        no = self.conditional()
        return yes if condition else no

    def binary(self, level: int) -> Any:
        if level == len(self.LEVELS):
            return self.unary()
        left = self.binary(level + 1)
        while self.peek() in self.LEVELS[level]:
            op = self.take()
            left = self.OPS[op](left, self.binary(level + 1))
        return left

    def unary(self) -> Any:
        if self.peek() == "!":
            self.take()
            return not self.unary()
        return self.primary()

    def items(self, close: str) -> list[Any]:
        out = []
        while self.peek() != close:
            out.append(self.conditional())
            if self.peek() == ",":
                self.take(",")
        self.take(close)
        return out

    def primary(self) -> Any:
        token = self.take()
        if token == "(":
            out = self.conditional()
            self.take(")")
            return out
        if token == "[":
            return self.items("]")
        if token.startswith('"'):
            return hcl_value(token[1:-1], self.scope)
        if re.fullmatch(r"\d+(?:\.\d+)?", token):
            return float(token) if "." in token else int(token)
        if token in ("true", "false"):
            return token == "true"
        if token == "concat" and self.peek() == "(":
            self.take("(")
            return [x for part in self.items(")") for x in part]
        if token not in self.scope:
            raise _Runtime(token)
        return self.scope[token]


def job_scope(name: str, **overrides: Any) -> dict[str, Any]:
    """``var.*`` (defaults, then ``overrides`` as ``-var`` gives them) and ``local.*``."""
    spec = load(name)
    declared = {var: body for variable in spec["variable"] for var, body in variable.items()}
    assert set(overrides) <= set(declared), f"{name} declares no {set(overrides) - set(declared)}"
    scope = {
        f"var.{var}": overrides.get(var, body.get("default")) for var, body in declared.items()
    }
    for locals_block in spec.get("locals", []):
        for local, expression in locals_block.items():
            if local != "__comments__":
                scope[f"local.{local}"] = hcl_value(expression, scope)
    return scope


def expanded(node: Any, scope: dict[str, Any]) -> Any:
    """``node`` with its dynamic blocks expanded (for_each evaluated, ``<label>.value`` and
    the other expressions in their content resolved) as Nomad would for ``scope``."""
    if isinstance(node, list):
        return [expanded(item, scope) for item in node]
    if not isinstance(node, dict):
        return hcl_value(node, scope)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "__comments__":
            continue
        if key == "dynamic":
            for dynamic in value:
                for block, body in dynamic.items():
                    for item in hcl_value(body["for_each"], scope):
                        inner = {**scope, f"{block}.value": item}
                        content = expanded(body["content"], inner)
                        labels = body.get("labels")
                        made = [{labels[0]: [c]} for c in content] if labels else content
                        out.setdefault(block, []).extend(made)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            out.setdefault(key, []).extend(expanded(value, scope))
        else:
            out[key] = expanded(value, scope)
    return out


def the_job(name: str, **overrides: Any) -> dict:
    """The job block of ``name`` as Nomad would run it with these ``-var`` values."""
    spec = load(name)
    scope = job_scope(name, **overrides)
    [job] = [body for job in spec["job"] for body in job.values()]
    return expanded(job, scope)


def job_groups(job: dict) -> list[dict]:
    return [body for group in job["group"] for body in group.values()]


def group_tasks(group: dict) -> list[tuple[str, dict]]:
    return [(name, body) for task in group["task"] for name, body in task.items()]


@pytest.mark.parametrize("name", JOBS)
def test_tasks_run_isolated_as_a_user_of_their_own_within_their_stop_time(name):
    """exec by default (raw_exec, disabled on Nomad clients by default, is the documented
    fallback), never as root, and a kill_timeout longer than the program's own graceful stop
    and within Nomad's cap."""
    for group in job_groups(the_job(name)):
        for task_name, task in group_tasks(group):
            assert task["driver"] == "exec", f"{name}/{task_name}: {task['driver']}"
            assert task["user"] and task["user"] not in ("root", "0"), f"{name}/{task_name}"
            kill = seconds(task["kill_timeout"])
            assert GRACE_S[name] < kill <= MAX_KILL_TIMEOUT_S, f"{name}/{task_name}: {kill}"
            # exec's chroot sees the package only through the read-only host volume.
            mounts = {m["destination"]: m for m in task.get("volume_mount", [])}
            assert mounts["/opt/silentswarm"]["read_only"] is True
            volume = {v_name: v for vol in group["volume"] for v_name, v in vol.items()}[
                mounts["/opt/silentswarm"]["volume"]
            ]
            assert volume["type"] == "host" and volume["read_only"] is True
            assert task_config(task)["command"].startswith("/opt/silentswarm/")
    # raw_exec cannot mount volumes (Nomad refuses the allocation): none then, same paths.
    for group in job_groups(the_job(name, driver="raw_exec")):
        for task_name, task in group_tasks(group):
            assert task["driver"] == "raw_exec"
            assert not task.get("volume_mount"), f"{name}/{task_name} mounts under raw_exec"
            assert task["user"] not in ("root", "0")


@pytest.mark.parametrize("name", ["fellow", "serve"])
def test_the_gpu_count_is_a_variable(name):
    """No GPU by default; -var gpus=N asks for N (and raw_exec: the nvidia device plugin gives
    a task no device nodes, and exec's chroot has none of the host's)."""
    for gpus, driver in ((0, "exec"), (1, "raw_exec"), (4, "raw_exec")):
        [group] = job_groups(the_job(name, gpus=gpus))
        [(_, task)] = group_tasks(group)
        devices = [d for r in task["resources"] for d in r.get("device", [])]
        assert task["driver"] == driver
        if gpus == 0:
            assert devices == []
        else:
            assert devices == [{"nvidia/gpu": [{"count": gpus}]}]
    [group] = job_groups(the_job(name, gpus=2, driver="exec"))
    assert group_tasks(group)[0][1]["driver"] == "exec"  # the operator's choice wins


def test_services_restart_their_task_when_their_health_check_fails():
    for name, service_name in (
        ("leader", "swarm-leader"),
        ("nats", "swarm-nats"),
        ("serve", "swarm-serve"),
    ):
        for group in job_groups(the_job(name)):
            services = [s for _, task in group_tasks(group) for s in task.get("service", [])]
            [service] = [s for s in services if s["name"] == service_name]
            assert service["provider"] == "nomad"
            for check in service["check"]:
                [restart] = check["check_restart"]
                assert restart["limit"] >= 1, f"{name}: {restart}"
                # The grace covers the start-up, under the update's healthy deadline.
                assert seconds(restart["grace"]) < seconds(group["update"][0]["healthy_deadline"])


@pytest.mark.parametrize("name", JOBS)
def test_every_job_updates_one_allocation_at_a_time_and_restarts_sensibly(name):
    job = the_job(name)
    for group in job_groups(job):
        [update] = group["update"]
        assert update["max_parallel"] == 1
        assert seconds(update["min_healthy_time"]) < seconds(update["healthy_deadline"])
        assert seconds(update["healthy_deadline"]) < seconds(update["progress_deadline"])
        [restart] = group["restart"]
        assert restart["mode"] == "delay" and restart["attempts"] >= 10
        if job["type"] == "system":
            # No service and no reschedule block (Nomad refuses one: a system job runs on
            # every eligible node); older Nomad versions enforce only max_parallel and stagger.
            assert update["health_check"] == "task_states" and "stagger" in update
            assert "reschedule" not in group
            assert group["ephemeral_disk"][0]["sticky"] is True  # keeps its NATS user
        else:
            assert update["health_check"] == "checks" and update["auto_revert"] is True
            [reschedule] = group["reschedule"]
            assert reschedule["unlimited"] is True


@pytest.mark.parametrize(
    ("name", "volume_source", "where"),
    [("leader", "swarm-leader-state", "SWARM_STATE_DIR"), ("nats", "swarm-nats", "--store_dir")],
)
def test_state_lives_on_a_host_volume_where_the_program_keeps_it(name, volume_source, where):
    """A replaced allocation (a new job version, a restarted client) finds the leader's state
    (its generated operator token, exports, datasets) and the JetStream store (the jobs)."""
    for driver in ("exec", "raw_exec"):
        [group] = job_groups(the_job(name, driver=driver))
        [(_, task)] = group_tasks(group)
        volumes = {v_name: v for vol in group["volume"] for v_name, v in vol.items()}
        [(volume_name, volume)] = [
            (n, v) for n, v in volumes.items() if v["source"] == volume_source
        ]
        assert volume["type"] == "host" and volume["read_only"] is False
        if where.startswith("SWARM_"):
            path = {k: v for e in task["env"] for k, v in e.items()}[where]
        else:
            args = task_config(task)["args"]
            path = args[args.index(where) + 1]
        if driver == "exec":
            [mount] = [m for m in task["volume_mount"] if m["volume"] == volume_name]
            assert mount["destination"] == path and mount["read_only"] is False
        # The destination is the host volume's documented path: raw_exec uses it in place.
        assert f'host_volume "{volume_source}"' in NOMAD_DOC
        assert re.search(rf'host_volume "{volume_source}" \{{\s*path\s*=\s*"{path}"', NOMAD_DOC)


NOMAD_DOC = (Path(__file__).parents[2] / "docs" / "deploy" / "nomad.md").read_text()


def test_the_operator_token_comes_from_a_nomad_variable_into_a_setting_the_leader_reads():
    [body] = [b for b in template_blocks(load("leader")) if "operator_token" in b["data"]]
    assert body["env"] is True and body["perms"] == "0600"
    assert body["destination"].startswith("secrets/")
    assert 'nomadVar "nomad/jobs/swarm-leader"' in body["data"]
    variables = {"nomad/jobs/swarm-leader": {"enroll_token": "e", "operator_token": "op-token"}}
    rendered = render_template(body["data"], {}, variables)
    env = dict(line.split("=", 1) for line in rendered.split() if "=" in line)
    [setting] = [k for k, v in env.items() if v == "op-token"]
    assert setting == env_name("api_token") and setting in READ
    settings = Settings.from_env(env)
    assert operator_token(settings) == "op-token"  # what the leader's API checks
    assert settings.client_token() == "op-token"  # what `swarm` sends (SWARM_API_TOKEN)


def render_task_dir(spec: dict, task_dir: Path, services: dict, variables: dict) -> dict[str, str]:
    """Every template of ``spec`` rendered under ``task_dir`` as Nomad would; the
    environment the ``env = true`` ones give the task."""
    env: dict[str, str] = {}
    for body in template_blocks(spec):
        text = render_template(body["data"], services, variables)
        path = task_dir / body["destination"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if body.get("env"):
            env.update(line.split("=", 1) for line in text.split() if "=" in line)
    return env


def test_the_rendered_leader_keeps_its_operator_token_across_a_replaced_allocation(
    procs, secure_nats, nats_authority, tmp_path
):
    """The leader task as Nomad runs it (its command, environment and templates), on a real
    authenticated NATS: with no operator_token in the variable it makes one in its state
    volume, and the allocation that replaces it (a fresh task directory, the same volume)
    answers to the same token."""
    auth = nats_authority.dir
    variables = {
        "nomad/jobs/swarm-leader": {
            "operator_nk": (auth / "operator.nk").read_text(),
            "account_nk": (auth / "account.nk").read_text(),
            "system_nk": (auth / "system.nk").read_text(),
            "leader_creds": (auth / "leader.creds").read_text(),
            "enroll_token": "fleet-secret",
        }
    }
    host, port = secure_nats.url.removeprefix("nats://").split(":")
    services = {"swarm-nats": [{"Address": host, "Port": int(port)}]}
    spec = load("leader")
    [group] = job_groups(the_job("leader"))
    [(_, task)] = group_tasks(group)
    volume_dir = tmp_path / "host-volume-swarm-leader-state"
    volume_dir.mkdir()
    volumes = {v_name: v for vol in group["volume"] for v_name, v in vol.items()}
    mounts = {
        m["destination"]: volume_dir
        for m in task["volume_mount"]
        if volumes[m["volume"]]["source"] == "swarm-leader-state"
    }
    config = task_config(task)
    program = Path(config["command"])
    if not program.exists():  # this environment's copy when nothing is installed
        program = Path(sys.executable).parent / program.name

    def allocation(index: int) -> tuple[Any, str]:
        task_dir = tmp_path / f"alloc-{index}" / "leader"
        template_env = render_task_dir(spec, task_dir, services, variables)
        http_port = free_port()
        nomad = {"NOMAD_PORT_http": str(http_port), "NOMAD_SECRETS_DIR": str(task_dir / "secrets")}

        def interpolate(value: str) -> str:
            value = re.sub(r"\$\{([^}]+)\}", lambda m: nomad[m.group(1)], value)
            for destination, host_path in mounts.items():  # the chroot's view of the volume
                if value == destination or value.startswith(destination + "/"):
                    value = str(host_path) + value[len(destination) :]
            return value

        env = {k: interpolate(v) for e in task["env"] for k, v in e.items()}
        # child_env runs tests' processes in dev mode; the job sets no SWARM_DEV (off).
        proc = procs.start(
            f"nomad-leader-{index}",
            [str(program)],
            env=child_env(**env, **template_env, SWARM_DEV="0"),
        )
        url = f"http://127.0.0.1:{http_port}"

        wait_healthy(procs, proc, url, timeout=60, what="the leader's /health")
        return proc, url

    proc, url = allocation(0)
    token = (volume_dir / "api-token").read_text().strip()
    assert token
    assert httpx.get(f"{url}/api/v1/info").status_code == 401  # off loopback: reads need it
    auth_header = {"Authorization": f"Bearer {token}"}
    assert httpx.get(f"{url}/api/v1/info", headers=auth_header).status_code == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=seconds(task["kill_timeout"])) == 0, procs.log(proc)

    proc, url = allocation(1)
    assert httpx.get(f"{url}/api/v1/info", headers=auth_header).status_code == 200
    assert (volume_dir / "api-token").read_text().strip() == token
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=seconds(task["kill_timeout"])) == 0, procs.log(proc)
