"""One thread that runs the model for every request: continuous batching over the slots.

Requests wait in a bounded queue; a free slot takes the oldest. Each turn of the loop
starts the newly admitted sequences (their prompt through the model, the first token
sampled), then runs one step for every running sequence at once (one batched call:
``Stepper.step``), samples each its next token and hands it to the sequence's ``emit``. A
sequence ends at its ``max_tokens``, when cancelled (its client left, or a stop sequence
was seen), or, with every other running one, if the model call fails. No TensorFlow here:
the stepper holds the model, so the loop is tested with any stepper.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from silentswarm.agent.errors import ServeBusyError
from silentswarm.agent.runtime.generate import pick
from silentswarm.agent.serve.kvcache import Stepper

log = logging.getLogger(__name__)

FinishReason = Literal["length", "cancelled", "error"]


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: every token
    top_p: float = 1.0
    seed: int | None = None


@dataclass(frozen=True)
class Token:
    id: int


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    message: str = ""


Event = Token | Finished


@dataclass(eq=False)
class Job:
    """One sequence to continue: its prompt's token ids, how many tokens to add, how to
    sample them, and where each event goes (``emit`` is called on the engine's thread)."""

    ids: Sequence[int]
    max_tokens: int
    sampling: Sampling
    emit: Callable[[Event], None]
    slot: int = -1
    made: int = 0  # tokens sampled so far
    last: int = 0  # the last token sampled: the next step's input
    cancelled: threading.Event = field(default_factory=threading.Event)  # to end, its slot freed
    ended: bool = False  # its Finished was emitted
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.sampling.seed)

    def finish(self, reason: FinishReason, message: str = "") -> None:
        """Emit the job's one Finished event (later calls do nothing) and mark it to end."""
        self.cancelled.set()
        if not self.ended:
            self.ended = True
            self.emit(Finished(reason, message))

    @property
    def position(self) -> int:
        """Where ``last`` goes in the sequence."""
        return len(self.ids) + self.made - 1


class Engine:
    """The loop of the module's docstring, on a daemon thread (:meth:`start`)."""

    def __init__(
        self,
        stepper: Stepper,
        *,
        max_waiting: int = 64,
        on_step: Callable[[int, float], None] | None = None,
    ) -> None:
        """``on_step(batch, seconds)``: after each batched step (for the metrics)."""
        self.stepper = stepper
        self.max_waiting = max_waiting
        self.on_step = on_step
        self._waiting: deque[Job] = deque()
        self._running: dict[int, Job] = {}
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="serve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)

    @property
    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._wake:
            return len(self._running), len(self._waiting)

    def submit(self, job: Job) -> None:
        """Queue ``job``; ServeBusyError when ``max_waiting`` jobs wait already."""
        if job.max_tokens < 1:
            job.finish("length")
            return
        with self._wake:
            if len(self._waiting) >= self.max_waiting:
                raise ServeBusyError(
                    f"{len(self._waiting)} requests are waiting for one of the "
                    f"{self.stepper.slots} slots; try again shortly"
                )
            self._waiting.append(job)
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """End ``job``: a waiting one leaves the queue at once, a running one at the next
        turn."""
        job.cancelled.set()
        with self._wake:
            if job in self._waiting:
                self._waiting.remove(job)
                job.finish("cancelled")
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self._waiting and not self._running:
                    self._wake.wait()
                if self._stopped:
                    break
                admitted = self._admit()
            try:
                self._turn(admitted)
            except Exception as exc:  # a model call failed: every running sequence ends
                log.exception("the model failed; ending %d running requests", len(self._running))
                # The details are in the log, never in an answer: TensorFlow's first line
                # names devices, tensors and paths of this machine.
                self._end_all(f"the model failed ({type(exc).__name__}; the server's log has it)")
        self._end_all("the server is shutting down")

    def _admit(self) -> list[Job]:
        free = [s for s in range(self.stepper.slots) if s not in self._running]
        admitted = []
        while free and self._waiting:
            job = self._waiting.popleft()
            if job.cancelled.is_set():
                job.finish("cancelled")
                continue
            job.slot = free.pop(0)
            self._running[job.slot] = job
            admitted.append(job)
        return admitted

    def _turn(self, admitted: list[Job]) -> None:
        for job in admitted:
            if not job.cancelled.is_set():
                self._take(job, self.stepper.start(job.slot, job.ids))
        self._drop_finished()
        jobs = list(self._running.values())
        if not jobs:
            return
        began = time.perf_counter()
        logits = self.stepper.step(
            [job.slot for job in jobs], [job.last for job in jobs], [job.position for job in jobs]
        )
        if self.on_step is not None:
            self.on_step(len(jobs), time.perf_counter() - began)
        for job, row in zip(jobs, logits, strict=True):
            if not job.cancelled.is_set():
                self._take(job, row)
        self._drop_finished()

    def _take(self, job: Job, logits: np.ndarray) -> None:
        """Sample ``job``'s next token from ``logits`` and hand it over (a failure ends this
        job only)."""
        try:
            token = sample(logits, job.sampling, job.rng)
        except (ValueError, FloatingPointError) as exc:
            job.finish("error", f"sampling failed: {exc}")
            return
        job.last, job.made = token, job.made + 1
        job.emit(Token(token))
        if job.made >= job.max_tokens:
            job.finish("length")  # the slot is freed below

    def _drop_finished(self) -> None:
        with self._wake:
            for slot, job in list(self._running.items()):
                if job.cancelled.is_set():
                    del self._running[slot]
                    job.finish("cancelled")

    def _end_all(self, message: str) -> None:
        with self._wake:
            jobs = [*self._running.values(), *self._waiting]
            self._running.clear()
            self._waiting.clear()
        for job in jobs:
            job.finish("error", message)


def sample(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """One token of ``logits`` as ``sampling`` says (``generate``'s :func:`pick`)."""
    return pick(
        logits,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        rng=rng,
    )
