"""Glue an exported pipeline into one single-device Keras model, and prove it is the same model.

``python -m agent.runtime.glue --export-dir DIR [--out OUT] [--data PATTERN ...] [--json]``

A job's export directory (written by the leader) holds ``run_manifest.json`` and every stage's
checkpoint of one step (``shards/step-N/stage-i.json`` + ``.npz``, exactly what
:func:`agent.runtime.checkpoint.save_checkpoint` writes). Glueing:

1. reads and validates the manifest (format, keys, types, stages against the placement) and
   every file it lists (present, sha256 as recorded), before TensorFlow is even imported: a
   missing or corrupt shard is ``glue: error: <file>: ...``, exit 2, nothing written;
2. rebuilds each stage's ``StageModel`` from the very plans the job ran
   (:func:`swarm.jobspec.stage_plans`, GPU slots dropped so any machine can build them) and
   restores its checkpoint into it;
3. assembles a :class:`agent.runtime.model.GluedTransformer`: embed, the blocks in order, and
   at every stage boundary what the pipeline did there (the learned ``down``/``up``
   bottleneck, the wire codec's round trip in TensorFlow ops), then the head;
4. checks that it reproduces the pipeline on the job's validation batches (the same batches,
   built with the same configuration, as the last stage's validation in
   :meth:`agent.runtime.stage.StageRunner.evaluate`), see "The check" below; a mismatch is
   exit 1 and nothing is written;
5. computes the glued model's validation loss over those batches;
6. saves ``model.keras``, loads it back in this process and compares logits (if the ``.keras``
   format fails: ``model.weights.h5`` + ``config.json`` and ``"fallback": <reason>``);
7. writes ``inference_manifest.json`` next to it.

Output: one self-contained directory, ``OUT`` (default ``DIR/full_model``), holding
``model.keras`` (or the fallback pair) and ``inference_manifest.json``; it can be copied
anywhere and read by ``python -m agent.runtime.generate --model-dir OUT``. It is built in a
temporary sibling directory and renamed into place only when everything passed, so a failed
glue leaves nothing behind, and a previous ``OUT`` is replaced only by a complete new one
(an existing ``OUT`` that is not empty and holds no ``inference_manifest.json`` is refused,
as is the export directory itself). Loading the model needs this package, whose
``agent.runtime.model`` registers the layers with Keras::

    import keras, agent.runtime.model
    model = keras.saving.load_model("OUT/model.keras")  # tokens (batch, seq) -> logits

The check
---------
The reference is the chain of restored stage models run the way the pipeline runs them: each
stage's compiled forward (XLA when ``train.jit_compile``, like the pipeline), and between
stages the real numpy wire codec (``encode_frame``/``decode_frame`` of agent/pipe/wire.py).
Three comparisons, on every validation batch:

- per stage, teacher-forced: the glued model's part for stage *s*
  (:meth:`GluedTransformer.stage_forward`) on exactly the input stage *s* received must give
  its output within ``1e-3 * max(1, max|reference|)``. Both sides do the same float32 ops on
  the same weights; only op fusion and kernels differ (XLA or not): about 1e-6 measured. This
  is the check that catches wrong wiring or weights, whatever the compression.
- the codec: :class:`WireRoundTrip` on the activations stage *s* sent must give what the
  numpy wire decoded. Same formula, same float32 input: bit-identical on CPU, eager, in a
  ``tf.function`` and under XLA (tested; this check found Grappler's reciprocal rewrite). At
  most ``1e-4`` of the values may differ, each by at most one codec step, for accelerators
  whose kernels round differently (not measured on one).
- end to end, the final logits (``max_abs_diff`` in the manifest): ``1e-3 * R`` without a
  lossy codec, where ``R = max(1, max|reference logits|)``. With ``fp16`` or ``fixed_intN`` the
  glued model quantizes its *own* activations, which differ from the chain's by float noise;
  a value on a rounding edge (``x / scale`` within ~1e-7 of a half-integer, or near a float16
  tie) then lands one step apart: one float16 ulp (2**-11 relative), or one quantization
  step, ``absmax / qmax`` of its row (1/127 of the row's range at int8, 1/7 at int4, all of
  it at int2). Such flips are rare (measured: 0 to 4 in 10 000 boundary values) but each
  moves later logits by up to about that fraction of their range, so the end-to-end
  tolerance is ``1e-2 * R`` for ``fp16`` and ``max(1e-2, 2 / qmax) * R`` for ``fixed_intN``.
  Measured (4 layers, d=128, 3 stages, trained, 4 batches of 8 x 64, R about 4.5): 1.4e-6
  (none), 6.8e-5 (fp16), 7.8e-4 (int8, tolerance 0.071), 1.7e-2 (int4, tolerance 1.3); up to
  4.5e-4 (fp16) and 8.4e-3 (int8) with other weights. At int4 and below the end-to-end bound
  says little; the two checks above still pin every stage and every boundary down exactly.

The validation data is read on this machine: ``train.data`` of the job, resolved here (so
``stdlib`` means this Python's standard library, and relative paths are relative to the
working directory). ``--data`` points at another copy. The manifest records how many tokens
were read and their sha256, and ``chain_val_loss`` (the stage models' own loss on these
batches) next to ``pipeline_val_loss`` (what the job reported): if they differ a lot, the
data here is not what the job validated on.

Exit codes: 0 glued; 1 the glued model does not reproduce the pipeline (or TensorFlow
failed); 2 a bad argument, manifest, missing or corrupt file, or unreadable data. Errors are
one line on stderr, ``glue: error: ...``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import msgspec

from agent.runtime.tool import ToolParser, exit_with
from swarm.errors import ConfigError, SwarmError
from swarm.jobspec import JobSpec, Placement, stage_plans
from swarm.plan import StagePlan

if TYPE_CHECKING:
    import numpy as np

    from agent.runtime.model import GluedTransformer
    from agent.runtime.stage_model import StageModel

PROG = "glue"
RUN_MANIFEST = "run_manifest.json"
RUN_MANIFEST_FORMAT = 1
INFERENCE_MANIFEST = "inference_manifest.json"
INFERENCE_FORMAT = 1
KIND = "silentswarm-glued-transformer"
DEFAULT_OUT = "full_model"
MODEL_FILE = "model.keras"
WEIGHTS_FILE = "model.weights.h5"
CONFIG_FILE = "config.json"

STAGE_RTOL = 1e-3  # per stage and end to end without a lossy codec, times max(1, max|ref|)
RELOAD_RTOL = 1e-5  # the reloaded model against the one saved: the same ops on the same weights
CODEC_MISMATCH_FRACTION = 1e-4

_REQUIRED = {
    "format": int,
    "job_id": str,
    "attempt": int,
    "spec": dict,
    "placement": dict,
    "compression": str,
    "step": int,
    "stages": list,
}
_STAGE_REQUIRED = {
    "stage": int,
    "layer_start": int,
    "layer_end": int,
    "checkpoint": str,
    "checkpoint_sha256": str,
    "weights": str,
    "weights_sha256": str,
}


class GlueError(ConfigError):
    """The export cannot be glued: a bad manifest, a missing or corrupt file, no data."""

    code = "GLUE_INVALID"


class GlueMismatchError(SwarmError):
    """The glued model does not compute what the pipeline computed."""

    code = "GLUE_MISMATCH"
    exit_code = 1


# --- the run manifest (no TensorFlow) ---------------------------------------------------------


@dataclass(frozen=True)
class StageFiles:
    stage: int
    fellow_id: str | None
    layer_start: int
    layer_end: int
    checkpoint: Path  # the JSON
    weights: Path  # the npz
    checkpoint_rel: str
    weights_rel: str
    checkpoint_sha256: str
    weights_sha256: str


@dataclass(frozen=True)
class RunManifest:
    path: Path
    raw: dict[str, Any]
    sha256: str
    spec: JobSpec
    placement: Placement
    stages: list[StageFiles]

    @property
    def job_id(self) -> str:
        return self.raw["job_id"]

    @property
    def attempt(self) -> int:
        return self.raw["attempt"]

    @property
    def step(self) -> int:
        return self.raw["step"]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _typed(where: str, data: dict[str, Any], fields: dict[str, type]) -> None:
    missing = [k for k in fields if k not in data]
    if missing:
        raise GlueError(f"{where}: missing {', '.join(missing)}")
    for key, kind in fields.items():
        value = data[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise GlueError(f"{where}: {key} must be {kind.__name__}, got {value!r}")


def _inside(export_dir: Path, rel: str, where: str) -> Path:
    """``export_dir / rel``, refusing absolute paths and paths that leave the directory."""
    if not rel or Path(rel).is_absolute():
        raise GlueError(f"{where}: {rel!r} must be a path relative to the export directory")
    path = export_dir / rel
    root = export_dir.resolve()
    if root != path.resolve() and root not in path.resolve().parents:
        raise GlueError(f"{where}: {rel!r} leaves the export directory")
    return path


def _check_file(export_dir: Path, rel: str, want: str, what: str) -> None:
    path = export_dir / rel
    if not path.is_file():
        raise GlueError(f"{rel}: missing ({what})")
    got = sha256_file(path)
    if got != want.lower():
        raise GlueError(f"{rel}: sha256 {got} does not match the manifest ({want})")


def read_run_manifest(export_dir: str | os.PathLike[str]) -> RunManifest:
    """The validated manifest of ``export_dir``; every file it lists exists and checks out."""
    export_dir = Path(export_dir)
    path = export_dir / RUN_MANIFEST
    if not export_dir.is_dir():
        raise GlueError(f"{export_dir}: not a directory")
    try:
        body = path.read_bytes()
    except FileNotFoundError:
        raise GlueError(f"{path}: missing (not an export directory?)") from None
    except OSError as exc:
        raise GlueError(f"{path}: cannot read it ({exc.strerror})") from None
    try:
        raw = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GlueError(f"{RUN_MANIFEST}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise GlueError(f"{RUN_MANIFEST}: not a JSON object")
    if raw.get("format") != RUN_MANIFEST_FORMAT:
        raise GlueError(
            f"{RUN_MANIFEST}: format {raw.get('format')!r}, this glue reads format "
            f"{RUN_MANIFEST_FORMAT}"
        )
    _typed(RUN_MANIFEST, raw, _REQUIRED)
    try:
        spec = msgspec.convert(raw["spec"], JobSpec)
        placement = msgspec.convert(raw["placement"], Placement)
    except msgspec.ValidationError as exc:
        raise GlueError(f"{RUN_MANIFEST}: {exc}") from None
    if raw["compression"] != spec.compression:
        raise GlueError(
            f"{RUN_MANIFEST}: compression {raw['compression']!r} differs from the spec's "
            f"{spec.compression!r}"
        )
    problems = spec.problems()
    if problems:
        raise GlueError(f"{RUN_MANIFEST}: the job spec is invalid: {'; '.join(problems)}")
    n = len(placement.stages)
    if n < 1 or [s.stage for s in placement.stages] != list(range(n)):
        raise GlueError(f"{RUN_MANIFEST}: the placement's stages are not 0..{n - 1} in order")
    if len(raw["stages"]) != n:
        raise GlueError(
            f"{RUN_MANIFEST}: lists {len(raw['stages'])} stage checkpoints, the placement has "
            f"{n} stages"
        )
    stages = []
    for i, (entry, placed) in enumerate(zip(raw["stages"], placement.stages, strict=True)):
        where = f"{RUN_MANIFEST}: stages[{i}]"
        if not isinstance(entry, dict):
            raise GlueError(f"{where}: not an object")
        _typed(where, entry, _STAGE_REQUIRED)
        if entry["stage"] != i:
            raise GlueError(f"{where}: stage {entry['stage']}, expected {i}")
        have = (entry["layer_start"], entry["layer_end"])
        want = (placed.layer_start, placed.layer_end)
        if have != want:
            raise GlueError(
                f"{where}: layers {list(have)} differ from the placement's {list(want)}"
            )
        checkpoint = _inside(export_dir, entry["checkpoint"], where)
        weights = _inside(export_dir, entry["weights"], where)
        if checkpoint.parent.resolve() != weights.parent.resolve():
            raise GlueError(f"{where}: the checkpoint and its weights must share a directory")
        stages.append(
            StageFiles(
                stage=i,
                fellow_id=entry.get("fellow_id"),
                layer_start=entry["layer_start"],
                layer_end=entry["layer_end"],
                checkpoint=checkpoint,
                weights=weights,
                checkpoint_rel=entry["checkpoint"],
                weights_rel=entry["weights"],
                checkpoint_sha256=entry["checkpoint_sha256"],
                weights_sha256=entry["weights_sha256"],
            )
        )
    for files in stages:
        what = f"stage {files.stage}'s"
        _check_file(export_dir, files.checkpoint_rel, files.checkpoint_sha256, f"{what} checkpoint")
        _check_file(export_dir, files.weights_rel, files.weights_sha256, f"{what} weights")
        _check_meta(files, raw, spec)
    return RunManifest(
        path=path,
        raw=raw,
        sha256=hashlib.sha256(body).hexdigest(),
        spec=spec,
        placement=placement,
        stages=stages,
    )


def _check_meta(files: StageFiles, raw: dict[str, Any], spec: JobSpec) -> None:
    """The checkpoint's own JSON agrees with the manifest (it is read again when restoring)."""
    rel = files.checkpoint_rel
    try:
        meta = json.loads(files.checkpoint.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GlueError(f"{rel}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise GlueError(f"{rel}: not a stage checkpoint")
    want = {
        "job_id": raw["job_id"],
        "stage": files.stage,
        "n_stages": len(raw["stages"]),
        "layer_start": files.layer_start,
        "layer_end": files.layer_end,
        "steps_done": raw["step"],
        "compression": spec.compression,
        "model": msgspec.to_builtins(spec.model),
        "npz": files.weights.name,
    }
    wrong = [f"{k} {meta.get(k)!r} (want {v!r})" for k, v in want.items() if meta.get(k) != v]
    if wrong:
        raise GlueError(f"{rel}: does not fit the manifest: {'; '.join(wrong)}")


def plans_for(manifest: RunManifest) -> list[StagePlan]:
    """The plans the job's stages ran, without GPU slots (any machine builds them)."""
    plans = stage_plans(
        job_id=manifest.job_id,
        attempt=manifest.attempt,
        spec=manifest.spec,
        placement=manifest.placement,
        subject_prefix="swarm",
    )
    return [msgspec.structs.replace(plan, gpu_slots=[]) for plan in plans]


# --- tolerances -------------------------------------------------------------------------------


def codec_bits(wire: str) -> int | None:
    return int(wire.removeprefix("fixed_int")) if wire.startswith("fixed_int") else None


def end_to_end_rtol(wire: str) -> float:
    """The end-to-end tolerance, relative to ``max(1, max|logits|)`` (see the module doc)."""
    if wire == "none":
        return STAGE_RTOL
    if wire == "fp16":
        return 1e-2
    bits = codec_bits(wire)
    assert bits is not None, wire
    return max(1e-2, 2.0 / ((1 << (bits - 1)) - 1))


# --- the chain and the glued model (TensorFlow from here on) ----------------------------------


def build_stage_models(manifest: RunManifest, plans: list[StagePlan]) -> list[StageModel]:
    from agent.runtime.checkpoint import CheckpointError, load_checkpoint, restore_into
    from agent.runtime.stage_model import StageModel

    models = []
    for plan, files in zip(plans, manifest.stages, strict=True):
        model = StageModel(plan)
        try:
            restore_into(model, None, load_checkpoint(files.checkpoint))
        except CheckpointError as exc:
            raise GlueError(f"{files.checkpoint_rel}: {exc}") from None
        models.append(model)
    return models


def glued_from_stages(models: list[StageModel]) -> GluedTransformer:
    """A GluedTransformer holding exactly the stage models' variables (values copied)."""
    from agent.runtime.model import GluedTransformer

    plans = [m.plan for m in models]
    first = plans[0]
    glued = GluedTransformer(
        first.model,
        first.train.seed,
        first.compression,
        [[p.layer_start, p.layer_end] for p in plans],
        name="glued_transformer",
    )
    for model in models:
        stage = model.plan.stage
        for piece in model.pieces:
            name = piece.layer.name
            if name == "down":
                target = glued.downs[stage]
            elif name == "up":
                target = glued.ups[stage - 1]
            elif name.startswith("block_"):
                target = glued.blocks[int(name.removeprefix("block_"))]
            else:
                target = {"embed": glued.embed, "head": glued.head}[name]
            source_vars, target_vars = piece.layer.variables, target.variables
            if len(source_vars) != len(target_vars):
                raise GlueMismatchError(f"stage {stage}'s {name} has another set of variables")
            for src, dst in zip(source_vars, target_vars, strict=True):
                if tuple(src.shape) != tuple(dst.shape):
                    raise GlueMismatchError(
                        f"stage {stage}: {src.path} {tuple(src.shape)} does not fit "
                        f"{dst.path} {tuple(dst.shape)}"
                    )
                dst.assign(src.value)
    return glued


class Chain:
    """The restored stage models run like the pipeline runs them, numpy wire codec between."""

    def __init__(self, models: list[StageModel]) -> None:
        import tensorflow as tf

        from agent.pipe.wire import parse_wire_codec
        from agent.runtime.model import Head
        from swarm.compression import parse_compression

        self.models = models
        last = models[-1]
        spec = parse_compression(last.plan.compression, d_model=last.plan.model.d_model)
        self.codec = parse_wire_codec(spec.wire)

        def logits(x):
            for piece in last.pieces:
                layer = piece.layer
                if isinstance(layer, Head):
                    return layer(x)
                x = layer(x, training=False) if layer.name.startswith("block_") else layer(x)
            raise AssertionError("the last stage has no head")

        # The last stage's forward as StageModel compiles it (the pipeline asks it for the
        # loss only; here the logits are wanted too).
        self.last_logits = tf.function(
            logits, reduce_retracing=True, jit_compile=last.plan.train.jit_compile
        )

    def wire(self, array: np.ndarray, *, step: int = 0, micro: int = 0) -> np.ndarray:
        """What the next stage receives: encoded into a frame, over "the wire", decoded."""
        from agent.pipe.wire import Direction, decode_frame, encode_frame

        plan = self.models[0].plan
        _, parts = encode_frame(
            array,
            self.codec,
            job=plan.job_id,
            attempt=plan.attempt,
            step=step,
            micro=micro,
            direction=Direction.FWD,
            phase="eval",
        )
        _, decoded = decode_frame([bytes(part) for part in parts])
        return decoded

    def run(self, tokens: np.ndarray, targets: np.ndarray | None = None):
        """Each stage's input and output (numpy) and the last stage's loss, if targets."""
        import numpy as np
        import tensorflow as tf

        inputs, outputs = [], []
        x: np.ndarray = tokens
        loss = None
        for model in self.models:
            inputs.append(x)
            if model.plan.is_last:
                outputs.append(self.last_logits(tf.constant(x)).numpy())
                if targets is not None:
                    loss = float(
                        model.forward_loss(tf.constant(x), tf.constant(targets), training=False)
                    )
            else:
                out = model.forward(tf.constant(x), training=False).numpy()
                outputs.append(out)
                x = self.wire(np.ascontiguousarray(out, dtype=np.float32))
        return inputs, outputs, loss


@dataclass
class CheckResult:
    batches: int
    max_abs_diff: float
    tolerance: float
    logit_scale: float  # R = max(1, max|reference logits|)
    stage_max_abs_diff: list[float]
    stage_tolerance: list[float]
    codec_mismatches: list[int]
    codec_elements: list[int]
    val_loss: float | None
    chain_val_loss: float | None
    reference_logits: np.ndarray  # of the first batch, for the reload check
    first_batch: np.ndarray

    def to_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "max_abs_diff": self.max_abs_diff,
            "tolerance": self.tolerance,
            "logit_scale": self.logit_scale,
            "stage_max_abs_diff": self.stage_max_abs_diff,
            "stage_tolerance": self.stage_tolerance,
            "codec_mismatches": self.codec_mismatches,
            "codec_elements": self.codec_elements,
        }


def _codec_step(wire: str, sent: np.ndarray) -> np.ndarray:
    """Per row, the largest difference one rounding flip of the codec can make."""
    import numpy as np

    rows = np.max(np.abs(sent), axis=-1, keepdims=True)
    if wire == "fp16":
        return rows * 2.0**-10 + 2.0**-24
    bits = codec_bits(wire)
    assert bits is not None
    return rows / ((1 << (bits - 1)) - 1) * 1.01 + 2.0**-24


def check_and_evaluate(
    glued: GluedTransformer,
    chain: Chain,
    batches: list[tuple[np.ndarray, np.ndarray]],
    *,
    score: bool,
) -> CheckResult:
    """Compare the glued model with the chain on ``batches``; GlueMismatchError if it differs.

    With ``score`` the batches are the pipeline's validation batches and both losses are
    computed (means of per-batch means, as :meth:`StageRunner.evaluate` does).
    """
    import numpy as np
    import tensorflow as tf

    from agent.runtime.model import token_loss

    n = len(chain.models)
    wire = chain.codec.name
    forward = tf.function(lambda t: glued(t, training=False), reduce_retracing=True)
    stage_fns = [
        tf.function(lambda x, s=s: glued.stage_forward(s, x, training=False), reduce_retracing=True)
        for s in range(n)
    ]
    codec_fn = tf.function(glued.wire, reduce_retracing=True)
    stage_diff = [0.0] * n
    stage_scale = [1.0] * n
    mismatches, elements = [0] * (n - 1), [0] * (n - 1)
    worst, scale = 0.0, 1.0
    glued_losses, chain_losses = [], []
    first_logits = None
    for tokens, targets in batches:
        inputs, outputs, chain_loss = chain.run(tokens, targets if score else None)
        for s in range(n):
            got = stage_fns[s](tf.constant(inputs[s])).numpy()
            stage_diff[s] = max(stage_diff[s], float(np.max(np.abs(got - outputs[s]))))
            stage_scale[s] = max(stage_scale[s], float(np.max(np.abs(outputs[s]))))
            if s + 1 < n:
                mine = codec_fn(tf.constant(outputs[s])).numpy()
                differ = mine != inputs[s + 1]
                mismatches[s] += int(differ.sum())
                elements[s] += int(differ.size)
                if differ.any() and (
                    wire == "none"
                    or (np.abs(mine - inputs[s + 1]) > _codec_step(wire, outputs[s])).any()
                ):
                    raise GlueMismatchError(
                        f"boundary {s}: the glued model's {wire} codec gives "
                        f"{np.max(np.abs(mine - inputs[s + 1])):.3g} away from the wire's on "
                        f"{int(differ.sum())} of {differ.size} values"
                    )
        logits = forward(tf.constant(tokens)).numpy()
        reference = outputs[-1]
        worst = max(worst, float(np.max(np.abs(logits - reference))))
        scale = max(scale, float(np.max(np.abs(reference))))
        if first_logits is None:
            first_logits = logits
        if score:
            glued_losses.append(float(token_loss(tf.constant(logits), tf.constant(targets))))
            chain_losses.append(chain_loss)
    stage_tol = [STAGE_RTOL * s for s in stage_scale]
    for s in range(n):
        if not stage_diff[s] <= stage_tol[s]:  # NaN fails too
            raise GlueMismatchError(
                f"stage {s}: the glued model's part differs from the stage model by "
                f"{stage_diff[s]:.3g} (max abs difference; tolerance {stage_tol[s]:.3g}) on "
                f"the same input"
            )
    for s in range(n - 1):
        if mismatches[s] > max(1, CODEC_MISMATCH_FRACTION * elements[s]):
            raise GlueMismatchError(
                f"boundary {s}: the glued model's {wire} codec differs from the wire's on "
                f"{mismatches[s]} of {elements[s]} values"
            )
    tolerance = end_to_end_rtol(wire) * scale
    if not worst <= tolerance:
        raise GlueMismatchError(
            f"the glued model's logits differ from the pipeline's by {worst:.3g} (max abs "
            f"difference; tolerance {tolerance:.3g} for compression {glued.compression!r})"
        )
    assert first_logits is not None
    return CheckResult(
        batches=len(batches),
        max_abs_diff=worst,
        tolerance=tolerance,
        logit_scale=scale,
        stage_max_abs_diff=stage_diff,
        stage_tolerance=stage_tol,
        codec_mismatches=mismatches,
        codec_elements=elements,
        val_loss=sum(glued_losses) / len(glued_losses) if glued_losses else None,
        chain_val_loss=sum(chain_losses) / len(chain_losses) if chain_losses else None,
        reference_logits=first_logits,
        first_batch=batches[0][0],
    )


# --- validation data --------------------------------------------------------------------------


@dataclass
class ValidationData:
    batches: list[tuple[np.ndarray, np.ndarray]]
    scored: bool  # the pipeline's validation batches (else: one short batch, for the check)
    info: dict[str, Any]


def validation_data(plan: StagePlan, data: Sequence[str] | None) -> ValidationData:
    """The last stage's validation batches: the same ``job_dataset`` and ``job_val_batches``
    as :class:`StageRunner`, so the pipeline's ``val_loss`` and ``chain_val_loss`` agree to
    the last bit (tested against real stage processes).
    """
    import numpy as np

    from agent.runtime.data import DataError, job_dataset, job_val_batches

    train = plan.train
    patterns = list(data) if data else list(train.data)
    try:
        dataset = job_dataset(train, plan.model.seq_len, patterns)
    except (DataError, OSError) as exc:
        raise GlueError(
            f"cannot read the job's validation data {patterns}: {exc} (--data points at a copy)"
        ) from None
    batches = list(job_val_batches(dataset, train))
    scored = bool(batches)
    if not batches:  # fewer validation windows than one batch: the pipeline had no val loss
        batches = list(dataset.val_batches(train.batch_size, max_batches=1))
    info = {
        "patterns": patterns,
        "override": bool(data),
        "n_tokens": dataset.n_tokens,
        "sha256": hashlib.sha256(np.ascontiguousarray(dataset.tokens).tobytes()).hexdigest(),
        "batch_size": train.batch_size,
        "val_batches": len(batches) if scored else 0,
    }
    return ValidationData(batches=batches, scored=scored, info=info)


# --- saving -----------------------------------------------------------------------------------


def _reload_diff(loaded, tokens: np.ndarray, want: np.ndarray) -> float:
    import numpy as np
    import tensorflow as tf

    forward = tf.function(lambda t: loaded(t, training=False))
    return float(np.max(np.abs(forward(tf.constant(tokens)).numpy() - want)))


def save_model(
    glued: GluedTransformer, directory: Path, tokens: np.ndarray, want: np.ndarray
) -> tuple[str, str | None, float, str | None]:
    """Save (``.keras``, else weights + config) and prove it loads back to the same logits.

    Returns (model file, config file or None, reload max abs diff, fallback reason or None).
    """
    import keras

    from agent.runtime.model import GluedTransformer

    tolerance = RELOAD_RTOL * max(1.0, float(abs(want).max()))
    path = directory / MODEL_FILE
    try:
        glued.save(path)
        loaded = keras.saving.load_model(path, compile=False)
        if not isinstance(loaded, GluedTransformer):
            raise TypeError(f"it loads back as {type(loaded).__name__}")
        diff = _reload_diff(loaded, tokens, want)
        if not diff <= tolerance:
            raise ValueError(f"it loads back with logits {diff:.3g} away")
        return MODEL_FILE, None, diff, None
    except Exception as exc:  # any failure of the format: fall back to weights + config
        reason = f"saving {MODEL_FILE} failed: {type(exc).__name__}: {exc}".splitlines()[0]
        path.unlink(missing_ok=True)
    weights = directory / WEIGHTS_FILE
    config = directory / CONFIG_FILE
    try:
        glued.save_weights(weights)
        config.write_text(json.dumps(glued.get_config(), indent=1) + "\n")
        rebuilt = load_fallback(directory)
        diff = _reload_diff(rebuilt, tokens, want)
    except Exception as exc:
        raise GlueMismatchError(f"{reason}; {WEIGHTS_FILE} failed too: {exc}") from None
    if not diff <= tolerance:
        raise GlueMismatchError(f"{reason}; {WEIGHTS_FILE} loads back {diff:.3g} away")
    return WEIGHTS_FILE, CONFIG_FILE, diff, reason


def load_fallback(directory: Path) -> GluedTransformer:
    """A model saved as ``config.json`` + ``model.weights.h5``."""
    from agent.runtime.model import GluedTransformer

    config = json.loads((directory / CONFIG_FILE).read_text())
    model = GluedTransformer.from_config(config)
    model.build((None, model.cfg.seq_len))  # its variables exist already; Keras wants "built"
    model.load_weights(directory / WEIGHTS_FILE)
    return model


def check_out(export_dir: Path, out: Path) -> None:
    """GlueError unless ``out`` is new, empty, or an earlier glue's output (it gets replaced)."""
    resolved = out.resolve()
    if resolved == export_dir.resolve() or resolved in export_dir.resolve().parents:
        raise GlueError(f"--out {out}: would replace the export directory")
    if not out.exists():
        return
    if not out.is_dir():
        raise GlueError(f"--out {out}: exists and is not a directory")
    if any(out.iterdir()) and not (out / INFERENCE_MANIFEST).is_file():
        raise GlueError(
            f"--out {out}: exists and holds no {INFERENCE_MANIFEST}; refusing to replace it"
        )


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``; a previous ``out`` goes only once ``tmp`` is in."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        if old.exists():
            os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


# --- glue -------------------------------------------------------------------------------------


def glue(
    export_dir: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    data: Sequence[str] | None = None,
    manifest: RunManifest | None = None,
) -> dict[str, Any]:
    """Glue the export in ``export_dir`` into ``out``; the inference manifest written there.

    ``manifest``: the export's, already read by :func:`read_run_manifest` (else it is read
    here). GlueError (exit 2) for bad input, GlueMismatchError (exit 1) when the glued model
    does not reproduce the pipeline; nothing is written in either case.
    """
    export_dir = Path(export_dir)
    out = Path(out) if out is not None else export_dir / DEFAULT_OUT
    check_out(export_dir, out)
    if manifest is None:
        manifest = read_run_manifest(export_dir)
    plans = plans_for(manifest)
    val = validation_data(plans[-1], data)

    import keras
    import tensorflow as tf

    import swarm
    from swarm.compression import parse_compression

    models = build_stage_models(manifest, plans)
    glued = glued_from_stages(models)
    check = check_and_evaluate(glued, Chain(models), val.batches, score=val.scored)
    del models

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        model_file, config_file, reload_diff, fallback = save_model(
            glued, tmp, check.first_batch, check.reference_logits
        )
        files = {}
        for name in (model_file, config_file):
            if name is not None:
                files[name] = {
                    "sha256": sha256_file(tmp / name),
                    "bytes": (tmp / name).stat().st_size,
                }
        spec, raw = manifest.spec, manifest.raw
        compression = parse_compression(spec.compression, d_model=spec.model.d_model)
        inference = {
            "format": INFERENCE_FORMAT,
            "kind": KIND,
            "job_id": manifest.job_id,
            "name": raw.get("name", spec.name),
            "attempt": manifest.attempt,
            "step": manifest.step,
            "total_steps": raw.get("total_steps"),
            "model": msgspec.to_builtins(spec.model),
            "vocab_size": spec.model.vocab_size,
            "seq_len": spec.model.seq_len,
            "seed": spec.seed,
            "compression": spec.compression,
            "wire_codec": compression.wire,
            "bottleneck_dim": compression.bottleneck_dim,
            "stages": [
                {
                    "stage": f.stage,
                    "fellow_id": f.fellow_id,
                    "layer_start": f.layer_start,
                    "layer_end": f.layer_end,
                    "checkpoint": f.checkpoint_rel,
                    "checkpoint_sha256": f.checkpoint_sha256,
                    "weights": f.weights_rel,
                    "weights_sha256": f.weights_sha256,
                }
                for f in manifest.stages
            ],
            "model_file": model_file,
            "config_file": config_file,
            "files": files,
            "fallback": fallback,
            "max_abs_diff": check.max_abs_diff,
            "tolerance": check.tolerance,
            "check": {**check.to_dict(), "reload_max_abs_diff": reload_diff},
            "val_loss": check.val_loss,
            "chain_val_loss": check.chain_val_loss,
            "pipeline_val_loss": raw.get("val_loss"),
            "pipeline_loss": raw.get("loss"),
            "data": val.info,
            "keras_version": keras.__version__,
            "tensorflow_version": tf.__version__,
            "package_version": swarm.__version__,
            "run_package_version": raw.get("package_version"),
            "run_manifest_sha256": manifest.sha256,
            "export_dir": str(export_dir.resolve()),
            "created_at": time.time(),
        }
        (tmp / INFERENCE_MANIFEST).write_text(json.dumps(inference, indent=1) + "\n")
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**inference, "out": str(out)}


