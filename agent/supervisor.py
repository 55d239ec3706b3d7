"""One job's stage, run as a supervised runtime subprocess.

The runtime (``python -m silentswarm.agent.runtime.main --plan FILE --control-stdin``) is the only
process that imports TensorFlow. It exits when the job ends, which frees every byte of
TensorFlow and CUDA memory, and it dies with the agent two ways: PR_SET_PDEATHSIG (SIGKILL)
and EOF on its stdin pipe. Its JSON-line events (stdout, :mod:`silentswarm.types.stage`) are
decoded and handed to a callback; a line that starts like JSON but is no event is logged and
counted (``malformed_events``), never fatal. Its stderr (TensorFlow's start-up noise,
tracebacks) goes to a file in the job's folder.

:func:`sync_fields` is the one translation of what a step or done event says of a stage's
replicas into progress fields (the runner adds them to what it reports).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from silentswarm.agent.exitreason import signal_reason
from silentswarm.agent.runtime import compilecache
from silentswarm.errors import ErrorCode
from silentswarm.plan import StagePlan
from silentswarm.procs import die_with_parent, tail
from silentswarm.protocol import StageOutcome, StageResult
from silentswarm.ram import OomKills, memory_limit, oom_kills
from silentswarm.types.stage import (
    Command,
    DoneEvent,
    ErrorEvent,
    StageEvent,
    StepEvent,
    decode_event,
    encode_command,
)

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
LINE_LIMIT = 16 << 20
# stage.err keeps this much of a runtime's stderr, then a note that the rest is not kept: a
# stage logs what peers send it (rate-limited, cut), but a file without a bound is a disk a
# stranger could fill.
STDERR_FILE_MAX_BYTES = 64 << 20
# A runtime's oom_score_adj: when its fellow's container or host runs out of memory, the
# kernel's out-of-memory killer takes a stage before the agent (which then says why the stage
# died) and before the host's other programs (a volunteer's own). Raising it needs no
# privilege; the fellow unit lowers the agent's (OOMScoreAdjust=).
STAGE_OOM_SCORE_ADJ = 500

# TensorFlow's GPU memory: allocate on demand and hand it back (the async allocator), so a
# fellow's VRAM telemetry stays truthful and several stages can share a GPU.
RUNTIME_ENV = {
    "TF_GPU_ALLOCATOR": "cuda_malloc_async",
    "TF_FORCE_GPU_ALLOW_GROWTH": "true",
    "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONUNBUFFERED": "1",
}


# The stage's own settings among SWARM_*: where stage 0 keeps its data cache, and its size.
RUNTIME_PASSTHROUGH = (
    frozenset({"SWARM_DATA_CACHE", "SWARM_DATA_CACHE_MAX_BYTES"}) | compilecache.ENV_NAMES
)


def sync_fields(plan: StagePlan, event: StepEvent | DoneEvent | None) -> dict[str, Any]:
    """What a stage's event says of its replicas' sync, as :class:`~swarm.protocol.Progress`
    fields: the replica it trains (the plan's, whatever the event), its bytes over the
    replicas' ring and its clipped and missed counts since the run began, and for a step the
    seconds it spent syncing (left out for a stage without replicas, which never syncs)."""
    fields: dict[str, Any] = {"replica": plan.replica}
    if event is None:
        return fields
    fields.update(
        sync_bytes_sent=event.sync_bytes_sent,
        sync_bytes_received=event.sync_bytes_received,
        sync_clipped=event.sync_clipped,
        sync_missed=event.sync_missed,
    )
    if isinstance(event, StepEvent) and plan.replicated:
        fields["sync_s"] = event.sync_s
        if event.sync_epoch:  # elastic membership: the ring epoch, the state after a change
            fields["sync_epoch"] = event.sync_epoch
        if event.state_digests:
            fields["state_digests"] = event.state_digests
    return fields


def stage_preexec(tie: Callable[[], None]) -> Callable[[], None]:
    """A runtime's ``preexec_fn``: ``tie`` (it dies with the agent), then the first to go on
    an out-of-memory kill (:data:`STAGE_OOM_SCORE_ADJ`, never lower than it already is)."""

    def _run() -> None:
        tie()
        with (
            contextlib.suppress(OSError, ValueError),
            open("/proc/self/oom_score_adj", "r+") as adj,
        ):
            if int(adj.read()) < STAGE_OOM_SCORE_ADJ:
                adj.seek(0)
                adj.write(str(STAGE_OOM_SCORE_ADJ))

    return _run


def runtime_env() -> dict[str, str]:
    """The agent's environment minus SWARM_* (the plan says all a stage needs, but for
    :data:`RUNTIME_PASSTHROUGH`) plus TF's."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SWARM_") or k in RUNTIME_PASSTHROUGH
    }
    env.update(RUNTIME_ENV)
    return env


