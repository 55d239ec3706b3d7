"""What one stage needs to run: the model and training configuration and the stage plan.

Shared by the leader (which will make plans from placement) and the runtime (which runs
them); msgspec Structs so a plan round-trips through JSON files and NATS messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal, Protocol, Self

import msgspec

from silentswarm import datasets
from silentswarm.compression import CompressionSpec, WireCodec, parse_compression, parse_wire_codec
from silentswarm.cpus import usable_cores
from silentswarm.errors import ConfigError
from silentswarm.natsconn import NatsAccess
from silentswarm.unknown_fields import NewerValues


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The transformer. ``family`` "gpt2": learned positions, LayerNorm, GELU MLP, biases.
    "llama": rotary positions (RoPE), RMSNorm, a SwiGLU MLP, grouped-query attention
    (``n_kv_heads``), no biases, an untied head (keras-hub's Llama, logit for logit)."""

    family: Literal["gpt2", "llama"] = "gpt2"
    vocab_size: Annotated[int, msgspec.Meta(ge=1, le=2**22)] = 256
    seq_len: Annotated[int, msgspec.Meta(ge=1, le=2**20)] = 64
    n_layers: Annotated[int, msgspec.Meta(ge=1, le=MAX_LAYERS)] = 4
    d_model: Annotated[int, msgspec.Meta(ge=1, le=2**16)] = 128
    n_heads: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 4
    # llama: the key/value heads (grouped-query attention; None: n_heads).
    n_kv_heads: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None
    mlp_ratio: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    # The MLP's width (None: mlp_ratio * d_model).
    intermediate_dim: Annotated[int, msgspec.Meta(ge=1, le=2**20)] | None = None
    # llama: RoPE's longest wavelength, and RMSNorm's epsilon.
    rope_theta: Annotated[float, msgspec.Meta(gt=1.0, le=1e9)] = 10000.0
    norm_eps: Annotated[float, msgspec.Meta(gt=0.0, le=1e-1)] = 1e-6
    dropout: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.0

    @property
    def hidden_dim(self) -> int:
        """The MLP's width."""
        return self.intermediate_dim or self.mlp_ratio * self.d_model

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def problems(self) -> list[str]:
        out = []
        for name in ("vocab_size", "seq_len", "n_layers", "d_model", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                out.append(f"model.{name} must be >= 1")
        if self.n_heads >= 1 and self.d_model % self.n_heads:
            out.append(f"model.n_heads ({self.n_heads}) must divide model.d_model ({self.d_model})")
        if not 0.0 <= self.dropout < 1.0:
            out.append("model.dropout must be in [0, 1)")
        if self.family == "llama":
            if self.n_heads >= 1 and self.n_heads % self.kv_heads:
                out.append(
                    f"model.n_kv_heads ({self.kv_heads}) must divide model.n_heads ({self.n_heads})"
                )
            if self.n_heads >= 1 and (self.d_model // self.n_heads) % 2:
                out.append("model.d_model / model.n_heads must be even for rotary positions")
        elif self.n_kv_heads is not None:
            out.append('model.n_kv_heads is for the "llama" family')
        return out


PROVISIONAL_MICRO_BATCHES = 4  # micro_batches "auto" before the stages have measured

# Bounds of the numbers and strings a job spec and a plan carry: far beyond what a demanding
# real job needs, short of what would overflow, allocate absurdly or never end. msgspec checks
# them while decoding, so out of bounds is an error that names the field.
MAX_STEPS = 10**9
MAX_LAYERS = 4096  # a model's n_layers
Steps = Annotated[int, msgspec.Meta(ge=1, le=MAX_STEPS)]
StepCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_STEPS)]
PathText = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
FieldName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class JsonlSource(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A ``data`` entry naming JSONL files: every line a JSON object whose ``field`` (a string)
    is one document. Beside plain path/glob strings (text files, each one document)."""

    jsonl: PathText  # a file, directory or glob, as a text entry
    field: FieldName = "text"

    def problems(self, where: str) -> list[str]:
        out = []
        if not self.jsonl.strip():
            out.append(f"{where}.jsonl must name a path or glob")
        if not self.field.strip():
            out.append(f"{where}.field must name a JSON field")
        return out


DataSource = PathText | JsonlSource

DEFAULT_CORPUS = "stdlib"
"""A ``data`` entry no fellow's own disk chooses: the top-level ``*.py`` files of the Python
standard library (``agent/runtime/data.py`` expands it)."""

BYTE_VOCAB = 256
# A BPE's vocabulary holds the 256 bytes and its two special tokens at least.
MIN_BPE_VOCAB = BYTE_VOCAB + 2


class TokenizerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How text becomes ids: ``byte`` (UTF-8 bytes, 256 ids) or ``bpe`` (a byte-level BPE
    trained by stage 0 on the job's own data before training starts)."""

    kind: Literal["byte", "bpe"] = "byte"
    # bpe: the vocabulary (None: model.vocab_size; given, it must equal it). byte: 256.
    vocab_size: Annotated[int, msgspec.Meta(ge=1, le=2**22)] | None = None
    # bpe: the BPE learns from at most this many bytes of the data (the start of it).
    train_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**40)] = 64 * 2**20

    def problems(self, model_vocab: int, prefix: str = "") -> list[str]:
        """Why this tokenizer cannot feed a model of ``model_vocab`` ids."""
        where = f"{prefix}tokenizer"
        if self.kind == "byte":
            if self.vocab_size not in (None, BYTE_VOCAB):
                return [f"{where}.vocab_size of a byte tokenizer is {BYTE_VOCAB}"]
            if model_vocab < BYTE_VOCAB:
                return [f"model.vocab_size ({model_vocab}) must be >= 256 for byte tokens"]
            return []
        vocab = self.vocab_size if self.vocab_size is not None else model_vocab
        if vocab != model_vocab:
            return [
                f"{where}.vocab_size ({vocab}) must equal model.vocab_size ({model_vocab}) "
                "(or leave it out)"
            ]
        if vocab < MIN_BPE_VOCAB:
            return [f"a bpe tokenizer needs model.vocab_size >= {MIN_BPE_VOCAB}, not {vocab}"]
        return []


