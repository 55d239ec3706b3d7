"""``swarm-stage --plan plan.json``: run one pipeline stage from an explicit plan.

Writes JSON lines to stdout (``links``, ``step``, ``done``, or ``error``) and exits non-zero
with a one-line message on stderr when it fails. No leader is needed: two or three of these
processes train a model together.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import cyclopts

from swarm.entry import configure_logging, fail
from swarm.errors import ConfigError, SwarmError
from swarm.plan import decode_plan

app = cyclopts.App(name="swarm-stage", help="Run one pipeline stage from an explicit plan.")
log = logging.getLogger("stage")


def emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


@app.default
def run(
    *,
    plan: Annotated[Path, cyclopts.Parameter(help="Stage plan (JSON)")],
    log_level: str = "WARNING",
) -> None:
    configure_logging(log_level)
    try:
        data = plan.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read plan {plan}: {exc.strerror}") from None
    stage_plan = decode_plan(data, source=str(plan))
    from agent.runtime.tfsetup import configure_tensorflow

    configure_tensorflow(
        intra_op_threads=stage_plan.intra_op_threads or os.cpu_count() or 1,
        logical_cpus=max(1, len(stage_plan.gpu_slots)),
    )
    from agent.pipe.link import LinkError
    from agent.pipe.wire import FrameError
    from agent.runtime.data import DataError
    from agent.runtime.stage import StageRunner

    runner: StageRunner | None = None
    try:
        runner = StageRunner(stage_plan, emit)
        runner.run()
    except (LinkError, FrameError, DataError) as exc:
        emit({"event": "error", "stage": stage_plan.stage, "message": str(exc)})
        fail("swarm-stage", f"stage {stage_plan.stage}: {exc}", 1)
    except Exception as exc:  # a bug or a TensorFlow failure: say so, keep the trace in the log
        log.exception("stage %d failed", stage_plan.stage)
        message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        emit({"event": "error", "stage": stage_plan.stage, "message": message})
        fail("swarm-stage", f"stage {stage_plan.stage}: {message}", 1)
    finally:
        if runner is not None:
            runner.close()


def main() -> None:
    try:
        app()
    except SwarmError as exc:
        fail("swarm-stage", exc.message, exc.exit_code)


if __name__ == "__main__":
    main()
