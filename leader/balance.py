"""The ``balanced`` partition: contiguous layer ranges that even out the stages' step times.

Pure. A stage's time is ``(layers + extra) / speed``: ``speed`` is the fellow's measured
compute speed (standard blocks per second, :data:`silentswarm.protocol.ComputeSpeed`),
``extra`` the work a stage does beside its blocks, in blocks (the head's matmul on the last
stage, :func:`head_blocks`). Memory bounds the layers a stage may hold (``caps``, from
:mod:`silentswarm.leader.memory`). A pipeline runs at the pace of its slowest stage, plus
the fill and drain of each step (``(m - 1) * max + sum`` over ``m`` micro-batches under
1F1B), which :func:`balanced_sizes` minimizes.

Every block costs the same, so the least bottleneck is found by handing out layers one at a
time, each to the stage whose time after taking it is smallest (for costs that grow with the
count this greedy is optimal: an exchange argument); for a given bottleneck the least sum
fills the fastest stages first; trying every bottleneck above the least one finds the best
step. ``tests/unit/test_balance.py`` checks both against every split on small cases.

:func:`chain_order` orders the chosen fellows along the pipeline when their links were
measured: the order whose links cost a step least (the slowest boundary's transfer plus
every boundary's round trip).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import statistics
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

from silentswarm.compression import parse_compression
from silentswarm.jobspec import JobSpec, PlacedStage
from silentswarm.leader.memory import block_params
from silentswarm.plan import ModelConfig
from silentswarm.protocol import (
    MAX_COMPUTE_SPEED,
    MIN_COMPUTE_SPEED,
    SPEED_UNIT_BATCH,
    SPEED_UNIT_D_MODEL,
    SPEED_UNIT_HEADS,
    SPEED_UNIT_SEQ_LEN,
    Progress,
    ProgressEvent,
)
from silentswarm.types.links import LinkStats, MeasuredLink

# chain_order tries every order up to this many fellows, then keeps the given order.
MAX_ORDERED = 7
# fellows_along_links costs at most this many chains (sets times orders) per placement: it
# runs on every tick while a job waits (2520: 5 stages of 7 fellows, ~30 ms here).
MAX_CHAINS = 2520
SPEED_UNIT = ModelConfig(
    d_model=SPEED_UNIT_D_MODEL, seq_len=SPEED_UNIT_SEQ_LEN, n_heads=SPEED_UNIT_HEADS, n_layers=1
)
# The fewest and most standard blocks per second a speed may be (protocol.ComputeSpeed's
# bounds): a speed learned from step records is kept within them too.
MIN_SPEED, MAX_SPEED = MIN_COMPUTE_SPEED, MAX_COMPUTE_SPEED
# Step records of the first steps (tracing, compiling) say nothing of the speed.
SKIP_STEPS = 3
# The 1F1B search tries every bottleneck up to this many layers x stages (then: the least
# bottleneck alone).
MAX_SEARCH = 16384
# With a fellow under a CPU quota every split is tried up to this many (a few ms here;
# then the search runs on speed x share).
MAX_EVERY_SPLIT = 2048
EPSILON = 1e-9
# A stage's measured speed moves the fellow's kept one this far (exponential smoothing).
SMOOTHING = 0.3


def head_blocks(m: ModelConfig) -> float:
    """The head's work in blocks: its matmul against a block's, by parameters (both are
    dense layers over the same tokens, so FLOPs go with parameters)."""
    return m.d_model * m.vocab_size / block_params(m)


def block_work(m: ModelConfig, batch_size: int) -> float:
    """FLOPs of one block's forward and backward over a batch: six per parameter and token
    for the dense layers, and the attention scores' ``12 * seq * d`` per token."""
    tokens = batch_size * m.seq_len
    return tokens * (6 * block_params(m) + 12 * m.seq_len * m.d_model)


