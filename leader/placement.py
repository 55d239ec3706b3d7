"""Placement: which ready fellows run a job, in which order, with which layers on which device.

A pure function of the job spec and the fellows' latest telemetry (already reduced to what
each fellow offers: :mod:`silentswarm.telemetry`). The rules:

- Only fellows of the job's pool that carry all its labels count
  (:func:`silentswarm.leader.pools.fits`).
- A GPU is eligible when it has at least ``placement_min_gpu_free_gb`` free;
  ``max_gpus_per_worker`` caps how many of a fellow's GPUs count.
- Fellows with eligible GPUs rank first, by their aggregate eligible free VRAM; CPU-only
  fellows (when ``allow_cpu``) follow, by available RAM.
- The job takes the best ranked fellows; with ``largest_vram`` the best one runs the last
  stage (head, logits and loss are the largest), with ``preserve`` the ranked order stays.
  A ``balanced`` job takes the fastest instead (GPU fellows still first; measured speed
  times its quota's share; the unmeasured last), in the same order, and the best ranked
  where the fastest do not fit.
- Layers are split equally, or (``weighted``) in proportion to each fellow's aggregate
  eligible free memory, or (``balanced``) to even out the stages' times by each fellow's
  measured compute speed within its memory (:mod:`silentswarm.leader.balance`), every stage
  getting at least one layer. A ``balanced`` job's stages are ordered along the fellows'
  measured links where the leader has measured any: the order whose slowest boundary's
  transfer plus every boundary's round trip is least.
- Inside a fellow, ``gpu_slots`` split its layers over its eligible GPUs by free VRAM, the
  GPU with the most free memory last, so it also hosts the head on the last stage.
- Every stage and every slot must fit its memory estimate (:mod:`silentswarm.leader.memory`); a job
  that does not fit is unplaceable with the numbers.
- A job with ``replicas`` runs k copies of its p-stage pipeline on k * p distinct fellows
  (:func:`shape`): the best k * p ranked, dealt out like cards (replica r takes every k-th
  from the r-th) so the replicas are alike, each replica ordered by the rules above on its
  own; a ``balanced`` job with measured links among them takes the grouping and orders
  predicted fastest instead, its pipelines' links and compute against its rings'
  (:mod:`silentswarm.leader.replica_groups`: under DiLoCo's rare syncs each pipeline stays
  on one site, under allreduce each ring may), unless that grouping does not fit or changes
  the transport. A ``weighted`` or ``balanced`` job splits each replica's layers on its own
  fellows (the replicas average per layer, one ring per segment: :mod:`silentswarm.rings`);
  an equal split, a resumed job's fixed ranges, a learned codec, or a ``p2p`` fellow with
  fewer sync ports than its stage's rings gives every replica one split, computed as above
  over each stage position's weakest fellow (least memory; least speed, which sets the pace
  of every step the replicas sync). A ``balanced`` job's fixed split (a resumed job's, a
  replacement replica's) goes to the fellows and order predicted fastest by their speeds,
  links and the rings a replacement joins (:mod:`silentswarm.leader.refill`), within their
  memory and never onto the relay. Under transport ``p2p`` every member needs a sync
  address (``SWARM_SYNC_ADDRESS``); under ``auto`` a ring link to a member without one uses
  the relay.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from silentswarm import rings
from silentswarm.compression import parse_compression
from silentswarm.hosts import endpoint_host
from silentswarm.jobspec import JobSpec, LastStagePlacement, Partition, PlacedStage, Placement
from silentswarm.leader import pools
from silentswarm.leader.balance import (
    MAX_ORDERED,
    CoreShares,
    GuessedLinks,
    LinkBook,
    along_pool_size,
    balanced_sizes,
    boundary_bits,
    chain_order,
    compute_seconds,
    fellows_along_links,
    guessed_links,
    head_blocks,
    ranges_of,
    within_speeds,
)
from silentswarm.leader.memory import (
    CPU_RUNTIME_BYTES,
    GPU_RUNTIME_BYTES,
    StageMemory,
    stage_memory,
)
from silentswarm.leader.refill import (
    JoinedRings,
    candidate_pool,
    chain_seconds,
    pool_size,
    refill,
)
from silentswarm.leader.replica_groups import (
    range_sync_bits,
    replica_groups,
    rounds_per_step,
    sync_bits,
)
from silentswarm.plan import GpuSlot, Transport, split_layers
from silentswarm.pools import DEFAULT_POOL
from silentswarm.protocol import GpuInfo
from silentswarm.types.links import MeasuredLink

GIB = 1024**3


@dataclass(frozen=True)
class PlacementDefaults:
    """The leader's defaults for the job fields left unset (``SWARM_PLACEMENT_*``)."""

    min_gpu_free_gb: float = 4.0
    last_stage: LastStagePlacement = LastStagePlacement.LARGEST_VRAM


DEFAULTS = PlacementDefaults()


class Candidate(msgspec.Struct, kw_only=True, frozen=True):
    """What placement needs to know of one ready, idle fellow: what it offers."""

    fellow_id: str
    hostname: str
    data_address: str | None
    cpu_cores: int  # what it may use: its affinity capped by its quota (silentswarm.cpus)
    ram_available_bytes: int  # already cut to the operator's cap
    gpus: tuple[GpuInfo, ...] = ()  # usable by TensorFlow, free VRAM cut to the cap
    pool: str = DEFAULT_POOL
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    # Standard blocks per second (protocol.ComputeSpeed): measured from its stages' step
    # times where it ran any, else its start-up probe; None: unknown.
    compute_speed: float | None = None
    # The share of its threads' time its CPU quota lets it run (decide.cpu_share): a
    # container's 0.5 of a core for one thread is 0.5; 1 without a quota. Its compute_speed
    # is its speed while it runs; balance models the quota's stalls with this.
    cpu_share: float = 1.0
    # Its host's logical cores, which the fellows on one host share; None: as cpu_cores.
    host_cpu_cores: int | None = None
    # Its kernel's boot id (HardwareSnapshot.machine_id): one per machine; None: unknown.
    machine_id: str | None = None
    # Where its stage binds for its replicas' ring (SWARM_SYNC_ADDRESS); None: not given.
    sync_address: str | None = None
    # The SilentSwarm version its agent runs: a job's fellows all run one (by_version).
    version: str = ""


def by_version(candidates: Sequence[Candidate], leader_version: str) -> list[list[Candidate]]:
    """``candidates`` in groups of one version each, the groups to try a job on in order:
    the leader's version first, then the others by how many fellows run them (the most
    first). A job's stages talk to each other in their version's wire layouts (the relay's,
    the rings', the frames'), which the project changes between versions; so a job runs on
    fellows of one version, never across two."""
    groups: dict[str, list[Candidate]] = {}
    for c in candidates:
        groups.setdefault(c.version, []).append(c)
    order = sorted(groups, key=lambda v: (v != leader_version, -len(groups[v]), v))
    return [groups[v] for v in order]


