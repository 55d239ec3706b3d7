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

import msgspec

from silentswarm.agent.errors import GlueError, GlueMismatchError
from silentswarm.agent.runtime.glue.manifest import CheckedExport
from silentswarm.jobspec import stage_plans
from silentswarm.plan import StagePlan

if TYPE_CHECKING:
    from silentswarm.agent.runtime.model import GluedTransformer
    from silentswarm.agent.runtime.stage_model import StageModel


def plans_for(export: CheckedExport) -> list[StagePlan]:
    """The plans the job's stages ran, without GPU slots (any machine builds them), in
    float32 (a bfloat16 job's weights are float32 too: glue checks and saves in float32)."""
    plans = stage_plans(
        job_id=export.job_id,
        attempt=export.attempt,
        spec=export.spec,
        placement=export.placement,
        subject_prefix="swarm",
    )
    return [
        msgspec.structs.replace(
            plan, gpu_slots=[], train=msgspec.structs.replace(plan.train, precision="float32")
        )
        for plan in plans
    ]


def build_stage_models(export: CheckedExport, plans: list[StagePlan]) -> list[StageModel]:
    from silentswarm.agent.errors import CheckpointError
    from silentswarm.agent.runtime.checkpoint import load_checkpoint, restore_into
    from silentswarm.agent.runtime.stage_model import StageModel

    models = []
    for plan, files in zip(plans, export.stages, strict=True):
        model = StageModel(plan)
        try:
            restore_into(model, None, load_checkpoint(files.checkpoint))
        except CheckpointError as exc:
            raise GlueError(f"{files.shard.checkpoint}: {exc}") from None
        models.append(model)
    return models


def glued_from_stages(models: list[StageModel]) -> GluedTransformer:
    """A GluedTransformer holding exactly the stage models' variables (values copied)."""
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
