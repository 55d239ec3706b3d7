"""Every message that crosses NATS, as msgspec Structs (msgpack on the wire).

Rules:
- every top-level message carries ``v`` (the protocol version);
- peers' messages are decoded leniently: unknown fields are ignored, so a newer peer can add
  fields without breaking an older one;
- a subject that carries several kinds uses a tagged union (``kind`` field).

Which subject carries which Struct is said once, in :mod:`silentswarm.subjects`.
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec

from silentswarm.endpoints import DATA_ENDPOINT, SYNC_ENDPOINT
from silentswarm.plan import StateDigests
from silentswarm.pools import DEFAULT_POOL, Labels, PoolName
from silentswarm.types.links import LinkStats, Tuning
from silentswarm.types.signals import (
    CheckpointArgs,
    ProbeArgs,
    PurgeArgs,
    RingArgs,
    SignalArgs,
    StartArgs,
    StopArgs,
    UpdateArgs,
)
from silentswarm.unknown_fields import NewerValues

PROTOCOL_VERSION = 1

# Bounds on what a fellow may claim (a stranger's numbers reach placement and the metrics
# page): a value outside them fails decoding, and the message is refused with the reason.
Id = Annotated[str, msgspec.Meta(max_length=64)]
Name = Annotated[str, msgspec.Meta(max_length=256)]
# What a fellow advertises for its stages' peers (silentswarm.endpoints): tcp://host:port.
DataEndpoint = Annotated[str, msgspec.Meta(max_length=256, pattern=DATA_ENDPOINT)]
SyncEndpoint = Annotated[str, msgspec.Meta(max_length=256, pattern=SYNC_ENDPOINT)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
MachineId = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f-]{8,64}$")]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
Bytes = Annotated[int, msgspec.Meta(ge=0, le=2**60)]  # an exabyte: more than any machine
Rate = Annotated[float, msgspec.Meta(ge=0.0, le=1e15)]
# A fellow's wall-clock time (seconds since the epoch, before the year 2286): rates are its
# differences, so one of 0 next to a denormal would be an infinite rate.
Timestamp = Annotated[float, msgspec.Meta(ge=0.0, le=1e10)]
# Standard transformer blocks (gpt2, d_model 256, seq 128, batch 8, fp32) trained per second,
# forward and backward (silentswarm.agent.runtime.speedprobe). Steers placement only: a fellow
# that overstates it slows its own jobs, it gains nothing else. The floor keeps a stage's
# time (layers over speed, times a quota's share) finite: a claimed denormal would divide by
# zero in placement (a block in 1000 s is slower than any machine that can train).
MIN_COMPUTE_SPEED, MAX_COMPUTE_SPEED = 1e-3, 1e6
ComputeSpeed = Annotated[float, msgspec.Meta(ge=MIN_COMPUTE_SPEED, le=MAX_COMPUTE_SPEED)]
# The standard block of ComputeSpeed (gpt2 family, mlp_ratio 4), and its batch.
SPEED_UNIT_D_MODEL, SPEED_UNIT_SEQ_LEN, SPEED_UNIT_HEADS, SPEED_UNIT_BATCH = 256, 128, 4, 8
MAX_GPUS = 64
# How long a fellow's account of a missing final export may be (StageOutcome.export_error).
EXPORT_ERROR_CHARS = 1024
# How long a fellow's account of a refused signal may be (SignalAck.message).
ACK_MESSAGE_CHARS = 4096


class Message(msgspec.Struct, kw_only=True, gc=False):
    """Base of every top-level NATS payload."""

    v: int = PROTOCOL_VERSION


# --- hardware -------------------------------------------------------------------------------


# NVML's id of a GPU (GPU-8c1f...) or of a MIG instance (MIG-...): no spaces, no controls.
GpuUuid = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9/_.:-]{0,127}$")]


class GpuInfo(msgspec.Struct, kw_only=True, gc=False):
    index: Annotated[int, msgspec.Meta(ge=0, lt=MAX_GPUS)]
    uuid: GpuUuid
    name: Name
    memory_total_bytes: Bytes
    memory_free_bytes: Bytes
    memory_used_bytes: Bytes
    utilization_pct: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] | None = None
    temperature_c: Annotated[float, msgspec.Meta(ge=-100.0, le=200.0)] | None = None


class FellowLimits(msgspec.Struct, kw_only=True, gc=False):
    """What an operator lets a fellow offer (``SWARM_FELLOW_MAX_*``); None: no cap."""

    max_vram_bytes: Bytes | None = None
    max_memory_bytes: Bytes | None = None
    max_network_bytes_per_s: Bytes | None = None


class HardwareSnapshot(msgspec.Struct, kw_only=True, gc=False):
    hostname: Name
    platform: Name = ""
    # The cores this fellow may use (silentswarm.cpus: its affinity mask capped by its
    # cgroup's CPU quota, rounded up), not the host's count; its stages run that many threads.
    cpu_cores: Annotated[int, msgspec.Meta(ge=0, le=65536)]
    # The cgroup's CPU quota in cores (a container's limit); None: no quota.
    cpu_quota: Annotated[float, msgspec.Meta(ge=0.01, le=65536.0)] | None = None
    # The host's logical cores (what fellows on one host share); None from an older agent.
    host_cpu_cores: Annotated[int, msgspec.Meta(ge=1, le=65536)] | None = None
    # The running kernel's boot id (Linux: /proc/sys/kernel/random/boot_id): fellows that
    # report one id share one machine's cores (containers on it too; machines cloned from
    # one image do not). None where the kernel has none, or from an older agent.
    machine_id: MachineId | None = None
    cpu_load_pct: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 0.0
    # The memory this fellow may use (silentswarm.ram): the host's, capped by its cgroup's
    # memory limit and the room under it; placement offers ram_available_bytes.
    ram_total_bytes: Bytes
    ram_available_bytes: Bytes
    # That limit where one holds the fellow below the host's memory (a container's); None: none.
    ram_limit_bytes: Bytes | None = None
    # The host's memory (what fellows on one host share); None from an older agent.
    host_ram_total_bytes: Bytes | None = None
    host_ram_available_bytes: Bytes | None = None
    net_sent_bytes_per_s: Rate = 0.0
    net_recv_bytes_per_s: Rate = 0.0
    gpus: Annotated[list[GpuInfo], msgspec.Meta(max_length=MAX_GPUS)] = msgspec.field(
        default_factory=list
    )
    # Why NVML gave no GPUs (no driver, no library); None when NVML answered.
    nvml_error: Text | None = None
    # How many GPUs TensorFlow itself can use, from a probe at agent start; None: not
    # probed (NVML saw no GPU, so there was nothing to check) or the probe is still running.
    tf_gpu_count: Annotated[int, msgspec.Meta(ge=0, le=MAX_GPUS)] | None = None
    tf_probe_error: Text | None = None
    # Measured at agent start (or set by the operator, SWARM_FELLOW_COMPUTE_SPEED); None until
    # the probe answers, or when it failed.
    compute_speed: ComputeSpeed | None = None
    limits: FellowLimits = msgspec.field(default_factory=FellowLimits)
    taken_at: Timestamp = msgspec.field(default_factory=time.time)


# --- fellows --------------------------------------------------------------------------------


class FellowStatus(NewerValues):
    REGISTERING = "registering"
    READY = "ready"
    TRAINING = "training"
    CHECKPOINTING = "checkpointing"
    FAILED = "failed"
    OFFLINE = "offline"


class JobState(NewerValues):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


class FellowIdentity(msgspec.Struct, kw_only=True, gc=False):
    """Who a fellow is. ``instance_id`` changes with every agent process."""

    fellow_id: Id
    instance_id: Id
    hostname: Name
    version: Annotated[str, msgspec.Meta(max_length=128)]
    pid: Annotated[int, msgspec.Meta(ge=0, le=2**32)]
    data_address: DataEndpoint | None = None
    # Where its stages bind for their replicas' ring (SWARM_SYNC_ADDRESS): a job with
    # replicas; an older agent says nothing (its ring links go over the relay).
    sync_address: SyncEndpoint | None = None
    # Where jobs may place it (silentswarm.pools): an older agent says nothing, "default".
    pool: PoolName = DEFAULT_POOL
    labels: Labels = msgspec.field(default_factory=dict)


class RegisterRequest(Message, tag="register", tag_field="kind"):
    fellow: FellowIdentity
    hardware: HardwareSnapshot
    status: FellowStatus = FellowStatus.REGISTERING


class StageResult(NewerValues):
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"  # a STOP signal ended it (cancel, or a peer failed)


class StageOutcome(msgspec.Struct, kw_only=True, gc=False):
    """How the fellow's last stage run ended.

    Repeated in every heartbeat until the next START, so a leader that was away (restarted,
    or cut off from NATS) when the job ended still learns how it ended.
    """

    job_id: Id
    attempt: Count
    result: StageResult
    step: Count | None = None
    loss: float | None = None
    val_loss: float | None = None
    message: Text = ""
    # A FAILED run's ErrorCode from the stage's error event, as text (a fellow of another
    # version may send a code this leader does not know); None when the stage gave none.
    code: Id | None = None
    ended_at: Timestamp = msgspec.field(default_factory=time.time)
    # A completed run whose final shard did not reach the leader: why, in the fellow's words
    # (its checkpoint could not be written, or the push failed). The leader cleans it, names
    # the stage and fellow itself, and puts it in the job's ``export_error``.
    export_error: Annotated[str, msgspec.Meta(max_length=EXPORT_ERROR_CHARS)] | None = None


class DeregisterRequest(Message, tag="deregister", tag_field="kind"):
    fellow_id: Id
    instance_id: Id
    # What the leader's register reply gave this instance: only the registering process
    # holds it, so nobody who merely knows the (public) instance id can deregister it.
    instance_secret: Annotated[str, msgspec.Meta(max_length=128)] = ""
    reason: Name = "agent stopped"
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
    # The secret a deregister of this instance must carry (in every accepted reply).
    instance_secret: str = ""


class LinkProbeReport(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What one end of a PROBE measured (:class:`silentswarm.types.signals.ProbeArgs`): the
    link's figures when ``ok``, else why not. A fellow repeats its latest report in its
    heartbeats for a few seconds (a heartbeat may be lost); the leader takes each probe's
    once, from each of the two fellows it paired, and records the link only when both ends
    report it (:mod:`silentswarm.leader.linkprobes`)."""

    probe_id: Id
    peer: Id
    ok: bool
    stats: LinkStats | None = None
    message: Annotated[str, msgspec.Meta(max_length=512)] = ""


