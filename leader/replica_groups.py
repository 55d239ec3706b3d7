"""Which fellows form each replica of a job with replicas, when their links were measured.

Pure. A job of ``k`` replicas of ``p`` stages has two kinds of traffic between fellows: each
replica's pipeline boundaries carry a step's activations and gradients (every micro-batch,
on the step's critical path), and each stage position's ring carries the stage's gradients
every step (``allreduce``) or its pseudo-gradients every ``sync_every`` steps (``diloco``).
Dealing the fellows out like cards (replica ``r`` takes the ``r``-th best, the ``k + r``-th,
...) ignores both: two sites joined by a slow link, two fellows each, get two pipelines that
each cross the slow link every micro-batch, where a DiLoCo job would rather keep each
pipeline on one site and send only its rare syncs across.

:func:`replica_groups` costs a grouping as the step it predicts: the slowest replica's
compute (where the fellows' speeds are known) plus its pipeline's links in their best order
(:func:`silentswarm.leader.balance.link_seconds`), plus the slowest ring's share of a step
(:func:`ring_seconds`: a round is an all-gather, ``k - 1`` contributions over each ring
link), and keeps the least. Every grouping is tried while there are at most
:data:`MAX_GROUPINGS` and costing them all stays within :data:`MAX_WORK` (8 fellows as
2 x 4 or 4 x 2, 9 as 3 x 3); beyond that, swaps of two fellows between replicas while one
pays, from two ends, the better first: the dealt grouping and one of fellows close to each
other (:func:`clustered`), the first within half the budget.
The dealt grouping stays unless another is predicted faster.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

from silentswarm.compression import CodecKind, parse_wire_codec
from silentswarm.jobspec import JobSpec
from silentswarm.leader.balance import MAX_CHAINS as MAX_CHAINS_ALONG
from silentswarm.leader.balance import link_between, link_seconds
from silentswarm.leader.memory import (
    adapter_block_params,
    block_params,
    embedding_params,
    head_params,
)
from silentswarm.plan import split_layers
from silentswarm.types.links import MeasuredLink

# Every grouping is costed up to this many (within MAX_WORK), else swaps from two starts.
MAX_GROUPINGS = 512
# The work of a placement's search beyond the dealt grouping, in chains costed (10-20 us
# each here: a pipeline order tried, a ring, a stage's layers in a balanced split). It runs
# on every tick while a job waits: fellows_along_links' MAX_CHAINS (under 0.1 s here).
MAX_WORK = MAX_CHAINS_ALONG
# A grouping replaces the dealt one only when predicted faster by more than this share.
MARGIN = 0.01
EPSILON = 1e-9

Links = Mapping[tuple[str, str], MeasuredLink]
Chain = list[str]


def dealt(taken: Sequence[str], k: int) -> list[Chain]:
    """``taken`` (ranked) dealt out like cards: replica ``r`` takes every ``k``-th from the
    ``r``-th, so the replicas are alike."""
    return [list(taken[r::k]) for r in range(k)]


def clustered(taken: Sequence[str], k: int, links: Links) -> list[Chain]:
    """``taken`` (ranked) in ``k`` groups of fellows close to each other: each group starts
    at the best ranked fellow left and takes, one by one, the fellow left whose slowest link
    to the group is fastest (ties: the better ranked). Two sites of ``p`` fellows each make
    two groups, one per site. Every pair must be in ``links``."""
    left = list(taken)
    p = len(taken) // k
    out = []
    for _ in range(k):
        group = [left.pop(0)]
        while len(group) < p:
            rates = {f: min(link_between(links, f, g).mbit_s for g in group) for f in left}
            nearest = max(left, key=lambda f: (rates[f], -left.index(f)))
            group.append(nearest)
            left.remove(nearest)
        out.append(group)
    return out


def grouping_count(n: int, k: int) -> int:
    """How many ways ``n`` fellows split into ``k`` unordered groups of ``n // k``."""
    p = n // k
    return math.factorial(n) // (math.factorial(k) * math.factorial(p) ** k)


def groupings(ids: Sequence[str], k: int) -> Iterator[list[Chain]]:
    """Every split of ``ids`` into ``k`` groups of equal size, each once (a group's first
    member is the first of the fellows left)."""
    if k == 1:
        yield [list(ids)]
        return
    p = len(ids) // k
    first, rest = ids[0], list(ids[1:])
    for others in itertools.combinations(rest, p - 1):
        group = [first, *others]
        left = [f for f in rest if f not in others]
        for tail in groupings(left, k - 1):
            yield [group, *tail]


