"""The Grafana dashboard asks only for series the leader exports.

The exported series come from a real leader app (no lifespan, so no NATS) whose registry and
job manager hold one training fellow with a GPU and one running job; its metrics are read
over HTTP and parsed with prometheus-client's parser. Only names and labels that have
samples there count as exported.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from silentswarm.jobspec import JobSpec, PlacedStage, Placement
from silentswarm.leader.app import create_app
from silentswarm.leader.jobs import JobManager
from silentswarm.leader.registry import FellowRegistry
from silentswarm.plan import Transport
from silentswarm.protocol import (
    FellowIdentity,
    FellowStatus,
    GpuInfo,
    HardwareSnapshot,
    Heartbeat,
    Progress,
    RegisterRequest,
)
from silentswarm.settings import Settings
from tests.helpers import REPO

DASHBOARD = REPO / "packaging" / "grafana" / "silentswarm.json"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
METRIC = re.compile(r"\b(swarm_[A-Za-z0-9_]*)")
SELECTOR = re.compile(r"\b(swarm_[A-Za-z0-9_]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LABEL_VALUES = re.compile(r"label_values\(\s*(swarm_[A-Za-z0-9_]*)[^,]*,\s*([A-Za-z0-9_]+)\s*\)")
LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')

# --- the leader's side ---------------------------------------------------------------------


def _identity(fellow_id: str, instance_id: str = "i-1") -> FellowIdentity:
    return FellowIdentity(
        fellow_id=fellow_id, instance_id=instance_id, hostname="host-a", version="t", pid=1
    )


def _hardware() -> HardwareSnapshot:
    gpu = GpuInfo(
        index=0,
        uuid="GPU-0000",
        name="Test GPU",
        memory_total_bytes=24 << 30,
        memory_free_bytes=20 << 30,
        memory_used_bytes=4 << 30,
        utilization_pct=55.0,
        temperature_c=61.0,
    )
    return HardwareSnapshot(
        hostname="host-a",
        cpu_cores=8,
        cpu_load_pct=25.0,
        ram_total_bytes=32 << 30,
        ram_available_bytes=16 << 30,
        net_sent_bytes_per_s=1000.0,
        net_recv_bytes_per_s=2000.0,
        gpus=[gpu],
    )


def populate(registry: FellowRegistry, jobs: JobManager) -> str:
    """One training fellow with a GPU, one running job, one dropped heartbeat; the job id."""
    registry.register(RegisterRequest(fellow=_identity("gpu-1"), hardware=_hardware()))
    job = jobs.submit(JobSpec(name="demo", steps=100))
    placement = Placement(
        stages=[
            PlacedStage(stage=0, fellow_id="gpu-1", hostname="host-a", layer_start=0, layer_end=2)
        ],
        transport=Transport.AUTO,
    )
    jobs.begin_start(job.job_id, placement)
    jobs.start_succeeded(job.job_id)
    registry.heartbeat(
        Heartbeat(
            fellow=_identity("gpu-1"),
            seq=1,
            status=FellowStatus.TRAINING,
            job_id=job.job_id,
            attempt=1,
            step=5,
            loss=2.5,
            bytes_sent=4096,
            bytes_received=8192,
            hardware=_hardware(),
        )
    )
    jobs.record_progress(
        Progress(
            job_id=job.job_id,
            fellow_id="gpu-1",
            attempt=1,
            step=5,
            total_steps=100,
            loss=2.5,
            val_loss=2.7,
            lr=1e-3,
            step_time_s=0.1,
            tokens_per_s=5120.0,
            bytes_sent=4096,
            bytes_received=8192,
        )
    )
    # A released agent still heartbeating: the leader drops (and counts) what it sends.
    registry.register(RegisterRequest(fellow=_identity("gone-1"), hardware=_hardware()))
    registry.release("gone-1")
    registry.heartbeat(
        Heartbeat(
            fellow=_identity("gone-1"),
            seq=2,
            status=FellowStatus.READY,
            hardware=_hardware(),
        )
    )
    return job.job_id


@pytest.fixture(scope="module")
def scrape() -> tuple[str, str]:
    """The metrics text of a populated app (after one request, for the latency histogram)."""
    app = create_app(Settings(), nats="nats://127.0.0.1:1")
    job_id = populate(app.state["registry"], app.state["jobs"])
    client = TestClient(app)  # not entered: the lifespan (NATS, job loop) does not run
    assert client.get("/health").status_code == 503  # NATS is down: still timed
    response = client.get("/api/v1/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return client.get("/api/v1/metrics").text, job_id


def exported_series(text: str) -> dict[str, set[str]]:
    """Every metric name that has samples (histograms also by base name) -> its label names."""
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
            if family.type == "histogram":
                series.setdefault(family.name, set()).update(sample.labels)
    return series


@pytest.fixture(scope="module")
def exported(scrape: tuple[str, str]) -> dict[str, set[str]]:
    return exported_series(scrape[0])


# --- the dashboard's side ------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def walk(node: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object in the dashboard, depth first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


def targets(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [obj for obj in walk(dashboard.get("panels", [])) if "expr" in obj]


def template_queries(dashboard: dict[str, Any]) -> list[str]:
    queries = []
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]
        queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def metric_name(identifier: str, exported: dict[str, set[str]]) -> str:
    """The metric an identifier names: a histogram's ``_bucket``/``_sum``/``_count`` is its own
    series, but stands for the histogram when the leader exports it by its base name."""
    for suffix in HISTOGRAM_SUFFIXES:
        base = identifier.removesuffix(suffix)
        if base != identifier and base in exported:
            return base
    return identifier


def unknown_metrics(expr: str, exported: dict[str, set[str]]) -> set[str]:
    return {metric_name(m, exported) for m in METRIC.findall(expr)} - set(exported)


def unknown_labels(expr: str, exported: dict[str, set[str]], legend: str = "") -> set[str]:
    """Labels matched, grouped by or shown in the legend that the expression's metrics lack."""
    unquoted = QUOTED.sub('""', expr)
    missing = set()
    for name, body in SELECTOR.findall(unquoted):
        missing |= set(MATCHER.findall(body)) - exported.get(name, set())
    available = set().union(*(exported.get(n, set()) for n in METRIC.findall(unquoted)))
    for group in GROUPING.findall(unquoted):
        missing |= {label.strip() for label in group.split(",") if label.strip()} - available
    missing |= set(LEGEND_LABEL.findall(legend)) - available
    return missing


