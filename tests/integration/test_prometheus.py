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

import httpx
import pytest
from litestar import Litestar, get
from litestar.response import ServerSentEvent
from litestar.testing import TestClient
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from silentswarm.leader.metrics import (
    CONTENT_TYPE,
    REQUEST_DURATION,
    REQUEST_LABELS,
    STREAM_BUCKETS,
    STREAM_DURATION,
    STREAM_LABELS,
    STREAMS_OPEN,
    RequestTimer,
)
from tests.conftest import start_agent
from tests.helpers import Leader, wait_for
from tests.integration.test_jobs import tiny, wait_ready, wait_steps

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
    status_labels = (("fellow", "prom-1"), ("status", "ready"))
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
    # The process's own series, as the default registry would have had them.
    assert samples[("process_resident_memory_bytes", ())] > 0
    assert samples[("process_cpu_seconds_total", ())] > 0
    assert samples[("process_start_time_seconds", ())] > 0
    assert samples[("process_open_fds", ())] >= 1
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


# --- retention and archival of finished jobs ---------------------------------------------

RETENTION_S = 5.0  # a finished job's series stay this long
ARCHIVE_AFTER_S = 20.0  # then it leaves the list (and deleting comes after at least this)
STREAM_ROUTE = "/api/v1/jobs/{job_id}/metrics/stream"


def job_ids_in(samples: Samples) -> set[str]:
    return {
        dict(labels)["job_id"] for (_, labels), _ in samples.items() if dict(labels).get("job_id")
    }