def measured_speed(
    m: ModelConfig, *, batch_size: int, layers: int, last: bool, busy_s: float
) -> float | None:
    """A stage's work in standard blocks per second (the unit of the probe's
    ``compute_speed``): its blocks, and the head on the last stage, over the seconds it
    worked in a step (its step time less its waits). None when there is nothing to go by."""
    if busy_s <= 0 or layers < 1:
        return None
    blocks = layers + (head_blocks(m) if last else 0.0)
    unit = block_work(SPEED_UNIT, SPEED_UNIT_BATCH)
    speed = blocks * block_work(m, batch_size) / unit / busy_s
    return within_speeds(speed)


def within_speeds(speed: float) -> float:
    """``speed`` within [:data:`MIN_SPEED`, :data:`MAX_SPEED`]."""
    return min(max(speed, MIN_SPEED), MAX_SPEED)


def stage_busy_s(progress: Progress) -> float | None:
    """The seconds a step record's stage worked: its step time less its waits and the
    seconds its CPU quota held it back; None for a record without step time and waits, or
    one of the first :data:`SKIP_STEPS` steps (they compile)."""
    if progress.event is not ProgressEvent.STEP or progress.step <= SKIP_STEPS:
        return None
    if progress.step_time_s is None or progress.wait_s is None:
        return None
    busy = progress.step_time_s - progress.wait_s - progress.throttled_s
    return busy if busy > 0 else None


def boundary_link(
    stages: Sequence[PlacedStage], link: LinkStats
) -> tuple[tuple[str, str], MeasuredLink] | None:
    """The fellow pair a measured boundary joins (``link.boundary`` is its upstream stage)
    and what is kept of it: the slower direction's Mbit/s and the round trip. None for a
    boundary the placement lacks."""
    b = link.boundary
    if not 0 <= b < len(stages) - 1:
        return None
    kept = MeasuredLink(mbit_s=min(link.fwd_mbit_s, link.bwd_mbit_s), rtt_ms=link.rtt_ms)
    return (stages[b].fellow_id, stages[b + 1].fellow_id), kept


def smoothed(kept: float | None, sample: float) -> float:
    return sample if kept is None else kept + SMOOTHING * (sample - kept)


def stage_time(layers: int, speed: float, extra: float = 0.0) -> float:
    return (layers + extra) / speed


def balanced_sizes(
    n_layers: int,
    speeds: Sequence[float],
    *,
    caps: Sequence[int | None] | None = None,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
    micro_batches: int | None = None,
    shares: Sequence[float] | None = None,
) -> list[int] | None:
    """Layers per stage, in order, at least one each, for the shortest pipeline step.

    Without ``micro_batches``: the split whose slowest stage is fastest. With ``m`` of them,
    a 1F1B step takes about ``(m - 1) * max(T) + sum(T)`` (the first micro-batch crosses
    every stage, the rest follow at the slowest stage's pace; ``T``: each stage's time for
    the whole batch, over ``m``): the split minimizing that, which moves layers off a slow
    stage further than the bottleneck alone would when ``m`` is small.

    ``speeds`` must be positive; ``caps[i]`` (None: no limit) is the most layers stage ``i``
    may hold. None when the caps leave no split (a cap below one, or too few in all).

    ``shares[i]`` < 1: stage ``i``'s fellow runs under a CPU quota of that share of its
    threads (``speeds`` are then its speed while it runs, the quota's stalls left out).
    Such a stage runs at full speed while it is busy less than that share of the step, and
    at ``speed * share`` once it is busier (:func:`throttled_step_cost`); the cost is then
    no longer one the greedy search is exact for, so every split is tried (up to
    :data:`MAX_EVERY_SPLIT` of them; beyond that the search runs on ``speed * share``).
    """
    n = len(speeds)
    if not 1 <= n <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {n} stages")
    if not all(s > 0 and math.isfinite(s) for s in speeds):
        raise ValueError(f"speeds must be positive: {list(speeds)}")
    limits = [n_layers if c is None else min(c, n_layers) for c in (caps or [None] * n)]
    if len(limits) != n or min(limits) < 1 or sum(limits) < n_layers:
        return None
    extras = [0.0] * n
    extras[0] += first_extra
    extras[-1] += last_extra
    if shares is not None and min(shares) < 1.0:
        if len(shares) != n or not all(q > 0 and math.isfinite(q) for q in shares):
            raise ValueError(f"shares must be positive, one per stage: {list(shares)}")
        shares = tuple(min(1.0, q) for q in shares)
        if math.comb(n_layers - 1, n - 1) <= MAX_EVERY_SPLIT:
            found = _every_split(
                n_layers, tuple(speeds), tuple(limits), tuple(extras), shares, micro_batches
            )
            return None if found is None else list(found)
        speeds = [v * q for v, q in zip(speeds, shares, strict=True)]
        if not all(v > 0 for v in speeds):
            raise ValueError(f"speeds times shares must be positive: {speeds}")
    sizes = _least_bottleneck(n_layers, speeds, limits, extras)
    if micro_batches is None or n_layers * n > MAX_SEARCH:
        return sizes
    best = (step_cost(sizes, speeds, extras, micro_batches), sizes)
    floor = max(stage_time(k, v, e) for k, v, e in zip(sizes, speeds, extras, strict=True))
    bounds = {
        stage_time(k, speeds[i], extras[i])
        for i in range(n)
        for k in range(1, limits[i] + 1)
        if stage_time(k, speeds[i], extras[i]) >= floor - EPSILON
    }
    for bound in sorted(bounds):
        least = _least_sum(n_layers, speeds, limits, extras, bound)
        if least is not None:
            best = min(best, (step_cost(least, speeds, extras, micro_batches), least))
    return best[1]


