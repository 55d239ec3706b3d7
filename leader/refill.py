"""Which fellows take a fixed split, in which order: a resumed job's, a replacement replica's.

Pure. A resumed job keeps its layer ranges (its checkpoint shards are cut along them) and a
replacement replica takes the split of the replica whose weights it downloads, so the
partition cannot adapt to the fellows that come: the choice of fellows and their order
does. A slow fellow on the largest range sets the pace of every micro-batch; a slow link
between two stages adds its transfer to every step; and each stage of a replacement joins
the ring of the other replicas' fellows that hold its layers, whose slowest link paces
every sync round.

:func:`refill` costs every chain of ``n`` of the best candidates (every set and every
order, at most :data:`MAX_POOL` candidates and :data:`MAX_CHAINS` chains) and keeps the
one whose predicted step is least;
:func:`chain_seconds` is that prediction: the split's compute on the chain's measured
speeds (:func:`silentswarm.leader.balance.split_seconds`), its links
(:func:`silentswarm.leader.balance.link_seconds`) and the rings it joins
(:class:`JoinedRings`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from silentswarm.jobspec import Placement
from silentswarm.leader.balance import MAX_CHAINS, link_seconds, split_seconds
from silentswarm.leader.replica_groups import ring_seconds
from silentswarm.plan import ModelConfig
from silentswarm.types.links import MeasuredLink

EPSILON = 1e-9
# The most candidates a fixed split is weighed among: the links between them (and the rings'
# members) are guessed for the chains costed, so a large swarm's fastest few.
MAX_POOL = 16

Links = Mapping[tuple[str, str], MeasuredLink]
Chain = list[str]


class JoinedRings(NamedTuple):
    """The rings a replacement replica's stages join. ``members[i]``: for its stage ``i``,
    the fellow of each other live replica that holds most of that stage's layers, in ring
    order (by replica); ``at``: the replacement's place in that order; ``bits[i]``: one
    contribution to stage ``i``'s round; ``rounds``: rounds a step; ``addresses``: the
    members' data addresses (which tell a member on a candidate's machine)."""

    members: list[list[str]]
    at: int
    bits: list[float]
    rounds: float
    addresses: dict[str, str | None]

    @property
    def fellows(self) -> list[str]:
        return sorted({f for ring in self.members for f in ring})

    def seconds(self, fellows: Sequence[str], links: Links) -> list[dict[str, float]]:
        """For each stage, what its ring adds to a step with each of ``fellows`` in it: its
        round's time times the rounds a step (a chain then costs the slowest of its
        stages'). Every pair in a ring must be in ``links``."""
        return [
            {
                f: self.rounds
                * ring_seconds([*ring[: self.at], f, *ring[self.at :]], links, bits=bits)
                for f in fellows
            }
            for ring, bits in zip(self.members, self.bits, strict=True)
        ]


def joined_rings(
    placement: Placement, slot: int, bits: Sequence[float], rounds: float
) -> JoinedRings:
    """The rings a replacement in replica slot ``slot`` of ``placement`` joins, taking the
    lead replica's split (``bits``: one contribution per stage of it)."""
    ranges = placement.split(placement.lead)
    live = placement.live_replicas
    members = []
    for start, end in ranges:
        ring = []
        for replica in live:
            overlap = [
                (min(end, s.layer_end) - max(start, s.layer_start), -s.stage, s.fellow_id)
                for s in placement.pipeline(replica)
            ]
            ring.append(max(overlap)[2])
        members.append(ring)
    at = sum(1 for replica in live if replica < slot)
    addresses = {s.fellow_id: s.data_address for s in placement.stages}
    return JoinedRings(members=members, at=at, bits=list(bits), rounds=rounds, addresses=addresses)


