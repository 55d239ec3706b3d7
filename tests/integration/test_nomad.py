"""The Nomad job specs: parsed and checked for meaning; the fellow and serve tasks rendered
and run."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from silentswarm.agent.serve.main import TOKEN_ENV as SERVE_TOKEN_ENV
from silentswarm.natsauth import NatsAuthority, creds_user_name
from silentswarm.procs import free_port
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