# The projections of each family that a LoRA adapter may target (the blocks' weight names).
LORA_TARGETS = {
    "gpt2": ("w_qkv", "w_o", "w_fc", "w_proj"),
    "llama": ("w_q", "w_k", "w_v", "w_o", "w_gate", "w_up", "w_down"),
}


class AdapterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A LoRA adapter (``adapter`` of a job spec): each targeted projection ``W`` of every
    block gets ``A`` (d_in x rank) and ``B`` (rank x d_out, zero at the start) and computes
    ``x W + (x A B) * alpha / rank``; everything else is frozen. ``targets`` None: every
    projection of the family (:data:`LORA_TARGETS`)."""

    kind: Literal["lora"] = "lora"
    rank: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 8
    alpha: Annotated[float, msgspec.Meta(gt=0, le=1e6)] = 16.0
    targets: Annotated[list[str], msgspec.Meta(min_length=1, max_length=16)] | None = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def target_names(self, family: str) -> tuple[str, ...]:
        return tuple(self.targets) if self.targets is not None else LORA_TARGETS[family]

    def problems(self, family: str, prefix: str = "adapter.") -> list[str]:
        known = LORA_TARGETS.get(family, ())
        wrong = [t for t in self.targets or () if t not in known]
        if wrong:
            return [
                f"{prefix}targets: {', '.join(map(repr, wrong))} not projections of a "
                f"{family} block (they are {', '.join(known)})"
            ]
        if self.targets is not None and len(set(self.targets)) != len(self.targets):
            return [f"{prefix}targets names a projection twice"]
        return []


# The forms of ``init_from``: a keras-hub preset, a finished job, an export directory.
INIT_FROM_KINDS = ("preset", "job", "export")


class TrainConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a job trains: a plan's ``train``, and the top-level training fields of a job spec
    (:class:`silentswarm.jobspec.JobSpec` embeds these fields; docs/reference/jobs.md documents the
    defaults)."""

    steps: Steps = 200
    batch_size: Annotated[int, msgspec.Meta(ge=1, le=2**20)] = 8
    # "auto": the stages choose the count (and the window below) from their measured links
    # and compute (agent/runtime/tuning.py), starting from PROVISIONAL_MICRO_BATCHES.
    micro_batches: Annotated[int, msgspec.Meta(ge=1, le=2**16)] | Literal["auto"] = 4
    # Micro-batches a stage before the last keeps in flight (forwards ahead of its backwards):
    # at least 1F1B's p - s; more hides the links' latency for activation memory. None: 1F1B.
    # Under micro_batches "auto": the most the stages may choose (None: up to the count).
    in_flight: Annotated[int, msgspec.Meta(ge=1, le=2**16)] | None = None
    # Re-measure every boundary's link every this many steps (the start of an attempt and
    # the end of the warm-up always): what `compression`/`micro_batches` "auto" follow.
    # 0: only at those two points.
    link_probe_every: StepCount = 100
    # "1f1b": synchronous, each step's update before the next step's forwards. "overlap":
    # consecutive steps overlap and each update is applied one step late (PipeDream-2BW's
    # delay), so no step waits for the pipeline to drain or for the gradients' round trip;
    # each stage keeps a second gradient set and, while the steps overlap, a second copy
    # of its weights.
    schedule: Literal["1f1b", "overlap"] = "1f1b"
    # Stages before the last keep no intermediates of a forward for its backward: each
    # backward runs the forward again inside one compiled call with the received gradient
    # (activation recomputation). A micro-batch in flight then holds only the stage's input,
    # so a deep window (in_flight) costs little memory; the compute is measured in
    # docs/performance.md. Needs schedule "1f1b" and model.dropout 0.
    recompute: bool = False
    # The last stage's weight-gradient pass of a step's last ``defer_weight_grads``
    # micro-batches runs after the step's last input gradient has left: each of them first
    # gets a call that computes only the gradient upstream waits for, and once the last one
    # is sent, the whole forward and backward again for the weights' gradients, while the
    # gradient travels and the stage would otherwise wait for the next step's first
    # forward (zero-bubble pipelining's split of the backward, by recomputation). The same
    # gradients, a shorter critical path over slow links, more compute on the last stage.
    # "auto": the stages choose from their measured links and compute
    # (agent/runtime/tuning.py; 0 under dropout or schedule "overlap"). An int needs
    # schedule "1f1b" and model.dropout 0 when above 0.
    defer_weight_grads: Annotated[int, msgspec.Meta(ge=0, le=2**16)] | Literal["auto"] = "auto"
    learning_rate: Annotated[float, msgspec.Meta(gt=0, le=100.0)] = 3e-3
    warmup_steps: StepCount = 10
    # The cosine decay ends at this fraction of learning_rate.
    min_lr_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.1
    weight_decay: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 0.01
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0
    # Text paths/globs ("stdlib": Python's own sources) and JSONL sources (JsonlSource);
    # either may name a dataset uploaded to the leader ("dataset:NAME", silentswarm.datasets).
    data: Annotated[list[DataSource], msgspec.Meta(min_length=1, max_length=1024)] = msgspec.field(
        default_factory=lambda: [DEFAULT_CORPUS]
    )
    max_data_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**50)] | None = None
    tokenizer: TokenizerConfig = msgspec.field(default_factory=TokenizerConfig)
    # Start from these weights instead of random ones: "preset:DIR", a keras-hub Llama preset
    # directory that every fellow can read (each stage loads its own layers); "job:ID", the
    # final weights and tokenizer of a finished job of this leader; "export:DIR", those of an
    # export directory under the leader's export root (INIT_FROM_KINDS).
    init_from: PathText | None = None
    val_fraction: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.05
    val_batches: Annotated[int, msgspec.Meta(ge=1, le=10**6)] = 4
    # 0: validate only after the last step
    val_every: StepCount = 0
    jit_compile: bool = True  # XLA-compile the stage's forward (and so its backward)
    # "bfloat16": compute in bfloat16 (for GPUs) with float32 weights, optimizer state,
    # gradients, loss and boundary activations (Keras's mixed_bfloat16).
    precision: Literal["float32", "bfloat16"] = "float32"
    # Train a LoRA adapter on the weights init_from names ("job:" or "export:"), everything
    # else frozen; the job's shards and export then hold only the adapter.
    adapter: AdapterConfig | None = None
    # How the replicas of a stage (a job's ``replicas`` > 1) keep their weights in sync, over
    # the data plane among themselves (agent/runtime/replicas.py). "allreduce": the
    # gradients are averaged every step (one pipeline with ``replicas`` times the batch);
    # "diloco": ``sync_every`` local steps, then the replicas' pseudo-gradients (weights at
    # the last sync minus weights now) are averaged and applied by an outer SGD with
    # Nesterov momentum (``outer_learning_rate``, ``outer_momentum``).
    sync: Literal["allreduce", "diloco"] = "allreduce"
    sync_every: Annotated[int, msgspec.Meta(ge=1, le=10**6)] = 20
    outer_learning_rate: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] = 0.7
    outer_momentum: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.9
    # The wire codec of what replicas exchange (a wire codec of the codec table).
    sync_compression: Literal["none", "fp16", "fixed_int8"] = "none"
    # A replica that has not sent its contribution within this long is left out of the round.
    sync_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)] = 30.0
    # A contribution whose norm is above this many times the median of the others' is scaled
    # down to that bound (and counted), so one bad replica cannot wreck the average.
    sync_clip_ratio: Annotated[float, msgspec.Meta(gt=1.0, le=1e6)] = 4.0

    def problems(self) -> list[str]:
        return self.train_problems()

    def train_problems(self, prefix: str = "train.") -> list[str]:
        """Why this training cannot run, each reason naming ``<prefix><field>``."""
        out = []
        for name in ("steps", "batch_size", "val_batches"):
            if getattr(self, name) < 1:
                out.append(f"{prefix}{name} must be >= 1")
        out.extend(self._schedule_problems(prefix))
        if self.learning_rate <= 0:
            out.append(f"{prefix}learning_rate must be > 0")
        if self.warmup_steps < 0:
            out.append(f"{prefix}warmup_steps must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            out.append(f"{prefix}min_lr_ratio must be in [0, 1]")
        if not 0.0 < self.val_fraction < 1.0:
            out.append(f"{prefix}val_fraction must be in (0, 1)")
        if self.val_every < 0:
            out.append(f"{prefix}val_every must be >= 0")
        if self.max_data_bytes is not None and self.max_data_bytes < 1:
            out.append(f"{prefix}max_data_bytes must be >= 1")
        out.extend(self._data_problems(prefix))
        if self.adapter is not None and not self.init_from_export:
            out.append(
                f'{prefix}adapter needs {prefix}init_from "job:ID" or "export:DIR": the '
                "weights it adapts"
            )
        if self.init_from is not None:
            kind, _, rest = self.init_from.partition(":")
            if kind not in INIT_FROM_KINDS or not rest.strip():
                out.append(
                    f'{prefix}init_from must be "preset:DIR" (a keras-hub Llama preset), '
                    '"job:ID" (a finished job) or "export:DIR" (an export directory)'
                )
        return out

    @property
    def init_from_export(self) -> bool:
        """Whether the job starts from a job's or an export's weights (the leader serves
        them), not from random ones or a preset every fellow reads itself."""
        return self.init_from is not None and self.init_from.startswith(("job:", "export:"))

    def _data_problems(self, prefix: str) -> list[str]:
        if not self.data:
            return [f"{prefix}data must name at least one path or glob"]
        out = []
        for i, entry in enumerate(self.data):
            where = f"{prefix}data[{i}]"
            if isinstance(entry, JsonlSource):
                out.extend(entry.problems(where))
                text = entry.jsonl
            elif not isinstance(entry, str) or not entry.strip():
                out.append(f'{where} must be a path or glob, or {{"jsonl": ..., "field": ...}}')
                continue
            else:
                text = entry
            if datasets.is_dataset(text):
                try:
                    datasets.parse(text)
                except ValueError as exc:
                    out.append(f"{where}: {exc}")
        return out

    def dataset_entries(self) -> list[tuple[int, str]]:
        """``(index, text)`` of each ``data`` entry that names an uploaded dataset."""
        out = []
        for i, entry in enumerate(self.data):
            text = datasets.entry_text(entry)
            if text is not None and datasets.is_dataset(text):
                out.append((i, text))
        return out

    def _schedule_problems(self, prefix: str) -> list[str]:
        out = []
        m = self.micro_batches
        if m != "auto" and m < 1:
            out.append(f'{prefix}micro_batches must be >= 1 or "auto"')
        elif m != "auto" and self.batch_size % m:
            out.append(
                f"{prefix}micro_batches ({m}) must divide {prefix}batch_size ({self.batch_size})"
            )
        top = self.batch_size if m == "auto" else m
        if self.in_flight is not None and not 1 <= self.in_flight <= top:
            what = f"{prefix}batch_size" if m == "auto" else f"{prefix}micro_batches"
            out.append(f"{prefix}in_flight ({self.in_flight}) must be in [1, {what} ({top})]")
        k = self.fixed_deferred
        if k and m != "auto" and k >= m:
            out.append(
                f"{prefix}defer_weight_grads ({k}) must be below {prefix}micro_batches ({m}): "
                "the step's last micro-batch is the one upstream waits for first"
            )
        if k and self.overlap:
            out.append(f'{prefix}defer_weight_grads needs {prefix}schedule "1f1b" (or 0)')
        if self.recompute and self.overlap:
            out.append(
                f'{prefix}recompute needs {prefix}schedule "1f1b" (an overlapped backward may '
                "run after the update its forward did not see)"
            )
        return out

    @property
    def auto_micro_batches(self) -> bool:
        return self.micro_batches == "auto"

    @property
    def overlap(self) -> bool:
        """Whether consecutive steps overlap (``schedule: "overlap"``)."""
        return self.schedule == "overlap"

    @property
    def auto_deferred(self) -> bool:
        """Whether the stages choose ``defer_weight_grads`` (see :func:`may_defer`)."""
        return self.defer_weight_grads == "auto"

    @property
    def fixed_deferred(self) -> int:
        """The job's own count of deferred weight-gradient passes; 0 under "auto" (until the
        stages choose, and where they may not: :func:`may_defer`)."""
        k = self.defer_weight_grads
        return 0 if k == "auto" else k

    @property
    def initial_deferred(self) -> int:
        """Micro-batches whose weight gradients the last stage defers before any decision."""
        return min(self.fixed_deferred, self.initial_micro_batches - 1)

    @property
    def initial_micro_batches(self) -> int:
        """The count a step runs with before any decision: the spec's, or under "auto" the
        largest divisor of the batch up to :data:`PROVISIONAL_MICRO_BATCHES`."""
        if self.micro_batches != "auto":
            return self.micro_batches
        top = min(PROVISIONAL_MICRO_BATCHES, self.batch_size)
        return max(d for d in range(1, top + 1) if self.batch_size % d == 0)

    @property
    def initial_in_flight(self) -> int:
        """The forward window before any decision (1: 1F1B's own, see :func:`stage_in_flight`)."""
        window = self.in_flight or 1
        return min(window, self.initial_micro_batches)

    def memory_schedule(self) -> tuple[int, int | None]:
        """The micro-batch count and window a memory estimate must assume: under "auto",
        a whole batch's activations held at once (the most any choice can hold)."""
        if self.micro_batches == "auto":
            return 1, None
        return self.micro_batches, self.in_flight

    def memory_deferred(self) -> int | None:
        """The deferred weight-gradient passes a memory estimate must assume (None: "auto",
        any count the stages may choose)."""
        k = self.defer_weight_grads
        return None if k == "auto" else k

    def train_config(self) -> TrainConfig:
        """Exactly the training fields, as a TrainConfig (of a JobSpec: for its plans)."""
        if type(self) is TrainConfig:
            return self
        return TrainConfig(**{name: getattr(self, name) for name in TrainConfig.__struct_fields__})


class Transport(NewerValues):
    AUTO = "auto"
    P2P = "p2p"
    TUNNEL = "tunnel"


class GpuSlot(msgspec.Struct, frozen=True, kw_only=True):
    gpu_index: int
    gpu_uuid: str
    layer_start: int
    layer_end: int


class Peer(msgspec.Struct, frozen=True, kw_only=True):
    fellow_id: str
    data_address: str | None = None


class CurveKeys(msgspec.Struct, frozen=True, kw_only=True):
    """ZeroMQ CURVE keys (Z85) for one end of a p2p boundary: its own pair and its one peer's
    public key. The leader makes them for each START; they are never stored."""

    public: str
    secret: str
    peer_public: str


RelayToken = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32,128}$")]
ReplicaIndex = Annotated[int, msgspec.Meta(ge=0, le=4095)]