def ring_seconds(members: Sequence[str], links: Links, *, bits: float) -> float:
    """A ring round over ``members`` (in ring order): an all-gather, each
    member sending ``k - 1`` contributions of ``bits`` to the next over its link, each hop
    after the round trip of the one before; the slowest link sets the pace. 0 for a ring of
    one or nothing to send. Every consecutive pair must be in ``links``."""
    k = len(members)
    if k < 2 or bits <= 0:
        return 0.0
    after = [*members[1:], members[0]]
    hops = [link_between(links, a, b) for a, b in zip(members, after, strict=True)]
    slowest = min(h.mbit_s for h in hops)
    return (k - 1) * (bits / max(slowest * 1e6, 1.0) + max(h.rtt_ms for h in hops) / 1000)


def sync_bits(spec: JobSpec, n_stages: int) -> list[float]:
    """The bits of one contribution to a stage position's ring round in ``spec``, by stage,
    for an equal split (:func:`range_sync_bits`)."""
    return range_sync_bits(spec, split_layers(spec.model.n_layers, n_stages))


def range_sync_bits(spec: JobSpec, ranges: Sequence[tuple[int, int]]) -> list[float]:
    """The bits of one contribution to the ring round of each of these layer ranges in
    ``spec``: the trainable parameters of its layers (the embedding with layer 0 and the
    head with the last layer; an adapter's alone when the job trains one), in the spec's
    ``sync_compression`` (``fixed_int8`` with its per-row scales)."""
    m = spec.model
    codec = parse_wire_codec(spec.sync_compression)
    value_bits = codec.bits + (32 / 64 if codec.kind is CodecKind.INT else 0.0)
    out = []
    for start, end in ranges:
        if spec.adapter is not None:
            params = (end - start) * adapter_block_params(m, spec.adapter)
        else:
            params = (end - start) * block_params(m)
            params += embedding_params(m) if start == 0 else 0
            params += head_params(m) if end == m.n_layers else 0
        out.append(float(params * value_bits))
    return out


def rounds_per_step(spec: JobSpec) -> float:
    """How many ring rounds ``spec`` runs a step: one (``allreduce``), or one every
    ``sync_every`` steps (``diloco``). A round holds the step it ends (``sync_s``)."""
    return 1.0 / spec.sync_every if spec.sync == "diloco" else 1.0


