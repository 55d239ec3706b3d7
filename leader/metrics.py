"""The leader's Prometheus metrics: one registry per app, read from live state at scrape time.

Nothing here keeps a copy of the swarm's state. :class:`SwarmCollector` walks the registry
and the job manager on every scrape, so the series of a released (forgotten) fellow or GPU
simply stop being exported, and nothing has to be cleaned up when the state changes. A
finished job's series stop once it is retired (SWARM_JOB_METRICS_RETENTION_S, or archived:
:mod:`silentswarm.leader.retention`), so sweeps do not grow the scrape for good. The only
stateful metrics are the HTTP ones, fed by :class:`RequestTimer`, and the process's own
(``process_*``, ``python_*``: prometheus-client's collectors, which the default registry
would have had).

A job with replicas (k copies of its pipeline) keeps the job's and the stages' series as
they are (a stage's series are told apart by their ``fellow``; the job's tokens/s is the sum
of the replicas' rates) and adds series with a ``replica`` label: per replica
(``swarm_job_replica_*``: its tokens/s, step, loss, sync seconds and bytes, clipped and
missed counts) and per stage (``swarm_job_stage_sync_*``). A job without replicas exports
none of them.

Each app gets its own :class:`~prometheus_client.CollectorRegistry` (never the process-wide
default): tests build several apps in one process, and the leader's scrape should show its
own numbers only.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from prometheus_client import (
    CollectorRegistry,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from silentswarm import __version__
from silentswarm.protocol import PROTOCOL_VERSION, FellowStatus, GpuInfo, JobState
from silentswarm.types.api import LeaderInfo
from silentswarm.types.fleet import FellowRecord
from silentswarm.types.jobs import JobRecord
from silentswarm.types.views import (
    StageProgress,
    by_replica,
    last_stage,
    pipeline_step,
)

if TYPE_CHECKING:
    from litestar.types import ASGIApp, Message, Receive, Scope, Send

    from silentswarm.leader.bus import LeaderBus
    from silentswarm.leader.jobs import JobManager
    from silentswarm.leader.linkprobes import LinkProber
    from silentswarm.leader.registry import FellowRegistry
    from silentswarm.leader.services.info import InfoService

# The text exposition format 0.0.4, which generate_latest() writes. prometheus-client >= 0.22
# calls its 1.0.0 variant CONTENT_TYPE_LATEST; Prometheus 2.x only knows 0.0.4 by name.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# What to give Litestar, which appends "; charset=utf-8" to every text/ media type itself.
MEDIA_TYPE = CONTENT_TYPE.removesuffix("; charset=utf-8")
REQUEST_DURATION = "swarm_leader_http_request_duration_seconds"
REQUEST_LABELS = ("method", "route", "status_code")
STREAM_DURATION = "swarm_leader_http_stream_duration_seconds"
STREAMS_OPEN = "swarm_leader_http_streams_open"
STREAM_LABELS = ("route",)
# How long SSE clients stay: from a second to a day (a dashboard left open).
STREAM_BUCKETS = (1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 86400.0)
STREAM_MEDIA_TYPE = b"text/event-stream"

T = TypeVar("T")
Value = float | int | None


@dataclass(frozen=True)
class Series(Generic[T]):
    """One metric family over a list of items: each item gives its labels and its value."""

    name: str
    doc: str
    value: Callable[[T], Value]
    counter: bool = False

    def family(
        self, items: Iterable[T], labelnames: Sequence[str], labels: Callable[[T], list[str]]
    ) -> Metric:
        """The family with one sample per item whose value is known (None: no sample)."""
        family_cls = CounterMetricFamily if self.counter else GaugeMetricFamily
        family = family_cls(self.name, self.doc, labels=labelnames)
        for item in items:
            value = self.value(item)
            if value is not None:
                family.add_metric(labels(item), float(value))
        return family


def _ratio(pct: float | None) -> float | None:
    return None if pct is None else pct / 100.0


def _online(fellow: FellowRecord) -> bool:
    return fellow.status is not FellowStatus.OFFLINE


# --- fellows -------------------------------------------------------------------------------

# A fellow's series are labelled by its id alone: its host name and version (a fellow's
# claims, which it may change at every heartbeat) are in one info series each, so a fellow
# that changes them churns one series, not every one it has.
FELLOW_LABELS = ("fellow",)

FELLOW_SERIES: tuple[Series[FellowRecord], ...] = (
    Series("swarm_fellow_up", "1 while the fellow is not offline, else 0", _online),
    Series("swarm_fellow_step", "Training step the fellow last reported", lambda f: f.step),
    Series("swarm_fellow_loss", "Training loss the fellow last reported", lambda f: f.loss),
    Series(
        "swarm_fellow_heartbeat_age_seconds",
        "Seconds since the fellow's last heartbeat reached the leader",
        lambda f: f.last_heartbeat_age_s,
    ),
    Series(
        "swarm_fellow_sent_bytes",
        "Bytes the fellow's current stage run sent to its pipeline neighbours",
        lambda f: f.bytes_sent,
        counter=True,
    ),
    Series(
        "swarm_fellow_received_bytes",
        "Bytes the fellow's current stage run received from its pipeline neighbours",
        lambda f: f.bytes_received,
        counter=True,
    ),
)

# From the fellow's hardware snapshot: only exported while it is online, since an offline
# fellow's last snapshot describes a machine the leader no longer hears from.
HARDWARE_SERIES: tuple[Series[FellowRecord], ...] = (
    Series(
        "swarm_fellow_cpu_cores",
        "CPU cores the fellow may use (its affinity capped by its cgroup's quota, rounded up)",
        lambda f: f.hardware.cpu_cores,
    ),
    Series(
        "swarm_fellow_cpu_quota_cores",
        "The fellow's cgroup CPU quota in cores (absent: no quota)",
        lambda f: f.hardware.cpu_quota,
    ),
    Series(
        "swarm_fellow_cpu_load_ratio",
        "CPU load of the fellow's host (0-1, all cores)",
        lambda f: _ratio(f.hardware.cpu_load_pct),
    ),
    Series(
        "swarm_fellow_ram_total_bytes",
        "RAM the fellow may use (its host's, capped by its cgroup's memory limit)",
        lambda f: f.hardware.ram_total_bytes,
    ),
    Series(
        "swarm_fellow_ram_available_bytes",
        "RAM the fellow offers (its host's available, capped by the room under its limit)",
        lambda f: f.hardware.ram_available_bytes,
    ),
    Series(
        "swarm_fellow_ram_limit_bytes",
        "The fellow's cgroup memory limit (absent: none below its host's RAM)",
        lambda f: f.hardware.ram_limit_bytes,
    ),
    Series(
        "swarm_fellow_network_transmit_bytes_per_second",
        "Bytes per second the fellow's host sent on all interfaces (since its last snapshot)",
        lambda f: f.hardware.net_sent_bytes_per_s,
    ),
    Series(
        "swarm_fellow_network_receive_bytes_per_second",
        "Bytes per second the fellow's host received on all interfaces (since its last snapshot)",
        lambda f: f.hardware.net_recv_bytes_per_s,
    ),
)

GPU_LABELS = ("fellow", "gpu")  # the GPU's uuid and model: swarm_fellow_gpu_info
Gpu = tuple[FellowRecord, GpuInfo]

GPU_SERIES: tuple[Series[Gpu], ...] = (
    Series(
        "swarm_fellow_gpu_memory_total_bytes",
        "VRAM of the GPU",
        lambda g: g[1].memory_total_bytes,
    ),
    Series(
        "swarm_fellow_gpu_memory_free_bytes",
        "Free VRAM of the GPU",
        lambda g: g[1].memory_free_bytes,
    ),
    Series(
        "swarm_fellow_gpu_memory_used_bytes",
        "Used VRAM of the GPU",
        lambda g: g[1].memory_used_bytes,
    ),
    Series(
        "swarm_fellow_gpu_utilization_ratio",
        "GPU utilisation as NVML reports it (0-1)",
        lambda g: _ratio(g[1].utilization_pct),
    ),
    Series(
        "swarm_fellow_gpu_temperature_celsius",
        "GPU temperature",
        lambda g: g[1].temperature_c,
    ),
)


def _fellow_labels(fellow: FellowRecord) -> list[str]:
    return [fellow.fellow_id]


def _gpu_labels(gpu: Gpu) -> list[str]:
    fellow, info = gpu
    return [fellow.fellow_id, str(info.index)]


def _gpus(fellow: FellowRecord) -> list[GpuInfo]:
    """A fellow's GPUs, one per index (the first reported): a snapshot that repeats an
    index would make two samples of one series."""
    by_index: dict[int, GpuInfo] = {}
    for gpu in fellow.hardware.gpus:
        by_index.setdefault(gpu.index, gpu)
    return [by_index[i] for i in sorted(by_index)]


def fellow_families(fellows: list[FellowRecord], counts: dict[str, int]) -> Iterator[Metric]:
    """Fellows by status, then one sample per fellow (and per GPU of an online fellow)."""
    by_status = GaugeMetricFamily(
        "swarm_fellows", "Fellows the leader knows, by status", labels=["status"]
    )
    for status in FellowStatus:
        by_status.add_metric([status.value], counts.get(status.value, 0))
    yield by_status
    yield _state_set(
        "swarm_fellow_status",
        "1 for the fellow's current status, 0 for the others",
        fellows,
        FELLOW_LABELS,
        _fellow_labels,
        "status",
        [s.value for s in FellowStatus],
        lambda f: f.status.value,
    )
    info = InfoMetricFamily(
        "swarm_fellow",
        "The fellow's agent version and host name",
        labels=[*FELLOW_LABELS, "version", "host"],
    )
    for fellow in fellows:
        info.add_metric([*_fellow_labels(fellow), fellow.version, fellow.hostname], {})
    yield info
    for series in FELLOW_SERIES:
        yield series.family(fellows, FELLOW_LABELS, _fellow_labels)
    online = [f for f in fellows if _online(f)]
    for series in HARDWARE_SERIES:
        yield series.family(online, FELLOW_LABELS, _fellow_labels)
    gpus = [(f, gpu) for f in online for gpu in _gpus(f)]
    gpu_info = InfoMetricFamily(
        "swarm_fellow_gpu", "The GPU's uuid and model name", labels=[*GPU_LABELS, "uuid", "model"]
    )
    for gpu in gpus:
        gpu_info.add_metric([*_gpu_labels(gpu), gpu[1].uuid, gpu[1].name], {})
    yield gpu_info
    for series in GPU_SERIES:
        yield series.family(gpus, GPU_LABELS, _gpu_labels)


# --- jobs ----------------------------------------------------------------------------------

# Not "job": Prometheus gives every scraped series the scrape job's name in that label.
JOB_LABELS = ("job_id",)
STAGE_LABELS = ("job_id", "stage", "fellow")
JobStage = tuple[JobRecord, StageProgress]


def _pick(values: Iterable[float | None], pick: Callable[[list[float]], float]) -> Value:
    """``pick`` (min or max) of the values the stages reported; None if none did."""
    known = [v for v in values if v is not None]
    return pick(known) if known else None


def _job_tokens_per_s(job: JobRecord) -> Value:
    """The job's tokens/s: each pipeline's is its slowest stage's, and with replicas the
    job's is the sum of its replicas' (None until a stage reported one)."""
    rates = [
        rate
        for stages in by_replica(job.progress).values()
        if (rate := _pick((p.tokens_per_s for p in stages), min)) is not None
    ]
    return sum(rates) if rates else None


@dataclass(frozen=True)
class Replica:
    """One replica (pipeline) of a running job with replicas: its stages, in stage order."""

    job: JobRecord
    replica: int
    stages: list[StageProgress]


def _sync_s(stages: Iterable[StageProgress]) -> Value:
    return _pick((p.sync_s for p in stages), max)


def _replica_loss(r: Replica) -> Value:
    last = last_stage(r.stages)
    return None if last is None else last.loss


def _if_replicated(job: JobRecord, value: int) -> int | None:
    """``value`` for a job with replicas; None (no sample) for one without."""
    replicated = job.placement is not None and job.placement.n_replicas > 1
    return value if replicated else None


JOB_SERIES: tuple[Series[JobRecord], ...] = (
    Series("swarm_job_attempt", "Start attempts of the job so far", lambda j: j.attempt),
    Series(
        "swarm_job_step",
        "Steps every stage of the job has completed",
        lambda j: j.current_view().step,
    ),
    Series("swarm_job_total_steps", "Steps the job trains for", lambda j: j.spec.steps),
    Series(
        "swarm_job_loss", "Training loss of the job's last stage", lambda j: j.current_view().loss
    ),
    Series(
        "swarm_job_val_loss",
        "Validation loss of the job's last stage",
        lambda j: j.current_view().val_loss,
    ),
    Series(
        "swarm_job_replicas_lost",
        "Replicas of the job lost in its current attempt (the others went on without them)",
        lambda j: _if_replicated(
            j, sum(m.kind == "lost" and m.attempt == j.attempt for m in j.membership)
        ),
        counter=True,
    ),
    Series(
        "swarm_job_replicas_joined",
        "Replacement replicas that joined the job's rings in its current attempt",
        lambda j: _if_replicated(
            j, sum(m.kind == "joined" and m.attempt == j.attempt for m in j.membership)
        ),
        counter=True,
    ),
)

# Throughput only while the job runs: a finished job's last rate is not a current one.
RUNNING_JOB_SERIES: tuple[Series[JobRecord], ...] = (
    Series(
        "swarm_job_step_time_seconds",
        "Seconds per training step of the job's slowest stage",
        lambda j: _pick((p.step_time_s for p in j.progress), max),
    ),
    Series(
        "swarm_job_tokens_per_second",
        "Training tokens per second of the job (its slowest stage; with replicas, the sum "
        "of the replicas' rates)",
        _job_tokens_per_s,
    ),
    Series(
        "swarm_job_learning_rate",
        "Learning rate of the job's last stage",
        lambda j: j.current_view().lr,
    ),
    Series(
        "swarm_job_replicas",
        "Replicas of the job that train now (a replica lost or still joining is not counted)",
        lambda j: _if_replicated(j, len({p.replica for p in j.progress if p.joining is None})),
    ),
)

STAGE_SERIES: tuple[Series[JobStage], ...] = (
    Series("swarm_job_stage_step", "Steps the stage has completed", lambda s: s[1].step),
    Series("swarm_job_stage_loss", "Training loss the stage reported", lambda s: s[1].loss),
    Series(
        "swarm_job_stage_step_time_seconds",
        "Seconds per training step of the stage",
        lambda s: s[1].step_time_s,
    ),
    Series(
        "swarm_job_stage_tokens_per_second",
        "Training tokens per second of the stage",
        lambda s: s[1].tokens_per_s,
    ),
    Series(
        "swarm_job_stage_sent_bytes",
        "Bytes the stage sent to its neighbours in this attempt",
        lambda s: s[1].bytes_sent,
        counter=True,
    ),
    Series(
        "swarm_job_stage_received_bytes",
        "Bytes the stage received from its neighbours in this attempt",
        lambda s: s[1].bytes_received,
        counter=True,
    ),
)


REPLICA_LABELS = ("job_id", "replica")
REPLICA_SERIES: tuple[Series[Replica], ...] = (
    Series(
        "swarm_job_replica_tokens_per_second",
        "Training tokens per second of one replica of the job (its slowest stage)",
        lambda r: _pick((p.tokens_per_s for p in r.stages), min),
    ),
    Series(
        "swarm_job_replica_step",
        "Steps every stage of the replica has completed",
        lambda r: pipeline_step(r.stages),
    ),
    Series("swarm_job_replica_loss", "Training loss of the replica's last stage", _replica_loss),
    Series(
        "swarm_job_replica_sync_seconds",
        "Seconds the replica's latest step spent syncing with the other replicas (its "
        "slowest stage)",
        lambda r: _sync_s(r.stages),
    ),
    Series(
        "swarm_job_replica_sync_sent_bytes",
        "Bytes the replica's stages sent to the other replicas in this attempt",
        lambda r: sum(p.sync_bytes_sent for p in r.stages),
        counter=True,
    ),
    Series(
        "swarm_job_replica_sync_received_bytes",
        "Bytes the replica's stages received from the other replicas in this attempt",
        lambda r: sum(p.sync_bytes_received for p in r.stages),
        counter=True,
    ),
    Series(
        "swarm_job_replica_sync_clipped",
        "Contributions the replica's stages clipped in their sync rounds (norm far above "
        "the others')",
        lambda r: sum(p.sync_clipped for p in r.stages),
        counter=True,
    ),
    Series(
        "swarm_job_replica_sync_missed",
        "Replicas the replica's stages left out of their sync rounds (past the sync timeout)",
        lambda r: sum(p.sync_missed for p in r.stages),
        counter=True,
    ),
)

SYNC_STAGE_LABELS = ("job_id", "stage", "replica", "fellow")
SYNC_STAGE_SERIES: tuple[Series[JobStage], ...] = (
    Series(
        "swarm_job_stage_sync_seconds",
        "Seconds the stage's latest step spent syncing with its other replicas",
        lambda s: s[1].sync_s,
    ),
    Series(
        "swarm_job_stage_sync_sent_bytes",
        "Bytes the stage sent to its other replicas in this attempt",
        lambda s: s[1].sync_bytes_sent,
        counter=True,
    ),
    Series(
        "swarm_job_stage_sync_received_bytes",
        "Bytes the stage received from its other replicas in this attempt",
        lambda s: s[1].sync_bytes_received,
        counter=True,
    ),
    Series(
        "swarm_job_stage_sync_clipped",
        "Contributions the stage clipped in its sync rounds",
        lambda s: s[1].sync_clipped,
        counter=True,
    ),
    Series(
        "swarm_job_stage_sync_missed",
        "Replicas the stage left out of its sync rounds",
        lambda s: s[1].sync_missed,
        counter=True,
    ),
)


def _job_labels(job: JobRecord) -> list[str]:
    return [job.job_id]


def _stage_labels(stage: JobStage) -> list[str]:
    return [stage[0].job_id, str(stage[1].stage), stage[1].fellow_id]


def _replica_labels(r: Replica) -> list[str]:
    return [r.job.job_id, str(r.replica)]


def _sync_stage_labels(stage: JobStage) -> list[str]:
    return [stage[0].job_id, str(stage[1].stage), str(stage[1].replica), stage[1].fellow_id]


def replicas_of(jobs: Iterable[JobRecord]) -> list[Replica]:
    """The replicas of the jobs placed with more than one (none of a job without replicas;
    a job that lost all but one keeps that one's series, as it keeps its replica slots)."""
    out = []
    for job in jobs:
        groups = by_replica(job.progress)
        if job.placement is not None and job.placement.n_replicas > 1:
            out.extend(Replica(job, r, stages) for r, stages in groups.items())
    return out


def job_families(
    jobs: list[JobRecord], retired: AbstractSet[str] = frozenset()
) -> Iterator[Metric]:
    """Jobs by state (archived ones not counted), then one sample per job that is not
    ``retired`` (and per stage of a running job)."""
    by_state = GaugeMetricFamily(
        "swarm_jobs",
        "Jobs the leader lists (archived ones not counted), by state",
        labels=["state"],
    )
    for state in JobState:
        by_state.add_metric([state.value], sum(j.state is state and not j.archived for j in jobs))
    yield by_state
    jobs = [j for j in jobs if j.job_id not in retired]
    yield _state_set(
        "swarm_job_state",
        "1 for the job's current state, 0 for the others",
        jobs,
        JOB_LABELS,
        _job_labels,
        "state",
        [s.value for s in JobState],
        lambda j: j.state.value,
    )
    info = InfoMetricFamily("swarm_job", "The job's name", labels=[*JOB_LABELS, "name"])
    for job in jobs:
        info.add_metric([job.job_id, job.name], {})
    yield info
    for series in JOB_SERIES:
        yield series.family(jobs, JOB_LABELS, _job_labels)
    running = [j for j in jobs if j.state is JobState.RUNNING]
    for series in RUNNING_JOB_SERIES:
        yield series.family(running, JOB_LABELS, _job_labels)
    stages = [(j, p) for j in running for p in j.progress]
    for series in STAGE_SERIES:
        yield series.family(stages, STAGE_LABELS, _stage_labels)
    replicas = replicas_of(running)
    for series in REPLICA_SERIES:
        yield series.family(replicas, REPLICA_LABELS, _replica_labels)
    replicated = {r.job.job_id for r in replicas}
    synced = [(j, p) for j, p in stages if j.job_id in replicated]
    for series in SYNC_STAGE_SERIES:
        yield series.family(synced, SYNC_STAGE_LABELS, _sync_stage_labels)


# --- the leader itself ---------------------------------------------------------------------


def leader_families(
    state: LeaderInfo, dropped_by_source: Mapping[str, Mapping[str, int]]
) -> Iterator[Metric]:
    """The leader's own state (what ``/api/v1/info`` says: NATS, the store, its start) and
    its build. ``dropped_by_source``: dropped messages by source (bus, registry) and reason."""
    yield GaugeMetricFamily(
        "swarm_leader_nats_connected",
        "1 while the leader is connected to NATS, else 0",
        value=float(state.nats_connected),
    )
    yield GaugeMetricFamily(
        "swarm_leader_state_loaded",
        "1 once the leader has loaded its jobs and fellows from JetStream, else 0",
        value=float(state.state_loaded),
    )
    yield GaugeMetricFamily(
        "swarm_leader_start_time_seconds",
        "When the leader started, in seconds since the Unix epoch",
        value=state.started_at,
    )
    storage = state.storage
    yield GaugeMetricFamily(
        "swarm_leader_storage_degraded",
        "1 while the JetStream store is short of room (/health gives the reasons), else 0",
        value=float(bool(storage.reasons)),
    )
    store = GaugeMetricFamily(
        "swarm_leader_jetstream_store_bytes",
        "The JetStream store as the leader last saw it: used by its account, and the "
        "capacity the server grants it",
        labels=["kind"],
    )
    for kind, value in (("used", storage.used_bytes), ("capacity", storage.capacity_bytes)):
        if value is not None:
            store.add_metric([kind], float(value))
    yield store
    build = InfoMetricFamily("swarm_leader_build", "The leader's version and protocol")
    build.add_metric(
        [],
        {
            "version": __version__,
            "protocol_version": str(PROTOCOL_VERSION),
            "python_version": platform.python_version(),
        },
    )
    yield build
    dropped = CounterMetricFamily(
        "swarm_leader_dropped_messages",
        "NATS messages the leader dropped: malformed (bus) or from a stale agent (registry)",
        labels=["source", "reason"],
    )
    for source, counter in dropped_by_source.items():
        for reason, count in sorted(counter.items()):
            dropped.add_metric([source, reason], count)
    yield dropped


def link_probe_family(results: Mapping[str, int]) -> Metric:
    """Link probes between idle fellows (silentswarm.leader.linkprobes), by result."""
    family = CounterMetricFamily(
        "swarm_link_probes",
        "Link probes between idle fellows, by result: measured (recorded), refused, failed, "
        "expired",
        labels=["result"],
    )
    for result in ("measured", "refused", "failed", "expired"):
        family.add_metric([result], float(results.get(result, 0)))
    return family


def loop_failure_family(failures: Mapping[str, int]) -> Metric:
    """The job loop's parts that raised (silentswarm.leader.orchestrator: each part runs on
    whatever the others do), by part."""
    family = CounterMetricFamily(
        "swarm_leader_loop_failures",
        "Passes of a part of the leader's job loop that failed (the leader's log has the "
        "error, at most once a minute per part), by part",
        labels=["part"],
    )
    for part, count in sorted(failures.items()):
        family.add_metric([part], float(count))
    return family


def _state_set(
    name: str,
    doc: str,
    items: Iterable[T],
    labelnames: Sequence[str],
    labels: Callable[[T], list[str]],
    state_label: str,
    states: list[str],
    current: Callable[[T], str],
) -> Metric:
    """A gauge per item and state, 1 for the item's current state (a Prometheus state set).

    Every state is exported (0 or 1) so that ``== 1`` selects and ``sum by`` counts work
    without absent series.
    """
    family = GaugeMetricFamily(name, doc, labels=[*labelnames, state_label])
    for item in items:
        now = current(item)
        for state in states:
            family.add_metric([*labels(item), state], float(state == now))
    return family


class SwarmCollector:
    """Reads the leader's live parts at scrape time (a ``prometheus_client`` Collector)."""

    def __init__(
        self,
        *,
        info: InfoService,
        bus: LeaderBus,
        registry: FellowRegistry,
        jobs: JobManager,
        prober: LinkProber | None = None,
        loop_failures: Mapping[str, int] | None = None,
    ) -> None:
        self.info = info
        self.bus = bus
        self.registry = registry
        self.jobs = jobs
        self.prober = prober
        self.loop_failures = loop_failures

    def collect(self) -> Iterator[Metric]:
        dropped = {"bus": self.bus.dropped, "registry": self.registry.dropped}
        yield from leader_families(self.info.info(), dropped)
        if self.prober is not None:
            yield link_probe_family(self.prober.results)
        if self.loop_failures is not None:
            yield loop_failure_family(self.loop_failures)
        yield from fellow_families(self.registry.list(), self.registry.counts())
        yield from job_families(self.jobs.list(), self.jobs.retired())


# --- request latency -----------------------------------------------------------------------


class RequestTimer(ASGIMiddleware):
    """Observes each HTTP request's latency, from its arrival to the start of its response;
    a streaming (SSE) response is timed apart, from its arrival until the stream ends.

    Litestar runs app-level middleware after routing, inside each route's stack, so the
    scope holds ``path_template`` (e.g. ``/api/v1/jobs/{job_id:str}``): the route label
    stays bounded by the app's routes, whatever the clients ask for. Requests that match
    no route (404, 405) never reach route middleware and are not observed.

    Streams (``text/event-stream``) stay out of the latency histogram: a watcher holds one
    open for minutes or hours, which would pile up in its top bucket and hide the latency
    of every other request, and their time to the first byte says little. They have their
    own histogram (``streams``, buckets up to a day) observed when the stream ends, however
    it ends (the job's end, the client going away, the leader stopping), and a gauge of the
    streams open now (``open_streams``). Messages are passed through untouched.
    """

    scopes = (ScopeType.HTTP,)

    def __init__(
        self,
        histogram: Histogram,
        clock: Callable[[], float] = time.perf_counter,
        *,
        streams: Histogram | None = None,
        open_streams: Gauge | None = None,
    ):
        self.histogram = histogram
        self.clock = clock
        self.streams = streams
        self.open_streams = open_streams

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        started = self.clock()
        observed = streaming = False
        route = scope.get("path_template") or "unmatched"

        async def timed_send(message: Message) -> None:
            nonlocal observed, streaming
            if message["type"] == "http.response.start" and not observed:
                observed = True
                if _is_stream(message):
                    streaming = True
                    if self.open_streams is not None:
                        self.open_streams.labels(route).inc()
                else:
                    self._observe(scope, message["status"], started)
            await send(message)

        try:
            await next_app(scope, receive, timed_send)
        except Exception:
            # Litestar turns handler errors into responses inside this middleware; what
            # still escapes becomes a 500 further out.
            if not observed:
                self._observe(scope, 500, started)
            raise
        finally:
            if streaming:
                if self.open_streams is not None:
                    self.open_streams.labels(route).dec()
                if self.streams is not None:
                    self.streams.labels(route).observe(self.clock() - started)

    def _observe(self, scope: Scope, status: int, started: float) -> None:
        route = scope.get("path_template") or "unmatched"
        labels = (scope.get("method", ""), route, str(status))
        self.histogram.labels(*labels).observe(self.clock() - started)


def _is_stream(start: Message) -> bool:
    """Whether a response start announces a server-sent event stream."""
    for name, value in start.get("headers", ()):
        if name.lower() == b"content-type":
            return value.split(b";")[0].strip().lower() == STREAM_MEDIA_TYPE
    return False


# --- one app's metrics ---------------------------------------------------------------------


class LeaderMetrics:
    """One app's metrics: its own registry, the state collector and the latency histogram."""

    def __init__(self, collector: SwarmCollector) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(collector)
        self.request_duration = Histogram(
            REQUEST_DURATION,
            "Time from an HTTP request's arrival to the start of the leader's response "
            "(streams are timed apart)",
            labelnames=REQUEST_LABELS,
            registry=self.registry,
        )
        self.stream_duration = Histogram(
            STREAM_DURATION,
            "Time from an SSE request's arrival until its stream ended",
            labelnames=STREAM_LABELS,
            buckets=STREAM_BUCKETS,
            registry=self.registry,
        )
        self.streams_open = Gauge(
            STREAMS_OPEN, "SSE streams open now", labelnames=STREAM_LABELS, registry=self.registry
        )
        # What the process-wide default registry would have had: CPU, memory, open files,
        # start time (process_*, Linux), the Python build and its garbage collector (python_*).
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    def middleware(self) -> RequestTimer:
        return RequestTimer(
            self.request_duration, streams=self.stream_duration, open_streams=self.streams_open
        )

    def render(self) -> bytes:
        """The text exposition (format 0.0.4) of everything in this app's registry."""
        return generate_latest(self.registry)
