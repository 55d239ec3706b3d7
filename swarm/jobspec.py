"""The job spec users submit, its strict decoding, and the stage plans a placement yields.

A spec is decoded strictly (an unknown or mistyped field is an error that names it) and
then checked for what cannot work (more stages than layers, heads not dividing d_model, an
unknown compression spec, ...). Everything has a default that trains something sensible.

The spec is flat JSON: the training fields are :class:`silentswarm.plan.TrainConfig`'s, which
``JobSpec`` embeds (a subclass, like an embedded struct), so every job file written for
earlier versions still decodes, and each field has one default and one bound, the same in a
job spec and in a stage plan's ``train``.
"""

from __future__ import annotations

import enum
import re
import secrets
import types
import typing
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from silentswarm.compression import parse_compression
from silentswarm.errors import ConfigError, FieldError, JobSpecError
from silentswarm.plan import (
    GpuSlot,
    ModelConfig,
    PathText,
    Peer,
    StagePlan,
    StepCount,
    TrainConfig,
    Transport,
    defer_problems,
    recompute_problems,
)
from silentswarm.pools import DEFAULT_POOL, Labels, PoolName
from silentswarm.rings import (
    Seat,
    build_rings,
    fellow_ports,
    link_secrets,
    segments,
    stage_segments,
)
from silentswarm.unknown_fields import NewerValues

T = TypeVar("T")


class Partition(NewerValues):
    EQUAL = "equal"  # the same number of layers per stage (earlier stages take the remainder)
    WEIGHTED = "weighted"  # layers in proportion to each fellow's capacity
    # layers that even out the stages' times by each fellow's measured compute speed, within
    # its memory (silentswarm.leader.balance)
    BALANCED = "balanced"


class LastStagePlacement(NewerValues):
    LARGEST_VRAM = "largest_vram"  # the head (largest activations + logits) on the most VRAM
    PRESERVE = "preserve"  # keep the ranked order


# Bounds on every number and string of a spec (the training fields' are TrainConfig's, in
# swarm/plan.py): far beyond what a demanding real job needs, short of what would overflow,
# allocate absurdly or never end. Out of bounds is a 400 that names the field (msgspec checks
# them while decoding, here and in ``swarm submit``).
MAX_STAGES = 1024
Seconds = Annotated[float, msgspec.Meta(gt=0, le=30 * 86400)]