def step_cost(
    sizes: Sequence[int], speeds: Sequence[float], extras: Sequence[float], micro_batches: int
) -> float:
    """A 1F1B step's time, in the stages' time unit: ``(m - 1) * max(T) / m + sum(T) / m``."""
    times = [stage_time(k, v, e) for k, v, e in zip(sizes, speeds, extras, strict=True)]
    return ((micro_batches - 1) * max(times) + sum(times)) / micro_batches


def throttled_step_cost(
    sizes: Sequence[int],
    speeds: Sequence[float],
    extras: Sequence[float],
    shares: Sequence[float],
    micro_batches: int | None,
) -> float:
    """A step's time when some stages run under a CPU quota (``shares[i]`` of their threads'
    time): a stage busy longer than its share of the step is held back, and its time becomes
    ``T / share``; the step is found again until no stage crosses its share (each pass only
    lengthens it, so at most one pass per stage). Without ``micro_batches``: the slowest
    stage's time."""
    times = [stage_time(k, v, e) for k, v, e in zip(sizes, speeds, extras, strict=True)]
    held = list(times)

    def step() -> float:
        if micro_batches is None:
            return max(held)
        return ((micro_batches - 1) * max(held) + sum(held)) / micro_batches

    current = step()
    for _ in range(len(times)):
        over = [
            i
            for i, (t, q) in enumerate(zip(times, shares, strict=True))
            if q < 1.0 and held[i] == t and t > q * current + EPSILON
        ]
        if not over:
            break
        for i in over:
            held[i] = times[i] / shares[i]
        current = step()
    return current


@functools.lru_cache(maxsize=256)
def _every_split(
    n_layers: int,
    speeds: Sequence[float],
    limits: Sequence[int],
    extras: Sequence[float],
    shares: Sequence[float],
    micro_batches: int | None,
) -> tuple[int, ...] | None:
    """The split with the least :func:`throttled_step_cost`, trying every one within the
    limits (the first found among equals). Cached: placement asks again at every tick while
    a job waits, with the same idle fellows' figures."""
    n = len(speeds)
    best: tuple[float, list[int]] | None = None
    for cuts in itertools.combinations(range(1, n_layers), n - 1):
        sizes = [b - a for a, b in itertools.pairwise((0, *cuts, n_layers))]
        if any(k > c for k, c in zip(sizes, limits, strict=True)):
            continue
        cost = throttled_step_cost(sizes, speeds, extras, shares, micro_batches)
        if best is None or cost < best[0] - EPSILON:
            best = (cost, sizes)
    return None if best is None else tuple(best[1])


