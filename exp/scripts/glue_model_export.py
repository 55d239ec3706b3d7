"""Glue a job's exported stage checkpoints into one Keras model (``model.keras``).

A thin wrapper around ``python -m silentswarm.agent.runtime.glue`` for use from a source checkout;
see that module for the export format, the reproduction check, the output and the exit codes.

    python exp/scripts/glue_model_export.py --export-dir exports/j-abc123 [--out DIR] [--json]
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from silentswarm.agent.runtime.glue import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
