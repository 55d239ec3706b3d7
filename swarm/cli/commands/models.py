"""A trained job's model: ``glue`` (its shards into one Keras model) and ``generate`` (text
from it). Both are TensorFlow tools run in a process of their own: the CLI never imports
TensorFlow."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import cyclopts
from cyclopts import Parameter

from silentswarm.cli.context import Ctx


def glue(
    export_dir: Annotated[Path, Parameter(help="A job's export directory (run_manifest.json)")],
    *,
    out: Annotated[
        Path | None, Parameter(help="Where to write (default: EXPORT_DIR/full_model)")
    ] = None,
    ctx: Ctx,
) -> None:
    """Assemble a job's pushed shards into one Keras model, checked against the pipeline."""
    argv = ["--export-dir", str(export_dir), *(["--out", str(out)] if out else [])]
    run_runtime("silentswarm.agent.runtime.glue", [*argv, *(["--json"] if ctx.json else [])])


def generate(
    *,
    model_dir: Annotated[Path, Parameter(help="A glued model (full_model/ or its export dir)")],
    prompt: Annotated[str, Parameter(help="The text to continue")],
    max_new_tokens: Annotated[int, Parameter(help="How many tokens to generate")] = 100,
    temperature: Annotated[float, Parameter(help="0: greedy")] = 0.8,
    top_k: Annotated[int, Parameter(help="Sample from the k likeliest (0: all)")] = 40,
    seed: Annotated[int, Parameter(help="Sampling seed")] = 0,
) -> None:
    """Sample text from a glued model."""
    run_runtime(
        "silentswarm.agent.runtime.generate",
        [
            "--model-dir",
            str(model_dir),
            "--prompt",
            prompt,
            "--max-new-tokens",
            str(max_new_tokens),
            "--temperature",
            str(temperature),
            "--top-k",
            str(top_k),
            "--seed",
            str(seed),
        ],
    )


def run_runtime(module: str, argv: list[str]) -> None:
    """A TensorFlow tool in its own process: its output and its exit status are the
    command's."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    code = subprocess.call([sys.executable, "-m", module, *argv], env=env)
    if code:
        raise SystemExit(code)


def register(app: cyclopts.App) -> None:
    app.command(glue)
    app.command(generate)
