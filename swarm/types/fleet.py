"""The fleet as the leader serves it: fellows (``/api/v1/workers``), hosts
(``/api/v1/nodes``), a fellow's logs, release and pending purges, and the bodies of the
requests that act on fellows. The leader's registry, purge book and log buffer own the
logic (:mod:`silentswarm.leader.registry`, :mod:`silentswarm.leader.purges`,
:mod:`silentswarm.leader.logs`)."""

from __future__ import annotations

from typing import Literal

import msgspec

from silentswarm.pools import DEFAULT_POOL
from silentswarm.protocol import FellowLimits, FellowStatus, GpuInfo, HardwareSnapshot, StageOutcome
from silentswarm.types.links import MeasuredLink


class Transition(msgspec.Struct, kw_only=True, gc=False):
    at: float
    from_status: FellowStatus | None
    to_status: FellowStatus
    reason: str


class FellowRecord(msgspec.Struct, kw_only=True, gc=False):
    fellow_id: str
    instance_id: str
    hostname: str
    version: str
    pid: int
    data_address: str | None
    status: FellowStatus
    job_id: str | None = None
    attempt: int | None = None
    step: int | None = None
    loss: float | None = None
    # How the fellow's last stage run ended, as its heartbeats repeat it.
    outcome: StageOutcome | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    hardware: HardwareSnapshot
    registered_at: float
    # Accepted register requests from this id: > 1 after reconnects and restarts.
    registrations: int = 1
    last_registered_at: float | None = None
    last_heartbeat_at: float | None = None
    heartbeats: int = 0  # accepted heartbeats, since the record was created
    last_heartbeat_age_s: float | None = None
    offline_reason: str | None = None
    history: list[Transition] = msgspec.field(default_factory=list)
    # The pool the fellow says it is in and its labels (silentswarm.pools); records from
    # before pools existed are in the default pool.
    pool: str = DEFAULT_POOL
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    # Standard blocks per second its stages' step times showed, smoothed
    # (silentswarm.leader.balance.measured_speed); placement prefers it to the start-up probe's.
    measured_speed: float | None = None
    # Its stages' latest measured links downstream, per downstream fellow id (at most
    # silentswarm.leader.registry.LINKS_KEPT, the most recent): balanced jobs are ordered
    # along them (silentswarm.leader.balance.chain_order).
    links: dict[str, MeasuredLink] = msgspec.field(default_factory=dict)
    # Where its stages bind for their replicas' ring (SWARM_SYNC_ADDRESS); None: not given
    # (or a record from before replicas).
    sync_address: str | None = None


class NodeView(msgspec.Struct, kw_only=True):
    """One host, merged over all its fellows (:mod:`silentswarm.leader.hostview` says how)."""

    hostname: str
    # Its kernel's boot id (HardwareSnapshot.machine_id): tells apart machines that share a
    # host name; None where its fellows report none.
    machine_id: str | None = None
    online: bool
    fellows: list[str]
    cpu_cores: int
    cpu_load_pct: float
    ram_total_bytes: int
    ram_available_bytes: int
    gpus: list[GpuInfo]
    nvml_error: str | None
    # GPUs NVML reports that TensorFlow cannot use (and the fix); None when all are usable.
    # Prefixed with the fellow ids when the host's fellows say different things.
    gpu_warning: str | None = None
    tf_gpu_count: int | None = None
    # The operator's caps, per fellow id.
    limits: dict[str, FellowLimits] = msgspec.field(default_factory=dict)
    # The UUIDs of the GPUs each fellow sees, per fellow id.
    fellow_gpus: dict[str, list[str]] = msgspec.field(default_factory=dict)
    net_sent_bytes_per_s: float = 0.0
    net_recv_bytes_per_s: float = 0.0


class LogEntry(msgspec.Struct, kw_only=True):
    """One log record of a fellow (``/api/v1/workers/{id}/logs`` and its stream)."""

    seq: int  # the stream sequence of the batch it came in
    fellow_id: str
    ts: float
    level: str
    logger: str
    message: str


class PendingPurge(msgspec.Struct, kw_only=True):
    fellow_id: str
    requested_at: float
    attempts: int = 0
    last_attempt_at: float | None = None
    last_error: str = ""


class ReleasedFellow(msgspec.Struct, kw_only=True):
    """The agent instance an operator released: kept (and stored) until another instance
    takes the fellow id, so the released one is not taken back, even by a restarted leader."""

    fellow_id: str
    instance_id: str
    released_at: float


class ReleaseRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    purge_install: bool = False


class UpdateRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    fellow_id: str | None = None  # None: every online fellow


class RetryPurgeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    fellow_id: str | None = None  # None: every pending purge


class ReleaseResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a release did. ``agent_stopped`` only when the fellow was online and got a STOP
    (no purge asked): whether it acknowledged it. ``nats_user_revoked`` only when the
    fellow's NATS users were revoked now (not while a purge is pending): whether nats-server
    confirmed it (false: it is retried in the background)."""

    fellow_id: str
    released: bool
    purge: Literal["pending", "delivered"] | None
    agent_stopped: bool | None = None
    nats_user_revoked: bool | None = None


class PurgeDelivery(msgspec.Struct, kw_only=True):
    """One pending purge tried now (``POST /api/v1/purges/retry``)."""

    fellow_id: str
    delivered: bool
    error: str  # the last delivery's error ("" once delivered)