Digest = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
# A stage's state digests after a ring change, by ring (its segment's first layer).
StateDigests = Annotated[
    dict[Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYERS)], Digest],
    msgspec.Meta(max_length=MAX_LAYERS),
]


class SyncRing(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """One ring a replicated stage is a member of (:mod:`silentswarm.rings`): the ring of the
    replicas' stages that hold the segment of layers ``[layer_start, layer_end)``.

    The member binds its stage's sync port ``port`` (an index into the plan's
    ``sync_ports``; None: the link from ``prev`` uses the relay) for its predecessor ``prev``
    and connects to its successor ``next`` (whose ``data_address`` is the successor's port
    for this ring; None: the relay), with the links' CURVE keys and relay tokens as for a
    boundary (up: from the predecessor, down: to the successor). A ring of one member has no
    peers.

    In a ring of three or more a member forwards the others' contributions, so the links'
    keys prove only who passed a frame on: each member signs what it originates (ed25519;
    ``sign_seed`` its own key, ``signers`` every member's public key by replica), and a
    frame whose origin did not sign it is dropped. A ring of two forwards nothing. Fields at
    their defaults are left out of the JSON, so an agent from before signing still takes a
    ring of two (and refuses a signed one, which it could not check)."""

    layer_start: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYERS)]
    layer_end: Annotated[int, msgspec.Meta(ge=1, le=MAX_LAYERS)]
    port: Annotated[int, msgspec.Meta(ge=0, le=63)] | None = None
    prev: Peer | None = None
    next: Peer | None = None
    curve_up: CurveKeys | None = None
    curve_down: CurveKeys | None = None
    relay_up_token: RelayToken | None = None
    relay_down_token: RelayToken | None = None
    sign_seed: Digest | None = None
    signers: dict[Annotated[int, msgspec.Meta(ge=0, le=4095)], Digest] = msgspec.field(
        default_factory=dict
    )

    @property
    def segment(self) -> int:
        """The segment's name: its first layer."""
        return self.layer_start


