"""Calibration along the chain: measure every boundary, decide on the last stage, agree.

At a calibration point (:func:`next_due`: the start of an attempt, after the warm-up steps
and after each change of micro-batch count, every ``link_probe_every`` steps) every stage of
the attempt runs :func:`calibrate` before its next step, in stage order:

1. **Down the chain.** Stage s measures its upstream boundary with stage s-1
   (:mod:`silentswarm.agent.pipe.probe`), takes what stage s-1 passed on (every boundary
   measured so far and each stage's seconds of work per step at the micro-batch counts it
   ran), adds its own, measures its downstream boundary and passes the lot on.
2. **On the last stage**, ``decide`` turns the measurements into codecs and a schedule
   (:func:`silentswarm.agent.runtime.tuning.tune`).
3. **Up the chain**, the decision goes back from stage to stage, so every stage starts the
   next step with the same micro-batch count and window, and each end of a boundary knows
   what the other now sends.

The decision comes from a neighbour, so it is checked before it is used: the boundaries and
step it names, codecs that are wire codecs the plan allows, a micro-batch count that divides
the batch, a window inside it, deferred weight-gradient passes as the job allows them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import msgspec

from silentswarm.agent.errors import FrameError
from silentswarm.agent.pipe.probe import (
    ChainBack,
    ChainForward,
    ProbeLink,
    measure_as_downstream,
    measure_as_upstream,
    recv_msg,
    send_msg,
)
from silentswarm.types.links import LinkStats

WARMUP_STEPS = 2  # steps before a decision: the first compiles, the second is timed

Busy = list[tuple[int, float]]  # one stage's (micro-batches, seconds of work per step) points
Decide = Callable[[list[LinkStats], list[Busy]], ChainBack]


def next_due(step: int, *, start_step: int, probe_every: int, changed: bool) -> int | None:
    """The step before which the stages calibrate next, after one before ``step``: every
    stage computes the same from what they all share.

    After the first (start of the attempt) and after a change of micro-batch count, once the
    new count has compiled and been timed; otherwise ``probe_every`` steps on (0: never)."""
    if step == start_step or changed:
        return step + WARMUP_STEPS
    return step + probe_every if probe_every > 0 else None


@dataclass(frozen=True)
class Rules:
    """What a decision must respect (the plan's): a neighbour's answer outside them is refused."""

    n_stages: int
    batch_size: int
    fwd_codecs: Collection[str]  # the codec names each direction may use
    bwd_codecs: Collection[str]
    max_in_flight: int | None  # None: up to the micro-batch count
    fixed: tuple[int, int] | None  # the spec's micro-batches and window; None: the tuner's
    overlap: bool = False  # the job's schedule is "overlap"
    # The deferred weight-gradient passes the job fixes (at most m - 1 of them are
    # deferred); None: the tuner's to choose, below the micro-batch count.
    deferred: int | None = 0


def calibrate(
    *,
    stage: int,
    n_stages: int,
    up: ProbeLink | None,
    down: ProbeLink | None,
    step: int,
    busy: Busy,
    current: tuple[str, str] | None,
    decide: Decide,
    rules: Rules,
    timeout_s: float,
) -> ChainBack:
    """This stage's part of one calibration; the decision every stage of the chain shares.

    ``current``: the forward and backward codecs in force on the downstream boundary."""
    links: list[LinkStats] = []
    busies: list[Busy] = []
    if up is not None:
        measure_as_downstream(up, boundary=stage - 1, step=step, timeout_s=timeout_s)
        chain = recv_msg(up, ChainForward, timeout_s)
        if len(chain.links) != stage or len(chain.busy) != stage:
            raise FrameError(f"{up.name}: the chain's measurements do not end at stage {stage}")
        links, busies = list(chain.links), [list(b) for b in chain.busy]
    busies.append(busy)
    if down is not None:
        measured = measure_as_upstream(down, boundary=stage, step=step, timeout_s=timeout_s)
        if current is not None:
            measured = msgspec.structs.replace(measured, fwd_codec=current[0], bwd_codec=current[1])
        links.append(measured)
        send_msg(down, ChainForward(links=links, busy=busies), timeout_s)
        # The rest of the chain measures its boundaries before the answer comes back.
        back = recv_msg(down, ChainBack, timeout_s * max(1, n_stages - stage))
    else:
        back = decide(links, busies)
    edge = down or up
    check(back, rules, step=step, name=edge.name if edge is not None else f"stage {stage}")
    if up is not None:
        send_msg(up, back, timeout_s)
    return back


def check(back: ChainBack, rules: Rules, *, step: int, name: str) -> None:
    """FrameError unless ``back`` is a decision the plan allows, for this step."""
    problems = []
    if [link.boundary for link in back.links] != list(range(rules.n_stages - 1)):
        problems.append("its boundaries are not the chain's")
    if any(link.step != step for link in back.links) or back.tuning.step != step:
        problems.append(f"it is not for step {step}")
    for link in back.links:
        if link.fwd_codec not in rules.fwd_codecs or link.bwd_codec not in rules.bwd_codecs:
            problems.append(f"codecs {link.fwd_codec}/{link.bwd_codec} are not allowed")
    m, window = back.tuning.micro_batches, back.tuning.in_flight
    top = m if rules.max_in_flight is None else min(m, rules.max_in_flight)
    if rules.fixed is not None and (m, window) != rules.fixed:
        problems.append(f"the job's schedule is {rules.fixed}, not {(m, window)}")
    elif rules.batch_size % m:
        problems.append(f"{m} micro-batches do not divide the batch of {rules.batch_size}")
    elif not 1 <= window <= top:
        problems.append(f"a window of {window} is outside 1..{top}")
    deferred = back.tuning.deferred
    if rules.deferred is not None and deferred != min(rules.deferred, max(0, m - 1)):
        problems.append(f"the job defers {rules.deferred} weight-gradient passes, not {deferred}")
    elif deferred >= m:
        problems.append(f"{deferred} deferred passes are not below {m} micro-batches")
    if back.tuning.overlap != rules.overlap:
        problems.append(f"the job's steps {'' if rules.overlap else 'do not '}overlap")
    if problems:
        raise FrameError(f"{name}: refused the chain's calibration: {'; '.join(problems)}")


__all__ = ["WARMUP_STEPS", "Rules", "calibrate", "check", "next_due"]
