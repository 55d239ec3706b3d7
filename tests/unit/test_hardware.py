"""The real probe on this machine: psutil numbers, and NVML falling back cleanly."""

import psutil
import pynvml

from agent.hardware import HardwareProbe


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