def _least_bottleneck(
    n_layers: int, speeds: Sequence[float], limits: Sequence[int], extras: Sequence[float]
) -> list[int]:
    """Layers handed out one at a time, each to the stage whose time after it is least."""
    n = len(speeds)
    sizes = [1] * n
    # (time after one more layer, stage): ties go to the earlier stage.
    heap = [(stage_time(2, speeds[i], extras[i]), i) for i in range(n) if limits[i] > 1]
    heapq.heapify(heap)
    for _ in range(n_layers - n):
        _, i = heapq.heappop(heap)
        sizes[i] += 1
        if sizes[i] < limits[i]:
            heapq.heappush(heap, (stage_time(sizes[i] + 1, speeds[i], extras[i]), i))
    return sizes


def _least_sum(
    n_layers: int,
    speeds: Sequence[float],
    limits: Sequence[int],
    extras: Sequence[float],
    bound: float,
) -> list[int] | None:
    """The split with no stage slower than ``bound`` and the least total time: the fastest
    stages filled first (a layer costs ``1 / speed`` wherever it goes); None if none fits."""
    n = len(speeds)
    room = [min(limits[i], math.floor(bound * speeds[i] - extras[i] + EPSILON)) for i in range(n)]
    if min(room) < 1 or sum(room) < n_layers:
        return None
    sizes, left = [1] * n, n_layers - n
    for i in sorted(range(n), key=lambda i: (-speeds[i], i)):
        take = min(left, room[i] - 1)
        sizes[i] += take
        left -= take
    return sizes


def ranges_of(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous half-open ranges with these sizes, from layer 0."""
    bounds = [0, *itertools.accumulate(sizes)]
    return list(itertools.pairwise(bounds))


def bottleneck(
    sizes: Sequence[int], speeds: Sequence[float], first_extra: float = 0.0, last_extra: float = 0.0
) -> float:
    """The slowest stage's time for these sizes: what :func:`balanced_sizes` minimizes."""
    n = len(sizes)
    return max(
        stage_time(
            size,
            speed,
            (first_extra if i == 0 else 0.0) + (last_extra if i == n - 1 else 0.0),
        )
        for i, (size, speed) in enumerate(zip(sizes, speeds, strict=True))
    )


def boundary_bits(spec: JobSpec) -> float:
    """The bits a boundary carries forward in one step of ``spec``: the batch's activations
    in the spec's wire codec (under ``"auto"``, int8: what the tuner picks on the slow links
    where the order matters). What :func:`chain_order` weighs the links' rates by."""
    compression = parse_compression(spec.compression, d_model=spec.model.d_model)
    bits = 8 if compression.auto else compression.codec.bits
    return spec.batch_size * spec.model.seq_len * compression.dims(spec.model.d_model) * bits


class LinkBook(Mapping[tuple[str, str], MeasuredLink]):
    """Measured links by (upstream, downstream) fellow pair, indexed by fellow too, so a
    placement reads the few links of the fellows it weighs, not every link the swarm
    measured (160,000 at 5,000 fellows: a third of a second a scan, on every tick)."""

    def __init__(self, pairs: Mapping[tuple[str, str], MeasuredLink] | None = None) -> None:
        self._pairs: dict[tuple[str, str], MeasuredLink] = {}
        self._by_fellow: dict[str, set[tuple[str, str]]] = {}
        for pair, link in (pairs or {}).items():
            self.put(pair, link)

    def put(self, pair: tuple[str, str], link: MeasuredLink) -> None:
        self._pairs[pair] = link
        for end in pair:
            self._by_fellow.setdefault(end, set()).add(pair)

    def drop(self, pair: tuple[str, str]) -> None:
        if self._pairs.pop(pair, None) is None:
            return
        for end in pair:
            held = self._by_fellow.get(end)
            if held is not None:
                held.discard(pair)
                if not held:
                    del self._by_fellow[end]

    def between(self, a: str, b: str) -> MeasuredLink | None:
        """The link measured between ``a`` and ``b``, either direction."""
        return between(self._pairs, a, b)

    def of(self, fellow: str) -> list[MeasuredLink]:
        """Every link measured with ``fellow`` at either end."""
        return [self._pairs[p] for p in self._by_fellow.get(fellow, ())]

    def __getitem__(self, pair: tuple[str, str]) -> MeasuredLink:
        return self._pairs[pair]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self._pairs)

    def __len__(self) -> int:
        return len(self._pairs)


