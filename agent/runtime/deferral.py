"""Deferred weight-gradient passes kept only where the measured steps agree.

Under ``defer_weight_grads: "auto"`` the calibration's model (:func:`tuning.tune`) proposes
how many of a step's last micro-batches the last stage defers. The model does not know
everything that decides it: two stages sharing a machine's cores, a link whose drain is
shorter than it assumes. So the last stage, the only one whose work the count changes, tries
a proposal before it keeps it: :class:`DeferralCheck` runs the proposed count for a few
steps, the count it ran before for as many (the steps just before the proposal count, when
there are enough), and keeps the one whose median step is shorter; the fewer deferred passes
unless the other is faster by more than :data:`KEEP_MARGIN`. The gradients are the same
whatever the count (the deferred calls are the undeferred ones, later), so a step may run
either count.

Pure logic: the stage feeds it each step's seconds and runs the count it answers.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

from silentswarm.types.links import DeferralVerdict

SAMPLES = 4  # timed steps per count before a verdict
KEEP_MARGIN = 0.005  # more deferred passes are kept only if their median step is this much shorter


@dataclass(frozen=True)
class StepOutcome:
    """What :meth:`DeferralCheck.after_step` answers: the count the next step runs, and the
    verdict taken after this step, if one was."""

    next_count: int
    verdict: DeferralVerdict | None = None


def verdict(
    step: int, a: int, a_steps: list[float], b: int, b_steps: list[float], margin: float
) -> DeferralVerdict:
    """The count to keep between ``a`` and ``b`` from their steps' seconds: the one with fewer
    deferred passes unless the other's median step is shorter by more than ``margin``."""
    (lo, lo_s), (hi, hi_s) = sorted(((a, a_steps), (b, b_steps)))
    lo_m, hi_m = statistics.median(lo_s), statistics.median(hi_s)
    kept, kept_m, other, other_m = (
        (hi, hi_m, lo, lo_m) if hi_m < lo_m * (1 - margin) else (lo, lo_m, hi, hi_m)
    )
    return DeferralVerdict(
        step=step,
        kept=kept,
        kept_step_s=round(kept_m, 5),
        other=other,
        other_step_s=round(other_m, 5),
    )


class DeferralCheck:
    """The last stage's count of deferred passes, step by step.

    :meth:`propose` (at a calibration) says what the model chose and under which schedule
    (``setting``: anything that changes a step's time, such as the micro-batch count,
    window and codecs; a new one forgets every measurement); :meth:`after_step` takes each
    step's count and seconds; ``current`` and ``setting`` are what the first steps run.
    Steps before the first proposal are not timed (they still warm up: the second step of a
    run took three times a steady one), nor is the first step after the count changes (it
    may compile, and it starts from the other count's pipeline)."""

    def __init__(
        self,
        current: int,
        setting: Hashable,
        *,
        samples: int = SAMPLES,
        margin: float = KEEP_MARGIN,
    ) -> None:
        self.current = current  # the count kept (what runs outside a trial)
        self.samples = max(1, samples)
        self.margin = margin
        self.trial: tuple[int, int] | None = None  # (proposed, the count run before it)
        self.last_verdict: DeferralVerdict | None = None
        self._setting = setting  # the schedule the steps run under
        self._timed: dict[int, deque[float]] = {}
        self._last_ran: int | None = None
        self._proposed = False  # the steps before the first calibration still warm up: untimed

    def propose(self, proposed: int, setting: Hashable, most: int) -> int:
        """The model's count for ``setting``, where at most ``most`` passes can be deferred
        (the micro-batch count less one); the count the next step runs."""
        self._proposed = True
        if setting != self._setting:
            self._setting = setting
            self.current = min(self.current, most)
            self._timed.clear()
            self._last_ran = None  # a new schedule's first step compiles
            self.trial = None
        if proposed == self.current:
            self.trial = None
        elif self.trial is None or self.trial[0] != proposed:
            # Fresh measurements only: the current count's latest steps, nothing older.
            self._timed = {self.current: self._timed.get(self.current, self._queue())}
            self.trial = (proposed, self.current)
        return self._next()

    def after_step(self, step: int, ran: int, seconds: float) -> StepOutcome:
        """Step ``step`` ran ``ran`` deferred passes in ``seconds``: the count for the next."""
        if ran == self._last_ran and self._proposed:
            self._timed.setdefault(ran, self._queue()).append(seconds)
        self._last_ran = ran
        if self.trial is not None:
            proposed, before = self.trial
            a, b = self._timed.get(proposed, ()), self._timed.get(before, ())
            if len(a) >= self.samples and len(b) >= self.samples:
                self.last_verdict = verdict(
                    step + 1, proposed, list(a), before, list(b), self.margin
                )
                self.current = self.last_verdict.kept
                self.trial = None
                return StepOutcome(self._next(), self.last_verdict)
        return StepOutcome(self._next())

    def _next(self) -> int:
        """What runs next: in a trial, the proposed count until it has its steps, then the
        one before it until that has as many; otherwise the count kept."""
        if self.trial is None:
            return self.current
        proposed, before = self.trial
        if len(self._timed.get(proposed, ())) < self.samples:
            return proposed
        return before

    def _queue(self) -> deque[float]:
        return deque(maxlen=self.samples)


__all__ = ["KEEP_MARGIN", "SAMPLES", "DeferralCheck", "StepOutcome", "verdict"]
