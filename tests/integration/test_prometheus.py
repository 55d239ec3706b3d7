"""``GET /api/v1/metrics`` of a real leader with a real agent, checked by Prometheus' own tools.

``promtool`` (Debian's ``prometheus`` package, which .ci/run installs) lints the exposition:
a missing promtool fails the test rather than skipping it.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import AsyncIterator

import pytest
from litestar import Litestar, get
from litestar.response import ServerSentEvent
from litestar.testing import TestClient
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from silentswarm.leader.metrics import CONTENT_TYPE, REQUEST_DURATION, REQUEST_LABELS, RequestTimer
from tests.conftest import start_agent
from tests.helpers import Leader

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(leader: Leader) -> tuple[str, Samples]:
    """The metrics text, and every sample by (name, sorted labels)."""
    response = leader.http.get("/api/v1/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CONTENT_TYPE
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }
    return response.text, samples


def of_fellow(samples: Samples, fellow_id: str) -> dict[str, float]:
    """The fellow's own series (not its GPUs'), by name."""
    return {
        name: value
        for (name, labels), value in samples.items()
        if dict(labels).get("fellow") == fellow_id and "gpu" not in dict(labels)
    }


def promtool_check(text: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail(
            "promtool is not installed: it comes with Debian's prometheus package, which "
            ".ci/run installs (apt-get install -y --no-install-recommends prometheus)"
        )
    return subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )


@pytest.mark.integration
def test_metrics_of_a_live_fellow_pass_promtool_and_vanish_on_release(procs, nats_server, leader):
    agent = start_agent(procs, nats_server.url, "prom-1")
    leader.wait_status("prom-1", "ready", timeout=20)
    leader.get("/api/v1/workers/prom-1")  # for the latency histogram's route template

    text, samples = scrape(leader)
    workers = leader.get("/api/v1/workers")

    mine = of_fellow(samples, "prom-1")
    assert mine["swarm_fellow_up"] == 1
    assert 0 <= mine["swarm_fellow_heartbeat_age_seconds"] < 3
    assert mine["swarm_fellow_cpu_cores"] >= 1 and mine["swarm_fellow_ram_available_bytes"] > 0
    assert 0 <= mine["swarm_fellow_cpu_load_ratio"] <= 1
    assert mine["swarm_fellow_sent_bytes_total"] == 0
    assert {"swarm_fellow_network_transmit_bytes_per_second", "swarm_fellow_info"} <= set(mine)
    status_labels = (("fellow", "prom-1"), ("host", workers[0]["hostname"]), ("status", "ready"))
    assert samples[("swarm_fellow_status", status_labels)] == 1

    by_status = {
        dict(labels)["status"]: value
        for (name, labels), value in samples.items()
        if name == "swarm_fellows"
    }
    expected = {status: 0 for status in by_status}
    for worker in workers:
        expected[worker["status"]] += 1
    assert by_status == expected and by_status["ready"] == 1

    assert samples[("swarm_leader_nats_connected", ())] == 1
    assert samples[("swarm_leader_state_loaded", ())] == 1
    routes = {
        dict(labels)["route"]: value
        for (name, labels), value in samples.items()
        if name == f"{REQUEST_DURATION}_count"
        and dict(labels)["method"] == "GET"
        and dict(labels)["status_code"] == "200"
    }
    assert routes["/api/v1/workers"] >= 1 and routes["/api/v1/workers/{fellow_id}"] >= 1
    assert routes["/api/v1/info"] >= 1  # the fixture's readiness polls
    assert not any("prom-1" in route for route in routes), "raw paths must not be labels"

    checked = promtool_check(text)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert (checked.stdout + checked.stderr).strip() == "", "promtool warnings"

    response = leader.request("POST", "/api/v1/workers/prom-1/release", json={})
    assert response.status_code == 200, response.text
    agent.wait(timeout=20)
    _, after = scrape(leader)
    assert of_fellow(after, "prom-1") == {}
    assert sum(v for (n, _), v in after.items() if n == "swarm_fellows") == 0


# --- the latency middleware on its own (no processes) -------------------------------------

STREAM_EVENTS = 3
STREAM_PAUSE_S = 0.2


@get("/things/{thing_id:str}/stream")
async def stream_things(thing_id: str) -> ServerSentEvent:
    async def events() -> AsyncIterator[str]:
        for i in range(STREAM_EVENTS):
            await asyncio.sleep(STREAM_PAUSE_S)
            yield f"{thing_id}-{i}"

    return ServerSentEvent(events())


@get("/things/{thing_id:str}")
async def one_thing(thing_id: str) -> dict[str, str]:
    if thing_id == "broken":
        raise RuntimeError("a handler bug")
    return {"id": thing_id}


def test_latency_middleware_times_to_the_first_byte_and_keeps_streams_intact():
    registry = CollectorRegistry()
    histogram = Histogram(REQUEST_DURATION, "test", REQUEST_LABELS, registry=registry)
    app = Litestar([stream_things, one_thing], middleware=[RequestTimer(histogram)], debug=False)
    client = TestClient(app)

    started = time.monotonic()
    response = client.get("/things/a/stream")
    took = time.monotonic() - started
    assert response.status_code == 200
    assert [line for line in response.text.splitlines() if line] == [
        f"data: a-{i}" for i in range(STREAM_EVENTS)
    ]
    assert took >= STREAM_EVENTS * STREAM_PAUSE_S
    assert client.get("/things/b").status_code == 200
    assert client.get("/things/broken").status_code == 500
    assert client.get("/nothing/here").status_code == 404  # unrouted: not observed

    def observed(route: str, code: str, suffix: str) -> float | None:
        labels = {"method": "GET", "route": route, "status_code": code}
        return registry.get_sample_value(f"{REQUEST_DURATION}{suffix}", labels)

    assert observed("/things/{thing_id}/stream", "200", "_count") == 1
    # Timed until the response started, not until the stream ended.
    assert observed("/things/{thing_id}/stream", "200", "_sum") < STREAM_PAUSE_S
    assert observed("/things/{thing_id}", "200", "_count") == 1
    assert observed("/things/{thing_id}", "500", "_count") == 1
    text = generate_latest(registry).decode()
    assert "/things/b" not in text and "/nothing/here" not in text