class Heartbeat(Message, kw_only=True):
    fellow: FellowIdentity
    seq: Count
    status: FellowStatus
    job_id: Id | None = None
    attempt: Count | None = None
    step: Count | None = None
    loss: float | None = None
    outcome: StageOutcome | None = None
    bytes_sent: Bytes = 0
    bytes_received: Bytes = 0
    hardware: HardwareSnapshot
    sent_at: float = msgspec.field(default_factory=time.time)
    link_probe: LinkProbeReport | None = None


# --- signals --------------------------------------------------------------------------------


class SignalKind(NewerValues):
    START = "START"
    CHECKPOINT = "CHECKPOINT"
    STOP = "STOP"
    UPDATE = "UPDATE"
    PURGE = "PURGE"
    RING = "RING"
    PROBE = "PROBE"


class _Signal(Message, kw_only=True, tag_field="kind"):
    """A signal from the leader to one fellow: one Struct per kind (the ``kind`` tag), each
    with its kind's typed ``args`` (:mod:`silentswarm.types.signals`). ``job_id`` and ``attempt``
    name the run it is about (None: whatever runs)."""

    signal_id: Id
    job_id: Id | None = None
    attempt: Count | None = None

    @property
    def kind(self) -> SignalKind:
        return SignalKind(self.__struct_config__.tag)