def versions_note(groups: Sequence[Sequence[Candidate]]) -> str:
    """What a waiting job's reason adds when the ready fellows run several versions."""
    if len(groups) < 2:
        return ""
    counts = ", ".join(f"{g[0].version or '?'}: {len(g)}" for g in groups)
    return (
        f"; the ready fellows run {len(groups)} versions ({counts}) and a job's fellows must "
        "share one: `swarm update` brings them to the leader's"
    )


class Unplaceable(msgspec.Struct, kw_only=True, frozen=True):
    reason: str
    # Too few ready fellows fit (rather than too little memory, a missing address...).
    too_few: bool = False


def eligible_gpus(
    candidate: Candidate, spec: JobSpec, defaults: PlacementDefaults = DEFAULTS
) -> list[GpuInfo]:
    """The fellow's GPUs with enough free VRAM for the job, most free first, capped in number."""
    floor_gb = spec.placement_min_gpu_free_gb
    floor = (defaults.min_gpu_free_gb if floor_gb is None else floor_gb) * GIB
    gpus = sorted(
        (g for g in candidate.gpus if g.memory_free_bytes >= floor),
        key=lambda g: (-g.memory_free_bytes, g.index),
    )
    return gpus[: spec.max_gpus_per_worker] if spec.max_gpus_per_worker else gpus


def place(
    spec: JobSpec,
    candidates: list[Candidate],
    defaults: PlacementDefaults = DEFAULTS,
    *,
    ranges: list[tuple[int, int]] | None = None,
    max_stages: int | None = None,
    links: Mapping[tuple[str, str], MeasuredLink] | None = None,
    joining: JoinedRings | None = None,
    beside: Mapping[str, int] | None = None,
) -> Placement | Unplaceable:
    """A placement for ``spec`` on some of ``candidates``, or why there is none now.

    ``ranges`` fixes the stages' layer ranges (a resumed job keeps its boundaries, a
    replacement replica takes its job's); ``max_stages`` caps how many fellows the job may
    take in all (its account's limit); ``links`` (fellow pair -> its measured link) orders
    a ``balanced`` job's stages (:func:`silentswarm.leader.balance.chain_order`);
    ``joining``: the rings a replacement replica's stages join, which its links to them
    are weighed by; ``beside``: the job's stages already running, per :func:`machine` (a
    replacement's live replicas'), which share those hosts' cores with the placed ones.
    The placed stages are ordered by (replica, stage)."""
    candidates = [c for c in candidates if pools.fits(c.pool, c.labels, spec)]
    gpus = {c.fellow_id: eligible_gpus(c, spec, defaults) for c in candidates}
    ranked = _ranked(spec, candidates, gpus)
    k, wanted, need = shape(spec, len(ranked), ranges=ranges, max_stages=max_stages)
    if len(ranked) < need:
        return _too_few(spec, need, len(ranked), replicas=k)
    if max_stages is not None and k > 1 and k * wanted > max_stages:
        return Unplaceable(
            reason=f"{k} replicas of {wanted} stages need {k * wanted} fellows; the owner's "
            f"account may take {max_stages} more in pool {spec.run_pool}"
        )
    # The choices to try, best first: along the links, the fastest, and (the others may
    # lack the memory the best ranked have) the memory ranking's.
    by_speed = _taken_by_speed(spec, ranked, k * wanted, gpus)
    if k == 1 and ranges is not None:
        refilled = _refilled(spec, ranked, by_speed, gpus, ranges, links, joining, defaults, beside)
        if refilled is not None:
            placed = _place_groups(spec, [refilled], gpus, ranges, beside)
            dealt = _pipelines(spec, by_speed, 1, defaults, None)
            if _keeps_transport(spec, placed, dealt):
                return placed
    choices = [by_speed, ranked[: k * wanted]]
    if k == 1 and ranges is None:
        choices.insert(0, _taken_along_links(spec, ranked, by_speed, gpus, links or {}))
    placement: Placement | Unplaceable | None = None
    for at, taken in enumerate(choices):
        if taken in choices[:at]:
            continue
        placement = _place_on(spec, taken, k, gpus, defaults, ranges, links, beside)
        if isinstance(placement, Unplaceable):
            continue
        if taken is choices[0] and len(choices) == 3:  # along the links: for speed
            dealt = _pipelines(spec, by_speed, k, defaults, links)
            if not _keeps_transport(spec, placement, dealt):
                continue
        return placement
    assert placement is not None
    return placement


def _taken_by_speed(
    spec: JobSpec, ranked: list[Candidate], n: int, gpus: dict[str, list[GpuInfo]]
) -> list[Candidate]:
    """The ``n`` fellows a job takes of ``ranked``: the best ranked, or for a ``balanced``
    job the ``n`` fastest (fellows with eligible GPUs first, then by measured speed times
    the share its CPU quota leaves; a fellow not measured after every measured one, ties by
    rank), kept in ranked order. A balanced split's step time falls as the chosen fellows'
    speeds add up, so a spare fast fellow beats a slow one with more memory. Where those
    are CPU fellows of measured speed and two such candidates share a host, by the speed
    they keep beside each other (:func:`_by_kept_speed`)."""
    if spec.partition != Partition.BALANCED or len(ranked) <= n:
        return ranked[:n]

    def pace(at: int) -> tuple[bool, bool, float, int]:
        c = ranked[at]
        speed = c.compute_speed * c.cpu_share if c.compute_speed else 0.0
        return (not gpus[c.fellow_id], c.compute_speed is None, -speed, at)

    chosen = [ranked[at] for at in sorted(sorted(range(len(ranked)), key=pace)[:n])]
    timed = _measured_cpu(ranked, gpus)
    timed_ids = {c.fellow_id for c in timed}
    if all(c.fellow_id in timed_ids for c in chosen) and _hosts_shared(timed):
        kept = {c.fellow_id for c in _by_kept_speed(timed, n)}
        return [c for c in ranked if c.fellow_id in kept]
    return chosen


def _by_kept_speed(fellows: list[Candidate], n: int) -> list[Candidate]:
    """``n`` of ``fellows`` (CPU fellows of measured speed, best ranked first), taken one at
    a time: each the one that adds the most speed kept (its speed times its quota's share
    times the :func:`core_share` it keeps beside those taken on its machine, less what those
    lose beside it, which is the same for every fellow of that machine); ties by rank. Only
    the last taken's machine's gains change."""
    taken: dict[str, list[Candidate]] = {}
    left: dict[str, list[Candidate]] = {}
    for c in fellows:
        left.setdefault(machine(c), []).append(c)

    def kept(c: Candidate, stages: int) -> float:
        return (c.compute_speed or 0.0) * c.cpu_share * core_share(c, stages)

    rank = {c.fellow_id: at for at, c in enumerate(fellows)}
    gains = {c.fellow_id: kept(c, 1) for c in fellows}
    chosen: list[Candidate] = []
    while len(chosen) < n and gains:
        best_id = max(gains, key=lambda f: (gains[f], -rank[f]))
        best = fellows[rank[best_id]]
        key = machine(best)
        left[key].remove(best)
        del gains[best_id]
        chosen.append(best)
        there = taken.setdefault(key, [])
        there.append(best)
        m = len(there)
        lost = sum(kept(t, m) - kept(t, m + 1) for t in there)
        for c in left[key]:
            gains[c.fellow_id] = kept(c, m + 1) - lost
    return chosen


