"""Steps 2 and 3 of glue: the job's stage models restored from their shards, and one
:class:`silentswarm.agent.runtime.model.GluedTransformer` built from them.

Each stage's ``StageModel`` is rebuilt from the very plans the job ran
(:func:`silentswarm.jobspec.stage_plans`, GPU slots dropped so any machine can build them) and its
checkpoint restored into it. The glued model holds embed, the blocks in order, and at every
stage boundary what the pipeline did there (the learned ``down``/``up`` bottleneck, the wire
codec's round trip in TensorFlow ops), then the head; its variables are the stage models'
values, copied. TensorFlow is imported inside the functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from silentswarm.agent.errors import GlueError, GlueMismatchError
from silentswarm.agent.runtime.glue.manifest import CheckedExport
from silentswarm.plan import StagePlan

if TYPE_CHECKING:
    from silentswarm.agent.runtime.model import GluedTransformer
    from silentswarm.agent.runtime.stage_model import StageModel


def plans_for(export: CheckedExport) -> list[StagePlan]:
    """The plans the job's stages ran, runnable here (:meth:`RunManifest.portable_plans`)."""
    return export.manifest.portable_plans()


def build_stage_models(
    export: CheckedExport, plans: list[StagePlan], base: CheckedExport | None = None
) -> list[StageModel]:
    """Each stage as it ran, its checkpoint restored; an adapter's stages on ``base`` (the
    export it adapts, checked by :func:`check_base`) first."""
    from silentswarm.agent.errors import CheckpointError
    from silentswarm.agent.runtime.checkpoint import load_checkpoint, restore_into
    from silentswarm.agent.runtime.stage_model import StageModel
    from silentswarm.agent.runtime.warmstart import ExportStart

    start = None if base is None else ExportStart(base.path.parent)
    models = []
    for plan, files in zip(plans, export.stages, strict=True):
        model = StageModel(plan)
        try:
            if start is not None:
                start.load_into(model)
            restore_into(model, None, load_checkpoint(files.checkpoint))
        except CheckpointError as exc:
            raise GlueError(f"{files.shard.checkpoint}: {exc}") from None
        models.append(model)
    return models


def check_base(export: CheckedExport, base: CheckedExport | None) -> CheckedExport | None:
    """The base an adapter's export needs (None for any other export); GlueError when it is
    missing or is not the export the adapter was trained on."""
    wanted = export.manifest.base
    if wanted is None:
        if base is not None:
            raise GlueError(f"--base: job {export.job_id}'s export is not an adapter's")
        return None
    if base is None:
        raise GlueError(
            f"job {export.job_id}'s export holds a LoRA adapter of job {wanted.job_id}'s "
            "export: give that export with --base"
        )
    if base.sha256 != wanted.manifest_sha256:
        raise GlueError(
            f"--base: the adapter was trained on job {wanted.job_id}'s export at step "
            f"{wanted.step} (run manifest sha256 {wanted.manifest_sha256[:12]}...), not on "
            f"job {base.job_id}'s (sha256 {base.sha256[:12]}...)"
        )
    return base


def glued_from_stages(models: list[StageModel]) -> GluedTransformer:
    """A GluedTransformer holding exactly the stage models' variables (values copied)."""
    import tensorflow as tf

    from silentswarm.agent.runtime.checkpoint import is_adapter_variable
    from silentswarm.agent.runtime.model import GluedTransformer

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
            # An adapter's variables are merged into the weights they adapt, below.
            source_vars = [v for v in piece.layer.variables if not is_adapter_variable(v)]
            target_vars = target.variables
            if len(source_vars) != len(target_vars):
                raise GlueMismatchError(f"stage {stage}'s {name} has another set of variables")
            for src, dst in zip(source_vars, target_vars, strict=True):
                if tuple(src.shape) != tuple(dst.shape):
                    raise GlueMismatchError(
                        f"stage {stage}: {src.path} {tuple(src.shape)} does not fit "
                        f"{dst.path} {tuple(dst.shape)}"
                    )
                dst.assign(src.value)
            for weight, (a, b) in getattr(piece.layer, "lora", {}).items():
                merged = getattr(target, weight)
                merged.assign(merged + tf.matmul(a, b) * piece.layer.adapter.scale)
    return glued
