"""A job's merged live metrics (``/api/v1/jobs/{id}/metrics``, its SSE stream and history)
and the swarm's capacity (``/api/v1/cluster``). The leader's :mod:`silentswarm.leader.aggregate`
computes them; ``swarm watch`` decodes them."""

from __future__ import annotations

import msgspec

from silentswarm.jobspec import Placement
from silentswarm.protocol import StageResult
from silentswarm.types.links import LinkStats, Tuning


class FellowMetrics(msgspec.Struct, kw_only=True):
    fellow_id: str
    stage: int
    step: int = 0
    loss: float | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    sent_bytes_per_s: float = 0.0
    received_bytes_per_s: float = 0.0
    result: StageResult | None = None
    at: float | None = None
    # Replicas: the pipeline the stage is of, its latest step's seconds of sync with its
    # other replicas, and its bytes over their ring in this attempt (0 without replicas).
    replica: int = 0
    sync_s: float | None = None
    sync_bytes_sent: int = 0
    sync_bytes_received: int = 0


class BoundaryMetrics(msgspec.Struct, kw_only=True):
    boundary: int  # between stage `boundary` and `boundary + 1` (of replica `replica`)
    upstream: str
    downstream: str
    bytes_per_s: float
    bytes_total: int
    transport: str | None = None  # "p2p" (ZeroMQ) or "relay" (NATS), as the stage reports
    link: LinkStats | None = None  # as its two ends last measured it, with the codecs in use
    replica: int = 0  # the pipeline it is a boundary of (a job with replicas)


class JobMetrics(msgspec.Struct, kw_only=True):
    job_id: str
    attempt: int
    step: int
    total_steps: int | None
    loss: float | None
    val_loss: float | None
    lr: float | None
    steps_per_min: float | None
    step_time_s: float | None
    tokens_per_s: float | None
    eta_s: float | None
    bytes_sent: int
    bytes_received: int
    boundaries: list[BoundaryMetrics]
    fellows: list[FellowMetrics]
    updated_at: float | None
    # The schedule the stages agreed on at their latest calibration (micro_batches "auto"
    # shows its choice here).
    tuning: Tuning | None = None


class HistoryPoint(msgspec.Struct, kw_only=True):
    """One finished step of the last stage, with the job's byte counters at that moment."""

    step: int
    at: float
    loss: float | None
    val_loss: float | None
    lr: float | None
    step_time_s: float | None
    tokens_per_s: float | None
    bytes_sent: int
    bytes_received: int


class RunningJob(msgspec.Struct, kw_only=True):
    """How one running job performs (``/api/v1/cluster``'s ``running_jobs``)."""

    job_id: str
    name: str
    step: int
    total_steps: int | None
    loss: float | None
    step_time_s: float | None
    steps_per_min: float | None
    tokens_per_s: float | None
    boundaries: list[BoundaryMetrics]
    placement: Placement | None


class ClusterView(msgspec.Struct, kw_only=True):
    """What the swarm has online, per host (fellows sharing a host count it once), and how
    its running jobs perform: ``GET /api/v1/cluster``."""

    fellows: dict[str, int]  # fellows by status
    hosts: int
    cpu_cores: int
    ram_total_bytes: int
    ram_available_bytes: int
    gpus: int
    vram_total_bytes: int
    vram_free_bytes: int
    net_sent_bytes_per_s: float
    net_recv_bytes_per_s: float
    running_jobs: list[RunningJob]
