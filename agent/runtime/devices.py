"""Which TensorFlow device a GPU slot means. Pure: no TensorFlow import."""

from __future__ import annotations


def tf_gpu_index(gpu_index: int, gpu_uuid: str, cuda_visible_devices: str | None) -> int | None:
    """TensorFlow's index of the GPU that NVML calls ``gpu_index`` / ``gpu_uuid``.

    With CUDA_DEVICE_ORDER=PCI_BUS_ID and no CUDA_VISIBLE_DEVICES the two numberings agree.
    When a supervisor pins GPUs (CUDA_VISIBLE_DEVICES="2,3" or "GPU-...,GPU-..."), TensorFlow
    numbers the visible ones from 0, so the slot is looked up in that list; None when the
    slot's GPU is not visible to this process at all.
    """
    if cuda_visible_devices is None or cuda_visible_devices.strip() == "":
        return gpu_index if cuda_visible_devices is None else None
    entries = [e.strip() for e in cuda_visible_devices.split(",") if e.strip()]
    for position, entry in enumerate(entries):
        if entry == str(gpu_index) or (gpu_uuid and entry == gpu_uuid):
            return position
        if entry.startswith("GPU-") and gpu_uuid.startswith(entry):  # a UUID prefix
            return position
    return None