class StartSignal(_Signal, tag="START", kw_only=True):
    args: StartArgs


class CheckpointSignal(_Signal, tag="CHECKPOINT", kw_only=True):
    args: CheckpointArgs


class StopSignal(_Signal, tag="STOP", kw_only=True):
    args: StopArgs = msgspec.field(default_factory=StopArgs)


class UpdateSignal(_Signal, tag="UPDATE", kw_only=True):
    args: UpdateArgs = msgspec.field(default_factory=UpdateArgs)


class PurgeSignal(_Signal, tag="PURGE", kw_only=True):
    args: PurgeArgs = msgspec.field(default_factory=PurgeArgs)


class RingSignal(_Signal, tag="RING", kw_only=True):
    args: RingArgs


class ProbeSignal(_Signal, tag="PROBE", kw_only=True):
    args: ProbeArgs


Signal = (
    StartSignal
    | CheckpointSignal
    | StopSignal
    | UpdateSignal
    | PurgeSignal
    | RingSignal
    | ProbeSignal
)
_SIGNAL_OF: dict[type[SignalArgs], type[Signal]] = {
    StartArgs: StartSignal,
    CheckpointArgs: CheckpointSignal,
    StopArgs: StopSignal,
    UpdateArgs: UpdateSignal,
    PurgeArgs: PurgeSignal,
    RingArgs: RingSignal,
    ProbeArgs: ProbeSignal,
}


def make_signal(
    args: SignalArgs, *, signal_id: str, job_id: str | None = None, attempt: int | None = None
) -> Signal:
    """The signal that carries ``args``: its kind follows from their type."""
    return _SIGNAL_OF[type(args)](signal_id=signal_id, job_id=job_id, attempt=attempt, args=args)


class SignalHead(Message, kw_only=True):
    """What a fellow can still read of a signal that does not decode: its id and kind, so
    the refusal answers that signal and says what was wrong with it."""

    signal_id: Id = ""
    kind: Annotated[str, msgspec.Meta(max_length=64)] = ""


