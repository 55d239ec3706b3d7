"""Glue an exported pipeline into one single-device Keras model, and prove it is the same model.

Usage::

    python -m silentswarm.agent.runtime.glue --export-dir DIR [--out OUT]
        [--data PATTERN ...] [--json]

A job's export directory (written by the leader) holds ``run_manifest.json`` and every stage's
checkpoint of one step (``shards/step-N/stage-i.json`` + ``.npz``, exactly what
:func:`silentswarm.agent.runtime.checkpoint.save_checkpoint` writes). Glueing, one module per step:

1. :mod:`~agent.runtime.glue.manifest`: reads and checks the manifest (its types, the
   stages against the placement) and every file it lists (present, sha256 as recorded),
   before TensorFlow is even imported: a missing or corrupt shard is
   ``glue: error: <file>: ...``, exit 2, nothing written;
2. and 3. :mod:`~agent.runtime.glue.assemble`: rebuilds each stage's ``StageModel`` from the
   very plans the job ran and restores its checkpoint into it, then assembles a
   :class:`silentswarm.agent.runtime.model.GluedTransformer` from them;
4. and 5. :mod:`~agent.runtime.glue.check`: checks that it reproduces the pipeline on the
   job's validation batches (:mod:`~agent.runtime.glue.data`: the same batches, built with
   the same configuration, as the last stage's validation in
   :meth:`agent.runtime.stage.StageRunner.evaluate`); a mismatch is exit 1 and nothing is
   written; and computes the glued model's validation loss over those batches;
6. :mod:`~agent.runtime.glue.save`: saves ``model.keras``, loads it back in this process and
   compares logits (if the ``.keras`` format fails: ``model.weights.h5`` + ``config.json``
   and ``"fallback": <reason>``);
7. :mod:`~agent.runtime.glue.run`: writes ``inference_manifest.json``
   (:class:`silentswarm.types.manifests.InferenceManifest`) next to it.

Output: one self-contained directory, ``OUT`` (default ``DIR/full_model``), holding
``model.keras`` (or the fallback pair) and ``inference_manifest.json``; it can be copied
anywhere and read by ``python -m silentswarm.agent.runtime.generate --model-dir OUT``. It is built
in a temporary sibling directory and renamed into place only when everything passed. Loading the
model needs this package, whose ``silentswarm.agent.runtime.model`` registers the layers with
Keras::

    import keras, silentswarm.agent.runtime.model
    model = keras.saving.load_model("OUT/model.keras")  # tokens (batch, seq) -> logits

The command line and its exit codes: :mod:`~agent.runtime.glue.cli`. Nothing here imports
TensorFlow at import time.
"""

from silentswarm.agent.runtime.glue.assemble import build_stage_models, glued_from_stages, plans_for
from silentswarm.agent.runtime.glue.check import (
    CODEC_MISMATCH_FRACTION,
    STAGE_RTOL,
    Chain,
    CheckResult,
    check_and_evaluate,
    end_to_end_rtol,
)
from silentswarm.agent.runtime.glue.cli import PROG, main, summary
from silentswarm.agent.runtime.glue.data import ValidationData, validation_data
from silentswarm.agent.runtime.glue.manifest import (
    CheckedExport,
    StageFiles,
    read_run_manifest,
    sha256_file,
)
from silentswarm.agent.runtime.glue.run import GlueResult, glue
from silentswarm.agent.runtime.glue.save import (
    CONFIG_FILE,
    DEFAULT_OUT,
    MODEL_FILE,
    RELOAD_RTOL,
    WEIGHTS_FILE,
    SavedModel,
    check_out,
    load_fallback,
    save_model,
)
from silentswarm.types.manifests import INFERENCE_MANIFEST, RUN_MANIFEST

__all__ = [
    "CODEC_MISMATCH_FRACTION",
    "CONFIG_FILE",
    "DEFAULT_OUT",
    "INFERENCE_MANIFEST",
    "MODEL_FILE",
    "PROG",
    "RELOAD_RTOL",
    "RUN_MANIFEST",
    "STAGE_RTOL",
    "WEIGHTS_FILE",
    "Chain",
    "CheckResult",
    "CheckedExport",
    "GlueResult",
    "SavedModel",
    "StageFiles",
    "ValidationData",
    "build_stage_models",
    "check_and_evaluate",
    "check_out",
    "end_to_end_rtol",
    "glue",
    "glued_from_stages",
    "load_fallback",
    "main",
    "plans_for",
    "read_run_manifest",
    "save_model",
    "sha256_file",
    "summary",
    "validation_data",
]