class StageRun:
    """A started runtime for one (job, attempt); ``finished`` resolves to its outcome."""

    def __init__(
        self,
        plan: StagePlan,
        workdir: Path,
        on_event: Callable[[StageEvent], None],
        on_output: Callable[[str, str], None] | None = None,
    ) -> None:
        self.plan = plan
        self.workdir = workdir
        self.on_event = on_event
        # (stream, line) for every line the runtime writes that is not an event: shipped to
        # the leader with the agent's own logs.
        self.on_output = on_output or (lambda _stream, _line: None)
        self.last_stderr = ""  # the runtime's last line on stderr (cut), as it was read
        self.proc: asyncio.subprocess.Process | None = None
        self.stopping: str | None = None  # why we stopped it, when we did
        self.last_step: StepEvent | None = None
        self.done: DoneEvent | None = None
        self.error: str | None = None
        self.error_code: str | None = None  # the error event's code
        self.malformed_events = 0  # lines that looked like events but were not
        # Whether its checkpoints are the job's (it pushes shards, its outcome says what
        # became of its final one): replica 0's, until a ring change moves the duty.
        self.leads = plan.replica == 0
        self.finished: asyncio.Future[StageOutcome] = asyncio.get_running_loop().create_future()
        # The kernel's out-of-memory kills counted when the runtime started: a count that rose
        # by its end says what a SIGKILL was (agent.exitreason).
        self.oom_kills_at_start = OomKills(group=None, host=None)
        self._reader: asyncio.Task[None] | None = None
        self._stderr_reader: asyncio.Task[None] | None = None

    @property
    def job_id(self) -> str:
        return self.plan.job_id

    @property
    def attempt(self) -> int:
        return self.plan.attempt

    @property
    def stderr_path(self) -> Path:
        return self.workdir / "stage.err"

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        plan_path = self.workdir / "plan.json"
        # The plan holds the boundary's CURVE secret keys: readable by this user only.
        fd = os.open(plan_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(msgspec.json.format(msgspec.json.encode(self.plan)))
        self.oom_kills_at_start = oom_kills()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "silentswarm.agent.runtime.main",
            "--plan",
            str(plan_path),
            "--control-stdin",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=runtime_env(),
            preexec_fn=stage_preexec(die_with_parent(signal.SIGKILL)),
            # A line longer than this would stop the readers, the pipe would fill and the
            # stage would block writing: allow very long lines.
            limit=LINE_LIMIT,
        )
        log.info(
            "job %s attempt %d: stage %d runtime started (pid %d)",
            self.job_id,
            self.attempt,
            self.plan.stage,
            self.proc.pid,
        )
        self._stderr_reader = asyncio.create_task(self._read_stderr(), name="stage-stderr")
        self._reader = asyncio.create_task(self._read(), name=f"stage-{self.job_id}")

    async def command(self, command: Command) -> bool:
        """Write one control command to the runtime; False when it is gone."""
        proc = self.proc
        if proc is None or proc.stdin is None or proc.returncode is not None:
            return False
        try:
            proc.stdin.write(encode_command(command))
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    def fail_unstarted(self, message: str) -> None:
        """The runtime could not be started (e.g. its resume shard did not arrive)."""
        self._end_unstarted(StageResult.FAILED, message)

    def _end_unstarted(self, result: StageResult, message: str) -> None:
        if not self.finished.done():
            self.finished.set_result(
                StageOutcome(
                    result=result, job_id=self.job_id, attempt=self.attempt, message=message
                )
            )

    def terminate(self, reason: str) -> None:
        """SIGTERM now, SIGKILL after a grace period; ``finished`` says when it is gone."""
        proc = self.proc
        if proc is None and self.stopping is None and not self.finished.done():
            # Not started yet (fetching its shard): it never will be.
            self.stopping = reason
            self._end_unstarted(StageResult.STOPPED, reason)
            return
        if proc is None or proc.returncode is not None or self.stopping is not None:
            return
        self.stopping = reason
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        asyncio.get_running_loop().call_later(STOP_GRACE_S, self._kill)

    def _kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            log.warning("stage runtime %d ignored SIGTERM; killing it", self.proc.pid)
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    async def stop(self, reason: str) -> StageOutcome:
        """Terminate the runtime and wait for its outcome."""
        self.terminate(reason)
        return await self.finished

    async def _read(self) -> None:
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        try:
            async for raw in read_lines(proc.stdout):
                line = raw.decode(errors="replace").strip()
                if not line.startswith("{"):
                    if line:
                        self.on_output("stdout", line)
                    continue
                try:
                    event = decode_event(line)
                except msgspec.DecodeError as exc:
                    self.malformed_events += 1
                    log.warning("stage wrote a malformed event (%s): %.200s", exc, line)
                    continue
                self._remember(event)
                try:
                    self.on_event(event)
                except Exception:
                    log.exception("handling stage event %s failed", type(event).__name__)
        finally:
            if proc.stdin is not None:
                proc.stdin.close()
            code = await proc.wait()
            if self._stderr_reader is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._stderr_reader, 5.0)
            self.finished.set_result(self._outcome(code))

    async def _read_stderr(self) -> None:
        """Keep the runtime's stderr in ``stage.err`` and hand every line on, but
        the harmless lines TensorFlow writes as it loads compile cache entries
        (:func:`compilecache.is_probe_noise`).

        The pipe is read to its end whatever happens to the file: a full disk must not stop
        the reading, or the runtime blocks on a full stderr pipe and training hangs."""
        proc = self.proc
        assert proc is not None and proc.stderr is not None
        out = self._open_stderr_file()
        try:
            async for raw in read_lines(proc.stderr):
                line = raw.decode(errors="replace").rstrip()
                if compilecache.is_probe_noise(line):
                    continue  # TensorFlow's look at a compile cache entry, on every load
                if out is not None:
                    try:
                        if out.tell() + len(raw) > STDERR_FILE_MAX_BYTES:
                            out.write(b"[swarm: stage.err is full; the rest is not kept here]\n")
                            out = _closed(out)
                        else:
                            out.write(raw)
                            out.flush()
                    except OSError as exc:
                        log.error("%s: cannot write %s any more: %s", self.job_id, out.name, exc)
                        out = _closed(out)
                if line.strip():
                    self.last_stderr = line.strip()[:500]  # the outcome's, whatever the file
                if line:
                    self.on_output("stderr", line)
        finally:
            if out is not None:
                _closed(out)

    def _open_stderr_file(self) -> BinaryIO | None:
        try:
            return open(self.stderr_path, "ab")
        except OSError as exc:
            log.error("%s: cannot open %s: %s", self.job_id, self.stderr_path, exc)
            return None

    def _remember(self, event: StageEvent) -> None:
        if isinstance(event, StepEvent):
            self.last_step = event
        elif isinstance(event, DoneEvent):
            self.done = event
        elif isinstance(event, ErrorEvent):
            self.error, self.error_code = event.message, event.code or None

    def _outcome(self, code: int) -> StageOutcome:
        done, last = self.done, self.last_step
        if done is not None:
            steps_done, loss, val_loss = done.steps, done.loss, done.val_loss
        elif last is not None:
            steps_done, loss, val_loss = last.step + 1, last.loss, None
        else:
            steps_done, loss, val_loss = None, None, None
        error_code = None
        killed = (  # the kernel's counters are read only for a death by a signal
            signal_reason(code, self.oom_kills_at_start, oom_kills(), memory_limit())
            if code < 0
            else None
        )
        # The out-of-memory killer's work is said even when a stop was asked for meanwhile
        # (an agent stalled at its group's limit reads both at once when it runs again).
        out_of_memory = killed is not None and killed[1] is ErrorCode.STAGE_OUT_OF_MEMORY
        if code == 0 and done is not None:
            result, message = StageResult.COMPLETED, ""
        elif self.stopping is not None and not out_of_memory:
            result, message = StageResult.STOPPED, self.stopping
        else:
            result, error_code = StageResult.FAILED, self.error_code
            last_line = self.last_stderr or _last_line(self.stderr_path)
            if killed is not None and self.error is None:
                why, error_code = killed
                if last_line:
                    why = f"{why}; its stderr's last line: {last_line}"
            else:
                why = self.error or last_line or f"runtime exited with {code}"
            message = f"{why} (exit {code})"
        return StageOutcome(
            result=result,
            message=message,
            code=error_code,
            job_id=self.job_id,
            attempt=self.attempt,
            step=steps_done,
            loss=loss,
            val_loss=val_loss,
        )


def _last_line(path: Path) -> str:
    lines = [line for line in tail(path, 5).splitlines() if line.strip()]
    return lines[-1].strip()[:500] if lines else ""


async def read_lines(stream: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The lines of ``stream`` to its end. A line longer than the stream's limit comes in
    pieces of about the limit: reading never stops on one (``async for`` over the stream
    raises there, and a runtime whose pipe is no longer read blocks on its next write)."""
    while True:
        try:
            yield await stream.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:  # the end, maybe after a last line
            if exc.partial:
                yield exc.partial
            return
        except asyncio.LimitOverrunError as exc:
            yield await stream.read(max(exc.consumed, 1))


def _closed(out: BinaryIO) -> None:
    """Close a log file that may not take its last buffered bytes (a full disk)."""
    with contextlib.suppress(OSError):
        out.close()