def replica_groups(
    taken: Sequence[str],
    k: int,
    links: Links,
    *,
    order: Callable[[Chain], Chain],
    bits_per_step: float,
    ring_bits: Sequence[float],
    rounds: float = 1.0,
    compute: Callable[[Chain], float] | None = None,
    order_work: int = 1,
    compute_work: int = 0,
) -> list[Chain]:
    """``taken`` (ranked, ``k * p`` fellows) as ``k`` pipelines, each in stage order: the
    grouping predicted fastest (module docstring), replica 0 holding the best ranked fellow,
    and so on.

    ``links`` must hold every pair of ``taken`` (:func:`silentswarm.leader.balance.
    guessed_links` gives them); ``order`` puts a group (ranked) in its stage order, for about
    ``order_work`` chains costed; ``ring_bits[i]``: a contribution to stage ``i``'s ring
    (:func:`sync_bits`), ``rounds`` rounds a step (:func:`rounds_per_step`); ``compute``: a
    chain's compute seconds a step, where known, for about ``compute_work`` chains."""
    group_work = order_work + (compute_work if compute is not None else 0)
    search = _Search(taken, links, order, bits_per_step, ring_bits, rounds, compute, group_work)
    n, p = len(taken), len(taken) // k
    best = search.cost(dealt(taken, k))
    search.spent = 0  # the dealt grouping is always costed; the budget is for the others
    bar = best.step * (1 - MARGIN)  # another grouping must beat the dealt one by this
    count = grouping_count(n, k)
    if count <= MAX_GROUPINGS and search.work(count, math.comb(n, p)) <= MAX_WORK:
        tried: Iterable[Predicted] = (search.cost(g) for g in groupings(list(taken), k))
    else:  # from two ends: dealt (each replica spread out) and clustered (each at home)
        home = search.cost(clustered(taken, k, links))
        first, second = sorted((best, home), key=lambda start: start.key)
        ahead = search.swaps(first, MAX_WORK // 2)
        tried = [ahead, search.swaps(second, MAX_WORK)]
    for predicted in tried:
        if predicted.step < bar and predicted.key < best.key:
            best = predicted
    return best.chains


class Predicted(NamedTuple):
    """A grouping's predicted step: its slowest replica's compute and links plus its slowest
    ring's share (``step``); every replica's and ring's together (``total``: among groupings
    of one ``step``, the one that loads the links less; and what lets a swap that speeds up
    a replica other than the slowest count)."""

    step: float
    total: float
    chains: list[Chain]

    @property
    def key(self) -> tuple[float, float]:
        return (self.step, self.total)


class _Search:
    """The costs of groupings of one placement, each replica ordered once (cached), and the
    work they took (``spent``, in chains: :data:`MAX_WORK`)."""

    def __init__(
        self,
        taken: Sequence[str],
        links: Links,
        order: Callable[[Chain], Chain],
        bits_per_step: float,
        ring_bits: Sequence[float],
        rounds: float,
        compute: Callable[[Chain], float] | None,
        group_work: int,
    ) -> None:
        self.rank = {f: at for at, f in enumerate(taken)}
        self.links, self.order, self.bits, self.ring_bits = links, order, bits_per_step, ring_bits
        self.rounds, self.compute = rounds, compute
        k = len(taken) // max(1, len(ring_bits))
        # a grouping's pipelines sorted and its rings costed: about a chain per 4 members
        self.grouping_work = 1 + len(ring_bits) * max(1, k // 4)
        self.group_work = group_work  # a replica seen the first time: its order and compute
        self.spent = 0
        self.replicas: dict[frozenset[str], tuple[Chain, float]] = {}

    def work(self, groupings: int, groups: int) -> int:
        """What costing ``groupings`` groupings of ``groups`` distinct replicas takes."""
        return groupings * self.grouping_work + groups * self.group_work

    def replica(self, group: Sequence[str]) -> tuple[Chain, float]:
        key = frozenset(group)
        if key not in self.replicas:
            self.spent += self.group_work
            chain = self.order(sorted(group, key=self.rank.__getitem__))
            own = self.compute(chain) if self.compute is not None else 0.0
            wire = link_seconds(chain, self.links, bits_per_step=self.bits)
            self.replicas[key] = (chain, own + wire)
        return self.replicas[key]

    def cost(self, grouping: Sequence[Sequence[str]]) -> Predicted:
        self.spent += self.grouping_work
        pipelines = sorted(
            (self.replica(g) for g in grouping), key=lambda r: min(map(self.rank.get, r[0]))
        )
        chains = [chain for chain, _ in pipelines]
        rings = [
            ring_seconds([chain[i] for chain in chains], self.links, bits=bits)
            for i, bits in enumerate(self.ring_bits)
        ]
        own = [seconds for _, seconds in pipelines]
        step = max(own) + self.rounds * max(rings)
        return Predicted(step, sum(own) + self.rounds * sum(rings), chains)

    def swaps(self, start: Predicted, budget: int) -> Predicted:
        """From ``start``, the first swap of two fellows between replicas that lowers the
        predicted step (or, at the same step, the total), again and again, until none does
        or the work spent would pass ``budget``."""
        current, improved = start, True
        room = self.grouping_work + 2 * self.group_work  # a swap: a grouping, two replicas
        while improved:
            improved = False
            members = [(i, f) for i, chain in enumerate(current.chains) for f in chain]
            for (i, a), (j, b) in itertools.combinations(members, 2):
                if i == j:
                    continue
                if self.spent + room > budget:
                    return current
                swapped = [list(chain) for chain in current.chains]
                swapped[i][swapped[i].index(a)], swapped[j][swapped[j].index(b)] = b, a
                predicted = self.cost(swapped)
                if _lower(predicted.key, current.key):
                    current, improved = predicted, True
                    break
        return current


def _lower(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """``a`` below ``b`` by more than rounding: the step, else the total."""
    step = a[0] < b[0] * (1 - EPSILON)
    return step or (a[0] <= b[0] * (1 + EPSILON) and a[1] < b[1] * (1 - EPSILON))
