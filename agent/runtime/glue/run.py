""":func:`glue`: the steps in order, and the inference manifest they end with (step 7)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from silentswarm.agent.errors import GlueError
from silentswarm.agent.runtime.glue import assemble
from silentswarm.agent.runtime.glue.check import Chain, CheckResult, check_and_evaluate
from silentswarm.agent.runtime.glue.data import validation_data
from silentswarm.agent.runtime.glue.manifest import CheckedExport, file_entry, read_run_manifest
from silentswarm.agent.runtime.glue.save import (
    DEFAULT_OUT,
    SavedModel,
    check_out,
    replace_dir,
    save_model,
    temp_dir,
)
from silentswarm.agent.runtime.tokenizer import Tokenizer
from silentswarm.errors import SwarmError
from silentswarm.plan import StagePlan
from silentswarm.types.manifests import (
    INFERENCE_MANIFEST,
    DataInfo,
    FileEntry,
    InferenceManifest,
    encode_inference_manifest,
)

TOKENIZER_FILE = "tokenizer.json"  # a BPE's, beside the model


@dataclass(frozen=True)
class GlueResult:
    """A finished glue: the manifest it wrote, and where."""

    manifest: InferenceManifest
    out: Path

    def to_json(self) -> bytes:
        """What ``--json`` prints: the manifest, and ``out``."""
        body = {**msgspec.to_builtins(self.manifest), "out": str(self.out)}
        return msgspec.json.format(msgspec.json.encode(body), indent=1)


def glue(
    export_dir: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    data: Sequence[str] | None = None,
    export: CheckedExport | None = None,
    base: str | os.PathLike[str] | CheckedExport | None = None,
) -> GlueResult:
    """Glue the export in ``export_dir`` into ``out``; the inference manifest written there.

    ``export``: ``export_dir`` already checked by :func:`read_run_manifest` (else it is
    checked here). ``base``: for an adapter's export, the export it adapts (the glued model
    is the base with the adapter merged in). GlueError (exit 2) for bad input,
    GlueMismatchError (exit 1) when the glued model does not reproduce the pipeline; nothing
    is written in either case.
    """
    export_dir = Path(export_dir)
    out = Path(out) if out is not None else export_dir / DEFAULT_OUT
    check_out(export_dir, out)
    if export is None:
        export = read_run_manifest(export_dir)
    if base is not None and not isinstance(base, CheckedExport):
        base = read_run_manifest(base)
    base = assemble.check_base(export, base)
    plans = assemble.plans_for(export)
    tokenizer = export_tokenizer(export, plans[0])
    val = validation_data(plans[-1], data, tokenizer)

    models = assemble.build_stage_models(export, plans, base)
    glued = assemble.glued_from_stages(models)
    check = check_and_evaluate(glued, Chain(models), val.batches, score=val.scored)
    del models

    tmp = temp_dir(out)
    try:
        saved = save_model(glued, tmp, check.first_batch, check.reference_logits)
        files = saved.files(tmp)
        text = tokenizer.to_json()
        if text is not None:
            (tmp / TOKENIZER_FILE).write_text(text)
            files[TOKENIZER_FILE] = file_entry(tmp / TOKENIZER_FILE)
        manifest = _inference_manifest(
            export,
            export_dir,
            saved=saved,
            files=files,
            check=check,
            data=val.info,
            tokenizer=tokenizer.kind,
            tokenizer_file=TOKENIZER_FILE if text is not None else None,
        )
        (tmp / INFERENCE_MANIFEST).write_bytes(encode_inference_manifest(manifest))
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return GlueResult(manifest=manifest, out=out)


def export_tokenizer(export: CheckedExport, first: StagePlan) -> Tokenizer:
    """The tokenizer stage 0 trained with: the one its checkpoint holds."""
    from silentswarm.agent.runtime.checkpoint import checkpoint_tokenizer

    path = export.stages[0].checkpoint
    try:
        meta = json.loads(path.read_bytes())
        return checkpoint_tokenizer(first, meta)
    except (OSError, ValueError, SwarmError) as exc:
        raise GlueError(f"{path}: cannot load the job's tokenizer ({exc})") from None


def _inference_manifest(
    export: CheckedExport,
    export_dir: Path,
    *,
    saved: SavedModel,
    files: dict[str, FileEntry],
    check: CheckResult,
    data: DataInfo,
    tokenizer: str,
    tokenizer_file: str | None,
) -> InferenceManifest:
    import keras
    import tensorflow as tf

    import silentswarm
    from silentswarm.compression import parse_compression

    spec, run = export.spec, export.manifest
    compression = parse_compression(spec.compression, d_model=spec.model.d_model)
    return InferenceManifest(
        job_id=run.job_id,
        name=run.name if run.name is not None else spec.name,
        attempt=run.attempt,
        step=run.step,
        total_steps=run.total_steps,
        model=spec.model,
        vocab_size=spec.model.vocab_size,
        seq_len=spec.model.seq_len,
        seed=spec.seed,
        compression=spec.compression,
        wire_codec=compression.wire,
        bottleneck_dim=compression.bottleneck_dim,
        stages=[stage.shard.files() for stage in export.stages],
        model_file=saved.model_file,
        config_file=saved.config_file,
        files=files,
        fallback=saved.fallback,
        max_abs_diff=check.max_abs_diff,
        tolerance=check.tolerance,
        check=check.summary(saved.reload_max_abs_diff),
        val_loss=check.val_loss,
        chain_val_loss=check.chain_val_loss,
        pipeline_val_loss=run.val_loss,
        pipeline_loss=run.loss,
        data=data,
        tokenizer=tokenizer,
        tokenizer_file=tokenizer_file,
        keras_version=keras.__version__,
        tensorflow_version=tf.__version__,
        package_version=silentswarm.__version__,
        run_package_version=run.package_version,
        run_manifest_sha256=export.sha256,
        export_dir=str(export_dir.resolve()),
        created_at=time.time(),
    )