def same_host(a: Candidate, b: Candidate) -> bool:
    """Whether two fellows may share a machine's loopback, as far as the leader can tell:
    the same host in their data addresses, or, where one advertises none, the same host
    name (its own claim). Such a pair is not probed. (Containers on one machine, one kernel
    boot id but addresses of their own, talk over its bridge: a link worth measuring.)"""
    ha, hb = endpoint_host(a.data_address), endpoint_host(b.data_address)
    if ha is not None and hb is not None:
        return ha == hb
    return a.hostname == b.hostname


def machine(fellow: Candidate | PlacedStage) -> str:
    """The machine a fellow (or a placed stage) runs on, as far as the leader can tell: its
    kernel's boot id (one per machine, shared by the containers on it), else, from an agent
    that reports none, the host of its data address, else its host name. Stages on one
    machine share its cores (:func:`intra_op_threads`)."""
    if fellow.machine_id:
        return f"boot:{fellow.machine_id}"
    host = endpoint_host(fellow.data_address)
    return f"addr:{host}" if host else f"name:{fellow.hostname}"


def _taken_along_links(
    spec: JobSpec,
    ranked: list[Candidate],
    taken: list[Candidate],
    gpus: dict[str, list[GpuInfo]],
    links: Mapping[tuple[str, str], MeasuredLink],
) -> list[Candidate]:
    """For a ``balanced`` pipeline with more fellows ready than it needs, where the fastest
    (``taken``) are CPU fellows of measured speed: the ``len(taken)`` of the measured CPU
    fellows whose balanced split plus best-ordered links are predicted fastest
    (:func:`silentswarm.leader.balance.fellows_along_links`; fellows on one machine split
    its cores, :func:`core_shares`, and where the search weighs fewer fellows than there
    are, at most ``len(taken)`` of a machine), in
    ranked order; ``taken`` where that cannot be judged (a GPU or an unmeasured fellow
    among the fastest) or neither links nor shared hosts tell sets apart."""
    if spec.partition != Partition.BALANCED or len(ranked) <= len(taken):
        return taken
    if any(gpus[c.fellow_id] or not c.compute_speed for c in taken):
        return taken
    m, n = _micro_batches_or_one(spec), len(taken)
    timed = _measured_cpu(ranked, gpus)
    speeds = _cpu_speeds(timed, gpus)
    if len(timed) > along_pool_size(n, linked=bool(links)):
        timed = _per_host(timed, n, speeds)
        speeds = {c.fellow_id: speeds[c.fellow_id] for c in timed}
    shared = _hosts_shared(timed)
    if not links and not shared:
        return taken
    by_id = {c.fellow_id: c for c in ranked}

    def cap(fellow: str, stage: int) -> int:
        return _layer_cap(spec, stage, n, by_id[fellow], gpus[fellow])

    chosen = set(
        fellows_along_links(
            speeds,
            n,
            links,
            model=spec.model,
            batch_size=spec.batch_size,
            micro_batches=m,
            bits_per_step=boundary_bits(spec),
            same_host=_loopback_pairs(spec, ranked),
            cap=cap,
            shares=_shares_of(timed) if shared else None,
            first_only=_first_only(spec, timed),
        )
    )
    return [c for c in ranked if c.fellow_id in chosen]


def _measured_cpu(fellows: list[Candidate], gpus: dict[str, list[GpuInfo]]) -> list[Candidate]:
    """The CPU fellows of measured speed among ``fellows``, in their order."""
    return [c for c in fellows if c.compute_speed and not gpus[c.fellow_id]]


def _cpu_speeds(fellows: list[Candidate], gpus: dict[str, list[GpuInfo]]) -> dict[str, float]:
    """The CPU fellows of measured speed among ``fellows``: speed times their quota's share."""
    return {
        c.fellow_id: (c.compute_speed or 0.0) * c.cpu_share for c in _measured_cpu(fellows, gpus)
    }


def _kept_cpu_speeds(
    fellows: list[Candidate], gpus: dict[str, list[GpuInfo]]
) -> dict[str, float] | None:
    """Each of ``fellows``' :func:`_cpu_speeds` times the :func:`core_share` it keeps while
    all of them run (every replica of a job at once); None where a GPU fellow or one not
    measured is among them."""
    speeds = _cpu_speeds(fellows, gpus)
    if len(speeds) < len(fellows):
        return None
    shares = core_shares(fellows)
    return {f: speed * shares[f] for f, speed in speeds.items()}


def _first_only(spec: JobSpec, fellows: Sequence[Candidate]) -> set[str]:
    """The ``fellows`` that may only run stage 0 unless the job relays every boundary: those
    without a data address (they connect out; after stage 0 the job would turn to the
    relay, whose links no figure describes)."""
    if spec.transport == Transport.TUNNEL:
        return set()
    return {c.fellow_id for c in fellows if not c.data_address}


def _per_host(
    fellows: list[Candidate], n: int, pace: Mapping[str, float] | None
) -> list[Candidate]:
    """``fellows`` with at most ``n`` of any machine (the fastest by ``pace``, else the
    best ranked): a set of ``n`` never needs more, and where a search weighs only the
    fastest few, a crowded machine's fellows would fill them with sets that halve each
    other (where it weighs all, none is left out: which of a machine's fellows is best
    may be told by the links)."""
    order = sorted(
        range(len(fellows)), key=lambda at: (-(pace or {}).get(fellows[at].fellow_id, 0.0), at)
    )
    on_host: Counter[str] = Counter()
    kept = set()
    for at in order:
        host = machine(fellows[at])
        if on_host[host] < n:
            on_host[host] += 1
            kept.add(at)
    return [c for at, c in enumerate(fellows) if at in kept]


def _micro_batches_or_one(spec: JobSpec) -> int:
    """The job's micro-batches where fixed; 1 under ``"auto"`` (unknown yet)."""
    return spec.micro_batches if isinstance(spec.micro_batches, int) else 1


def _loopback_pairs(spec: JobSpec, fellows: list[Candidate]) -> Callable[[str, str], bool]:
    """Which pairs of ``fellows`` (by id) talk over one machine's loopback in ``spec``'s
    job: a direct pair on one host, unless the job relays every boundary (``tunnel``)."""
    return _loopback_addresses(spec, {c.fellow_id: c.data_address for c in fellows})


def _loopback_addresses(
    spec: JobSpec, addresses: Mapping[str, str | None]
) -> Callable[[str, str], bool]:
    """:func:`_loopback_pairs` of fellows by their data addresses (a placed stage's too): a
    pair's direct link is one machine's loopback when both advertise a data address, on the
    same host (a host name alone is a fellow's claim, and a pair without addresses talks
    over the relay)."""
    if spec.transport == Transport.TUNNEL:
        return lambda a, b: False
    hosts = {f: endpoint_host(address) for f, address in addresses.items()}
    return lambda a, b: hosts.get(a) is not None and hosts.get(a) == hosts.get(b)


