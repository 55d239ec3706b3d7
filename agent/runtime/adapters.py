"""A LoRA adapter's export on a glued base: what ``generate --adapter`` and ``swarm serve
--adapter`` load.

An adapter job (``adapter`` with ``init_from``) exports like any job, but its shards hold
the adapter alone (every block's ``lora_<w>_a``/``_b``, and their optimizer state) and its
``run_manifest.json`` names the base it adapts by the sha256 of the base export's own
manifest (``base``). A glued base records that same digest (``run_manifest_sha256`` of its
inference manifest), so :func:`check_base` can refuse an adapter trained on another model,
saying which. :func:`merge_into` then adds each adapter's ``A B * alpha / rank`` to the weight
it adapts: the merged model computes what the adapted pipeline computed (to float rounding),
at the base model's cost per token. No TensorFlow is imported here (the model passed in has it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from silentswarm.agent.errors import GenerateError, GlueError
from silentswarm.agent.runtime.glue.manifest import CheckedExport, read_run_manifest
from silentswarm.types.manifests import BaseRef

# An adapter array's name in a stage checkpoint: ``model/<i>:block_<layer>/lora_<w>_<a|b>``.
ARRAY = re.compile(r"^model/\d+:block_(\d+)/lora_(\w+)_([ab])$")


@dataclass(frozen=True)
class Adapter:
    export: CheckedExport
    base: BaseRef
    scale: float
    # (layer, weight name) -> (A, B)
    pairs: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def directory(self) -> Path:
        return self.export.path.parent


def read_adapter(path: str | Path) -> Adapter:
    """The adapter export in ``path``, every file checked against its manifest;
    GenerateError when it is not an adapter's export or a file is missing or corrupt."""
    try:
        export = read_run_manifest(path)
    except GlueError as exc:
        raise GenerateError(f"--adapter: {exc.message}") from None
    spec, base = export.spec, export.manifest.base
    if spec.adapter is None or base is None:
        raise GenerateError(f"--adapter {path}: job {export.job_id}'s export is not an adapter's")
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for stage in export.stages:
        with np.load(stage.weights, allow_pickle=False) as arrays:
            for name in arrays.files:
                found = ARRAY.match(name)
                if found:
                    layer, target, half = int(found[1]), found[2], found[3]
                    pairs.setdefault((layer, target), {})[half] = arrays[name]
    whole = {key: (ab["a"], ab["b"]) for key, ab in pairs.items() if {"a", "b"} <= ab.keys()}
    if not whole or len(whole) != len(pairs):
        raise GenerateError(f"--adapter {path}: its shards do not hold a whole adapter")
    return Adapter(export=export, base=base, scale=spec.adapter.scale, pairs=whole)


def check_base(adapter: Adapter, base_manifest_sha256: str, base_name: str) -> None:
    """GenerateError unless the adapter was trained on the base whose export manifest has
    ``base_manifest_sha256``."""
    if adapter.base.manifest_sha256 != base_manifest_sha256:
        raise GenerateError(
            f"the adapter in {adapter.directory} was trained on job {adapter.base.job_id}'s "
            f"export at step {adapter.base.step} (run manifest sha256 "
            f"{adapter.base.manifest_sha256[:12]}...), not on {base_name} (run manifest sha256 "
            f"{base_manifest_sha256[:12]}...): refusing to apply it"
        )


def merge_into(model: Any, adapter: Adapter) -> int:
    """Add every adapter pair into the glued ``model``'s weights; how many weights changed.
    GenerateError (nothing changed) when a layer or a shape does not fit."""
    updates = []
    for (layer, target), (a, b) in sorted(adapter.pairs.items()):
        if not 0 <= layer < len(model.blocks) or not hasattr(model.blocks[layer], target):
            raise GenerateError(
                f"the adapter adapts block {layer}'s {target}, which the base lacks"
            )
        weight = getattr(model.blocks[layer], target)
        delta = (a.astype(np.float64) @ b.astype(np.float64)) * adapter.scale
        if delta.shape != tuple(weight.shape):
            raise GenerateError(
                f"the adapter's block {layer} {target} is {delta.shape}, the base's "
                f"{tuple(weight.shape)}"
            )
        updates.append((weight, delta))
    for weight, delta in updates:
        weight.assign((np.asarray(weight.numpy(), dtype=np.float64) + delta).astype(np.float32))
    return len(updates)