def chain_seconds(
    chain: Sequence[str],
    *,
    model: ModelConfig,
    batch_size: int,
    micro_batches: int,
    sizes: Sequence[int],
    speeds: Mapping[str, float] | None,
    links: Links | None,
    bits_per_step: float,
    rings: Sequence[Mapping[str, float]] | None = None,
) -> float:
    """The predicted step of ``chain`` holding ``sizes`` layers per stage: the split's
    compute where ``speeds`` (every fellow of the chain's, standard blocks per second) are
    given, plus, where ``links`` (every pair of the chain) are, its links' share, and the
    slowest of the rings it joins (``rings[i][f]``: stage ``i``'s ring with fellow ``f``
    in it, :meth:`JoinedRings.seconds`)."""
    total = 0.0
    if speeds is not None:
        total += split_seconds(
            model,
            batch_size=batch_size,
            sizes=sizes,
            speeds=[speeds[f] for f in chain],
            micro_batches=micro_batches,
        )
    if links:
        total += link_seconds(chain, links, bits_per_step=bits_per_step)
    if rings:
        total += max(ring[f] for ring, f in zip(rings, chain, strict=True))
    return total


def orders_tried(n: int, *, keep_last: bool) -> int:
    """How many orders of a set of ``n`` :func:`refill` tries: every one (the last fixed
    under ``keep_last``) while they are at most :data:`MAX_CHAINS`, else the given one."""
    orders = math.factorial(n - 1 if keep_last else n)
    return orders if orders <= MAX_CHAINS else 1


def pool_size(candidates: int, n: int, *, keep_last: bool) -> int:
    """How many of the best candidates :func:`refill` tries: at most :data:`MAX_POOL`, and
    as many as keep the chains to cost within :data:`MAX_CHAINS` (at least ``n``)."""
    orders = orders_tried(n, keep_last=keep_last)
    pool = min(candidates, max(n, MAX_POOL))
    while pool > n and math.comb(pool, n) * orders > MAX_CHAINS:
        pool -= 1
    return pool


def candidate_pool(
    ranked: Sequence[str],
    n: int,
    *,
    keep_last: bool,
    pace: Mapping[str, float] | None = None,
) -> list[str]:
    """The fellows :func:`refill` tries of ``ranked`` (best ranked first): the
    :func:`pool_size` fastest by ``pace`` (ties, and without ``pace``: by rank), in rank
    order. A caller that weighs links guesses them among these alone."""
    rank = {f: at for at, f in enumerate(ranked)}
    size = pool_size(len(ranked), n, keep_last=keep_last)
    by_pace = sorted(ranked, key=lambda f: (-(pace or {}).get(f, 0.0), rank[f]))
    return sorted(by_pace[:size], key=rank.__getitem__)


def refill(
    ranked: Sequence[str],
    n: int,
    cost: Callable[[Chain], float],
    *,
    keep_last: bool,
    pace: Mapping[str, float] | None = None,
) -> Chain | None:
    """The chain of ``n`` of ``ranked``'s fellows (best ranked first) of least ``cost``,
    or None where none is finite.

    The pool is the :func:`pool_size` fastest by ``pace`` (ties, and without ``pace``: by
    rank); past :data:`MAX_CHAINS` orders of ``n``, a set keeps its rank order. With
    ``keep_last`` each chain's best ranked fellow runs its last stage (it hosts the head).
    Ties keep the chain found first: the pool's best ranked set, in rank order, with its
    best ranked fellow last under ``keep_last`` (as such a set would be dealt)."""
    if n < 1 or len(ranked) < n:
        return None
    pool = candidate_pool(ranked, n, keep_last=keep_last, pace=pace)
    every_order = orders_tried(n, keep_last=keep_last) > 1
    best: tuple[float, Chain] | None = None
    for group in itertools.combinations(pool, n):
        head, tail = (group[1:], group[:1]) if keep_last else (group, ())
        for order in itertools.permutations(head) if every_order else [head]:
            chain = [*order, *tail]
            found = cost(chain)
            if math.isfinite(found) and (best is None or found < best[0] * (1 - EPSILON)):
                best = (found, chain)
    return None if best is None else best[1]