def _place_on(
    spec: JobSpec,
    taken: list[Candidate],
    k: int,
    gpus: dict[str, list[GpuInfo]],
    defaults: PlacementDefaults,
    ranges: list[tuple[int, int]] | None,
    links: Mapping[tuple[str, str], MeasuredLink] | None,
    beside: Mapping[str, int] | None = None,
) -> Placement | Unplaceable:
    """The job on ``taken`` (ranked order) as ``k`` pipelines: dealt like cards, or (a
    ``balanced`` job with replicas and measured links) grouped by its links where that
    grouping fits and keeps the dealt grouping's transport."""
    groups = _pipelines(spec, taken, k, defaults, links if ranges is None else None)
    if k > 1 and links and spec.partition == Partition.BALANCED:
        keep_last = _keeps_last(spec, defaults)
        grouped = _grouped_along_links(
            spec, taken, k, gpus, links, keep_last=keep_last, ranges=ranges
        )
        if grouped is not None and grouped != groups:
            placed = _place_groups(spec, grouped, gpus, ranges, beside)
            if _keeps_transport(spec, placed, groups):
                return placed
    placed = _place_groups(spec, groups, gpus, ranges, beside)
    if isinstance(placed, Unplaceable):  # a fellow moved to stage 0 may not hold it
        plain = _pipelines(spec, taken, k, defaults, None, relay_first=False)
        if plain != groups:
            again = _place_groups(spec, plain, gpus, ranges, beside)
            if not isinstance(again, Unplaceable):
                return again
    return placed


def _keeps_transport(
    spec: JobSpec, placed: Placement | Unplaceable, dealt: list[list[Candidate]]
) -> bool:
    """Whether ``placed`` (another choice than the ``dealt`` pipelines) is a placement with
    the transport the dealt one would have, or a direct one where the dealt one would
    relay: a choice made for speed never turns a job's boundaries over to the relay."""
    if isinstance(placed, Unplaceable):
        return False
    transport = _transport(spec, dealt)
    if isinstance(transport, Unplaceable) or placed.transport == transport:
        return True
    return transport == Transport.TUNNEL and placed.transport != Transport.TUNNEL


def _refilled(
    spec: JobSpec,
    ranked: list[Candidate],
    taken: list[Candidate],
    gpus: dict[str, list[GpuInfo]],
    ranges: list[tuple[int, int]],
    links: Mapping[tuple[str, str], MeasuredLink] | None,
    joining: JoinedRings | None,
    defaults: PlacementDefaults,
    beside: Mapping[str, int] | None = None,
) -> list[Candidate] | None:
    """For a ``balanced`` pipeline on fixed ``ranges`` (a resumed job, a replacement
    replica): the fellows and order of least predicted step (:func:`silentswarm.leader.
    refill.refill`). Where the fellows the speed ranking takes (``taken``) are all CPU
    fellows of measured speed, among the fastest such fellows, by their speeds; where they
    are all CPU fellows never measured, among such fellows (alike to the speed ranking);
    else only ``taken``, reordered (a GPU's compute cannot be weighed against a CPU's).
    Where any link is known, by the measured links too, and the ``joining`` rings', among
    fellows with a data address only (the relay's links are not measured). Only chains
    whose every stage fits its fellow's memory count, and, unless the job relays every
    boundary, whose stages after the first all have a data address (else the job would
    relay them). None where neither speeds nor links tell the chains apart."""
    if spec.partition != Partition.BALANCED:
        return None
    n, keep_last = len(ranges), _keeps_last(spec, defaults)
    speeds = _cpu_speeds(ranked, gpus)
    timed = all(c.fellow_id in speeds for c in taken)
    pace = speeds if timed else None
    by_id = {c.fellow_id: c for c in ranked}

    def best(fellows: list[Candidate]) -> list[Candidate]:
        """The pool weighed of ``fellows``: at most n of a machine where it cannot hold all."""
        if len(fellows) > pool_size(len(fellows), n, keep_last=keep_last):
            fellows = _per_host(fellows, n, pace)
        ids = [c.fellow_id for c in fellows]
        return [by_id[f] for f in candidate_pool(ids, n, keep_last=keep_last, pace=pace)]

    if timed:
        fellows = _measured_cpu(ranked, gpus)
    elif all(_unmeasured_cpu(c, gpus) for c in taken):
        fellows = [c for c in ranked if _unmeasured_cpu(c, gpus)]  # alike but for the links
    else:
        fellows = taken
    pool = best(fellows)
    pairs: Mapping[tuple[str, str], MeasuredLink] = {}
    rings: list[dict[str, float]] | None = None
    if links:
        linked = best([c for c in fellows if c.data_address])
        ids = [c.fellow_id for c in linked]
        members = joining.fellows if joining is not None else []
        addresses = {c.fellow_id: c.data_address for c in linked}
        if joining is not None:
            addresses |= joining.addresses
        same = _loopback_addresses(spec, addresses)
        found = GuessedLinks([*ids, *members], links, same_host=same)
        if found and len(linked) >= n:
            pool, pairs = linked, found
            rings = joining.seconds(ids, found) if joining is not None else None
    if not timed and not pairs:
        return None
    shares = _shares_of(pool, beside) if _hosts_shared(pool, beside) else None
    cost = _fixed_split_cost(spec, pool, gpus, ranges, pace, pairs, rings, shares=shares)
    chain = refill([c.fellow_id for c in pool], n, cost, keep_last=keep_last, pace=pace)
    return None if chain is None else [by_id[f] for f in chain]


def _unmeasured_cpu(c: Candidate, gpus: dict[str, list[GpuInfo]]) -> bool:
    return not gpus[c.fellow_id] and not c.compute_speed


def _fixed_split_cost(
    spec: JobSpec,
    fellows: list[Candidate],
    gpus: dict[str, list[GpuInfo]],
    ranges: list[tuple[int, int]],
    speeds: Mapping[str, float] | None,
    links: Mapping[tuple[str, str], MeasuredLink],
    rings: list[dict[str, float]] | None = None,
    *,
    fits: dict[tuple[str, int], bool] | None = None,
    shares: CoreShares | None = None,
) -> Callable[[list[str]], float]:
    """A chain of ``fellows`` holding ``ranges``: its predicted step (:func:`silentswarm.
    leader.refill.chain_seconds`: its compute by ``speeds`` where given, each times the
    share of its host's cores it keeps in the chain where ``shares`` are given, its
    ``links`` and the ``rings`` it joins where given); infinite where a stage does not
    fit its fellow's memory (``fits``: :func:`_fits_table`'s, where already made), or
    (unless the job relays every boundary) a stage after the first has no data address."""
    if fits is None:
        fits = _fits_table(spec, fellows, gpus, ranges)
    relays = spec.transport == Transport.TUNNEL
    direct = {c.fellow_id for c in fellows if c.data_address or relays}
    sizes = [end - start for start, end in ranges]
    m, bits = _micro_batches_or_one(spec), boundary_bits(spec)

    def cost(chain: list[str]) -> float:
        if not all(fits[f, i] for i, f in enumerate(chain)):
            return math.inf
        if not all(f in direct for f in chain[1:]):
            return math.inf
        pace = speeds
        if shares is not None and pace is not None:
            kept = shares(chain)
            pace = {f: pace[f] * kept[f] for f in chain}
        return chain_seconds(
            chain,
            model=spec.model,
            batch_size=spec.batch_size,
            micro_batches=m,
            sizes=sizes,
            speeds=pace,
            links=links,
            bits_per_step=bits,
            rings=rings,
        )

    return cost