class SignalAck(Message, kw_only=True):
    """A fellow's answer to a signal. The leader checks that it answers the signal it sent,
    as the fellow it sent it to, and keeps the words cleaned (a stranger's text)."""

    signal_id: Id
    fellow_id: Id
    ok: bool
    code: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    # Not bounded here: an older agent's long refusal must still read as a refusal, not as
    # no answer; the leader cuts it (leader.signals.answered), and NATS bounds the payload.
    # An agent sends at most ACK_MESSAGE_CHARS.
    message: str = ""
    duplicate: bool = False


# --- logs, progress, shards -----------------------------------------------------------------


class LogRecord(msgspec.Struct, kw_only=True, gc=False):
    ts: Timestamp  # a time to show
    level: Annotated[str, msgspec.Meta(max_length=16)]
    logger: Name
    message: Annotated[str, msgspec.Meta(max_length=8192)]


class LogBatch(Message, kw_only=True):
    fellow_id: Id
    records: Annotated[list[LogRecord], msgspec.Meta(max_length=1000)]


class ProgressEvent(NewerValues):
    STEP = "step"  # a training step completed (``step`` counts completed steps)
    CHECKPOINT = "checkpoint"  # a checkpoint was written (or, with ok=False, could not be)
    ENDED = "ended"  # the stage run ended; ``outcome`` says how
    JOINING = "joining"  # a joining stage is ready for its ring (elastic membership)


class Progress(Message, kw_only=True):
    job_id: Id
    fellow_id: Id
    attempt: Count
    event: ProgressEvent = ProgressEvent.STEP
    stage: Annotated[int, msgspec.Meta(ge=0, le=4096)] | None = None
    step: Count
    total_steps: Count | None = None
    loss: float | None = None  # a diverged run's is not finite, and says so
    val_loss: float | None = None
    lr: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] | None = None
    # Bounded (NaN and inf refused): the leader divides by step times (elastic.steps_ahead).
    step_time_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)] | None = None
    # Of step_time_s, the seconds the stage waited on its peers: the rest is its own work,
    # from which the leader learns the fellow's compute speed (balanced partitions).
    wait_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)] | None = None
    # Of the rest, the seconds the fellow's CPU quota held the stage back (a container's
    # limit): the quota's, not the work's; the leader's speed leaves them out.
    throttled_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)] = 0.0
    tokens_per_s: Rate | None = None
    bytes_sent: Bytes = 0  # over both boundaries of the stage, since it started
    bytes_received: Bytes = 0
    down_bytes_sent: Bytes = 0  # over the boundary to the next stage only
    down_bytes_received: Bytes = 0
    down_transport: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9_]{1,16}$")] | None = (
        None  # p2p, relay
    )
    # The downstream boundary as the latest calibration measured it, and the schedule then
    # agreed (agent/runtime/calibrate.py); None before the first.
    down_link: LinkStats | None = None
    tuning: Tuning | None = None
    # Relay messages the stage dropped because they failed its checks (agent/pipe/relay.py).
    relay_dropped: Count = 0
    # Replicas: which pipeline the stage is of, the seconds its latest step synced with the
    # stage's other replicas, its bytes over their ring since it started, and the
    # contributions clipped and replicas left out of its rounds so far.
    replica: Annotated[int, msgspec.Meta(ge=0, le=4095)] = 0
    sync_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)] | None = None
    sync_bytes_sent: Bytes = 0
    sync_bytes_received: Bytes = 0
    sync_clipped: Count = 0
    sync_missed: Count = 0
    # Elastic membership: the ring epoch the stage is in, and on the step after its rings
    # formed the sha256 of the state it took from the donor in each (by segment).
    sync_epoch: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0
    state_digests: StateDigests | None = None
    ok: bool = True
    message: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    checkpoint_path: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    checkpoint_id: Id | None = None
    outcome: StageOutcome | None = None
    at: Timestamp = msgspec.field(default_factory=time.time)


class ShardChunk(Message, kw_only=True):
    """One piece of one file of a stage's shard (its checkpoint after ``step`` steps), sent by
    request/reply in order; the leader verifies ``sha256`` once it has all ``total`` pieces."""

    job_id: Id
    fellow_id: Id
    attempt: Count
    stage: Annotated[int, msgspec.Meta(ge=0, le=4096)]
    step: Count
    name: Id  # stage-<i>.npz or stage-<i>.json (the JSON last: it completes the shard)
    size: Bytes
    sha256: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
    seq: Annotated[int, msgspec.Meta(ge=0, le=2**32)]
    total: Annotated[int, msgspec.Meta(ge=1, le=2**32)]
    data: Annotated[bytes, msgspec.Meta(max_length=1 << 20)]


class ShardAck(Message, kw_only=True):
    """``next_seq``: the piece the leader wants next (0 after a lost transfer: start over);
    ``done`` once the file is verified and stored."""

    ok: bool
    next_seq: int
    done: bool = False
    message: str = ""
