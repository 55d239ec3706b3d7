"""Pools, labels and accounts' pool limits at placement: pure decisions, table-tested.

- :func:`fits`: a fellow may run a stage of a job when it is in the job's pool and carries
  every label the job asks for, with the same value (extra labels do not matter).
- :func:`fleet_note`: why too few fellows fit, from the whole fleet: how many that fit are
  busy, offline or not ready, or that no fellow is in the pool (and which pools there are).
- :func:`holdings` and :func:`account_limit`: an account's jobs and fellows in use per pool,
  and whether its next job there must wait (``Account.pools``, ``Account.pool_limits``).

Accounts are looked up through an :data:`AccountLookup` the leader passes in (None: no
such account, or no limits), so these rules need no store.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from silentswarm.jobspec import JobSpec
from silentswarm.pools import format_labels
from silentswarm.protocol import FellowStatus, JobState
from silentswarm.types.accounts import Account
from silentswarm.types.fleet import FellowRecord
from silentswarm.types.jobs import JobRecord

# The account a job's owner names, or None (unknown, or the operator: no limits).
AccountLookup = Callable[[str], Account | None]

_BUSY = (FellowStatus.TRAINING, FellowStatus.CHECKPOINTING)


def no_accounts(_owner: str) -> Account | None:
    """The lookup of a leader without accounts: nobody is limited."""
    return None


def fits(pool: str, labels: Mapping[str, str], spec: JobSpec) -> bool:
    """Whether a fellow in ``pool`` with ``labels`` may run a stage of ``spec``'s job."""
    return pool == spec.run_pool and all(labels.get(k) == v for k, v in spec.labels.items())


def where(spec: JobSpec) -> str:
    """The job's pool and labels in words: ``in pool gpu matching gpu=a100``."""
    text = f"in pool {spec.run_pool}"
    return f"{text} matching {format_labels(spec.labels)}" if spec.labels else text


def by_pool(fellows: Iterable[FellowRecord]) -> dict[str, list[FellowRecord]]:
    """The fleet by pool: what :func:`fleet_note` reads (built once per scheduling round)."""
    pools: dict[str, list[FellowRecord]] = {}
    for f in fellows:
        pools.setdefault(f.pool, []).append(f)
    return pools


def fleet_note(
    spec: JobSpec, pools: Mapping[str, list[FellowRecord]], *, free: Collection[str]
) -> str:
    """What the rest of the fleet (``pools``: :func:`by_pool`) says about a job too few
    ``free`` fellows fit: the fitting fellows that are busy, offline or not ready; else
    that none is in its pool or carries its labels. "" when there is nothing to add."""
    in_pool = pools.get(spec.run_pool, [])
    fitting = [f for f in in_pool if fits(f.pool, f.labels, spec)]
    if not fitting:
        if in_pool:
            return f" (none of the {len(in_pool)} fellow(s) in pool {spec.run_pool} carries " + (
                f"{format_labels(spec.labels)})"
            )
        known = f"; pools: {', '.join(sorted(pools))}" if pools else ""
        return f" (no fellow is in pool {spec.run_pool}{known})"
    counts: Counter[str] = Counter()
    for f in fitting:
        if f.fellow_id in free:
            continue
        if f.status is FellowStatus.OFFLINE:
            counts["offline"] += 1
        elif f.status in _BUSY or f.job_id is not None or f.status is FellowStatus.READY:
            # Ready but not free: placed in a job being started, cooling down after a refused
            # START, or held by an operator's action.
            counts["busy"] += 1
        else:
            counts["not ready"] += 1
    parts = [f"{n} {what}" for what, n in sorted(counts.items()) if n]
    return f", {', '.join(parts)}" if parts else ""


@dataclass(frozen=True)
class Held:
    """What an account's running (and starting) jobs hold in one pool."""

    jobs: int = 0
    fellows: int = 0

    def plus(self, fellows: int) -> Held:
        return Held(self.jobs + 1, self.fellows + fellows)


def holdings(
    jobs: Iterable[JobRecord], *, starting: Collection[str]
) -> dict[tuple[str, str], Held]:
    """(owner, pool) -> what its placed jobs hold: RUNNING ones and those being started."""
    held: dict[tuple[str, str], Held] = {}
    for job in jobs:
        if job.placement is None or job.terminal:
            continue
        if job.job_id not in starting and job.state is not JobState.RUNNING:
            continue
        key = (job.owner, job.spec.run_pool)
        held[key] = held.get(key, Held()).plus(len(job.placement.stages))
    return held


@dataclass(frozen=True)
class Allowance:
    """Whether the owner's next job in a pool may be placed now: ``reason`` says why it must
    wait ("" when it may), ``max_stages`` how many fellows it may take (None: any)."""

    reason: str = ""
    max_stages: int | None = None


def account_limit(
    account: Account | None, spec: JobSpec, held: Held, *, needed: int | None = None
) -> Allowance:
    """What ``account`` (None: no limits) lets its next job in ``spec``'s pool do, given what
    its placed jobs there already ``held``; ``needed``: the fellows the job needs at least
    (default: the spec's; a resumed job keeps its number of stages)."""
    if account is None:
        return Allowance()
    pool = spec.run_pool
    if account.pools is not None and pool not in account.pools:
        allowed = ", ".join(account.pools) or "none"
        return Allowance(f"account {account.name} may not use pool {pool} (its pools: {allowed})")
    limit = account.pool_limits.get(pool)
    if limit is None:
        return Allowance()
    if limit.max_jobs is not None and held.jobs >= limit.max_jobs:
        return Allowance(
            f"account {account.name} runs {held.jobs} job(s) in pool {pool}; its limit is "
            f"{limit.max_jobs} (max_jobs)"
        )
    if limit.max_fellows is None:
        return Allowance()
    left = limit.max_fellows - held.fellows
    needed = spec.min_stages if needed is None else needed
    if left < needed:
        return Allowance(
            f"account {account.name} holds {held.fellows} fellow(s) in pool {pool}; its limit "
            f"is {limit.max_fellows} (max_fellows) and the job needs {needed}"
        )
    return Allowance(max_stages=left)
