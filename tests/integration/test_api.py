"""The leader's REST surface against a real leader process."""

from __future__ import annotations

import http.client
import re
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import start_agent

pytestmark = pytest.mark.integration


def test_info_health_workers_nodes(procs, nats_server, leader):
    start_agent(procs, nats_server.url, "api-1")
    record = leader.wait_status("api-1", "ready", timeout=20)

    health = leader.get("/health")
    assert health == {"status": "ok", "nats": "connected", "version": health["version"]}
    info = leader.get("/api/v1/info")
    assert info["nats_url"] == nats_server.url and info["nats_connected"]
    assert info["fellows"]["ready"] == 1 and info["nodes"] == 1
    assert info["heartbeat_interval_s"] == 1.0 and info["offline_after_s"] == 3.0

    one = leader.get("/api/v1/workers/api-1")
    assert one["fellow_id"] == "api-1" and one["instance_id"] == record["instance_id"]
    assert one["history"][-1]["to_status"] == "ready"
    assert one["last_heartbeat_age_s"] is not None and one["last_heartbeat_age_s"] < 3

    nodes = leader.get("/api/v1/nodes")
    assert len(nodes) == 1
    node = nodes[0]
    assert node["fellows"] == ["api-1"] and node["online"]
    assert node["cpu_cores"] >= 1 and node["ram_total_bytes"] >= node["ram_available_bytes"] > 0
    assert isinstance(node["gpus"], list)


@pytest.mark.parametrize("path", ["/api/v1/workers/nobody", "/api/v1/nothing-here"])
def test_not_found_is_a_json_error(leader, path):
    response = leader.http.get(path)
    assert response.status_code == 404
    body = response.json()
    assert body["code"] == "NOT_FOUND" and body["message"]


def test_wrong_method_is_a_json_error(leader):
    response = leader.http.post("/api/v1/workers")
    assert response.status_code == 405
    assert response.json()["code"] == "METHOD_NOT_ALLOWED"


def test_openapi_lists_every_route(leader):
    schema = leader.get("/schema/openapi.json")
    assert {
        "/health",
        "/api/v1/info",
        "/api/v1/workers",
        "/api/v1/workers/{fellow_id}",
        "/api/v1/nodes",
    } <= set(schema["paths"])


def test_mutating_routes_need_the_operator_token(leader):
    import httpx

    with httpx.Client(base_url=leader.url, timeout=5.0) as anonymous:
        missing = anonymous.post("/api/v1/jobs", json={})
        assert missing.status_code == 401 and missing.json()["code"] == "UNAUTHORIZED"
        assert "Authorization: Bearer" in missing.json()["message"]
        wrong = anonymous.post(
            "/api/v1/jobs", json={}, headers={"authorization": "Bearer not-the-token"}
        )
        assert wrong.status_code == 403 and wrong.json()["code"] == "FORBIDDEN"
        assert "not-the-token" not in wrong.text
        # Reads are open by default (SWARM_API_PUBLIC_READS), and so are the UI and /health.
        assert anonymous.get("/api/v1/jobs").status_code == 200
        assert anonymous.get("/ops/join-v2").status_code == 200
    assert anonymous.is_closed
    assert leader.request("POST", "/api/v1/jobs", json={"stages": 1}).status_code == 201


def test_a_leader_without_a_token_makes_one_and_can_close_reads(procs, nats_server, tmp_path):
    import stat

    from silentswarm.procs import free_port
    from tests.helpers import Leader, child_env, wait_for

    port, state = free_port(), tmp_path / "state"
    env = child_env(
        SWARM_NATS_URL=nats_server.url,
        SWARM_LEADER_PORT=str(port),
        SWARM_STATE_DIR=str(state),
        SWARM_API_PUBLIC_READS="0",
    )
    procs.python("leader", "silentswarm.leader.main", env=env)
    anonymous = Leader(f"http://127.0.0.1:{port}")
    wait_for(lambda: anonymous.get("/health"), timeout=20, what="the leader")
    token_file = state / "api-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32
    assert anonymous.request("GET", "/api/v1/jobs").status_code == 401
    owner = Leader(anonymous.url, token=token)
    assert owner.request("GET", "/api/v1/jobs").status_code == 200
    log = procs.log(procs.started[-1])
    assert token not in log, "the token is never logged"
    anonymous.close()
    owner.close()


def test_an_idle_connection_outlasts_the_clients_pool_expiry(leader):
    """A pooled client (httpx expires an idle connection after 5 s) must never send on a
    connection the leader is closing: the leader keeps idle ones open longer (KEEP_ALIVE_S)."""
    from urllib.parse import urlsplit

    from silentswarm.leader.main import KEEP_ALIVE_S

    caddyfile = (Path(__file__).parents[2] / "packaging" / "proxy" / "Caddyfile").read_text()
    proxy_s = int(re.search(r"keepalive (\d+)s", caddyfile).group(1))
    assert max(httpx.Limits().keepalive_expiry, proxy_s) < KEEP_ALIVE_S
    parts = urlsplit(leader.url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
    try:
        connection.request("GET", "/health")
        assert connection.getresponse().read()
        sock = connection.sock
        time.sleep(6)  # the idle time itself is what is tested: past httpx's expiry
        connection.request("GET", "/health")
        response = connection.getresponse()
        assert response.status == 200 and connection.sock is sock, "the same connection"
    finally:
        connection.close()