# Whether two fellows (by id) share a machine (silentswarm.leader.placement.same_host).
SameHost = Callable[[str, str], bool]
# The share of its measured speed each fellow of a set keeps while the set runs at once
# (fellows on one machine share its cores).
CoreShares = Callable[[Sequence[str]], Mapping[str, float]]
# What a pair on one machine is taken to have when no job measured it: its loopback, far
# faster than any network link (loopback ZeroMQ moves gigabytes a second here).
SAME_HOST_LINK = MeasuredLink(mbit_s=10_000.0, rtt_ms=0.05)


def between(links: Mapping[tuple[str, str], MeasuredLink], a: str, b: str) -> MeasuredLink | None:
    """The link in ``links`` between ``a`` and ``b``, either direction."""
    return links.get((a, b), links.get((b, a)))


def link_between(links: Mapping[tuple[str, str], MeasuredLink], a: str, b: str) -> MeasuredLink:
    """The link between ``a`` and ``b``, which a costing needs: KeyError when ``links`` has
    none (:func:`guessed_links` gives every pair)."""
    hop = between(links, a, b)
    if hop is None:
        raise KeyError(f"no link between {a} and {b}")
    return hop


def _book(links: Mapping[tuple[str, str], MeasuredLink]) -> LinkBook:
    return links if isinstance(links, LinkBook) else LinkBook(links)


def guessed_links(
    fellows: Sequence[str],
    links: Mapping[tuple[str, str], MeasuredLink],
    *,
    same_host: SameHost | None = None,
) -> dict[tuple[str, str], MeasuredLink]:
    """Every pair of ``fellows``: measured (either direction), or guessed
    (:class:`GuessedLinks`' rule). Empty where none of the fellows has a measured link."""
    return dict(GuessedLinks(fellows, links, same_host=same_host))


class GuessedLinks(Mapping[tuple[str, str], MeasuredLink]):
    """Every pair of ``fellows``: measured (either direction), or guessed, each pair found
    when first asked for (a placement that costs a few pairs among many fellows does not
    guess them all). Empty (false, no pairs) where none of the fellows has a measured link.

    Two fellows on one machine (``same_host``) share its loopback (:data:`SAME_HOST_LINK`).
    Over the internet a link's rate is mostly its slower end's own connection, so a fellow's
    access rate is the fastest any of its measured links showed, and another pair never
    measured gets the slower of its two ends' (for an end never measured, the median rate of
    the fellows' measured links) with the median round trip of those links."""

    def __init__(
        self,
        fellows: Sequence[str],
        links: Mapping[tuple[str, str], MeasuredLink],
        *,
        same_host: SameHost | None = None,
    ) -> None:
        self._book, self._same_host = _book(links), same_host
        self._fellows = list(dict.fromkeys(fellows))
        known = {f: self._book.of(f) for f in self._fellows}
        seen = list({id(m): m for ms in known.values() for m in ms}.values())
        self._any = bool(seen)
        median_rate = statistics.median(m.mbit_s for m in seen) if seen else 0.0
        self._median_rtt = statistics.median(m.rtt_ms for m in seen) if seen else 0.0
        self._access = {
            f: max((m.mbit_s for m in ms), default=median_rate) for f, ms in known.items()
        }
        self._found: dict[tuple[str, str], MeasuredLink] = {}

    def __getitem__(self, pair: tuple[str, str]) -> MeasuredLink:
        a, b = pair
        if not self._any or a == b or a not in self._access or b not in self._access:
            raise KeyError(pair)
        key = (a, b) if a <= b else (b, a)
        found = self._found.get(key)
        if found is None:
            found = self._book.between(a, b)
            if found is None and self._same_host is not None and self._same_host(a, b):
                found = SAME_HOST_LINK
            if found is None:
                found = MeasuredLink(
                    mbit_s=min(self._access[a], self._access[b]), rtt_ms=self._median_rtt
                )
            self._found[key] = found
        return found

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return itertools.combinations(self._fellows, 2) if self._any else iter(())

    def __len__(self) -> int:
        n = len(self._fellows)
        return n * (n - 1) // 2 if self._any else 0