def _fits_table(
    spec: JobSpec,
    fellows: list[Candidate],
    gpus: dict[str, list[GpuInfo]],
    ranges: list[tuple[int, int]],
) -> dict[tuple[str, int], bool]:
    """Whether each fellow holds each stage of ``ranges`` within its memory."""
    out = {}
    for i, (start, end) in enumerate(ranges):
        memory = _stage_memory(spec, i, len(ranges), end - start)
        for c in fellows:
            placed = _place_stage(i, c, gpus[c.fellow_id], memory, start, end, Counter())
            out[c.fellow_id, i] = not isinstance(placed, Unplaceable)
    return out


def _stage_memory(spec: JobSpec, i: int, n_stages: int, layers: int) -> StageMemory:
    """Stage ``i``'s memory estimate, of ``n_stages``, holding ``layers`` layers."""
    micro_batches, in_flight = spec.memory_schedule()
    return stage_memory(
        spec.model,
        batch_size=spec.batch_size,
        micro_batches=micro_batches,
        stage=i,
        n_stages=n_stages,
        layers=layers,
        in_flight=in_flight,
        overlap=spec.overlap,
        recompute=spec.recompute,
        deferred=spec.memory_deferred(),
    )


def _place_groups(
    spec: JobSpec,
    groups: list[list[Candidate]],
    gpus: dict[str, list[GpuInfo]],
    ranges: list[tuple[int, int]] | None,
    beside: Mapping[str, int] | None = None,
) -> Placement | Unplaceable:
    """The job on these pipelines (each replica's fellows in stage order), beside the job's
    stages already running (``beside``, per :func:`machine`)."""
    k = len(groups)
    transport = _transport(spec, groups)
    if isinstance(transport, Unplaceable):
        return transport
    splits = _splits(spec, groups, gpus, ranges, transport)
    if isinstance(splits, Unplaceable):
        return splits
    per_host = stages_per_machine([c for chosen in groups for c in chosen], beside)
    stages = []
    for r, chosen in enumerate(groups):
        for i, (c, (start, end)) in enumerate(zip(chosen, splits[r], strict=True)):
            memory = _stage_memory(spec, i, len(chosen), end - start)
            placed = _place_stage(i, c, gpus[c.fellow_id], memory, start, end, per_host)
            if isinstance(placed, Unplaceable):
                where = "the last stage" if i == len(chosen) - 1 else f"stage {i}"
                if k > 1:
                    where += f" of replica {r}"
                return Unplaceable(reason=f"{placed.reason} on {where} ({c.fellow_id})")
            if k > 1:
                placed.replica, placed.sync_address = r, c.sync_address
            stages.append(placed)
    return Placement(stages=stages, transport=transport)


def _ranked(
    spec: JobSpec, candidates: list[Candidate], gpus: dict[str, list[GpuInfo]]
) -> list[Candidate]:
    """Fellows with eligible GPUs by their free VRAM, then (``allow_cpu``) CPU-only ones by
    their RAM."""
    with_gpu = sorted(
        (c for c in candidates if gpus[c.fellow_id]),
        key=lambda c: (-sum(g.memory_free_bytes for g in gpus[c.fellow_id]), c.fellow_id),
    )
    cpu_only = sorted(
        (c for c in candidates if not gpus[c.fellow_id] and spec.allow_cpu),
        key=lambda c: (-c.ram_available_bytes, c.fellow_id),
    )
    return with_gpu + cpu_only


def _keeps_last(spec: JobSpec, defaults: PlacementDefaults) -> bool:
    """Whether each pipeline's best ranked fellow runs its last stage (``largest_vram``)."""
    rule = spec.pipeline_last_stage_placement or defaults.last_stage
    return rule == LastStagePlacement.LARGEST_VRAM


def _pipelines(
    spec: JobSpec,
    taken: list[Candidate],
    k: int,
    defaults: PlacementDefaults,
    links: Mapping[tuple[str, str], MeasuredLink] | None,
    *,
    relay_first: bool = True,
) -> list[list[Candidate]]:
    """``taken`` (ranked) as ``k`` pipelines, each in stage order. Dealt out like cards:
    replica r takes the r-th best, the (k + r)-th, ..., so the replicas are alike; with
    ``relay_first`` a lone fellow without a data address runs its pipeline's stage 0 (it
    connects out; after it, the job would relay every boundary), unless it must run the
    last (:func:`_place_on` deals without it where that stage does not fit the fellow)."""
    keep_last = _keeps_last(spec, defaults)
    along = spec.partition == Partition.BALANCED and bool(links)
    bits = boundary_bits(spec) if along else 0.0
    groups = []
    for r in range(k):
        chosen = taken[r::k]
        if keep_last and len(chosen) > 1:
            chosen = [*chosen[1:], chosen[0]]  # the best ranked runs the last stage
        if along:
            pairs = _loopback_pairs(spec, chosen)
            chosen = _along_links(chosen, links, keep_last=keep_last, bits=bits, same=pairs)
        elif relay_first:
            chosen = _lone_relay_first(chosen, keep_last=keep_last)
        groups.append(chosen)
    return groups


def _grouped_along_links(
    spec: JobSpec,
    taken: list[Candidate],
    k: int,
    gpus: dict[str, list[GpuInfo]],
    links: Mapping[tuple[str, str], MeasuredLink],
    *,
    keep_last: bool,
    ranges: list[tuple[int, int]] | None = None,
) -> list[list[Candidate]] | None:
    """``taken`` as the ``k`` pipelines whose predicted step is least
    (:func:`silentswarm.leader.replica_groups.replica_groups`): each replica's compute
    (where every fellow is a CPU fellow of measured speed) and its links in their best
    order, and the rings between the replicas. None where none of them has a measured link,
    or one has no data address (it talks over the relay, which no link figure describes,
    and only stage 0 may be such a fellow under ``p2p``). With ``keep_last`` each replica's
    best ranked fellow runs its last stage. Fixed ``ranges`` (a resumed job's) hold for
    every replica: a replica's order is then its least compute and links on them
    (:func:`silentswarm.leader.refill.refill`), a stage that does not fit costing
    infinitely."""
    if any(not c.data_address for c in taken):
        return None
    by_id = {c.fellow_id: c for c in taken}
    pairs = LinkBook(guessed_links(list(by_id), links, same_host=_loopback_pairs(spec, taken)))
    if not pairs:
        return None
    bits = boundary_bits(spec)
    p = len(taken) // k
    tried = p - 1 if keep_last else p  # the fellows an order permutes
    if ranges is None:
        ring_bits = sync_bits(spec, p)
        compute = _compute_seconds_of(spec, taken, gpus, p)

        def order(group: list[str]) -> list[str]:
            if keep_last and len(group) > 1:
                group = [*group[1:], group[0]]
            last = group[-1] if keep_last else None
            return chain_order(group, pairs, bits_per_step=bits, last=last)

    else:
        ring_bits = range_sync_bits(spec, ranges)
        timed = _kept_cpu_speeds(taken, gpus)  # every replica runs at once
        fits = _fits_table(spec, taken, gpus, ranges)
        compute = _fixed_split_cost(spec, taken, gpus, ranges, timed, {}, fits=fits)
        whole = _fixed_split_cost(spec, taken, gpus, ranges, timed, pairs, fits=fits)

        def order(group: list[str]) -> list[str]:  # ranked, as replica_groups hands it
            found = refill(group, len(group), whole, keep_last=keep_last)
            return group if found is None else found

    chains = replica_groups(
        list(by_id),
        k,
        pairs,
        order=order,
        bits_per_step=bits,
        ring_bits=ring_bits,
        rounds=rounds_per_step(spec),
        compute=compute,
        order_work=math.factorial(tried) if 3 <= p <= MAX_ORDERED else 1,
        compute_work=p * spec.model.n_layers,  # balanced_sizes' search, about
    )
    return [[by_id[f] for f in chain] for chain in chains]


