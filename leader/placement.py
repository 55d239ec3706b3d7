"""Placement: which ready fellows run a job, in which order, with which layers.

A pure function of the job spec and the fellows' latest telemetry. Fellows are ranked by
capacity (free VRAM, then available RAM); the job takes the best ones; the fellow with the
most free VRAM runs the last stage (the head and its logits) unless the job says
``preserve``. Layers are split equally, or in proportion to capacity with ``weighted``.
"""

from __future__ import annotations

from collections import Counter

import msgspec

from swarm.jobspec import JobSpec, LastStagePlacement, Partition, PlacedStage, Placement
from swarm.plan import GpuSlot, Transport, split_layers
from swarm.protocol import GpuInfo

GIB = 1024**3


class Candidate(msgspec.Struct, kw_only=True, frozen=True):
    """What placement needs to know of one ready fellow."""

    fellow_id: str
    hostname: str
    data_address: str | None
    cpu_cores: int
    ram_available_bytes: int
    gpus: tuple[GpuInfo, ...] = ()


class Unplaceable(msgspec.Struct, kw_only=True, frozen=True):
    reason: str


def usable_gpus(candidate: Candidate, spec: JobSpec) -> list[GpuInfo]:
    """The fellow's GPUs with enough free VRAM for the job, most free first, capped."""
    floor = spec.placement_min_gpu_free_gb * GIB
    gpus = sorted(
        (g for g in candidate.gpus if g.memory_free_bytes >= floor),
        key=lambda g: (-g.memory_free_bytes, g.index),
    )
    return gpus[: spec.max_gpus_per_worker] if spec.max_gpus_per_worker else gpus


def _capacity(candidate: Candidate, spec: JobSpec) -> tuple[int, int]:
    return (
        sum(g.memory_free_bytes for g in usable_gpus(candidate, spec)),
        candidate.ram_available_bytes,
    )


def place(spec: JobSpec, candidates: list[Candidate]) -> Placement | Unplaceable:
    """A placement for ``spec`` on some of ``candidates`` (all ready and idle), or why not."""
    eligible = [c for c in candidates if spec.allow_cpu or usable_gpus(c, spec)]
    layers = spec.model.n_layers
    wanted = spec.stages if spec.stages is not None else min(len(eligible), layers)
    need = max(wanted, spec.min_stages)
    if len(eligible) < need:
        what = "ready fellows" if spec.allow_cpu else "ready fellows with a usable GPU"
        return Unplaceable(
            reason=f"waiting for {need} {what}; {len(eligible)} available"
            + (f" of {len(candidates)} idle" if len(eligible) != len(candidates) else "")
        )
    ranked = sorted(eligible, key=lambda c: (*(-x for x in _capacity(c, spec)), c.fellow_id))
    chosen = ranked[:wanted]
    if spec.pipeline_last_stage_placement == LastStagePlacement.LARGEST_VRAM and len(chosen) > 1:
        # Ranked best first; the best goes last, the others keep their rank order.
        chosen = [*chosen[1:], chosen[0]]
    transport = spec.transport
    missing = [c.fellow_id for c in chosen[1:] if not c.data_address]
    if missing and transport == Transport.P2P:
        return Unplaceable(
            reason="transport p2p needs a data address (SWARM_DATA_ADDRESS) on "
            + ", ".join(missing)
        )
    if missing and transport == Transport.AUTO:
        transport = Transport.TUNNEL
    ranges = _layer_ranges(spec, chosen)
    per_host = Counter(c.hostname for c in chosen)
    stages = []
    for i, (candidate, (start, end)) in enumerate(zip(chosen, ranges, strict=True)):
        stages.append(
            PlacedStage(
                stage=i,
                fellow_id=candidate.fellow_id,
                hostname=candidate.hostname,
                layer_start=start,
                layer_end=end,
                data_address=candidate.data_address,
                gpu_slots=_gpu_slots(candidate, spec, start, end),
                # Stages sharing a host share its cores.
                intra_op_threads=max(1, candidate.cpu_cores // per_host[candidate.hostname]),
            )
        )
    return Placement(stages=stages, transport=transport)


def _layer_ranges(spec: JobSpec, chosen: list[Candidate]) -> list[tuple[int, int]]:
    n_layers, n = spec.model.n_layers, len(chosen)
    if spec.partition == Partition.EQUAL or n == 1:
        return split_layers(n_layers, n)
    with_gpu = all(usable_gpus(c, spec) for c in chosen)
    weights = [_capacity(c, spec)[0] if with_gpu else max(1, c.cpu_cores) for c in chosen]
    return weighted_ranges(n_layers, weights)


def weighted_ranges(n_layers: int, weights: list[float]) -> list[tuple[int, int]]:
    """Contiguous ranges with sizes proportional to ``weights``, at least one layer each.

    Largest remainder: every stage first gets one layer, the rest are shared out by weight,
    leftovers going to the largest fractional parts (ties to the earlier stage).
    """
    n = len(weights)
    if not 1 <= n <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {n} stages")
    total = sum(weights) or 1.0
    spare = n_layers - n
    shares = [spare * w / total for w in weights]
    sizes = [1 + int(s) for s in shares]
    order = sorted(range(n), key=lambda i: (-(shares[i] - int(shares[i])), i))
    for i in order[: n_layers - sum(sizes)]:
        sizes[i] += 1
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return ranges


def _gpu_slots(candidate: Candidate, spec: JobSpec, start: int, end: int) -> list[GpuSlot]:
    """The stage's layers on the fellow's best GPU; none on a CPU-only fellow."""
    gpus = usable_gpus(candidate, spec)
    if not gpus:
        return []
    best = gpus[0]
    return [GpuSlot(gpu_index=best.index, gpu_uuid=best.uuid, layer_start=start, layer_end=end)]
