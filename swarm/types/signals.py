"""The arguments of each signal kind: what ``Signal.args`` holds, one Struct per kind.

The leader builds them (:mod:`silentswarm.leader.orchestrator`, :mod:`silentswarm.leader.services`);
the fellow gets them decoded with the signal (:data:`silentswarm.protocol.Signal`, a union tagged by
``kind``) and reads attributes. On the wire ``args`` is the map it always was, with the same keys
(None and defaults left out), so a fellow of an older version still takes an UPDATE from a newer
leader: it reads ``args["package"]`` with ``file``, ``sha256`` and ``url``.

A signal comes from the leader but crosses the network: every size and value is bounded,
and one outside its bounds fails decoding, which the fellow answers with a refusal that says
why (``START_INVALID``, ``PLAN_INVALID``, ``UPDATE_INVALID``:
:func:`silentswarm.agent.decide.malformed`).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from silentswarm.endpoints import DATA_ENDPOINT
from silentswarm.plan import CurveKeys, RingChange, StagePlan

MAX_CREDS_CHARS = 16384  # a .creds file: a user JWT and its nkey seed, with room to spare
MAX_SHARD_FILES = 64  # a stage's shard is two files (stage-<i>.npz, stage-<i>.json)
MAX_DATASETS = 1024  # as many as a plan's data entries may be
MAX_INIT_FILES = 2 * 1024 + 1  # every stage's two files of a source split finer, the manifest
REASON_CHARS = 4096  # a STOP's or PURGE's reason: the sender cuts a longer one

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Text = Annotated[str, msgspec.Meta(max_length=REASON_CHARS)]
Url = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
Step = Annotated[int, msgspec.Meta(ge=0, le=2**53)]


class _Args(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Base of every kind's arguments: unknown keys are ignored (a newer leader may add some)."""


# --- START ----------------------------------------------------------------------------------


class ShardFile(_Args, kw_only=True):
    """One file of the shard a resumed stage starts from, and where the leader serves it."""

    name: Annotated[str, msgspec.Meta(pattern=r"^stage-[0-9]{1,4}\.(npz|json)$")]
    sha256: Sha256
    url: Url


class ResumeArgs(_Args, kw_only=True):
    """A resumed attempt's stage: the step its shard holds, the shard's files, and the token
    that opens them (sent in a header, never in the URL)."""

    step: Annotated[int, msgspec.Meta(ge=1, le=2**53)]
    files: Annotated[list[ShardFile], msgspec.Meta(max_length=MAX_SHARD_FILES)]
    token: Annotated[str, msgspec.Meta(max_length=256)]


class DatasetFile(_Args, kw_only=True):
    """One uploaded dataset a stage reads (its plan's ``data`` names it pinned) and where the
    leader serves it."""

    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
    sha256: Sha256
    size_bytes: Annotated[int, msgspec.Meta(ge=0, le=2**50)]
    url: Url


class DatasetArgs(_Args, kw_only=True):
    """The uploaded datasets a stage downloads before it starts, and the token that opens
    them (sent in a header, never in the URL)."""

    files: Annotated[list[DatasetFile], msgspec.Meta(max_length=MAX_DATASETS)]
    token: Annotated[str, msgspec.Meta(max_length=256)]


class InitFile(_Args, kw_only=True):
    """One file of the export a job starts from (``init_from: "job:"/"export:"``): its run
    manifest, or a stage shard's file, and where the leader serves it."""

    name: Annotated[
        str, msgspec.Meta(pattern=r"^(stage-[0-9]{1,4}\.(npz|json)|run_manifest\.json)$")
    ]
    sha256: Sha256
    url: Url


class InitArgs(_Args, kw_only=True):
    """A stage of a job that starts from an export: the export's step, its run manifest and
    the shards that hold this stage's layers, and the token that opens them (the stage's
    download token: in a header, never in the URL)."""

    step: Annotated[int, msgspec.Meta(ge=1, le=2**53)]
    files: Annotated[list[InitFile], msgspec.Meta(max_length=MAX_INIT_FILES)]
    token: Annotated[str, msgspec.Meta(max_length=256)]


class StartArgs(_Args, kw_only=True):
    """START: the stage plan; the attempt's own NATS user (a ``.creds`` file's text) when the
    swarm has NATS users; for a resumed attempt, where its shard is; for a stage that reads
    uploaded datasets, where they are; for a job that starts from an export, where the
    export's files that hold the stage's layers are."""

    plan: StagePlan
    nats_creds: Annotated[str, msgspec.Meta(max_length=MAX_CREDS_CHARS)] | None = None
    resume: ResumeArgs | None = None
    datasets: DatasetArgs | None = None
    init: InitArgs | None = None


# --- the others -----------------------------------------------------------------------------


class StopArgs(_Args, kw_only=True):
    """STOP: end the stage run; ``release``: the operator released the fellow, so its agent
    exits too (whatever job the signal names)."""

    reason: Text = ""
    release: bool = False


class CheckpointArgs(_Args, kw_only=True):
    """CHECKPOINT: write ``checkpoint_id`` once ``at_step`` steps are done (None: at once)."""

    checkpoint_id: Id
    at_step: Step | None = None


class RingArgs(_Args, kw_only=True):
    """RING: the ring of the stage's replicas changes (elastic membership): the stage
    switches to ``change`` before it trains step ``change.at_step``."""

    change: RingChange


class PackageRef(_Args, kw_only=True):
    """What UPDATE names: the leader's package, where to get it, and its sha256."""

    file: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    sha256: Sha256
    url: Url


class UpdateArgs(_Args, kw_only=True):
    """UPDATE: reinstall ``package`` first (fellows that fellow.sh installed), then restart;
    None: restart as installed."""

    package: PackageRef | None = None


class PurgeArgs(_Args, kw_only=True):
    """PURGE: remove the fellow's state (and its install), then exit."""

    reason: Text = ""


# --- PROBE ----------------------------------------------------------------------------------

# The most a probe may take, handshake included (ProbeArgs.timeout_s): two bursts each way
# (256 KiB, then 512 KiB) fit it down to about 0.5 Mbit/s.
PROBE_TIMEOUT_S = 30.0


class ProbeArgs(_Args, kw_only=True):
    """PROBE: measure the link to fellow ``peer`` while neither runs a stage (placement then
    knows the pair's link before any job crosses it: :mod:`silentswarm.leader.linkprobes`).
    ``bind``: this fellow binds its data address and waits for ``peer``; else it connects to
    ``address``, the peer's advertised data address. ``curve``: this end's CURVE keys (the
    leader makes them per probe), so only the two fellows the leader paired talk. The result
    goes back in the fellow's heartbeats (:class:`silentswarm.protocol.LinkProbeReport`)."""

    probe_id: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{8,64}$")]
    peer: Id
    bind: bool
    address: Annotated[str, msgspec.Meta(max_length=256, pattern=DATA_ENDPOINT)] | None = None
    curve: CurveKeys
    timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=PROBE_TIMEOUT_S)] = PROBE_TIMEOUT_S


SignalArgs = StartArgs | StopArgs | CheckpointArgs | UpdateArgs | PurgeArgs | RingArgs | ProbeArgs

__all__ = [
    "MAX_CREDS_CHARS",
    "PROBE_TIMEOUT_S",
    "REASON_CHARS",
    "CheckpointArgs",
    "InitArgs",
    "InitFile",
    "PackageRef",
    "ProbeArgs",
    "PurgeArgs",
    "ResumeArgs",
    "RingArgs",
    "ShardFile",
    "SignalArgs",
    "StartArgs",
    "StopArgs",
    "UpdateArgs",
]