def listed(leader: Leader, query: str = "") -> dict[str, dict]:
    return {job["job_id"]: job for job in leader.get(f"/api/v1/jobs{query}")}


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_finished_jobs_leave_the_scrape_then_the_list_and_stay_archived_across_restarts(
    procs, nats_server, restartable_leader
):
    restartable_leader.env.update(
        SWARM_JOB_METRICS_RETENTION_S=str(RETENTION_S),
        SWARM_JOBS_ARCHIVE_AFTER_S=str(ARCHIVE_AFTER_S),
        SWARM_JOBS_DELETE_AFTER_S="0",
    )
    leader = restartable_leader.client
    restartable_leader.start()
    start_agent(procs, nats_server.url, "keep-1")
    wait_ready(leader, "keep-1")
    running = leader.submit(**tiny(name="long", steps=100_000, stages=1))["job_id"]
    leader.wait_job(running, "RUNNING", timeout=60)
    wait_steps(leader, running, 1)
    # The only fellow is busy: this one waits, and is cancelled (a finished job).
    finished = leader.submit(**tiny(name="short", steps=10, stages=1))["job_id"]
    response = leader.request("DELETE", f"/api/v1/jobs/{finished}")
    assert response.status_code == 200 and response.json()["state"] == "CANCELLED"
    cancelled_at = time.monotonic()

    _, samples = scrape(leader)
    assert time.monotonic() - cancelled_at < RETENTION_S, "too slow to see it before retention"
    assert {finished, running} <= job_ids_in(samples)
    assert samples[("swarm_job_state", (("job_id", finished), ("state", "CANCELLED")))] == 1

    # A watcher's stream counts as open while it lasts (and is no request latency).
    with (
        httpx.Client(base_url=leader.url, headers=leader.http.headers, timeout=10) as http,
        http.stream("GET", f"/api/v1/jobs/{running}/metrics/stream") as stream,
    ):
        assert stream.status_code == 200
        lines = stream.iter_lines()  # kept: a closed generator would close the stream
        next(line for line in lines if line.startswith("data:"))
        _, during = scrape(leader)
        assert during[(STREAMS_OPEN, (("route", STREAM_ROUTE),))] == 1

    def retired() -> Samples | None:
        _, now = scrape(leader)
        return None if finished in job_ids_in(now) else now

    after = wait_for(retired, timeout=30, what="the finished job's series to be retired")
    assert time.monotonic() - cancelled_at >= RETENTION_S - 1.0
    # The running job keeps its series, the stage's too; the retired job is still counted.
    assert after[("swarm_job_state", (("job_id", running), ("state", "RUNNING")))] == 1
    assert any(n == "swarm_job_stage_step" and ("job_id", running) in ls for n, ls in after)
    assert after[("swarm_jobs", (("state", "CANCELLED"),))] == 1
    assert after[(f"{STREAM_DURATION}_count", (("route", STREAM_ROUTE),))] >= 1
    assert after[(STREAMS_OPEN, (("route", STREAM_ROUTE),))] == 0
    assert not any(
        n == f"{REQUEST_DURATION}_count" and ("route", STREAM_ROUTE) in ls for n, ls in after
    )
    text, _ = scrape(leader)
    checked = promtool_check(text)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    if time.monotonic() - cancelled_at < ARCHIVE_AFTER_S - 2:
        assert finished in listed(leader), "retired from the metrics, not yet archived"

    wait_for(
        lambda: finished not in listed(leader), timeout=60, what="the finished job to be archived"
    )
    assert time.monotonic() - cancelled_at >= ARCHIVE_AFTER_S - 1.0

    def archived_but_served() -> None:
        assert running in listed(leader) and not listed(leader)[running]["archived"]
        everything = listed(leader, "?all=true")
        assert everything[finished]["archived"] and not everything[running]["archived"]
        assert leader.job(finished)["archived"] and leader.job(finished)["state"] == "CANCELLED"
        assert listed(leader, "?all=false").keys() == listed(leader).keys()
        _, samples = scrape(leader)
        assert finished not in job_ids_in(samples)
        assert samples[("swarm_jobs", (("state", "CANCELLED"),))] == 0
        info = leader.request("GET", "/api/v1/info").json()
        assert info["jobs"]["CANCELLED"] == 0 and info["jobs_archived"] == 1, info

    archived_but_served()
    bad = leader.request("GET", "/api/v1/jobs?all=maybe")
    assert bad.status_code == 400, bad.text
    assert [d["key"] for d in bad.json()["details"]] == ["all"], bad.text

    restartable_leader.kill()
    restartable_leader.start()
    archived_but_served()

    # Deleting: a restart with a limit the archived job is past drops it for good.
    restartable_leader.kill()
    restartable_leader.env["SWARM_JOBS_DELETE_AFTER_S"] = str(ARCHIVE_AFTER_S)
    restartable_leader.start()
    wait_for(
        lambda: leader.request("GET", f"/api/v1/jobs/{finished}").status_code == 404,
        timeout=30,
        what="the archived job to be deleted",
    )
    assert finished not in listed(leader, "?all=true") and running in listed(leader)
    restartable_leader.kill()
    restartable_leader.start()
    assert leader.request("GET", f"/api/v1/jobs/{finished}").status_code == 404


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


def test_latency_middleware_times_streams_apart_until_they_end_and_keeps_them_intact():
    registry = CollectorRegistry()
    histogram = Histogram(REQUEST_DURATION, "test", REQUEST_LABELS, registry=registry)
    streams = Histogram(
        STREAM_DURATION, "test", STREAM_LABELS, buckets=STREAM_BUCKETS, registry=registry
    )
    open_streams = Gauge(STREAMS_OPEN, "test", STREAM_LABELS, registry=registry)
    timer = RequestTimer(histogram, streams=streams, open_streams=open_streams)
    app = Litestar([stream_things, one_thing], middleware=[timer], debug=False)
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

    # The stream is not a request latency: timed apart, from its arrival to its end.
    assert observed("/things/{thing_id}/stream", "200", "_count") is None
    route = {"route": "/things/{thing_id}/stream"}
    assert registry.get_sample_value(f"{STREAM_DURATION}_count", route) == 1
    lasted = registry.get_sample_value(f"{STREAM_DURATION}_sum", route)
    assert STREAM_EVENTS * STREAM_PAUSE_S <= lasted <= took
    assert registry.get_sample_value(STREAMS_OPEN, route) == 0
    assert observed("/things/{thing_id}", "200", "_count") == 1
    assert observed("/things/{thing_id}", "500", "_count") == 1
    text = generate_latest(registry).decode()
    assert "/things/b" not in text and "/nothing/here" not in text
