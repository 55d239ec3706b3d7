"""Glue a job's exported stage checkpoints into one Keras model (``model.keras``).

A thin wrapper around ``python -m silentswarm.agent.runtime.glue`` for use from a source checkout;
see that module for the export format, the reproduction check, the output and the exit codes.

    python exp/scripts/glue_model_export.py --export-dir DIR [--out OUT] [--json]

``DIR`` is the export directory (it holds ``run_manifest.json``), or a directory whose
``model_export/`` is one: the leader's ``<export root>/<job_id>`` or a benchmark repeat's
``exp/runs/benchmarks/<suite_run_id>/<scenario_id>/repeat-<n>``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from silentswarm.agent.runtime.glue import main  # noqa: E402
from silentswarm.types.manifests import RUN_MANIFEST  # noqa: E402

OPTION = "--export-dir"


def export_dir(given: str) -> str:
    """``given``, or its ``model_export/`` when that is the export and ``given`` is not."""
    path = Path(given)
    inner = path / "model_export"
    if not (path / RUN_MANIFEST).exists() and (inner / RUN_MANIFEST).is_file():
        return str(inner)
    return given


def with_export_dir(argv: list[str]) -> list[str]:
    """``argv`` with the value of ``--export-dir`` (either spelling) passed through
    :func:`export_dir`."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == OPTION and i + 1 < len(out):
            out[i + 1] = export_dir(out[i + 1])
        elif arg.startswith(OPTION + "="):
            out[i] = f"{OPTION}={export_dir(arg.partition('=')[2])}"
    return out


if __name__ == "__main__":
    raise SystemExit(main(with_export_dir(sys.argv[1:])))
