"""A stage that starts from an export's weights (``init_from: "job:ID"`` / ``"export:DIR"``).

The agent downloaded (START's ``init``) the export's ``run_manifest.json`` and the shards of
the source stages that hold any of this stage's layers into ``plan.init_dir``. Each such
source stage is rebuilt from the plans the source job ran (as glue rebuilds them) and its
checkpoint restored into it; then every layer of this stage takes the weights of the source
layer of the same name: the embedding, its blocks, the head, and a learned bottleneck's
projections where the boundary sits at the same layer with the same shapes (else they keep
their fresh start). The split may differ from the source's. Only weights are taken: the
optimizer and the step count start over, as does the data (the new job's). Stage 0 encodes
with the source's tokenizer (the one its stage 0 checkpoint holds).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from silentswarm.agent.errors import CheckpointError
from silentswarm.agent.runtime.checkpoint import (
    checkpoint_tokenizer,
    is_adapter_variable,
    load_checkpoint,
    restore_into,
)
from silentswarm.agent.runtime.tokenizer import Tokenizer
from silentswarm.errors import ManifestError
from silentswarm.plan import StagePlan, layers_overlap
from silentswarm.types.manifests import RUN_MANIFEST, RunManifest, decode_run_manifest

if TYPE_CHECKING:
    from silentswarm.agent.runtime.stage_model import StageModel

log = logging.getLogger(__name__)


def layer_key(plan: StagePlan, name: str) -> str:
    """What matches a layer across splits: its name, or for a bottleneck projection the layer
    its boundary sits before (``up`` at the stage's first layer, ``down`` after its last)."""
    if name == "up":
        return f"up@{plan.layer_start}"
    if name == "down":
        return f"down@{plan.layer_end}"
    return name


class ExportStart:
    """The export files in ``directory`` (see the module)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        path = directory / RUN_MANIFEST
        try:
            self.manifest: RunManifest = decode_run_manifest(path.read_bytes(), str(path))
        except OSError as exc:
            raise CheckpointError(f"{path}: unreadable ({exc})") from None
        except ManifestError as exc:
            raise CheckpointError(exc.message) from None
        self.plans = self.manifest.portable_plans()

    def _checkpoint_path(self, stage: int) -> Path | None:
        shard = next((s for s in self.manifest.stages if s.stage == stage), None)
        if shard is None:
            return None
        # As a fellow fetched it (flat), or an export directory as the leader keeps it.
        for path in (
            self.directory / Path(shard.checkpoint).name,
            self.directory / shard.checkpoint,
        ):
            if path.is_file():
                return path
        return None

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the export's stage 0 encoded with."""
        path = self._checkpoint_path(0)
        if path is None:
            raise CheckpointError(f"{self.directory}: the export's stage 0 shard is not here")
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: unreadable ({exc})") from None
        return checkpoint_tokenizer(self.plans[0], meta)

    def load_into(self, model: StageModel) -> int:
        """Copy the export's weights into ``model``'s layers (see the module); how many
        variables were set. CheckpointError when a block, the embedding or the head has no
        source, or a shape differs, before anything is set."""
        from silentswarm.agent.runtime.stage_model import StageModel

        wanted = {layer_key(model.plan, p.layer.name): p.layer for p in model.pieces}
        found: dict[str, list] = {}
        for plan in self.plans:
            path = self._checkpoint_path(plan.stage)
            if path is None or not layers_overlap(plan, model.plan):
                continue
            source = StageModel(plan)
            restore_into(source, None, load_checkpoint(path))
            for piece in source.pieces:
                key = layer_key(plan, piece.layer.name)
                if key in wanted:
                    found[key] = {str(w.path): w.numpy() for w in piece.layer.weights}
            del source
        missing = [k for k in wanted if k not in found and not k.startswith(("up@", "down@"))]
        if missing:
            raise CheckpointError(
                f"the export in {self.directory} has no weights here for {', '.join(missing)}"
            )
        pairs = []
        for key, arrays in found.items():
            # By name within the layer: an adapter's variables (which the export lacks, and
            # which keep their fresh start) come after the others.
            weights = [w for w in wanted[key].weights if not is_adapter_variable(w)]
            matched = [(w, arrays.get(str(w.path))) for w in weights]
            if any(a is None or tuple(a.shape) != tuple(w.shape) for w, a in matched):
                if key.startswith(("up@", "down@")):
                    log.info("the export's %s has other shapes: it starts fresh", key)
                    continue
                raise CheckpointError(f"the export's {key} does not have this stage's weights")
            pairs.extend(matched)
        for variable, array in pairs:
            variable.assign(array)
        return len(pairs)