def link_seconds(
    chain: Sequence[str],
    links: Mapping[tuple[str, str], MeasuredLink],
    *,
    bits_per_step: float,
) -> float:
    """What ``chain``'s links add to a step: its slowest boundary's transfer of
    ``bits_per_step`` (the other boundaries' transfers go on beside it) plus the round trips
    of all its boundaries (a step's fill and drain cross each once each way). Every pair of
    the chain must be in ``links`` (:func:`guessed_links` gives them all)."""
    hops = [link_between(links, a, b) for a, b in itertools.pairwise(chain)]
    if not hops:
        return 0.0
    transfer_s = max(bits_per_step / max(h.mbit_s * 1e6, 1.0) for h in hops)
    return transfer_s + sum(h.rtt_ms for h in hops) / 1000


def compute_seconds(
    m: ModelConfig,
    *,
    batch_size: int,
    speeds: Sequence[float],
    micro_batches: int,
    caps: Sequence[int | None] | None = None,
) -> float | None:
    """A balanced split's 1F1B step on fellows of these speeds (standard blocks per second,
    in stage order), in seconds: :func:`step_cost` of :func:`balanced_sizes` (within
    ``caps``, the most layers each stage's memory holds), the head on the last stage,
    scaled from standard blocks to this model's. None where no split fits."""
    sizes = balanced_sizes(
        m.n_layers, speeds, caps=caps, last_extra=head_blocks(m), micro_batches=micro_batches
    )
    if sizes is None:
        return None
    return split_seconds(
        m, batch_size=batch_size, sizes=sizes, speeds=speeds, micro_batches=micro_batches
    )


def split_seconds(
    m: ModelConfig,
    *,
    batch_size: int,
    sizes: Sequence[int],
    speeds: Sequence[float],
    micro_batches: int,
) -> float:
    """The 1F1B step, in seconds, of a split of ``sizes`` layers per stage on fellows of
    these speeds (in stage order): :func:`step_cost` with the head on the last stage,
    scaled from standard blocks to this model's. A resumed job's fixed split is costed so
    on each order of the fellows that would take it."""
    extras = [0.0] * len(speeds)
    extras[-1] = head_blocks(m)
    per_block = block_work(m, batch_size) / block_work(SPEED_UNIT, SPEED_UNIT_BATCH)
    return step_cost(sizes, speeds, extras, micro_batches) * per_block


