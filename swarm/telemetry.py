"""What a fellow can offer, read from its hardware snapshot: pure functions.

NVML says which GPUs a machine has; only the GPUs TensorFlow can also use (the agent's
start-up probe) count, and an operator's caps (``SWARM_FELLOW_MAX_*``) bound what the
planner may use. The leader's placement, its nodes view and the CLI all read fellows
through these functions, so they agree on what a fellow offers and on what to tell the
operator when a GPU is unusable.
"""

from __future__ import annotations

import msgspec

from silentswarm.protocol import GpuInfo, HardwareSnapshot

CUDA_FIX = "install the [cuda] extra: pip install 'silentswarm[cuda]'"


def gpu_warning(hw: HardwareSnapshot) -> str | None:
    """Why some of the GPUs NVML reports are not offered; None when all are (or none exist)."""
    n = len(hw.gpus)
    if not n:
        return None
    if hw.tf_gpu_count is None:
        if hw.tf_probe_error:
            return f"TensorFlow GPU probe failed ({hw.tf_probe_error}); GPUs unused: {CUDA_FIX}?"
        return "TensorFlow GPU probe still running; GPUs unused until it answers"
    if hw.tf_gpu_count == 0:
        return f"NVML sees {n} GPU(s) but TensorFlow sees none: {CUDA_FIX}"
    if hw.tf_gpu_count < n:
        return (
            f"TensorFlow sees {hw.tf_gpu_count} of the {n} GPUs NVML reports; only those are used"
        )
    return None


def usable_gpus(hw: HardwareSnapshot) -> list[GpuInfo]:
    """The GPUs TensorFlow can use, with free VRAM cut to the operator's cap.

    The cap is shared out over the GPUs with the most free memory first, so a 24 GiB cap on
    two 80 GiB GPUs offers one GPU with 24 GiB free, not two with 12.
    """
    if not hw.gpus or not hw.tf_gpu_count:
        return []
    gpus = sorted(hw.gpus, key=lambda g: g.index)[: hw.tf_gpu_count]
    cap = hw.limits.max_vram_bytes
    if cap is None:
        return gpus
    out, left = [], cap
    for gpu in sorted(gpus, key=lambda g: (-g.memory_free_bytes, g.index)):
        free = min(gpu.memory_free_bytes, left)
        left -= free
        if free > 0:
            out.append(msgspec.structs.replace(gpu, memory_free_bytes=free))
    return sorted(out, key=lambda g: g.index)


def offered_ram(hw: HardwareSnapshot) -> int:
    cap = hw.limits.max_memory_bytes
    return hw.ram_available_bytes if cap is None else min(hw.ram_available_bytes, cap)