def _compute_seconds_of(
    spec: JobSpec, taken: list[Candidate], gpus: dict[str, list[GpuInfo]], p: int
) -> Callable[[list[str]], float] | None:
    """A pipeline's compute seconds a step on ``p`` of these fellows (a balanced split's, by
    their measured speeds times their quotas' shares and the shares of their hosts' cores
    they keep while all of ``taken`` run, within each fellow's memory: infinite where no
    split fits), or None where a GPU fellow or one not measured is among them."""
    speeds = _kept_cpu_speeds(taken, gpus)
    if speeds is None:
        return None
    m = _micro_batches_or_one(spec)
    caps = {
        (c.fellow_id, i): _layer_cap(spec, i, p, c, gpus[c.fellow_id])
        for c in taken
        for i in range(p)
    }

    def seconds(chain: list[str]) -> float:
        found = compute_seconds(
            spec.model,
            batch_size=spec.batch_size,
            speeds=[speeds[f] for f in chain],
            micro_batches=m,
            caps=[caps.get((f, i)) for i, f in enumerate(chain)],
        )
        return math.inf if found is None else found

    return seconds


def _transport(spec: JobSpec, groups: list[list[Candidate]]) -> Transport | Unplaceable:
    """The job's transport on these fellows: ``auto`` turns ``tunnel`` when a stage after
    the first has no data address; ``p2p`` needs every data address (and, with replicas,
    every sync address: under ``auto`` a ring link to a member without one uses the relay)."""
    transport = spec.transport or Transport.AUTO  # the leader fills it in at submit
    missing = [c.fellow_id for chosen in groups for c in chosen[1:] if not c.data_address]
    if missing and transport == Transport.P2P:
        return Unplaceable(
            reason="transport p2p needs a data address (SWARM_DATA_ADDRESS) on "
            + ", ".join(missing)
        )
    if missing and transport == Transport.AUTO:
        transport = Transport.TUNNEL
    if len(groups) > 1 and transport == Transport.P2P:
        unsynced = [
            c.fellow_id
            for chosen in groups
            for c in chosen
            if not rings.fellow_ports(c.sync_address)
        ]
        if unsynced:
            return Unplaceable(
                reason="transport p2p with replicas needs a sync address (SWARM_SYNC_ADDRESS) "
                "on " + ", ".join(unsynced)
            )
    return transport


def _stage_count(
    spec: JobSpec, ranked: int, ranges: list[tuple[int, int]] | None, max_stages: int | None
) -> tuple[int, int]:
    """How many stages a job without replicas takes of ``ranked`` fitting fellows, and
    needs at least."""
    if ranges is not None:
        return len(ranges), len(ranges)
    wanted = spec.stages if spec.stages is not None else min(ranked, spec.model.n_layers)
    if spec.stages is None and max_stages is not None:
        wanted = min(wanted, max_stages)
    return wanted, max(wanted, spec.min_stages)