def ring_problems(
    rings: Sequence[SyncRing], layers: tuple[int, int] | None, *, members: int
) -> list[str]:
    """Why ``rings`` cannot be a stage's rings among ``members`` replicas: they must cut
    contiguous layers in order (exactly the stage's ``layers``, where given), and each ring
    of more than one member needs its peers."""
    out = []
    cuts = [(r.layer_start, r.layer_end) for r in rings]
    ordered = bool(cuts) and all(a < b for a, b in cuts)
    ordered = ordered and all(cuts[i][1] == cuts[i + 1][0] for i in range(len(cuts) - 1))
    if layers is not None and ordered:
        ordered = (cuts[0][0], cuts[-1][1]) == tuple(layers)
    if not ordered:
        whose = "" if layers is None else f" [{layers[0]}, {layers[1]})"
        out.append(f"'rings' {cuts} must cut the stage's layers{whose} in order")
    if members > 1 and any(r.prev is None or r.next is None for r in rings):
        out.append("a ring of more than one member needs 'prev' and 'next'")
    return out


class RingChange(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A new membership of the replicas' rings (elastic membership), for one member stage.

    The leader sends it (a ``ring`` command through the fellow's agent) to every member
    stage of the new rings when a replica is lost or a replacement joins. Every member
    switches before it trains step ``at_step`` (0-based: after ``at_step`` completed steps),
    so all switch at the same step: it closes its old ring links, opens the new ones
    (``rings``: one per segment the stage holds among the new members' splits, with their
    peers, CURVE keys and relay tokens, fresh for each epoch, so a member left out cannot
    talk to the new rings), and takes the state (weights, optimizer, DiLoCo's outer state)
    of ``donor``, which goes around each new ring once. A member that had state of its own
    checks the donor's against it; one in ``joining`` has none. ``members`` are replica
    indices, sorted: the rings' order (each sends to the next, the last to the first). A
    ring of one member has no links: its rounds average its own contribution.
    """

    epoch: Annotated[int, msgspec.Meta(ge=1, le=2**31)]
    at_step: Annotated[int, msgspec.Meta(ge=0, le=2**53)]
    members: Annotated[list[ReplicaIndex], msgspec.Meta(min_length=1, max_length=4096)]
    donor: ReplicaIndex
    joining: Annotated[list[ReplicaIndex], msgspec.Meta(max_length=4096)] = msgspec.field(
        default_factory=list
    )
    rings: Annotated[list[SyncRing], msgspec.Meta(max_length=MAX_LAYERS)] = msgspec.field(
        default_factory=list
    )
    # When replica 0 is lost, the lowest member replica takes over its duty of checkpointing
    # for the leader (the shard pushes and the export): from ``at_step`` on this member uses
    # these instead of its plan's ``checkpoint_every`` and ``checkpoint_at_end`` (None: the
    # plan's stay).
    checkpoint_every: Annotated[int, msgspec.Meta(ge=0, le=2**31)] | None = None
    checkpoint_at_end: bool | None = None

    def problems(self, replica: int, layers: tuple[int, int] | None = None) -> list[str]:
        """What makes this change impossible for member ``replica``, a stage of ``layers``
        (``[start, end)``; None: not checked) (empty: none)."""
        out = []
        if self.members != sorted(set(self.members)):
            out.append("'members' must be sorted and distinct")
        if replica not in self.members:
            out.append(f"replica {replica} is not in 'members' {self.members}")
        if self.donor not in self.members or self.donor in self.joining:
            out.append(f"'donor' {self.donor} must be a member that is not joining")
        if not set(self.joining) <= set(self.members):
            out.append("'joining' must be members")
        out.extend(ring_problems(self.rings, layers, members=len(self.members)))
        return out


class StagePlan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    job_id: str
    attempt: int = 1
    stage: int
    n_stages: int
    layer_start: int
    layer_end: int
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    compression: str = "none"
    grad_compression: str | None = None  # wire codec for gradients; None: as activations
    transport: Transport = Transport.AUTO
    fellow_id: str = "stage"
    data_address: str | None = None  # where this stage binds for its upstream boundary
    prev: Peer | None = None
    next: Peer | None = None
    nats: NatsAccess | None = None  # for the relay; each fellow fills in its own
    subject_prefix: str = "swarm"
    gpu_slots: list[GpuSlot] = msgspec.field(default_factory=list)
    # CURVE on the p2p boundaries: up (this stage binds; only the upstream peer may connect)
    # and down (this stage connects; it trusts only the downstream peer). None: plain TCP.
    curve_up: CurveKeys | None = None
    curve_down: CurveKeys | None = None
    # The relay secret (hex) of the up and down boundaries: every relay message is tagged with
    # it and one without a valid tag is dropped. None (plans made without a leader): the
    # relay accepts untagged messages.
    relay_up_token: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32,128}$")] | None = None
    relay_down_token: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32,128}$")] | None = None
    peer_timeout_s: float = 60.0
    p2p_probe_timeout_s: float = 3.0
    intra_op_threads: int | None = None
    checkpoint_dir: str | None = None  # where this stage writes checkpoints; None: nowhere
    # Also checkpoint every N steps (the job's shard pushes), and after the last step (the
    # export); both need checkpoint_dir.
    checkpoint_every: int = 0
    checkpoint_at_end: bool = False
    # Start from this checkpoint (its JSON file): weights, optimizer state, data position
    # and step. The job's automatic resume sets it.
    resume_from: str | None = None
    # Where the fellow put the export this job starts from (train.init_from "job:"/"export:"):
    # its run_manifest.json and the shards of the stages that hold this stage's layers. The
    # agent sets it; a resumed attempt (resume_from) does not use it.
    init_dir: str | None = None
    # Replicas (a job's ``replicas``): this plan is stage ``stage`` of pipeline ``replica`` of
    # ``n_replicas``. The stage is a member of one ring per segment of layers it holds
    # (``sync_rings``, in order; :mod:`silentswarm.rings`): each binds one of this
    # fellow's ring ports ``sync_ports`` for its predecessor and connects to its successor.
    replica: Annotated[int, msgspec.Meta(ge=0, le=4095)] = 0
    n_replicas: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    sync_ports: Annotated[list[str], msgspec.Meta(max_length=64)] = msgspec.field(
        default_factory=list
    )
    sync_rings: Annotated[list[SyncRing], msgspec.Meta(max_length=MAX_LAYERS)] = msgspec.field(
        default_factory=list
    )
    # Elastic membership: this stage is part of a replica that joins a running job in place
    # of a lost one. It builds its model and opens its pipeline boundaries (not the ring),
    # says so (a ``joining`` event), waits for its ``ring`` command (a RingChange that lists it
    # in ``joining``), takes the donor's state there and trains from the change's ``at_step``.
    joining: bool = False

    @property
    def replicated(self) -> bool:
        """Whether this stage has replicas to keep in sync with."""
        return self.n_replicas > 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1

    def codecs(self) -> tuple[CompressionSpec, WireCodec]:
        """The boundaries' compression and the gradients' wire codec (the activations' unless
        ``grad_compression`` says otherwise); ConfigError naming the bad spec."""
        spec = parse_compression(self.compression, d_model=self.model.d_model)
        if self.grad_compression is None:
            return spec, spec.codec
        return spec, parse_wire_codec(self.grad_compression, what="grad_compression")

    def problems(self) -> list[str]:
        """Why this plan cannot run: every reason, each naming its field."""
        out = [
            *self.model.problems(),
            *self.train.problems(),
            *self.train.tokenizer.problems(self.model.vocab_size, prefix="train."),
            *recompute_problems(self.model, self.train, prefix="train."),
            *defer_problems(self.model, self.train, prefix="train."),
        ]
        out.extend(self._layout_problems())
        out.extend(self._peer_problems())
        try:
            self.codecs()
        except ConfigError as exc:
            out.append(exc.message)
        out.extend(self._id_problems())
        if self.attempt < 0:
            out.append("attempt must be >= 0")
        if self.peer_timeout_s <= 0 or self.p2p_probe_timeout_s < 0:
            out.append("peer_timeout_s must be > 0 and p2p_probe_timeout_s >= 0")
        if self.intra_op_threads is not None and self.intra_op_threads < 1:
            out.append("intra_op_threads must be >= 1")
        out.extend(self._slot_problems())
        out.extend(self._replica_problems())
        return out

    def _replica_problems(self) -> list[str]:
        if not 0 <= self.replica < self.n_replicas:
            return [f"replica {self.replica} is outside 0..{self.n_replicas - 1}"]
        if not self.replicated:
            return []
        out = []
        if not self.joining:
            out.extend(
                ring_problems(
                    self.sync_rings, (self.layer_start, self.layer_end), members=self.n_replicas
                )
            )
        if self.train.overlap:
            out.append('schedule "overlap" cannot run with replicas (use "1f1b")')
        if self.transport == Transport.P2P:
            for ring in self.sync_rings:
                where = f"ring of layers [{ring.layer_start}, {ring.layer_end})"
                if self.sync_bind(ring) is None:
                    out.append(f"transport p2p needs a sync port to bind for the {where}")
                if ring.next is not None and not ring.next.data_address:
                    out.append(f"transport p2p needs the {where}'s 'next' with its sync address")
        if self.transport == Transport.TUNNEL and not self.nats:
            out.append("transport 'tunnel' needs 'nats' (the NATS URL) for the replicas' ring")
        return out

    def sync_bind(self, ring: SyncRing) -> str | None:
        """Where this stage binds for ``ring``'s predecessor (None: the relay)."""
        if ring.port is None or ring.port >= len(self.sync_ports):
            return None
        return self.sync_ports[ring.port]

    def _layout_problems(self) -> list[str]:
        out = []
        if not 0 <= self.stage < self.n_stages:
            out.append(f"stage {self.stage} is outside 0..{self.n_stages - 1}")
        if not 0 <= self.layer_start <= self.layer_end <= self.model.n_layers:
            out.append(
                f"layers [{self.layer_start}, {self.layer_end}) are outside the model's "
                f"{self.model.n_layers} layers"
            )
        if self.n_stages > 1 and self.layer_start == self.layer_end:
            out.append(f"stage {self.stage} owns no layer")
        return out

    def _peer_problems(self) -> list[str]:
        out = []
        p2p = self.transport != Transport.TUNNEL
        if not self.is_first and self.prev is None:
            out.append(f"stage {self.stage} needs 'prev' (the upstream peer)")
        if not self.is_last and self.next is None:
            out.append(f"stage {self.stage} needs 'next' (the downstream peer)")
        if not self.is_last and p2p and (self.next is None or not self.next.data_address):
            out.append(f"stage {self.stage} needs 'next' with a data_address for p2p")
        if not self.is_first and p2p and not self.data_address:
            out.append(f"stage {self.stage} needs 'data_address' to bind for p2p")
        if self.n_stages > 1 and not p2p and not self.nats:
            out.append("transport 'tunnel' needs 'nats' (the NATS URL) for the relay")
        return out

    def _id_problems(self) -> list[str]:
        # Imported here: swarm.subjects imports the protocol, whose START carries a StagePlan.
        from silentswarm.subjects import TOKEN_RE

        rule = "use 1-64 letters, digits, '-', '_'"
        out = [
            f"{name} {getattr(self, name)!r}: {rule}"
            for name in ("job_id", "fellow_id")
            if not TOKEN_RE.match(getattr(self, name))
        ]
        out.extend(
            f"peer fellow_id {peer.fellow_id!r}: {rule}"
            for peer in (self.prev, self.next)
            if peer is not None and not TOKEN_RE.match(peer.fellow_id)
        )
        return out

    def _slot_problems(self) -> list[str]:
        out, covered = [], set()
        for slot in self.gpu_slots:
            layers = set(range(slot.layer_start, slot.layer_end))
            if not layers or not layers <= set(range(self.layer_start, self.layer_end)):
                out.append(
                    f"gpu slot [{slot.layer_start}, {slot.layer_end}) is not inside the stage's "
                    f"layers [{self.layer_start}, {self.layer_end})"
                )
            if layers & covered:
                out.append(f"gpu slot [{slot.layer_start}, {slot.layer_end}) overlaps another")
            covered |= layers
        return out

    def checked(self) -> Self:
        problems = self.problems()
        if problems:
            raise ConfigError("invalid stage plan: " + "; ".join(problems))
        return self


def recompute_problems(model: ModelConfig, train: TrainConfig, prefix: str = "") -> list[str]:
    """``recompute`` runs a forward twice, so both must draw the same numbers: no dropout."""
    if train.recompute and model.dropout > 0:
        return [
            f"{prefix}recompute needs model.dropout 0 (a recomputed forward would draw other "
            "dropout masks)"
        ]
    return []


def defer_problems(model: ModelConfig, train: TrainConfig, prefix: str = "") -> list[str]:
    """Deferred weight gradients run a micro-batch's forward twice: no dropout."""
    if train.fixed_deferred and model.dropout > 0:
        return [
            f"{prefix}defer_weight_grads needs model.dropout 0 (the weights' pass runs the "
            'forward again, which would draw other dropout masks), or 0 or "auto"'
        ]
    return []


def may_defer(model: ModelConfig, train: TrainConfig) -> bool:
    """Whether ``defer_weight_grads: "auto"`` may choose more than 0: not where a forward run
    twice draws other numbers (dropout), nor where steps overlap."""
    return train.auto_deferred and model.dropout == 0 and not train.overlap


def decode_plan(data: bytes, *, source: str = "plan") -> StagePlan:
    """A plan from JSON; ConfigError naming the source, the field and the reason."""
    try:
        plan = msgspec.json.decode(data, type=StagePlan)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid JSON ({exc})") from None
    problems = plan.problems()
    if problems:
        raise ConfigError(f"{source}: invalid stage plan: " + "; ".join(problems))
    return plan


def split_layers(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Equal contiguous half-open layer ranges; earlier stages take the remainder."""
    if not 1 <= n_stages <= n_layers:
        raise ConfigError(f"cannot split {n_layers} layers into {n_stages} stages")
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for i in range(n_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


class LayerRange(Protocol):
    layer_start: int
    layer_end: int


def layers_overlap(a: LayerRange, b: LayerRange) -> bool:
    """Whether two half-open layer ranges (stages, placed stages, exported shards) share a
    layer."""
    return a.layer_start < b.layer_end and b.layer_start < a.layer_end


def stage_in_flight(
    stage: int, n_stages: int, micro_batches: int, in_flight: int | None = None
) -> int:
    """Micro-batches stage ``stage`` holds activations for at once.

    1F1B's ``p - s``, or ``in_flight`` where that is more, never more than ``m``; the last
    stage runs each micro-batch's forward and backward together, so 1. The count never grows
    along the chain, which keeps the schedule free of deadlock: a stage has sent every
    forward its downstream needs before it waits for a gradient.
    """
    if stage == n_stages - 1:
        return 1
    return max(1, min(micro_batches, max(n_stages - stage, in_flight or 0)))


def single_process_plan(
    *, job_id: str, model: ModelConfig, train: TrainConfig, intra_op_threads: int | None = 1
) -> StagePlan:
    """The whole model in one stage: the reference a pipeline is compared with."""
    return StagePlan(
        job_id=job_id,
        stage=0,
        n_stages=1,
        layer_start=0,
        layer_end=model.n_layers,
        model=model,
        train=train,
        intra_op_threads=intra_op_threads,
    ).checked()


def chain_plans(
    *,
    job_id: str,
    model: ModelConfig,
    train: TrainConfig,
    addresses: list[str | None],
    fellow_ids: list[str] | None = None,
    compression: str = "none",
    grad_compression: str | None = None,
    transport: Transport = Transport.AUTO,
    nats_url: str | None = None,
    attempt: int = 1,
    intra_op_threads: int | None = None,
    peer_timeout_s: float = 60.0,
    ranges: Sequence[tuple[int, int]] | None = None,
    secure: bool = False,
) -> list[StagePlan]:
    """Plans for a chain of ``len(addresses)`` stages with ``ranges`` of layers (default:
    equal ranges).

    ``addresses[i]`` is where stage i binds for its upstream boundary (unused for stage 0).
    Without ``intra_op_threads`` each stage gets this machine's cores / stages. With
    ``secure`` every boundary gets fresh CURVE keys (p2p) and relay tokens (tunnel), as a
    leader's plans have: a bound boundary without CURVE takes any connector, and ZeroMQ
    deals its frames out among all of them (a stray socket still reconnecting to a port
    that was freed and handed out again takes every other frame).
    """
    from silentswarm.rings import link_secrets  # it imports this module

    if intra_op_threads is None:
        intra_op_threads = max(1, usable_cores() // len(addresses))
    n = len(addresses)
    ids = fellow_ids or [f"stage-{i}" for i in range(n)]
    if ranges is None:
        ranges = split_layers(model.n_layers, n)
    links = (
        link_secrets(n - 1, curve=transport != Transport.TUNNEL, relay=transport != Transport.P2P)
        if secure
        else None
    )
    plans = []
    for i, (start, end) in enumerate(ranges):
        up = links[i - 1] if links and i > 0 else None
        down = links[i] if links and i + 1 < n else None
        plans.append(
            StagePlan(
                job_id=job_id,
                attempt=attempt,
                stage=i,
                n_stages=n,
                layer_start=start,
                layer_end=end,
                model=model,
                train=train,
                compression=compression,
                grad_compression=grad_compression,
                transport=transport,
                fellow_id=ids[i],
                data_address=addresses[i] if i > 0 else None,
                prev=Peer(fellow_id=ids[i - 1]) if i > 0 else None,
                next=Peer(fellow_id=ids[i + 1], data_address=addresses[i + 1])
                if i + 1 < n
                else None,
                nats=NatsAccess(url=nats_url) if nats_url else None,
                intra_op_threads=intra_op_threads,
                peer_timeout_s=peer_timeout_s,
                curve_up=up.binding if up else None,
                curve_down=down.connecting if down else None,
                relay_up_token=up.token if up else None,
                relay_down_token=down.token if down else None,
            ).checked()
        )
    return plans


def replicated_chain_plans(
    *,
    job_id: str,
    model: ModelConfig,
    train: TrainConfig,
    addresses: list[list[str | None]],
    sync_addresses: list[list[str | None]],
    fellow_ids: list[list[str]] | None = None,
    splits: list[list[tuple[int, int]]] | None = None,
    compression: str = "none",
    grad_compression: str | None = None,
    transport: Transport = Transport.AUTO,
    nats_url: str | None = None,
    attempt: int = 1,
    intra_op_threads: int | None = None,
    peer_timeout_s: float = 60.0,
    secure: bool = False,
) -> list[list[StagePlan]]:
    """Plans for ``len(addresses)`` replicas of a chain of ``len(addresses[0])`` stages,
    without a leader (tests, benchmarks): ``plans[r][s]`` is stage ``s`` of replica ``r``.

    ``addresses[r]`` are replica r's boundary addresses, as :func:`chain_plans` takes them;
    ``sync_addresses[r][s]`` is stage s of replica r's sync address (one port, or a range
    ``tcp://h:7000-7003``: one port per ring it is in). ``splits[r]`` is replica r's layer
    split (default: equal ranges for every replica). Every segment's holders form a ring in
    replica order (:func:`silentswarm.rings.build_rings`); with ``secure`` every boundary and
    ring link gets fresh CURVE keys and relay tokens, as a leader's plans have.
    """
    from silentswarm import rings  # it imports this module

    k = len(addresses)
    n = len(addresses[0]) if addresses else 0
    if k < 1 or any(len(a) != n for a in addresses) or len(sync_addresses) != k:
        raise ConfigError("need one address list of equal length per replica")
    if any(len(s) != n for s in sync_addresses):
        raise ConfigError("need one sync address per stage of every replica")
    if splits is not None and (len(splits) != k or any(len(s) != n for s in splits)):
        raise ConfigError("need one split of the chain's stages per replica")
    if intra_op_threads is None:
        intra_op_threads = max(1, usable_cores() // (k * n))
    ids = fellow_ids or [[f"r{r}-stage-{s}" for s in range(n)] for r in range(k)]
    chains = [
        chain_plans(
            job_id=job_id,
            model=model,
            train=train,
            addresses=addresses[r],
            fellow_ids=ids[r],
            ranges=None if splits is None else splits[r],
            compression=compression,
            grad_compression=grad_compression,
            transport=transport,
            nats_url=nats_url,
            attempt=attempt,
            intra_op_threads=intra_op_threads,
            peer_timeout_s=peer_timeout_s,
            secure=secure,
        )
        for r in range(k)
    ]
    if k == 1:
        return chains
    seats = {
        r: [
            rings.Seat.of(plan, r, rings.sync_ports(sync_addresses[r][s]))
            for s, plan in enumerate(chains[r])
        ]
        for r in range(k)
    }
    built = rings.build_rings(seats, curve=secure, relay=secure)
    return [
        [
            msgspec.structs.replace(
                plan,
                replica=r,
                n_replicas=k,
                sync_ports=rings.sync_ports(sync_addresses[r][s]),
                sync_rings=built[(r, s)],
            ).checked()
            for s, plan in enumerate(chains[r])
        ]
        for r in range(k)
    ]
