"""The real probe on this machine: psutil numbers, and NVML falling back cleanly."""

import asyncio

import psutil
import pynvml
import pytest

from silentswarm.agent.hardware import HardwareProbe


def test_snapshot_reports_this_machine():
    probe = HardwareProbe()
    try:
        snap = probe.snapshot()
    finally:
        probe.close()
    assert snap.cpu_cores == psutil.cpu_count(logical=True)
    assert snap.ram_total_bytes == psutil.virtual_memory().total
    assert 0 < snap.ram_available_bytes <= snap.ram_total_bytes
    assert snap.hostname


def test_no_nvml_means_no_gpus_and_a_reason_not_an_exception():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        has_nvml = False
    else:
        has_nvml = True
        pynvml.nvmlShutdown()
    probe = HardwareProbe()
    snap = probe.snapshot()
    probe.close()
    if has_nvml:
        assert snap.nvml_error is None
        assert all(g.uuid and g.memory_total_bytes > 0 for g in snap.gpus)
    else:
        assert snap.gpus == []
        assert snap.nvml_error and "NVML" in snap.nvml_error


def test_nvml_errors_after_init_do_not_escape(monkeypatch):
    probe = HardwareProbe()
    probe.nvml_error = None  # pretend NVML initialised, then make it fail

    def broken() -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", broken)
    assert probe.snapshot().gpus == []


def test_caps_travel_with_every_snapshot_and_network_rates_are_measured():
    from silentswarm.agent.hardware import limits_from
    from silentswarm.settings import Settings

    settings = Settings.from_env(
        {
            "SWARM_FELLOW_MAX_VRAM_GB": "24",
            "SWARM_FELLOW_MAX_MEMORY_GB": "1.5",
            "SWARM_FELLOW_MAX_NETWORK_MBPS": "100",
        }
    )
    probe = HardwareProbe(limits=limits_from(settings))
    try:
        first, second = probe.snapshot(), probe.snapshot()
    finally:
        probe.close()
    assert second.limits.max_vram_bytes == 24 << 30
    assert second.limits.max_memory_bytes == int(1.5 * (1 << 30))
    assert second.limits.max_network_bytes_per_s == 12_500_000
    assert first.net_sent_bytes_per_s >= 0 and second.net_recv_bytes_per_s >= 0
    assert second.tf_gpu_count is None  # probed only when NVML sees a GPU


def test_cuda_visible_devices_hides_gpus_by_index_or_uuid():
    from silentswarm.agent.hardware import _visible
    from silentswarm.protocol import GpuInfo

    gpu = GpuInfo(
        index=1,
        uuid="GPU-abcdef12-0000",
        name="t",
        memory_total_bytes=1,
        memory_free_bytes=1,
        memory_used_bytes=0,
    )
    assert _visible(gpu, None) and _visible(gpu, "0,1") and _visible(gpu, "GPU-abcdef12")
    assert not _visible(gpu, "0") and not _visible(gpu, "") and not _visible(gpu, "GPU-ffff")


@pytest.mark.integration  # starts TensorFlow in a subprocess
def test_the_tensorflow_probe_runs_tensorflow_in_a_subprocess():
    from silentswarm.agent.hardware import probe_tensorflow_gpus

    count, error = asyncio.run(probe_tensorflow_gpus(timeout=60))
    assert error is None and count is not None and count >= 0
