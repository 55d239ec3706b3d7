"""One host's view, merged over every fellow running on it: pure.

Each fellow on a host sends its own hardware snapshot, and they differ: a fellow pinned to
some GPUs (``CUDA_VISIBLE_DEVICES``, or Nomad's ``NVIDIA_VISIBLE_DEVICES``) reports only the
GPUs it can see, each has its own TensorFlow probe and its own operator caps
(``SWARM_FELLOW_MAX_*``). Taking one fellow's snapshot for the host made the view flip with
every heartbeat. So the view is merged:

- GPUs: the union by UUID over the fellows considered, the freshest reading of each GPU;
- host numbers (CPU, RAM, network): the freshest snapshot considered; they describe the
  host, whichever fellow read them (its ``host_*`` figures: a fellow in a container offers
  only its cgroup's share);
- caps and which GPUs each fellow sees: per fellow, keyed by fellow id, for every fellow
  of the host (offline ones too: their caps are still what they were started with);
- GPUs TensorFlow can use: the union of the GPUs each fellow's probe covers.

The fellows considered are the online ones, or all of them when none is online (the last
known view of an offline host).
"""

from __future__ import annotations

import msgspec

from silentswarm.protocol import GpuInfo, HardwareSnapshot
from silentswarm.telemetry import gpu_warning
from silentswarm.types.fleet import NodeView


class HostFellow(msgspec.Struct, kw_only=True, gc=False):
    """What the merge reads of one fellow: its id, whether it is online, its last snapshot,
    and when the leader got it (its own wall clock; None: unknown)."""

    fellow_id: str
    online: bool
    hardware: HardwareSnapshot
    seen_at: float | None = None


def _freshness(fellow: HostFellow) -> tuple[float, str]:
    """Newest snapshot first; the fellow id breaks ties so the choice never depends on order.
    A snapshot counts as taken no later than the leader got it: a fellow that dates its
    snapshots ahead (it may claim another machine's name and boot id) does not win every
    merge of that host."""
    taken = fellow.hardware.taken_at
    if fellow.seen_at is not None:
        taken = min(taken, fellow.seen_at)
    return (taken, fellow.fellow_id)


def tf_usable_uuids(hw: HardwareSnapshot) -> list[str]:
    """The GPUs a fellow's TensorFlow probe covers: its first ``tf_gpu_count`` by index (the
    order TensorFlow numbers them in, as :func:`silentswarm.telemetry.usable_gpus` reads it)."""
    return [g.uuid for g in sorted(hw.gpus, key=lambda g: g.index)[: hw.tf_gpu_count or 0]]


def merge_host(hostname: str, fellows: list[HostFellow]) -> NodeView:
    """The view of ``hostname`` from the snapshots of its ``fellows`` (at least one)."""
    if not fellows:
        raise ValueError("a host view needs at least one fellow")
    online = [f for f in fellows if f.online]
    considered = sorted(online or fellows, key=_freshness)
    freshest = considered[-1].hardware
    gpus: dict[str, GpuInfo] = {}
    for fellow in considered:  # oldest first: a fresher reading of a GPU replaces an older one
        for gpu in fellow.hardware.gpus:
            gpus[gpu.uuid] = gpu
    probed = [f.hardware for f in considered if f.hardware.tf_gpu_count is not None]
    tf_gpus = {uuid for hw in probed for uuid in tf_usable_uuids(hw)}
    nvml_ok = any(f.hardware.nvml_error is None for f in considered)
    by_id = sorted(fellows, key=lambda f: f.fellow_id)
    return NodeView(
        hostname=hostname,
        machine_id=freshest.machine_id,
        online=bool(online),
        fellows=[f.fellow_id for f in by_id],
        cpu_cores=freshest.host_cpu_cores or freshest.cpu_cores,
        cpu_load_pct=freshest.cpu_load_pct,
        ram_total_bytes=freshest.host_ram_total_bytes or freshest.ram_total_bytes,
        ram_available_bytes=freshest.host_ram_available_bytes or freshest.ram_available_bytes,
        gpus=sorted(gpus.values(), key=lambda g: (g.index, g.uuid)),
        nvml_error=None if nvml_ok else freshest.nvml_error,
        gpu_warning=_warning(considered),
        tf_gpu_count=len(tf_gpus) if probed else None,
        limits={f.fellow_id: f.hardware.limits for f in by_id},
        fellow_gpus={f.fellow_id: [g.uuid for g in f.hardware.gpus] for f in by_id},
        net_sent_bytes_per_s=freshest.net_sent_bytes_per_s,
        net_recv_bytes_per_s=freshest.net_recv_bytes_per_s,
    )


def _warning(fellows: list[HostFellow]) -> str | None:
    """The warning, when every fellow gives the same one; else each fellow's that has one (its
    id first), in id order."""
    warnings = {f.fellow_id: w for f in fellows if (w := gpu_warning(f.hardware))}
    if not warnings:
        return None
    if len(warnings) == len(fellows) and len(set(warnings.values())) == 1:
        return next(iter(warnings.values()))
    return "; ".join(f"{fid}: {w}" for fid, w in sorted(warnings.items()))
