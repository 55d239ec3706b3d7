"""The glue command line::

    python -m silentswarm.agent.runtime.glue --export-dir DIR [--out OUT]
        [--data PATTERN ...] [--json]

Exit codes: 0 glued; 1 the glued model does not reproduce the pipeline (or TensorFlow
failed); 2 a bad argument, manifest, missing or corrupt file, or unreadable data. Errors are
one line on stderr, ``glue: error: ...``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from silentswarm.agent.runtime.glue import assemble
from silentswarm.agent.runtime.glue.manifest import read_run_manifest
from silentswarm.agent.runtime.glue.run import GlueResult, glue
from silentswarm.agent.runtime.glue.save import DEFAULT_OUT, check_out
from silentswarm.agent.runtime.tool import ToolParser, exit_with, first_line
from silentswarm.cpus import usable_cores
from silentswarm.errors import SwarmError

PROG = "glue"


def fail(message: str, code: int) -> NoReturn:
    exit_with(PROG, message, code)


def summary(result: GlueResult) -> str:
    def loss(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    m = result.manifest
    file = m.model_file
    entry = m.files[file]
    lines = [
        f"glued {m.job_id} step {m.step} ({len(m.stages)} stages, "
        f"compression {m.compression}) -> {result.out}",
        f"  {file}: {entry.bytes / 2**20:.1f} MiB, sha256 {entry.sha256[:16]}...",
        f"  reproduces the pipeline: max |logits difference| {m.max_abs_diff:.3g} "
        f"(tolerance {m.tolerance:.3g}) over {m.check.batches} batches",
        f"  val_loss {loss(m.val_loss)} (this machine's stage chain "
        f"{loss(m.chain_val_loss)}, the job reported {loss(m.pipeline_val_loss)})",
    ]
    if m.fallback:
        lines.append(f"  fallback: {m.fallback}")
    pipeline, chain = m.pipeline_val_loss, m.chain_val_loss
    if pipeline is not None and chain is not None and abs(pipeline - chain) > 0.05:
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
    parser.add_argument(
        "--base", type=Path, help="for a LoRA adapter's export: the export it adapts"
    )
    parser.add_argument("--json", action="store_true", help="print the inference manifest as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        # Fail fast, before TensorFlow starts.
        export = read_run_manifest(args.export_dir)
        base = assemble.check_base(
            export, None if args.base is None else read_run_manifest(args.base)
        )
        check_out(args.export_dir, args.out or args.export_dir / DEFAULT_OUT)
        from silentswarm.agent.runtime.tfsetup import configure_tensorflow

        configure_tensorflow(intra_op_threads=usable_cores())
        import tensorflow as tf

        # Exact float32 matmuls on GPUs (TF32 would blur the comparison with the pipeline).
        with contextlib.suppress(Exception):
            tf.config.experimental.enable_tensor_float_32_execution(False)
        result = glue(args.export_dir, args.out, data=args.data, export=export, base=base)
    except SwarmError as exc:
        fail(exc.message, exc.exit_code)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Exception as exc:  # TensorFlow or I/O: one line, not a traceback
        fail(first_line(exc), 1)
    if args.json:
        print(result.to_json().decode())
    else:
        print(summary(result))
    return 0