# --- the command line -------------------------------------------------------------------------


def fail(message: str, code: int) -> NoReturn:
    exit_with(PROG, message, code)


def summary(result: dict[str, Any]) -> str:
    def loss(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    file = result["model_file"]
    size = result["files"][file]["bytes"]
    lines = [
        f"glued {result['job_id']} step {result['step']} ({len(result['stages'])} stages, "
        f"compression {result['compression']}) -> {result['out']}",
        f"  {file}: {size / 2**20:.1f} MiB, sha256 {result['files'][file]['sha256'][:16]}...",
        f"  reproduces the pipeline: max |logits difference| {result['max_abs_diff']:.3g} "
        f"(tolerance {result['tolerance']:.3g}) over {result['check']['batches']} batches",
        f"  val_loss {loss(result['val_loss'])} (this machine's stage chain "
        f"{loss(result['chain_val_loss'])}, the job reported {loss(result['pipeline_val_loss'])})",
    ]
    if result["fallback"]:
        lines.append(f"  fallback: {result['fallback']}")
    pipeline, chain = result["pipeline_val_loss"], result["chain_val_loss"]
    if isinstance(pipeline, float | int) and chain is not None and abs(pipeline - chain) > 0.05:
        lines.append(
            "  note: the job's val_loss differs from this machine's: other validation data "
            "here, or the job reported it at another step"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = ToolParser(
        prog=PROG, description="Glue an exported pipeline into one Keras model (model.keras)."
    )
    parser.add_argument("--export-dir", required=True, type=Path, help="holds run_manifest.json")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output directory (default: EXPORT_DIR/{DEFAULT_OUT})",
    )
    parser.add_argument(
        "--data",
        nargs="+",
        default=None,
        metavar="PATTERN",
        help="read the validation data here instead of the job's train.data",
    )
    parser.add_argument("--json", action="store_true", help="print the inference manifest as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        # Fail fast, before TensorFlow starts.
        manifest = read_run_manifest(args.export_dir)
        check_out(args.export_dir, args.out or args.export_dir / DEFAULT_OUT)
        from agent.runtime.tfsetup import configure_tensorflow

        configure_tensorflow(intra_op_threads=os.cpu_count() or 1)
        import tensorflow as tf

        # Exact float32 matmuls on GPUs (TF32 would blur the comparison with the pipeline).
        with contextlib.suppress(Exception):
            tf.config.experimental.enable_tensor_float_32_execution(False)
        result = glue(args.export_dir, args.out, data=args.data, manifest=manifest)
    except SwarmError as exc:
        fail(exc.message, exc.exit_code)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Exception as exc:  # TensorFlow or I/O: one line, not a traceback
        text = str(exc).splitlines()[0] if str(exc) else ""
        fail(f"{type(exc).__name__}: {text}", 1)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(summary(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