def shape(
    spec: JobSpec,
    ranked: int,
    *,
    ranges: list[tuple[int, int]] | None = None,
    max_stages: int | None = None,
) -> tuple[int, int, int]:
    """``(replicas, stages, fellows needed)`` of a job placed on ``ranked`` fitting fellows.

    Without replicas: the spec's stages, or every fellow (at most one per layer, at most
    ``max_stages``), and at least ``min_stages``. ``replicas`` k: k pipelines of the spec's
    stages, or of as many as the fellows allow for k pipelines. "auto": pipelines of the
    spec's ``stages`` (else ``min_fellows``), as many as the fellows (and ``max_stages``,
    the account's limit on the fellows a job takes) allow, at least one. A resumed job
    (``ranges``) keeps its number of stages."""
    if spec.replicas == 1:
        wanted, need = _stage_count(spec, ranked, ranges, max_stages)
        return 1, wanted, need
    if spec.replicas == "auto":
        p = len(ranges) if ranges is not None else spec.min_stages
        k = ranked // p
        if max_stages is not None:
            k = min(k, max_stages // p)
        k = max(1, k)
        return k, p, k * p
    k = spec.replicas
    if ranges is not None:
        p = len(ranges)
    elif spec.stages is not None:
        p = spec.stages
    else:
        p = min(ranked // k, spec.model.n_layers)
        if max_stages is not None:
            p = min(p, max_stages // k)
        p = max(p, spec.min_stages)
    return k, p, k * p


def fellows_needed(spec: JobSpec, ranges: list[tuple[int, int]] | None = None) -> int:
    """The fewest fellows the job runs on (what an account's limit must leave room for)."""
    p = len(ranges) if ranges is not None else spec.min_stages
    return p * (spec.replicas if isinstance(spec.replicas, int) else 1)


def _along_links(
    chosen: list[Candidate],
    links: Mapping[tuple[str, str], MeasuredLink],
    *,
    keep_last: bool,
    bits: float,
    same: Callable[[str, str], bool],
) -> list[Candidate]:
    """``chosen`` in the order its links cost least (:func:`chain_order`), a lone fellow
    without a data address first (:func:`_lone_relay_first`)."""
    chosen = _lone_relay_first(chosen, keep_last=keep_last)
    by_id = {c.fellow_id: c for c in chosen}
    last = chosen[-1].fellow_id if keep_last else None
    first = chosen[0].fellow_id if not chosen[0].data_address else None
    order = chain_order(
        list(by_id), links, bits_per_step=bits, last=last, first=first, same_host=same
    )
    return [by_id[f] for f in order]


def _lone_relay_first(chosen: list[Candidate], *, keep_last: bool) -> list[Candidate]:
    """``chosen`` with its one fellow without a data address first (it connects out; after
    stage 0 its boundaries would turn to the relay), unless that fellow must run the last
    stage (``keep_last``) or more than one has none (the job relays either way)."""
    relay_only = [at for at, c in enumerate(chosen) if not c.data_address]
    if len(relay_only) != 1 or (keep_last and relay_only[0] == len(chosen) - 1):
        return chosen
    at = relay_only[0]
    return [chosen[at], *chosen[:at], *chosen[at + 1 :]]


def _splits(
    spec: JobSpec,
    groups: list[list[Candidate]],
    gpus: dict[str, list[GpuInfo]],
    fixed: list[tuple[int, int]] | None,
    transport: Transport,
) -> list[list[tuple[int, int]]] | Unplaceable:
    """Each replica's layer split (``groups``: each replica's fellows in stage order).

    A ``weighted`` or ``balanced`` job with replicas splits each replica on its own fellows
    (the replicas average per layer, over one ring per segment: :mod:`silentswarm.rings`),
    unless a learned codec's projections sit at the boundaries (they have no counterpart in
    another split) or, under transport ``p2p``, a fellow has fewer sync ports than the rings
    its stage would be in: then every replica takes one split, over each stage position's
    weakest fellow (:func:`_ranges`). ``fixed`` ranges (a resumed job's) hold for all."""
    one = _ranges(spec, groups, gpus, fixed)
    if isinstance(one, Unplaceable):
        return one
    uniform_split = [one] * len(groups)
    per_replica = spec.partition in (Partition.WEIGHTED, Partition.BALANCED)
    bottleneck = parse_compression(spec.compression, d_model=spec.model.d_model).bottleneck_dim
    if fixed is not None or len(groups) < 2 or len(groups[0]) < 2 or not per_replica or bottleneck:
        return uniform_split
    everyone = [c for chosen in groups for c in chosen]  # all run at once
    own = [_ranges(spec, [chosen], gpus, None, running=everyone) for chosen in groups]
    if any(isinstance(split, Unplaceable) for split in own):
        return uniform_split
    splits = [list(split) for split in own if not isinstance(split, Unplaceable)]
    if transport == Transport.P2P:
        needed = rings.ports_needed(splits)
        if any(
            need > len(rings.fellow_ports(c.sync_address))
            for chosen, row in zip(groups, needed, strict=True)
            for c, need in zip(chosen, row, strict=True)
        ):
            return uniform_split
    return splits


def _ranges(
    spec: JobSpec,
    groups: list[list[Candidate]],
    gpus: dict[str, list[GpuInfo]],
    fixed: list[tuple[int, int]] | None,
    *,
    running: Sequence[Candidate] | None = None,
) -> list[tuple[int, int]] | Unplaceable:
    """The stages' layer ranges, one split for every replica in ``groups``: ``fixed`` ones
    (a resumed job's), or by the job's partition over each stage position's weakest
    fellow (``running``: all the job's fellows, which share their hosts' cores; default
    those of ``groups``)."""
    if fixed is not None:
        return [tuple(r) for r in fixed]
    layers, n = spec.model.n_layers, len(groups[0])

    def capacity(c: Candidate) -> int:
        own = gpus[c.fellow_id]
        return sum(g.memory_free_bytes for g in own) if own else c.ram_available_bytes

    if spec.partition == Partition.WEIGHTED and n > 1:
        return weighted_ranges(layers, [min(capacity(g[i]) for g in groups) for i in range(n)])
    if spec.partition == Partition.BALANCED and n > 1:
        return _balanced_ranges(spec, groups, gpus, running)
    return split_layers(layers, n)


def _balanced_ranges(
    spec: JobSpec,
    groups: list[list[Candidate]],
    gpus: dict[str, list[GpuInfo]],
    running: Sequence[Candidate] | None = None,
) -> list[tuple[int, int]] | Unplaceable:
    """Layers by measured speed within each fellow's memory; equal when no speed is known
    (a fellow without one counts at the others' mean). A CPU fellow's speed counts at the
    threads it keeps beside the job's other stages on its machine (:func:`thread_cores`,
    among ``running``, default ``groups``' fellows), and its quota's share of them: a
    stage on fewer threads than its quota's cores is never held back. With replicas,
    a stage position counts at its slowest fellow's speed and its smallest memory."""
    members = [c for chosen in groups for c in chosen]
    known = [c.compute_speed for c in members if c.compute_speed]
    n = len(groups[0])
    if not known:
        return split_layers(spec.model.n_layers, n)
    fill = sum(known) / len(known)
    # A GPU fellow's stage takes threads too, but its speed is its GPU's.
    per_machine = stages_per_machine(running or members)

    def speed(c: Candidate) -> float:
        alone = c.compute_speed or fill
        if gpus[c.fellow_id]:
            return alone
        return alone * (thread_cores(c, per_machine[machine(c)]) / intra_op_threads(c, 1))

    def share(c: Candidate) -> float:
        if gpus[c.fellow_id]:
            return c.cpu_share
        # its quota's cores over its threads' (cpu_share itself where nothing is shared)
        return min(1.0, c.cpu_share * (c.cpu_cores / thread_cores(c, per_machine[machine(c)])))

    speeds = [min(speed(g[i]) for g in groups) for i in range(n)]
    shares = [min(share(g[i]) for g in groups) for i in range(n)]
    caps = [
        min(_layer_cap(spec, i, n, g[i], gpus[g[i].fellow_id]) for g in groups) for i in range(n)
    ]
    # 1F1B's fill and drain count with a fixed micro-batch count; under "auto" (unknown
    # yet) or the overlap schedule only the slowest stage does.
    fixed = isinstance(spec.micro_batches, int) and not spec.overlap
    sizes = balanced_sizes(
        spec.model.n_layers,
        speeds,
        caps=caps,
        last_extra=head_blocks(spec.model),
        micro_batches=spec.micro_batches if fixed else None,
        shares=shares,
    )
    if sizes is None:
        return Unplaceable(
            reason=f"no split of {spec.model.n_layers} layers fits the fellows' memory "
            f"(at most {', '.join(map(str, caps))} layers per stage)"
        )
    return ranges_of(sizes)


def _layer_cap(spec: JobSpec, i: int, n: int, c: Candidate, gpus: list[GpuInfo]) -> int:
    """The most layers stage ``i`` of ``n`` fits in the fellow's memory (all its eligible
    GPUs together, or its RAM), by the same estimate the stage is checked against."""
    one = _stage_memory(spec, i, n, 1)
    if gpus:
        room = sum(g.memory_free_bytes for g in gpus) - GPU_RUNTIME_BYTES * len(gpus)
    else:
        room = c.ram_available_bytes - CPU_RUNTIME_BYTES
    room -= one.first_extra + one.last_extra
    return max(0, room // max(1, one.per_layer[0]))


def _too_few(spec: JobSpec, need: int, available: int, *, replicas: int = 1) -> Unplaceable:
    what = "ready fellows"
    if not spec.allow_cpu:
        what += " with an eligible GPU"
    if spec.pool is not None or spec.labels:
        what += f" {pools.where(spec)}"
    if replicas > 1:
        what += f" ({replicas} replicas of {need // replicas} stages)"
    return Unplaceable(reason=f"waiting for {need} {what}; {available} available", too_few=True)


def intra_op_threads(c: Candidate, on_host: int) -> int:
    """A stage's threads: the fellow's own cores (its container's quota, its affinity), and
    no more than its share of the host's cores when ``on_host`` stages share the host."""
    return max(1, min(c.cpu_cores, host_cores(c) // max(1, on_host)))


def host_cores(c: Candidate) -> int:
    """The logical cores of ``c``'s machine (its own where it reported none)."""
    return c.host_cpu_cores or c.cpu_cores


def speed_alone(c: Candidate, speed: float, cores: float | None) -> float:
    """A speed a CPU stage of ``c`` showed on ``cores`` cores' worth of threads
    (:func:`stage_cores`; None: all its own), on the footing of its speed alone (on
    :func:`intra_op_threads` of ``c`` with no other stage on its host, as its probe
    measured it): a stage's compute scales about with its threads, so a fellow that ran
    beside others on its host is not taken for slow by the jobs it would run alone (and
    :func:`core_share` is not counted twice)."""
    if not cores:
        return speed
    return within_speeds(speed * intra_op_threads(c, 1) / cores)


def stage_cores(
    stages: Sequence[PlacedStage], placed: PlacedStage, host_cores: int
) -> float | None:
    """The cores' worth a placed stage ran on: its threads, less where the job's ``stages``
    on its machine (:func:`machine`) hold more threads than its ``host_cores`` (a replacement's
    beside a live stage that kept its own); None where its threads were not set."""
    if not placed.intra_op_threads:
        return None
    held = sum(s.intra_op_threads or 0 for s in stages if machine(s) == machine(placed))
    return placed.intra_op_threads * min(1.0, host_cores / max(held, 1))


def core_share(c: Candidate, on_host: int) -> float:
    """The share of its speed alone (measured on :func:`intra_op_threads` of its own) a CPU
    fellow keeps while ``on_host`` stages of its job share its host: its threads then, at
    most the host's cores / ``on_host`` (more stages than cores hold a thread each), as far
    as its CPU quota lets them run (a quota of fewer cores than the threads caps both)."""
    quota = c.cpu_share * c.cpu_cores  # the cores' worth its quota lets it run
    alone = min(intra_op_threads(c, 1), quota)
    cores = min(thread_cores(c, on_host), quota)
    return cores / alone if alone > 0 else 1.0


def thread_cores(c: Candidate, on_host: int) -> float:
    """The cores' worth of threads a stage of ``c`` runs on while ``on_host`` stages of its
    job share its machine: :func:`intra_op_threads`, at most the machine's cores /
    ``on_host`` (more stages than cores hold a thread each)."""
    return min(intra_op_threads(c, on_host), host_cores(c) / max(1, on_host))


def core_shares(
    fellows: Sequence[Candidate], beside: Mapping[str, int] | None = None
) -> dict[str, float]:
    """:func:`core_share` of each of ``fellows`` while they all run (stages on one host
    split its cores), beside the job's stages already running (``beside``, per host)."""
    per_host = stages_per_machine(fellows, beside)
    return {c.fellow_id: core_share(c, per_host[machine(c)]) for c in fellows}


def stages_per_machine(
    fellows: Sequence[Candidate | PlacedStage], beside: Mapping[str, int] | None = None
) -> Counter[str]:
    """How many stages run on each :func:`machine` while ``fellows`` (or placed stages) run,
    beside the job's stages already running (``beside``, per machine)."""
    return Counter(machine(c) for c in fellows) + Counter(beside or {})


def _shares_of(fellows: Sequence[Candidate], beside: Mapping[str, int] | None = None) -> CoreShares:
    """:func:`core_shares` of a set of ``fellows`` given by id."""
    by_id = {c.fellow_id: c for c in fellows}
    return lambda ids: core_shares([by_id[f] for f in ids], beside)


def _hosts_shared(fellows: Sequence[Candidate], beside: Mapping[str, int] | None = None) -> bool:
    """Whether two of ``fellows``, or one and a running stage (``beside``), may share a
    host's cores (a choice of them then weighs it)."""
    per_host = stages_per_machine(fellows, beside)
    return any(per_host[machine(c)] > 1 for c in fellows)


def _place_stage(
    i: int,
    c: Candidate,
    gpus: list[GpuInfo],
    memory: StageMemory,
    start: int,
    end: int,
    per_host: Counter[str],
) -> PlacedStage | Unplaceable:
    slots: list[GpuSlot] = []
    if gpus:
        slots = gpu_slots(gpus, start, end)
        for k, slot in enumerate(slots):
            need = GPU_RUNTIME_BYTES + memory.slot(
                slot.layer_start - start,
                slot.layer_end - start,
                first=k == 0,
                last=k == len(slots) - 1,
            )
            free = next(g.memory_free_bytes for g in gpus if g.uuid == slot.gpu_uuid)
            if need > free:
                return Unplaceable(
                    reason=f"needs ~{need / GIB:.1f} GiB on GPU {slot.gpu_index}, best fellow "
                    f"has {free / GIB:.1f} GiB free there"
                )
        estimate = memory.total + GPU_RUNTIME_BYTES * len(slots)
        offered = sum(g.memory_free_bytes for g in gpus)
    else:
        estimate = memory.total + CPU_RUNTIME_BYTES
        offered = c.ram_available_bytes
        if estimate > offered:
            return Unplaceable(
                reason=f"needs ~{estimate / GIB:.1f} GiB of RAM, best fellow has "
                f"{offered / GIB:.1f} GiB"
            )
    return PlacedStage(
        stage=i,
        fellow_id=c.fellow_id,
        hostname=c.hostname,
        machine_id=c.machine_id,
        layer_start=start,
        layer_end=end,
        data_address=c.data_address,
        gpu_slots=slots,
        # Stages sharing a host share its cores.
        intra_op_threads=intra_op_threads(c, per_host[machine(c)]),
        memory_estimate_bytes=estimate,
        memory_offered_bytes=offered,
    )


def gpu_slots(gpus: list[GpuInfo], start: int, end: int) -> list[GpuSlot]:
    """Layers ``[start, end)`` over ``gpus`` by free VRAM, the GPU with the most free last."""
    use = sorted(gpus, key=lambda g: (-g.memory_free_bytes, g.index))[: end - start]
    use.reverse()
    ranges = weighted_ranges(end - start, [g.memory_free_bytes for g in use])
    return [
        GpuSlot(gpu_index=g.index, gpu_uuid=g.uuid, layer_start=start + a, layer_end=start + b)
        for g, (a, b) in zip(use, ranges, strict=True)
    ]


def weighted_ranges(n_layers: int, weights: list[float]) -> list[tuple[int, int]]:
    """Contiguous ranges with sizes proportional to ``weights``, at least one layer each.

    Largest remainder: each stage gets the floor of its exact share (at least one), then the
    layers left go to the largest remainders (ties to the earlier stage); a stage that the
    floor of one pushed over takes layers back from the largest stages.
    """
    n = len(weights)
    if not 1 <= n <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {n} stages")
    total = sum(weights)
    if total <= 0:  # nothing to go by (e.g. every GPU reports 0 free): equal
        return split_layers(n_layers, n)
    quotas = [n_layers * w / total for w in weights]
    sizes = [max(1, int(q)) for q in quotas]
    while sum(sizes) < n_layers:
        i = max(range(n), key=lambda k: (quotas[k] - sizes[k], -k))
        sizes[i] += 1
    while sum(sizes) > n_layers:
        i = max((k for k in range(n) if sizes[k] > 1), key=lambda k: (sizes[k] - quotas[k], k))
        sizes[i] -= 1
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    assert start == n_layers, (n_layers, weights, sizes)
    return ranges