class ArtifactPaths(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Under the leader's export root (SWARM_EXPORT_ROOT); a relative path is taken under it.
    model_export_dir: PathText | None = None


class JobSpec(TrainConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A job as users write it: TrainConfig's fields (``steps``, ``batch_size``, ``data``, ...)
    at the top level, embedded, not copied (one default and one bound each, the plan's
    ``train`` as well), and what the leader needs to place and look after the job."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] = "job"
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    # Exactly this many stages (one fellow each); None: every ready fellow, at least
    # ``min_fellows`` and at most one per layer.
    stages: Annotated[int, msgspec.Meta(ge=1, le=MAX_STAGES)] | None = None
    min_fellows: Annotated[int, msgspec.Meta(ge=1, le=MAX_STAGES)] = 1
    # Copies of the pipeline, each on its own fellows and reading its own slice of every
    # step's data (``batch_size`` is per replica); the replicas of a stage keep in sync as
    # ``sync`` says. "auto": as many full pipelines as the ready fellows allow.
    replicas: Annotated[int, msgspec.Meta(ge=1, le=MAX_STAGES)] | Literal["auto"] = 1
    partition: Partition = Partition.EQUAL
    compression: Annotated[str, msgspec.Meta(max_length=64)] = "none"
    # None: the leader's SWARM_PIPELINE_TRANSPORT (default auto); the leader writes the one it
    # chose into the spec it records (:func:`with_default_transport`).
    transport: Transport | None = None
    allow_cpu: bool = True
    # None: the leader's SWARM_PLACEMENT_MIN_GPU_FREE_GB (default 4.0).
    placement_min_gpu_free_gb: Annotated[float, msgspec.Meta(ge=0, le=100_000.0)] | None = None
    max_gpus_per_worker: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None
    # None: the leader's SWARM_PIPELINE_LAST_STAGE_PLACEMENT (default largest_vram).
    pipeline_last_stage_placement: LastStagePlacement | None = None
    shard_push_interval_steps: StepCount = 0
    shard_push_to_leader: bool = False
    # Automatic resume when a fellow is lost: at most this many times, from the newest step
    # every stage pushed; without any push, from step 0 only if resume_from_scratch.
    max_resumes: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 3
    resume_from_scratch: bool = False
    # A resumed job that cannot be placed again within this long fails.
    resume_wait_s: Seconds = 600.0
    artifact_paths: ArtifactPaths = msgspec.field(default_factory=ArtifactPaths)
    peer_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86400.0)] = 60.0
    # Where it may run (silentswarm.pools): only on fellows of this pool (None: the default
    # pool) that carry every one of these labels with the same value.
    pool: PoolName | None = None
    labels: Labels = msgspec.field(default_factory=dict)

    @property
    def run_pool(self) -> str:
        """The pool the job runs in."""
        return self.pool or DEFAULT_POOL

    @property
    def min_stages(self) -> int:
        return self.stages if self.stages is not None else self.min_fellows

    def problems(self) -> list[str]:
        """Why this job cannot run, in words that name the field; empty when it can."""
        out = [
            *self.model.problems(),
            *self.train_problems(prefix=""),
            *self.tokenizer.problems(self.model.vocab_size),
            *(self.adapter.problems(self.model.family) if self.adapter is not None else []),
            *recompute_problems(self.model, self),
            *defer_problems(self.model, self),
        ]
        if not 1 <= len(self.name) <= 128:
            out.append("name must be 1-128 characters")
        layers = self.model.n_layers
        if self.stages is not None and not 1 <= self.stages <= max(layers, 1):
            out.append(f"stages ({self.stages}) must be between 1 and model.n_layers ({layers})")
        if not 1 <= self.min_fellows <= max(layers, 1):
            out.append(
                f"min_fellows ({self.min_fellows}) must be between 1 and model.n_layers ({layers})"
            )
        if self.placement_min_gpu_free_gb is not None and self.placement_min_gpu_free_gb < 0:
            out.append("placement_min_gpu_free_gb must be >= 0")
        if self.max_gpus_per_worker is not None and self.max_gpus_per_worker < 1:
            out.append("max_gpus_per_worker must be >= 1")
        if self.shard_push_interval_steps < 0:
            out.append("shard_push_interval_steps must be >= 0")
        if self.shard_push_to_leader and self.shard_push_interval_steps == 0:
            out.append("shard_push_to_leader needs shard_push_interval_steps > 0")
        if self.max_resumes < 0:
            out.append("max_resumes must be >= 0")
        if self.resume_wait_s <= 0:
            out.append("resume_wait_s must be > 0")
        if self.peer_timeout_s <= 0:
            out.append("peer_timeout_s must be > 0")
        try:
            parse_compression(self.compression, d_model=self.model.d_model)
        except ConfigError as exc:
            out.append(f"compression: {exc.message}")
        out.extend(self._replica_problems())
        return out

    @property
    def replicated(self) -> bool:
        """Whether the job may run more than one pipeline (``replicas`` > 1 or "auto")."""
        return self.replicas != 1

    def _replica_problems(self) -> list[str]:
        if not self.replicated:
            return []
        out = []
        k = self.replicas
        if self.overlap:
            out.append(
                f'schedule "overlap" cannot run with replicas ({k!r}): replicas sync at step '
                'boundaries, which overlapping steps lack; use schedule "1f1b" or replicas 1'
            )
        if isinstance(k, int) and k * self.min_stages > MAX_STAGES:
            out.append(
                f"replicas ({k}) x stages ({self.min_stages}) needs {k * self.min_stages} "
                f"fellows; at most {MAX_STAGES}"
            )
        return out


def with_default_transport(spec: JobSpec, default: Transport | str) -> JobSpec:
    """``spec`` with ``default`` as its transport when it names none (a spec that names
    one, even ``auto``, keeps it)."""
    if spec.transport is not None:
        return spec
    return msgspec.structs.replace(spec, transport=Transport(default))


