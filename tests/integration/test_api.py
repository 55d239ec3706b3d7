"""The leader's REST surface against a real leader process."""

from __future__ import annotations

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
