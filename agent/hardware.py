"""Live hardware telemetry: psutil for CPU, RAM and network, pynvml for GPUs.

With no NVIDIA driver or library, ``pynvml.nvmlInit()`` raises an ``NVMLError`` subclass:
the fellow is then CPU-only, and the reason travels in ``nvml_error`` instead of an
exception. When NVML does see GPUs, :func:`probe_tensorflow_gpus` asks TensorFlow (in a
subprocess) how many it can use; until it answers, no GPU is offered. The operator's caps
travel with every snapshot, beside the measurements.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import re
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec
import psutil
import pynvml

from silentswarm.cpus import cpu_budget, usable_cores
from silentswarm.protocol import (
    MAX_COMPUTE_SPEED,
    MIN_COMPUTE_SPEED,
    FellowLimits,
    GpuInfo,
    HardwareSnapshot,
)
from silentswarm.ram import memory_budget
from silentswarm.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")


GIB = 1024**3
TF_PROBE_TIMEOUT_S = 120.0
SPEED_PROBE_TIMEOUT_S = 180.0


def limits_from(settings: Settings) -> FellowLimits:
    def gib(value: float | None) -> int | None:
        return None if value is None else int(value * GIB)

    mbps = settings.fellow_max_network_mbps
    return FellowLimits(
        max_vram_bytes=gib(settings.fellow_max_vram_gb),
        max_memory_bytes=gib(settings.fellow_max_memory_gb),
        max_network_bytes_per_s=None if mbps is None else int(mbps * 1e6 / 8),
    )


async def _run_probe(argv: list[str], key: str, timeout: float) -> tuple[object, str | None]:
    """Run a probe module in a subprocess and read ``key`` from the JSON of its last stdout
    line: (the value, None) or (None, why it failed).

    A probe past ``timeout`` is killed; so is one whose caller is cancelled (an agent that
    stops mid-probe exits at once instead of waiting seconds for TensorFlow to finish)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
    except OSError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        return None, f"TimeoutExpired: the probe took more than {timeout:g}s"
    finally:
        if proc.returncode is None:
            proc.kill()
            await asyncio.shield(proc.wait())
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    if proc.returncode != 0:
        last = (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return None, last[:300]
    try:
        return json.loads(stdout.strip().splitlines()[-1])[key], None
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return None, f"unreadable probe output ({exc})"


async def probe_tensorflow_gpus(
    timeout: float = TF_PROBE_TIMEOUT_S,
) -> tuple[int | None, str | None]:
    """(GPUs TensorFlow can use, None) or (None, why the probe failed)."""
    argv = [sys.executable, "-m", "silentswarm.agent.runtime.gpus"]
    value, why = await _run_probe(argv, "gpus", timeout)
    if why:
        return None, why
    try:
        return int(value), None  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        return None, f"unreadable probe output ({exc})"


async def probe_compute_speed(
    timeout: float = SPEED_PROBE_TIMEOUT_S,
    *,
    threads: int | None = None,
    prefix: list[str] | None = None,
    seconds: float | None = None,
    key: str = "compute_speed",
) -> tuple[float | None, str | None]:
    """(standard blocks trained per second, None) or (None, why the probe failed).

    Takes seconds (it imports TensorFlow in a subprocess, killed if this is cancelled).
    ``prefix`` goes in front of the command (a benchmark puts the probe in a cgroup);
    ``seconds``: how long its timed passes run (the probe's default: 2); ``key``:
    ``compute_speed`` (while it ran) or ``wall_clock_speed`` (a CPU quota's stalls in)."""
    argv = [*(prefix or []), sys.executable, "-m", "silentswarm.agent.runtime.speedprobe"]
    if threads:
        argv += ["--threads", str(threads)]
    if seconds:
        argv += ["--seconds", str(seconds)]
    value, why = await _run_probe(argv, key, timeout)
    if why:
        return None, why
    try:
        speed = float(value)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        return None, f"unreadable probe output ({exc})"
    if not MIN_COMPUTE_SPEED <= speed <= MAX_COMPUTE_SPEED:
        return None, f"probe measured {speed}: out of bounds"
    return speed, None


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
BOOT_ID_FORM = re.compile(r"[0-9a-f-]{8,64}")


def boot_id(path: Path = BOOT_ID) -> str | None:
    """The running kernel's boot id: one per machine and boot, shared by the containers on
    it (what tells the leader which fellows share a machine's cores); None where there is
    none or it is not of the usual form."""
    try:
        found = path.read_text(encoding="ascii").strip().lower()
    except (OSError, UnicodeDecodeError):
        return None
    return found if BOOT_ID_FORM.fullmatch(found) else None


class HardwareProbe:
    """Takes snapshots; initialises NVML once and shuts it down on close."""

    def __init__(
        self,
        hostname: str | None = None,
        limits: FellowLimits | None = None,
        compute_speed: float | None = None,
    ) -> None:
        """``compute_speed``: the operator's figure (SWARM_FELLOW_COMPUTE_SPEED); None: the
        agent measures it (:meth:`probe_speed`)."""
        self.hostname = hostname or socket.gethostname()
        self.machine_id = boot_id()
        self.limits = limits or FellowLimits()
        self.tf_gpu_count: int | None = None
        self.tf_probe_error: str | None = None
        self.compute_speed = compute_speed
        self.speed_declared = compute_speed is not None
        self._net = (time.monotonic(), psutil.net_io_counters())
        self.nvml_error: str | None = None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self.nvml_error = f"NVML unavailable: {exc}"
            log.info("no GPUs: %s", self.nvml_error)
        psutil.cpu_percent(interval=None)  # prime: the next call measures since now

    def snapshot(self) -> HardwareSnapshot:
        host = psutil.virtual_memory()
        mem = memory_budget(host.total, host.available)
        sent, received = self._net_rates()
        cpus = cpu_budget()
        return HardwareSnapshot(
            hostname=self.hostname,
            platform=f"{platform.system()} {platform.machine()}",
            cpu_cores=cpus.cores,
            cpu_quota=cpus.quota,
            host_cpu_cores=cpus.host,
            machine_id=self.machine_id,
            cpu_load_pct=psutil.cpu_percent(interval=None),
            ram_total_bytes=mem.total,
            ram_available_bytes=mem.available,
            ram_limit_bytes=mem.limit,
            host_ram_total_bytes=mem.host_total,
            host_ram_available_bytes=mem.host_available,
            net_sent_bytes_per_s=sent,
            net_recv_bytes_per_s=received,
            gpus=self._gpus(),
            nvml_error=self.nvml_error,
            tf_gpu_count=self.tf_gpu_count,
            tf_probe_error=self.tf_probe_error,
            compute_speed=self.compute_speed,
            limits=msgspec.structs.replace(self.limits),
        )

    @property
    def sees_gpus(self) -> bool:
        return bool(self._gpus())

    async def probe_tensorflow(self) -> None:
        """Ask TensorFlow which GPUs it can use (seconds: it imports TensorFlow)."""
        self.tf_gpu_count, self.tf_probe_error = await probe_tensorflow_gpus()
        if self.tf_probe_error:
            log.warning("TensorFlow GPU probe failed: %s", self.tf_probe_error)
        else:
            log.info("TensorFlow sees %d GPU(s)", self.tf_gpu_count)

    async def probe_speed(self) -> None:
        """Measure the compute speed (seconds: it imports TensorFlow), unless declared."""
        if self.speed_declared:
            return
        # As many threads as its stages will run (placement gives each the fellow's cores).
        speed, error = await probe_compute_speed(threads=usable_cores())
        if error:
            log.warning("compute speed probe failed: %s", error)
        else:
            self.compute_speed = speed
            log.info("compute speed: %.3g standard blocks/s", speed)

    def _net_rates(self) -> tuple[float, float]:
        """Bytes/s sent and received since the previous snapshot (all interfaces)."""
        now, counters = time.monotonic(), psutil.net_io_counters()
        then, before = self._net
        self._net = (now, counters)
        elapsed = now - then
        if counters is None or before is None or elapsed <= 0:
            return 0.0, 0.0
        sent = max(0, counters.bytes_sent - before.bytes_sent) / elapsed
        received = max(0, counters.bytes_recv - before.bytes_recv) / elapsed
        return round(sent, 1), round(received, 1)

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
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = []
        for index in range(count):
            gpu = _gpu(index)
            if gpu is not None and _visible(gpu, visible):
                gpus.append(gpu)
        return gpus


def _visible(gpu: GpuInfo, visible: str | None) -> bool:
    """Whether CUDA_VISIBLE_DEVICES (indices or UUIDs, PCI bus order) lets CUDA see ``gpu``."""
    if visible is None:
        return True
    tokens = [t.strip() for t in visible.split(",") if t.strip()]
    return any(
        t == str(gpu.index) or (t.startswith("GPU-") and gpu.uuid.startswith(t)) for t in tokens
    )


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
