"""``swarm-stage --plan plan.json``: run one pipeline stage from an explicit plan.

Writes JSON lines to stdout (``placement``, ``links``, ``joining``, ``step``, ``checkpoint``,
``done``, or ``error``: the events of :mod:`silentswarm.types.stage`) and exits non-zero with a
one-line message on stderr when it fails. No leader is needed: two or three of these processes
train a model together.

With ``--control-stdin`` the stage takes JSON-line commands on stdin (see
:mod:`silentswarm.agent.runtime.control`) and exits 70 at once when stdin reaches EOF: the
supervising agent is gone. Without it stdin is never read, so it may be anything, even at EOF;
a joining stage (``StagePlan.joining``) needs it: its ring command comes there.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, NoReturn

import cyclopts

from silentswarm.agent.errors import DataError, FrameError, LinkError, RingChangeError
from silentswarm.agent.runtime import compilecache
from silentswarm.agent.runtime.control import ControlChannel
from silentswarm.agent.runtime.tfsetup import configure_tensorflow, require_tensorflow
from silentswarm.agent.runtime.tool import first_line
from silentswarm.cpus import usable_cores
from silentswarm.entry import configure_logging, fail
from silentswarm.errors import ConfigError, ErrorCode, SwarmError
from silentswarm.plan import decode_plan
from silentswarm.types.stage import ErrorEvent, StageEvent, StepEvent, encode_event

app = cyclopts.App(name="swarm-stage", help="Run one pipeline stage from an explicit plan.")
log = logging.getLogger("stage")
MESSAGE_CHARS = 8192  # an error event's bound (swarm.types.stage)


def emit(event: StageEvent) -> None:
    """One event, one line on stdout, flushed at once: the agent follows the run by them."""
    sys.stdout.flush()  # whatever was printed before it comes first
    sys.stdout.buffer.write(encode_event(event) + b"\n")
    sys.stdout.buffer.flush()


def publishing_after_first_step(
    cache: compilecache.CompileCache,
) -> Callable[[StageEvent], None]:
    """:func:`emit`, which first publishes what the first step compiled, before that step's
    event: a stage killed once it said so does not take its executables along."""
    published = False

    def on_event(event: StageEvent) -> None:
        nonlocal published
        if not published and isinstance(event, StepEvent):
            published = True
            cache.publish()
        emit(event)

    return on_event


@app.default
def run(
    *,
    plan: Annotated[Path, cyclopts.Parameter(help="Stage plan (JSON)")],
    log_level: str = "WARNING",
    control_stdin: Annotated[
        bool,
        cyclopts.Parameter(help="Take commands on stdin; exit 70 when stdin closes"),
    ] = False,
) -> None:
    require_tensorflow("a stage")
    configure_logging(log_level)  # httpx/httpcore at WARNING: no request URLs logged
    try:
        data = plan.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read plan {plan}: {exc.strerror}") from None
    stage_plan = decode_plan(data, source=str(plan))
    control = None
    if control_stdin:
        control = ControlChannel()
        control.start_reader(0)  # fd 0, not sys.stdin: see start_reader
    cache = compilecache.open_from_env()
    if cache is not None:
        compilecache.enable(cache)
    configure_tensorflow(
        intra_op_threads=stage_plan.intra_op_threads or usable_cores(),
        logical_cpus=max(1, len(stage_plan.gpu_slots)),
    )
    from silentswarm.agent.runtime.stage import StageRunner

    runner: StageRunner | None = None
    try:
        on_event = emit if cache is None else publishing_after_first_step(cache)
        runner = StageRunner(stage_plan, on_event, control)
        runner.run()
    except (LinkError, FrameError, DataError, RingChangeError) as exc:
        stage_failed(stage_plan.stage, str(exc), exc.code, control)
    except Exception as exc:  # a bug or a TensorFlow failure: say so, keep the trace in the log
        log.exception("stage %d failed", stage_plan.stage)
        stage_failed(stage_plan.stage, *failure(exc), control)
    finally:
        if runner is not None:
            runner.close()
        if cache is not None:
            cache.close()


def failure(exc: BaseException) -> tuple[str, ErrorCode]:
    """What a stage that failed with ``exc`` reports: its first line and its code. A device
    out of memory (TensorFlow's ``ResourceExhaustedError``: a GPU's allocator, "OOM when
    allocating tensor"; Python's ``MemoryError``) is ``STAGE_OUT_OF_MEMORY``, which the
    leader remembers against the fellow (a later attempt gives it a smaller stage)."""
    message = first_line(exc)
    if isinstance(exc, SwarmError):
        return message, exc.code
    if _out_of_memory(exc):
        return f"the stage ran out of device memory ({message})", ErrorCode.STAGE_OUT_OF_MEMORY
    return message, ErrorCode.STAGE_FAILED


def _out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    tf = sys.modules.get("tensorflow")  # a stage's failure: TensorFlow is loaded by then
    return tf is not None and isinstance(exc, tf.errors.ResourceExhaustedError)


def stage_failed(
    stage: int, message: str, code: ErrorCode, control: ControlChannel | None
) -> NoReturn:
    """Report the failure (its message and code) and exit 1.

    The control channel is closed first: an agent that closes stdin once it has read the
    ``error`` event must not turn exit 1 into exit 70.
    """
    if control is not None:
        control.close()
    emit(ErrorEvent(stage=stage, message=message[:MESSAGE_CHARS], code=code))
    fail("swarm-stage", f"stage {stage}: {message}", 1)


def main() -> None:
    try:
        app()
    except SwarmError as exc:
        fail("swarm-stage", exc.message, exc.exit_code)


if __name__ == "__main__":
    main()
