"""Every message that crosses NATS, as msgspec Structs (msgpack on the wire).

Rules:
- every top-level message carries ``v`` (the protocol version);
- peers' messages are decoded leniently: unknown fields are ignored, so a newer peer can add
  fields without breaking an older one;
- a subject that carries several kinds uses a tagged union (``kind`` field).

Which subject carries which Struct is said once, in :mod:`swarm.subjects`.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

PROTOCOL_VERSION = 1


class Message(msgspec.Struct, kw_only=True, gc=False):
    """Base of every top-level NATS payload."""

    v: int = PROTOCOL_VERSION


# --- hardware -------------------------------------------------------------------------------


class GpuInfo(msgspec.Struct, kw_only=True, gc=False):
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    memory_free_bytes: int
    memory_used_bytes: int
    utilization_pct: float | None = None
    temperature_c: float | None = None


class FellowLimits(msgspec.Struct, kw_only=True, gc=False):
    """What an operator lets a fellow offer (``SWARM_FELLOW_MAX_*``); None: no cap."""

    max_vram_bytes: int | None = None
    max_memory_bytes: int | None = None
    max_network_bytes_per_s: int | None = None


class HardwareSnapshot(msgspec.Struct, kw_only=True, gc=False):
    hostname: str
    platform: str = ""
    cpu_cores: int
    cpu_load_pct: float = 0.0
    ram_total_bytes: int
    ram_available_bytes: int
    net_sent_bytes_per_s: float = 0.0
    net_recv_bytes_per_s: float = 0.0
    gpus: list[GpuInfo] = msgspec.field(default_factory=list)
    # Why NVML gave no GPUs (no driver, no library); None when NVML answered.
    nvml_error: str | None = None
    # How many GPUs TensorFlow itself can use, from a probe at agent start; None: not
    # probed (NVML saw no GPU, so there was nothing to check) or the probe is still running.
    tf_gpu_count: int | None = None
    tf_probe_error: str | None = None
    limits: FellowLimits = msgspec.field(default_factory=FellowLimits)
    taken_at: float = msgspec.field(default_factory=time.time)


# --- fellows --------------------------------------------------------------------------------


class FellowStatus(enum.StrEnum):
    REGISTERING = "registering"
    READY = "ready"
    TRAINING = "training"
    CHECKPOINTING = "checkpointing"
    FAILED = "failed"
    OFFLINE = "offline"


class JobState(enum.StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


class FellowIdentity(msgspec.Struct, kw_only=True, gc=False):
    """Who a fellow is. ``instance_id`` changes with every agent process."""

    fellow_id: str
    instance_id: str
    hostname: str
    version: str
    pid: int
    data_address: str | None = None


class RegisterRequest(Message, tag="register", tag_field="kind"):
    fellow: FellowIdentity
    hardware: HardwareSnapshot
    status: FellowStatus = FellowStatus.REGISTERING


class StageResult(enum.StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"  # a STOP signal ended it (cancel, or a peer failed)


class StageOutcome(msgspec.Struct, kw_only=True, gc=False):
    """How the fellow's last stage run ended.

    Repeated in every heartbeat until the next START, so a leader that was away (restarted,
    or cut off from NATS) when the job ended still learns how it ended.
    """

    job_id: str
    attempt: int
    result: StageResult
    step: int | None = None
    loss: float | None = None
    val_loss: float | None = None
    message: str = ""
    ended_at: float = msgspec.field(default_factory=time.time)


class DeregisterRequest(Message, tag="deregister", tag_field="kind"):
    fellow_id: str
    instance_id: str
    reason: str = "agent stopped"
    # How its last stage run ended: the deregister may overtake the last heartbeat.
    outcome: StageOutcome | None = None


RegisterMessage = RegisterRequest | DeregisterRequest


class RegisterReply(Message, kw_only=True):
    accepted: bool
    code: str | None = None
    message: str = ""
    heartbeat_interval_s: float = 1.0
    offline_after_s: float = 3.0
    leader_version: str = ""


class Heartbeat(Message, kw_only=True):
    fellow: FellowIdentity
    seq: int
    status: FellowStatus
    job_id: str | None = None
    attempt: int | None = None
    step: int | None = None
    loss: float | None = None
    outcome: StageOutcome | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    hardware: HardwareSnapshot
    sent_at: float = msgspec.field(default_factory=time.time)


# --- signals --------------------------------------------------------------------------------


class SignalKind(enum.StrEnum):
    START = "START"
    CHECKPOINT = "CHECKPOINT"
    STOP = "STOP"
    UPDATE = "UPDATE"
    PURGE = "PURGE"


class Signal(Message, kw_only=True):
    signal_id: str
    kind: SignalKind
    job_id: str | None = None
    attempt: int | None = None
    args: dict[str, Any] = msgspec.field(default_factory=dict)


class SignalAck(Message, kw_only=True):
    signal_id: str
    fellow_id: str
    ok: bool
    code: str | None = None
    message: str = ""
    duplicate: bool = False


# --- logs, progress, shards -----------------------------------------------------------------


class LogRecord(msgspec.Struct, kw_only=True, gc=False):
    ts: float
    level: str
    logger: str
    message: str


class LogBatch(Message, kw_only=True):
    fellow_id: str
    records: list[LogRecord]


class ProgressEvent(enum.StrEnum):
    STEP = "step"  # a training step completed (``step`` counts completed steps)
    CHECKPOINT = "checkpoint"  # a checkpoint was written (or, with ok=False, could not be)
    ENDED = "ended"  # the stage run ended; ``outcome`` says how


class Progress(Message, kw_only=True):
    job_id: str
    fellow_id: str
    attempt: int
    event: ProgressEvent = ProgressEvent.STEP
    stage: int | None = None
    step: int
    total_steps: int | None = None
    loss: float | None = None
    val_loss: float | None = None
    lr: float | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    bytes_sent: int = 0  # over both boundaries of the stage, since it started
    bytes_received: int = 0
    down_bytes_sent: int = 0  # over the boundary to the next stage only
    down_bytes_received: int = 0
    down_transport: str | None = None  # how that boundary runs: "p2p" or "relay"
    ok: bool = True
    message: str = ""
    checkpoint_path: str | None = None
    checkpoint_id: str | None = None
    outcome: StageOutcome | None = None
    at: float = msgspec.field(default_factory=time.time)


class ShardChunk(Message, kw_only=True):
    """One piece of one file of a stage's shard (its checkpoint after ``step`` steps), sent by
    request/reply in order; the leader verifies ``sha256`` once it has all ``total`` pieces."""

    job_id: str
    fellow_id: str
    attempt: int
    stage: int
    step: int
    name: str  # stage-<i>.npz or stage-<i>.json (the JSON last: it completes the shard)
    size: int
    sha256: str
    seq: int
    total: int
    data: bytes


class ShardAck(Message, kw_only=True):
    """``next_seq``: the piece the leader wants next (0 after a lost transfer: start over);
    ``done`` once the file is verified and stored."""

    ok: bool
    next_seq: int
    done: bool = False
    message: str = ""