_AT = re.compile(r"^(?P<reason>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"unknown field `(?P<name>[^`]+)`")


def decode_strict(data: bytes, kind: type[T]) -> T:
    """``kind`` from JSON (an empty body is ``{}``); FieldError naming the field (and, for a
    choice of words, what it takes)."""
    try:
        return msgspec.json.decode(data or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        raise _field_error(str(exc), kind) from None
    except msgspec.DecodeError as exc:
        raise FieldError(f"the body is not valid JSON ({exc})", field="$") from None


def decode_job_spec(data: bytes) -> JobSpec:
    """A JobSpec from JSON; FieldError naming the field, JobSpecError naming the problems."""
    spec = decode_strict(data, JobSpec)
    problems = spec.problems()
    if problems:
        raise JobSpecError("; ".join(problems))
    return spec


def _field_error(text: str, kind: type | None = None) -> FieldError:
    """msgspec's ``Object contains unknown field `x` - at `$.model``` as field ``model.x``."""
    match = _AT.match(text)
    reason = match.group("reason") if match else text
    if match and match.group("key"):  # a mapping's key (labels): "labels: a key: ..."
        reason = f"a key: {reason}"
    path = (match.group("path") if match else "") or ""
    field = path.lstrip(".")
    unknown = _UNKNOWN.search(reason)
    if unknown:
        field = f"{field}.{unknown.group('name')}" if field else unknown.group("name")
        reason = "unknown field"
    if not field:
        return FieldError(f"job spec: {reason}", field="$")
    if reason.startswith("Invalid enum value") and kind is not None:
        allowed = _allowed(kind, field)
        if allowed:
            reason = f"{reason}; expected {allowed}"
    return FieldError(f"{field}: {reason}", field=field)


_NUMBERS = {int: "an integer", float: "a number"}


def _allowed(kind: type, field: str) -> str | None:
    """What field ``field`` (a dotted path into struct ``kind``) takes when it is a choice
    of words (``Literal`` or an enum), perhaps beside a number: ``"auto" or an integer``."""
    hint: Any = kind
    for name in field.split("."):
        hints = typing.get_type_hints(hint) if isinstance(hint, type) else {}
        if name not in hints:
            return None
        hint = hints[name]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = typing.get_args(hint) if union else (hint,)
    words = [
        f'"{value}"'
        for arg in args
        for value in (
            typing.get_args(arg)
            if typing.get_origin(arg) is Literal
            else [m.value for m in arg]
            if isinstance(arg, type) and issubclass(arg, enum.Enum)
            else []
        )
    ]
    if not words:
        return None
    choice = words[0] if len(words) == 1 else f"one of {', '.join(words)}"
    return " or ".join([choice, *(_NUMBERS[a] for a in args if a in _NUMBERS)])


def new_job_id(name: str) -> str:
    """``<slug of the name>-<6 hex>``: readable, unique, and a valid subject token."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-").lower()[:40] or "job"
    return f"{slug}-{secrets.token_hex(3)}"


# --- placement -> plans ---------------------------------------------------------------------


class PlacedStage(msgspec.Struct, kw_only=True):
    stage: int
    fellow_id: str
    replica: int = 0  # the pipeline it is a stage of (a job with replicas)
    sync_address: str | None = None  # where it binds for its replicas' ring
    hostname: str
    layer_start: int
    layer_end: int
    data_address: str | None = None
    # Its fellow's kernel boot id (HardwareSnapshot.machine_id): stages of one machine
    # share its cores; None from an older agent.
    machine_id: str | None = None
    gpu_slots: list[GpuSlot] = msgspec.field(default_factory=list)
    intra_op_threads: int | None = None
    # The planner's estimate of what the stage needs (runtime included) and what the fellow
    # offered it (eligible free VRAM, or RAM on a CPU-only fellow).
    memory_estimate_bytes: int | None = None
    memory_offered_bytes: int | None = None


class Placement(msgspec.Struct, kw_only=True):
    # Every placed stage of every replica, ordered by (replica, stage): a job without
    # replicas has one per stage, in stage order.
    stages: list[PlacedStage]
    transport: Transport
    # Elastic membership: the replica slots the job was placed with, once a replica was lost
    # (its stages leave ``stages``; a replacement takes its slot). 0: every slot is placed.
    replica_slots: int = 0
    # The replica whose checkpoints and shards are the job's: 0, or when replica 0 is lost
    # the lowest that went on (a replacement joining later does not take it back).
    lead: int = 0

    @property
    def fellow_ids(self) -> list[str]:
        return [s.fellow_id for s in self.stages]

    @property
    def n_replicas(self) -> int:
        """The replica slots (the ``n_replicas`` of every plan), placed or not."""
        return self.replica_slots or 1 + max((s.replica for s in self.stages), default=0)

    @property
    def live_replicas(self) -> list[int]:
        """The replicas that have stages placed, in order."""
        return sorted({s.replica for s in self.stages})

    @property
    def lead_replica(self) -> int:
        """The replica whose checkpoints and shards are the job's (``lead``)."""
        return self.lead

    @property
    def n_stages(self) -> int:
        """The stages of one pipeline."""
        return len(self.pipeline(self.lead_replica))

    def pipeline(self, replica: int = 0) -> list[PlacedStage]:
        """The stages of pipeline ``replica``, in stage order (replica 0's: the ones whose
        checkpoints and shards are the job's)."""
        return sorted((s for s in self.stages if s.replica == replica), key=lambda s: s.stage)

    def stage_of(self, fellow_id: str) -> PlacedStage | None:
        return next((s for s in self.stages if s.fellow_id == fellow_id), None)

    def alone(self, ranges: Sequence[tuple[int, int]] | None = None) -> Placement:
        """The lead replica's pipeline as a placement without replicas (its stages replica
        0, the lead 0): what an export describes and glue rebuilds, whichever replica led.
        ``ranges``: the layers of the shards it describes, where they differ from the lead's
        own (a lead that took over and splits otherwise; its GPU slots then no longer fit)."""
        stages = [msgspec.structs.replace(s, replica=0) for s in self.pipeline(self.lead)]
        if ranges is not None and list(ranges) != [(s.layer_start, s.layer_end) for s in stages]:
            stages = [
                msgspec.structs.replace(s, layer_start=a, layer_end=b, gpu_slots=[])
                for s, (a, b) in zip(stages, ranges, strict=True)
            ]
        return msgspec.structs.replace(self, stages=stages, replica_slots=0, lead=0)

    def split(self, replica: int) -> list[tuple[int, int]]:
        """Pipeline ``replica``'s layer ranges, in stage order."""
        return [(s.layer_start, s.layer_end) for s in self.pipeline(replica)]

    def sync_segments(self, stage: PlacedStage, replicas: Sequence[int] | None = None) -> list[int]:
        """The first layers of the segments (:mod:`silentswarm.rings`) ``stage`` holds among
        the splits of ``replicas`` (default: the live ones): the rings it is in, and
        (elastic membership drops replicas and places replacements with the lead's split,
        which only merges segments) every ring it may be in later this attempt."""
        members = self.live_replicas if replicas is None else replicas
        splits = [self.split(r) for r in members]
        return [a for a, _ in stage_segments(stage.layer_start, stage.layer_end, segments(splits))]


def seats(placement: Placement, replicas: Sequence[int] | None = None) -> dict[int, list[Seat]]:
    """The placed pipelines of ``replicas`` (default: every live one) as the rings see them."""
    live = placement.live_replicas if replicas is None else replicas
    return {
        r: [Seat.of(s, r, fellow_ports(s.sync_address)) for s in placement.pipeline(r)]
        for r in live
    }


def stage_plans(
    *, job_id: str, attempt: int, spec: JobSpec, placement: Placement, subject_prefix: str
) -> list[StagePlan]:
    """One StagePlan per placed stage (in the placement's order). Each fellow fills in its
    own NATS URL and folders.

    Every p2p link gets fresh CURVE keys, so only the placed neighbours can connect, and
    every link that may use the relay (auto, tunnel) a fresh relay token, so only they can
    send relay messages the other accepts: each boundary of each replica's pipeline, and
    with replicas each link of each segment's ring (:func:`silentswarm.rings.build_rings`).
    Only the lead replica (``placement.lead``) checkpoints for the leader.
    """
    k = placement.n_replicas
    pipelines = [placement.pipeline(r) for r in range(k)]
    n = placement.n_stages
    train = spec.train_config()
    curve = placement.transport != Transport.TUNNEL
    relay = placement.transport != Transport.P2P
    boundaries = [link_secrets(n - 1, curve=curve, relay=relay) for _ in range(k)]
    rings = build_rings(seats(placement), curve=curve, relay=relay) if k > 1 else {}
    plans = []
    for placed in placement.stages:
        i, r = placed.stage, placed.replica
        own = pipelines[r]
        prev = own[i - 1] if i > 0 else None
        nxt = own[i + 1] if i + 1 < n else None
        up = boundaries[r][i - 1] if i > 0 else None
        down = boundaries[r][i] if i + 1 < n else None
        ring_fields = {}
        if k > 1:
            ring_fields = dict(
                sync_ports=fellow_ports(placed.sync_address),
                sync_rings=rings[(r, i)],
            )
        # The lead replica's stages (replica 0's when placed) checkpoint at the end (the
        # export) and, with shard pushes, every shard_push_interval_steps; its fellows push
        # each to the leader. The other replicas hold the same weights: they write none.
        lead = r == placement.lead
        plans.append(
            StagePlan(
                job_id=job_id,
                attempt=attempt,
                stage=i,
                n_stages=n,
                layer_start=placed.layer_start,
                layer_end=placed.layer_end,
                model=spec.model,
                train=train,
                compression=spec.compression,
                transport=placement.transport,
                fellow_id=placed.fellow_id,
                data_address=placed.data_address if i > 0 else None,
                prev=Peer(fellow_id=prev.fellow_id) if prev else None,
                next=Peer(fellow_id=nxt.fellow_id, data_address=nxt.data_address) if nxt else None,
                subject_prefix=subject_prefix,
                gpu_slots=list(placed.gpu_slots),
                curve_up=up.binding if up else None,
                curve_down=down.connecting if down else None,
                relay_up_token=up.token if up else None,
                relay_down_token=down.token if down else None,
                peer_timeout_s=spec.peer_timeout_s,
                intra_op_threads=placed.intra_op_threads,
                checkpoint_every=(
                    spec.shard_push_interval_steps if lead and spec.shard_push_to_leader else 0
                ),
                checkpoint_at_end=lead,
                replica=r,
                n_replicas=k,
                **ring_fields,
            )
        )
    return plans
