"""The two manifests of a model export, each with its one writer and its one reader.

- ``run_manifest.json``: the leader writes it into a job's export directory
  (:meth:`leader.artifacts.ExportStore.write_manifest`): the job, its spec and placement, and
  every stage's shard of the newest complete step. Glue reads it
  (:func:`silentswarm.agent.runtime.glue.read_run_manifest`).
- ``inference_manifest.json``: glue writes it next to the glued model; generate reads it
  (:func:`silentswarm.agent.runtime.generate.load_model`).

Both are JSON objects with ``"format": 1``; the format is read first, so a newer manifest is
refused by its format instead of by a field it renamed. Unknown fields are ignored (a newer
writer may add some). A reader's error names the file and the field::

    run_manifest.json: step must be int, got null
    run_manifest.json: stages[0]: missing checkpoint

Readers accept Python's ``NaN``/``Infinity`` literals (``json.dumps`` wrote them into older
manifests for a diverged loss); the writers write ``null`` for a non-finite float.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, TypeVar

import msgspec

from silentswarm.errors import ManifestError
from silentswarm.jobspec import JobSpec, Placement, stage_plans
from silentswarm.plan import JsonlSource, ModelConfig, StagePlan

RUN_MANIFEST = "run_manifest.json"
RUN_MANIFEST_FORMAT = 1
INFERENCE_MANIFEST = "inference_manifest.json"
INFERENCE_FORMAT = 1
GLUED_KIND = "silentswarm-glued-transformer"


# --- the run manifest (leader -> glue) --------------------------------------------------------


class StageShard(msgspec.Struct, kw_only=True, frozen=True):
    """One stage's checkpoint of one step: its JSON and its arrays, relative to the export
    directory, with their sha256s."""

    stage: int
    fellow_id: str | None = None
    layer_start: int
    layer_end: int
    checkpoint: str  # shards/step-<n>/stage-<i>.json
    checkpoint_sha256: str
    weights: str  # shards/step-<n>/stage-<i>.npz
    weights_sha256: str


class ExportedShard(StageShard, kw_only=True, frozen=True):
    """A shard as the leader stored it (the run manifest's entries)."""

    bytes: int | None = None  # both files

    def files(self) -> StageShard:
        """The shard without what only the leader's store knows."""
        return StageShard(**{name: getattr(self, name) for name in StageShard.__struct_fields__})


class BaseRef(msgspec.Struct, kw_only=True, frozen=True):
    """The export a job's adapter adapts (``adapter`` with ``init_from``): its job, step and
    the sha256 of its ``run_manifest.json`` (what glue, generate and serve check a base by;
    a glued base records it as ``run_manifest_sha256``)."""

    job_id: str
    step: int
    manifest_sha256: str


class RunManifest(msgspec.Struct, kw_only=True, frozen=True):
    format: int = RUN_MANIFEST_FORMAT
    job_id: str
    name: str | None = None
    attempt: int
    state: str | None = None
    package_version: str | None = None
    spec: JobSpec
    placement: Placement
    compression: str
    step: int
    total_steps: int | None = None
    loss: float | None = None
    val_loss: float | None = None
    stages: list[ExportedShard]
    updated_at: float | None = None
    # Set for an adapter's export: its shards hold the adapter only, for this base.
    base: BaseRef | None = None
    # The account whose job wrote it (swarm.types.accounts); None: an export from before
    # accounts. Who may start from it once the job's record is deleted.
    owner: str | None = None

    def portable_plans(self) -> list[StagePlan]:
        """The plans the job's stages ran, without GPU slots (any machine builds them), in
        float32 (a bfloat16 job's weights are float32 too): what glue and a job starting
        from this export rebuild the stages from."""
        plans = stage_plans(
            job_id=self.job_id,
            attempt=self.attempt,
            spec=self.spec,
            # One pipeline, whichever replica led (an export written before exports named
            # it replica 0 lists the lead's stages under their own replica number).
            placement=self.placement.alone(),
            subject_prefix="swarm",
        )
        return [
            msgspec.structs.replace(
                p, gpu_slots=[], train=msgspec.structs.replace(p.train, precision="float32")
            )
            for p in plans
        ]


def encode_run_manifest(manifest: RunManifest) -> bytes:
    """The manifest's JSON; ``base`` only for an adapter's and ``owner`` only when known
    (other exports keep the keys they always had)."""
    if manifest.base is not None and manifest.owner is not None:
        return _encode(manifest)
    raw = msgspec.to_builtins(manifest)
    for key in ("base", "owner"):
        if raw[key] is None:
            del raw[key]
    return msgspec.json.format(msgspec.json.encode(raw), indent=1) + b"\n"


def decode_run_manifest(body: bytes, source: str = RUN_MANIFEST) -> RunManifest:
    """The manifest in ``body``; ManifestError naming ``source`` and the field otherwise."""
    return _decode(body, RunManifest, RUN_MANIFEST_FORMAT, source)


# --- the inference manifest (glue -> generate) ------------------------------------------------


class FileEntry(msgspec.Struct, kw_only=True, frozen=True):
    sha256: str
    bytes: int


class GlueCheck(msgspec.Struct, kw_only=True, frozen=True):
    """How closely the glued model reproduces the stage chain (see agent/runtime/glue/check.py)."""

    batches: int
    max_abs_diff: float
    tolerance: float
    logit_scale: float  # R = max(1, max|reference logits|)
    stage_max_abs_diff: list[float]
    stage_tolerance: list[float]
    codec_mismatches: list[int]
    codec_elements: list[int]
    reload_max_abs_diff: float


class DataInfo(msgspec.Struct, kw_only=True, frozen=True):
    """The validation data glue read on its machine."""

    patterns: list[str | JsonlSource]  # the job's train.data, or --data
    override: bool  # --data was given
    n_tokens: int
    sha256: str  # of the tokens
    batch_size: int
    val_batches: int  # 0: fewer windows than one batch, the pipeline had no validation loss


class InferenceManifest(msgspec.Struct, kw_only=True, frozen=True):
    format: int = INFERENCE_FORMAT
    kind: str = GLUED_KIND
    job_id: str
    name: str | None
    attempt: int
    step: int
    total_steps: int | None
    model: ModelConfig
    vocab_size: Annotated[int, msgspec.Meta(ge=1)]
    seq_len: Annotated[int, msgspec.Meta(ge=1)]
    seed: int
    compression: str
    wire_codec: str
    bottleneck_dim: int | None
    stages: list[StageShard]
    model_file: str
    config_file: str | None  # set for the weights + config fallback
    files: dict[str, FileEntry]  # every file of the model, model_file's included
    fallback: str | None  # why model.keras could not be used
    max_abs_diff: float
    tolerance: float
    check: GlueCheck
    val_loss: float | None
    # The tokenizer the model was trained with: "byte", or "bpe" with its JSON in
    # tokenizer_file (one of ``files``).
    tokenizer: str = "byte"
    tokenizer_file: str | None = None
    chain_val_loss: float | None
    pipeline_val_loss: float | None
    pipeline_loss: float | None
    data: DataInfo
    keras_version: str
    tensorflow_version: str
    package_version: str
    run_package_version: str | None
    run_manifest_sha256: str
    export_dir: str
    created_at: float


def encode_inference_manifest(manifest: InferenceManifest) -> bytes:
    return _encode(manifest)


def decode_inference_manifest(body: bytes, source: str = INFERENCE_MANIFEST) -> InferenceManifest:
    """The manifest in ``body``; ManifestError naming ``source`` and the field otherwise."""
    manifest = _decode(body, InferenceManifest, INFERENCE_FORMAT, source)
    if manifest.model_file not in manifest.files:
        raise ManifestError(f"{source}: files must describe every file, model_file's too")
    return manifest


# --- JSON -------------------------------------------------------------------------------------

_T = TypeVar("_T", bound=msgspec.Struct)
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$\.?(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]*)`$")
_EXPECTED = re.compile(r"^Expected `(?P<want>[^`]*)`(?:, got `(?P<got>[^`]*)`)?(?P<bound>.*)$")


def _encode(manifest: msgspec.Struct) -> bytes:
    return msgspec.json.format(msgspec.json.encode(manifest), indent=1) + b"\n"


def _decode(body: bytes, kind: type[_T], version: int, source: str) -> _T:
    try:
        raw: Any = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{source}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ManifestError(f"{source}: not a JSON object")
    if raw.get("format") != version:
        raise ManifestError(
            f"{source}: format {raw.get('format')!r}, this version reads format {version}"
        )
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        raise ManifestError(f"{source}: {describe(exc)}") from None


def describe(error: msgspec.ValidationError) -> str:
    """msgspec's message in the manifests' words: the field first, as a path
    (``stages[0].weights``), then what is wrong with it."""
    match = _AT.match(str(error))
    assert match is not None  # the pattern matches any text
    what, path = match["what"], match["path"] or ""
    if missing := _MISSING.match(what):
        return f"{path}: missing {missing['field']}" if path else f"missing {missing['field']}"
    if expected := _EXPECTED.match(what):
        got = f", got {expected['got']}" if expected["got"] else ""
        return f"{path or 'the manifest'} must be {expected['want']}{expected['bound']}{got}"
    return f"{path}: {what}" if path else what
