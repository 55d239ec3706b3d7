"""Step 6 of glue: the glued model saved, loaded back and compared, and the output directory.

``model.keras`` is saved, loaded back in this process and its logits compared with the
saved model's; if the ``.keras`` format fails in any way, ``model.weights.h5`` +
``config.json`` instead, and the reason is recorded (``"fallback"`` in the manifest).

The output is built in a temporary sibling directory and renamed into place only when
everything passed: a failed glue leaves nothing behind, a previous output is replaced only
by a complete new one, and an existing directory that is not empty and holds no
``inference_manifest.json`` is refused, as is the export directory itself.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from silentswarm.agent.errors import GlueError, GlueMismatchError
from silentswarm.agent.runtime.glue.manifest import file_entry
from silentswarm.types.manifests import INFERENCE_MANIFEST, FileEntry

if TYPE_CHECKING:
    import numpy as np

    from silentswarm.agent.runtime.model import GluedTransformer

DEFAULT_OUT = "full_model"
MODEL_FILE = "model.keras"
WEIGHTS_FILE = "model.weights.h5"
CONFIG_FILE = "config.json"
RELOAD_RTOL = 1e-5  # the reloaded model against the one saved: the same ops on the same weights


@dataclass(frozen=True)
class SavedModel:
    model_file: str
    config_file: str | None  # with the weights + config fallback
    reload_max_abs_diff: float
    fallback: str | None  # why model.keras could not be used

    def files(self, directory: Path) -> dict[str, FileEntry]:
        """The saved files in ``directory``, with their sha256s and sizes."""
        names = [self.model_file, *([self.config_file] if self.config_file else [])]
        paths = {name: directory / name for name in names}
        return {name: file_entry(path) for name, path in paths.items()}


def _reload_diff(loaded, tokens: np.ndarray, want: np.ndarray) -> float:
    import numpy as np
    import tensorflow as tf

    from silentswarm.agent.runtime.tfsetup import graph_function

    forward = graph_function(lambda t: loaded(t, training=False))
    return float(np.max(np.abs(forward(tf.constant(tokens)).numpy() - want)))


def save_model(
    glued: GluedTransformer, directory: Path, tokens: np.ndarray, want: np.ndarray
) -> SavedModel:
    """Save (``.keras``, else weights + config) and prove it loads back to the same logits."""
    import keras

    from silentswarm.agent.runtime.model import GluedTransformer

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
        return SavedModel(MODEL_FILE, None, diff, None)
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
    return SavedModel(WEIGHTS_FILE, CONFIG_FILE, diff, reason)


def load_fallback(directory: Path) -> GluedTransformer:
    """A model saved as ``config.json`` + ``model.weights.h5``."""
    from silentswarm.agent.runtime.model import GluedTransformer

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


def temp_dir(out: Path) -> Path:
    """A fresh, empty temporary sibling of ``out`` to build the output in."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def replace_dir(tmp: Path, out: Path) -> None:
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
