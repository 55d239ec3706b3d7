"""Who may report what: the rules the leader applies to what fellows send about jobs. Pure.

A fellow is a stranger. It may report progress for a job only as the fellow placed at that
stage of the job's current attempt, and a measured link only of its own downstream boundary;
the live view, the job record and the history rebuilt from the stream after a restart all
apply this one rule. A fellow's volume is bounded by a
token bucket per fellow: what is over it is dropped and counted, so one fellow cannot make
the leader spend its time on it.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from silentswarm.jobspec import Placement
from silentswarm.protocol import Progress


class Verdict(enum.Enum):
    ADMIT = "admit"
    STALE = "stale"  # an earlier attempt's stage still talking: ignored, not hostile
    REFUSE = "refuse"


@dataclass(frozen=True)
class Admission:
    verdict: Verdict
    reason: str = ""


ADMITTED = Admission(Verdict.ADMIT)


def admit_progress(
    attempt: int | None, placement: Placement | None, progress: Progress
) -> Admission:
    """Whether ``progress`` comes from the fellow placed at its stage of the job's current
    ``attempt`` (None: no such job); ``placement`` is that attempt's."""
    if attempt is None:
        return Admission(Verdict.REFUSE, f"no job {progress.job_id!r}")
    if progress.attempt < attempt:
        return Admission(Verdict.STALE, f"attempt {progress.attempt} is over")
    if placement is None or progress.attempt > attempt:
        return Admission(
            Verdict.REFUSE, f"attempt {progress.attempt} is not the job's current attempt"
        )
    placed = placement.stage_of(progress.fellow_id)
    if placed is None:
        return Admission(
            Verdict.REFUSE, f"fellow {progress.fellow_id} is not placed in attempt {attempt}"
        )
    if progress.stage != placed.stage:
        return Admission(
            Verdict.REFUSE,
            f"fellow {progress.fellow_id} runs stage {placed.stage}, not stage {progress.stage}",
        )
    if progress.replica != placed.replica:
        return Admission(
            Verdict.REFUSE,
            f"fellow {progress.fellow_id} runs replica {placed.replica}, "
            f"not replica {progress.replica}",
        )
    link = progress.down_link
    if link is not None and link.boundary != placed.stage:
        # A stage measures only the boundary to its next stage; another pair's figures
        # would steer where the next balanced job's stages go.
        return Admission(
            Verdict.REFUSE,
            f"fellow {progress.fellow_id} runs stage {placed.stage}, "
            f"not the upstream end of boundary {link.boundary}",
        )
    return ADMITTED


class RateLimiter:
    """A token bucket per key: ``rate`` per second on average, bursts up to ``burst``.

    Keys are fellow ids; the least recently seen are forgotten past ``max_keys`` (a
    forgotten fellow starts again with a full bucket, which only ever errs towards
    admitting an honest one).
    """

    def __init__(
        self,
        rate: float,
        burst: float,
        *,
        max_keys: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def allow(self, key: str, cost: float = 1.0) -> bool:
        now = self._clock()
        tokens, at = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        allowed = tokens >= cost
        if allowed:
            tokens -= cost
        self._buckets[key] = (tokens, now)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return allowed