# --- tests ---------------------------------------------------------------------------------


def test_dashboard_is_a_grafana_dashboard(dashboard):
    assert dashboard["schemaVersion"] >= 39 and dashboard["uid"] == "silentswarm"
    ids = [p["id"] for p in walk(dashboard["panels"]) if "gridPos" in p]
    assert len(ids) == len(set(ids)) > 10
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"job", "fellow"} <= set(variables)
    for panel in walk(dashboard["panels"]):
        if panel.get("type") not in (None, "row") and "targets" in panel:
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], panel["title"]


def test_every_dashboard_metric_is_exported(dashboard, exported):
    exprs = [t["expr"] for t in targets(dashboard)] + template_queries(dashboard)
    assert len(exprs) > 20
    unknown = {expr: unknown_metrics(expr, exported) for expr in exprs}
    assert {e: names for e, names in unknown.items() if names} == {}
    used = {metric_name(m, exported) for e in exprs for m in METRIC.findall(e)}
    assert len(used) > 20


def test_every_dashboard_label_is_exported(dashboard, exported):
    unknown = {
        t["expr"]: unknown_labels(t["expr"], exported, t.get("legendFormat", ""))
        for t in targets(dashboard)
    }
    assert {e: labels for e, labels in unknown.items() if labels} == {}
    for query in template_queries(dashboard):
        for name, label in LABEL_VALUES.findall(query):
            assert label in exported[name], query


def test_the_checks_catch_what_is_not_exported(exported):
    """The checker itself: a misspelt metric, a missing label, a wrong legend are all caught."""
    assert unknown_metrics("rate(swarm_fellow_sent_total[5m])", exported) == {
        "swarm_fellow_sent_total"
    }
    assert unknown_metrics("swarm_nope_bucket", exported) == {"swarm_nope_bucket"}
    assert unknown_metrics("sum(swarm_fellow_up)", exported) == set()
    assert unknown_labels('swarm_job_loss{job="x"}', exported) == {"job"}
    assert unknown_labels("sum by (gpu) (swarm_fellow_up)", exported) == {"gpu"}
    assert unknown_labels("swarm_fellow_up", exported, "{{uuid}}") == {"uuid"}


def test_the_populated_state_exports_each_kind_of_series(scrape, exported):
    text, job_id = scrape
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    fellow = (("fellow", "gpu-1"),)
    gpu = (("fellow", "gpu-1"), ("gpu", "0"))
    job = (("job_id", job_id),)
    assert samples[("swarm_fellows", (("status", "training"),))] == 1
    assert samples[("swarm_fellows", (("status", "offline"),))] == 0
    assert samples[("swarm_fellow_up", fellow)] == 1
    assert samples[("swarm_fellow_sent_bytes_total", fellow)] == 4096
    assert samples[("swarm_fellow_cpu_load_ratio", fellow)] == 0.25
    assert samples[("swarm_fellow_gpu_memory_used_bytes", gpu)] == 4 << 30
    assert samples[("swarm_fellow_gpu_utilization_ratio", gpu)] == 0.55
    # What a fellow claims of itself (host name, version, GPU uuid and model): one info
    # series each, so a fellow that changes them churns one series, not all of its own.
    info = [labels for name, labels in samples if name == "swarm_fellow_info"]
    assert [dict(labels)["host"] for labels in info if dict(labels)["fellow"] == "gpu-1"] == [
        "host-a"
    ]
    gpu_info = (*gpu, ("model", "Test GPU"), ("uuid", "GPU-0000"))
    assert samples[("swarm_fellow_gpu_info", tuple(sorted(gpu_info)))] == 1
    hosted = {name for name, labels in samples if "host" in dict(labels)}
    assert hosted == {"swarm_fellow_info"}
    assert samples[("swarm_job_state", (*job, ("state", "RUNNING")))] == 1
    assert samples[("swarm_job_state", (*job, ("state", "PENDING")))] == 0
    assert samples[("swarm_job_step", job)] == 5
    assert samples[("swarm_job_tokens_per_second", job)] == 5120
    assert samples[("swarm_leader_nats_connected", ())] == 0
    dropped = (("reason", "released"), ("source", "registry"))
    assert samples[("swarm_leader_dropped_messages_total", dropped)] == 1
    # The released fellow is gone; only the route template, never a raw path, is a label.
    assert not any(dict(labels).get("fellow") == "gone-1" for _, labels in samples)
    routes = {
        dict(labels)["route"]
        for name, labels in samples
        if name == "swarm_leader_http_request_duration_seconds_count"
    }
    assert routes == {"/health", "/api/v1/metrics"}
