"""Live hardware telemetry: psutil for CPU and RAM, pynvml for GPUs.

With no NVIDIA driver or library, ``pynvml.nvmlInit()`` raises an ``NVMLError`` subclass:
the fellow is then CPU-only, and the reason travels in ``nvml_error`` instead of an
exception.
"""

from __future__ import annotations

import logging
import platform
import socket
from collections.abc import Callable
from typing import TypeVar

import psutil
import pynvml

from swarm.protocol import GpuInfo, HardwareSnapshot

log = logging.getLogger(__name__)
T = TypeVar("T")


class HardwareProbe:
    """Takes snapshots; initialises NVML once and shuts it down on close."""

    def __init__(self, hostname: str | None = None) -> None:
        self.hostname = hostname or socket.gethostname()
        self.nvml_error: str | None = None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self.nvml_error = f"NVML unavailable: {exc}"
            log.info("no GPUs: %s", self.nvml_error)
        psutil.cpu_percent(interval=None)  # prime: the next call measures since now

    def snapshot(self) -> HardwareSnapshot:
        mem = psutil.virtual_memory()
        return HardwareSnapshot(
            hostname=self.hostname,
            platform=f"{platform.system()} {platform.machine()}",
            cpu_cores=psutil.cpu_count(logical=True) or 1,
            cpu_load_pct=psutil.cpu_percent(interval=None),
            ram_total_bytes=mem.total,
            ram_available_bytes=mem.available,
            gpus=self._gpus(),
            nvml_error=self.nvml_error,
        )

    def close(self) -> None:
        if self.nvml_error is None:
            _quiet(pynvml.nvmlShutdown)

    def _gpus(self) -> list[GpuInfo]:
        if self.nvml_error is not None:
            return []
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            log.warning("NVML device count failed: %s", exc)
            return []
        gpus = []
        for index in range(count):
            gpu = _gpu(index)
            if gpu is not None:
                gpus.append(gpu)
        return gpus


def _gpu(index: int) -> GpuInfo | None:
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
        name = _text(pynvml.nvmlDeviceGetName(handle))
    except pynvml.NVMLError as exc:
        log.warning("NVML could not read GPU %d: %s", index, exc)
        return None
    util = _quiet(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    temp = _quiet(lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
    return GpuInfo(
        index=index,
        uuid=uuid,
        name=name,
        memory_total_bytes=int(mem.total),
        memory_free_bytes=int(mem.free),
        memory_used_bytes=int(mem.used),
        utilization_pct=None if util is None else float(util),
        temperature_c=None if temp is None else float(temp),
    )


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _quiet(fn: Callable[[], T]) -> T | None:
    """Optional NVML fields: some GPUs (and MIG slices) do not report them."""
    try:
        return fn()
    except pynvml.NVMLError:
        return None