def fellows_along_links(
    speeds: Mapping[str, float],
    n: int,
    links: Mapping[tuple[str, str], MeasuredLink],
    *,
    model: ModelConfig,
    batch_size: int,
    micro_batches: int,
    bits_per_step: float,
    same_host: SameHost | None = None,
    cap: Callable[[str, int], int] | None = None,
    shares: CoreShares | None = None,
    first_only: Collection[str] = (),
) -> list[str]:
    """The ``n`` of ``speeds``' fellows (of the :data:`MAX_ORDERED` fastest, fewer where
    more than :data:`MAX_CHAINS` chains, sets times orders where any link is known, would
    be costed: with links none to choose from at 6 stages and more) whose pipeline is
    predicted fastest: the balanced split's compute
    (:func:`compute_seconds`, within ``cap(fellow, stage)`` layers where given, each speed
    times the share ``shares(set)`` leaves it of its machine's cores) plus its best order's
    links (:func:`link_seconds`, a pair never measured as :func:`guessed_links` guesses it;
    none where no link is known); ties keep the fastest. A fellow of ``first_only`` (one
    without a data address: it connects out) may only run stage 0: a set with two of them
    is not weighed, one with one only in the orders it leads. Speeds are in standard blocks per
    second (already times any CPU quota's share). The fastest where neither links nor
    ``shares`` tell sets apart."""
    pool = along_pool_size(n, linked=bool(links))
    ids = sorted(speeds, key=lambda f: -speeds[f])[:pool]
    pairs = guessed_links(ids, links, same_host=same_host)
    if len(ids) <= n or not (pairs or shares):
        return ids[:n]
    best: tuple[float, list[str]] | None = None
    for group in itertools.combinations(ids, n):
        leads = [f for f in group if f in first_only]
        if len(leads) > 1:
            continue
        kept = shares(group) if shares is not None else {}
        compute = compute_seconds(
            model,
            batch_size=batch_size,
            speeds=[speeds[f] * kept.get(f, 1.0) for f in group],
            micro_batches=micro_batches,
            caps=None if cap is None else [cap(f, i) for i, f in enumerate(group)],
        )
        if compute is None:
            continue
        wire = 0.0
        if pairs:
            rest = [f for f in group if f not in leads]
            wire = min(
                link_seconds([*leads, *chain], pairs, bits_per_step=bits_per_step)
                for chain in itertools.permutations(rest)
            )
        if best is None or compute + wire < best[0] * (1 - EPSILON):
            best = (compute + wire, list(group))
    return ids[:n] if best is None else best[1]


def along_pool_size(n: int, *, linked: bool) -> int:
    """How many of the fastest :func:`fellows_along_links` weighs for ``n`` stages:
    :data:`MAX_ORDERED`, fewer where more than :data:`MAX_CHAINS` chains (sets, times
    their orders where any link is known) would be costed."""
    pool = MAX_ORDERED
    orders = math.factorial(n) if linked else 1
    while pool > n and math.comb(pool, n) * orders > MAX_CHAINS:
        pool -= 1
    return pool


def chain_order(
    fellows: Sequence[str],
    links: Mapping[tuple[str, str], MeasuredLink],
    *,
    bits_per_step: float,
    last: str | None = None,
    first: str | None = None,
    same_host: SameHost | None = None,
) -> list[str]:
    """``fellows`` in the pipeline order whose links cost a step least
    (:func:`link_seconds`); ties go to the chain whose rates add up to more.

    ``links[(a, b)]``: a measured link between ``a`` and ``b``, either direction; a pair
    never measured is guessed from its ends' other links (:func:`guessed_links`). ``last``,
    when given, stays the last stage (it hosts the head), ``first`` the first (the given
    order must start with it). With nothing measured, or more than :data:`MAX_ORDERED`
    fellows, the given order stays.
    """
    order = list(fellows)
    if not 3 <= len(order) <= MAX_ORDERED:  # two fellows share their one link either way
        return order
    pairs = guessed_links(order, links, same_host=same_host)
    if not pairs:
        return order

    def score(chain: Sequence[str]) -> tuple[float, float]:
        hops = [between(pairs, a, b) for a, b in itertools.pairwise(chain)]
        rates = sum(h.mbit_s for h in hops if h is not None)  # guessed_links gives every pair
        return (link_seconds(chain, pairs, bits_per_step=bits_per_step), -rates)

    lead = [first] if first is not None and first in order and first != last else []
    head = [f for f in order if f != last and f not in lead]
    tail = [last] if last is not None and last in order else []
    best = [*lead, *head, *tail]
    for perm in itertools.permutations(head):
        chain = [*lead, *perm, *tail]
        if score(chain) < score(best):
            best = chain
    return best
