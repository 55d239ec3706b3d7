"""exp/bench/gpu_check.sh, run here in this environment (``--python``, no offline install).

This machine has no GPU: the script must still run its heartbeat, leader and placement
checks with zero GPUs, pass only with ``--allow-no-gpu``, and leave no process behind. Its
GPU branch, which otherwise runs only on a GPU machine, runs here against a stand-in NVML (a
``pynvml`` module with one fake GPU, first on PYTHONPATH for the script, the leader and the
fellow) and without TensorFlow (a ``tensorflow`` that fails to import, as on that machine).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.helpers import REPO, child_env

pytestmark = pytest.mark.integration

SCRIPT = REPO / "exp" / "bench" / "gpu_check.sh"
FAKE_UUID = "GPU-00000000-1111-2222-3333-444444444444"
GIB = 1024**3

STAND_IN_NVML = f'''
"""A stand-in NVML with one GPU, for a machine without one."""


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801
    pass


NVML_TEMPERATURE_GPU = 0


class _Memory:
    total = 80 * {GIB}
    free = 60 * {GIB}
    used = 20 * {GIB}


class _Util:
    gpu = 7


def nvmlInit():
    pass


def nvmlShutdown():
    pass


def nvmlSystemGetDriverVersion():
    return "stand-in"


def nvmlDeviceGetCount():
    return 1


def nvmlDeviceGetHandleByIndex(index):
    if index != 0:
        raise NVMLError("no such GPU")
    return index


def nvmlDeviceGetMemoryInfo(handle):
    return _Memory()


def nvmlDeviceGetUUID(handle):
    return "{FAKE_UUID}"


def nvmlDeviceGetName(handle):
    return "Stand-in GPU"


def nvmlDeviceGetUtilizationRates(handle):
    return _Util()


def nvmlDeviceGetTemperature(handle, sensor):
    return 40
'''


def run_check(*args: str, pythonpath: Path | None = None) -> tuple[int, dict[str, Any], str]:
    """The script's exit status, its JSON line and its stderr."""
    env = child_env()
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    out = subprocess.run(
        ["bash", str(SCRIPT), "--python", sys.executable, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    lines = out.stdout.strip().splitlines()
    assert lines, f"no output; stderr:\n{out.stderr[-3000:]}"
    return out.returncode, json.loads(lines[-1]), out.stderr


def assert_nothing_left(result: dict[str, Any]) -> None:
    assert result["leftover_pids"] == []
    assert len(result["pids"]) >= 3  # nats-server, leader, fellow
    for pid in result["pids"]:
        with contextlib.suppress(psutil.NoSuchProcess):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"pid {pid} still runs"


def test_without_a_gpu_it_checks_heartbeat_and_placement_and_passes_only_when_allowed():
    rc, result, stderr = run_check("--allow-no-gpu")
    assert rc == 0, f"{result}\n{stderr[-3000:]}"
    assert result["ok"] and result["failures"] == []
    assert result["nvml_ok"] is False and "no NVIDIA driver" in result["nvml_error"]
    assert result["gpus"] == [] and result["leader_gpus"] == []
    assert result["heartbeat_ok"] and result["heartbeats"] >= 2
    assert result["tf_imported_by_services"] == []
    placed = result["placement"]["as_received"]
    assert placed["placed"] and placed["device"] == "cpu" and placed["layers"] == [0, 4]
    assert result["gpu_slots"] == []
    assert 0 < result["seconds"] < 120
    assert_nothing_left(result)

    rc, result, _ = run_check()
    assert rc == 1
    assert not result["ok"] and result["heartbeat_ok"]
    assert any("no GPU verified" in f for f in result["failures"])
    assert_nothing_left(result)


def test_with_a_stand_in_gpu_the_leader_sees_it_and_places_on_it(tmp_path: Path):
    (tmp_path / "pynvml.py").write_text(STAND_IN_NVML)
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text(
        "raise ImportError(\"No module named 'tensorflow' (the GPU machine has none)\")\n"
    )
    rc, result, stderr = run_check(pythonpath=tmp_path)
    assert rc == 0, f"{result}\n{stderr[-3000:]}"
    assert result["nvml_ok"] and result["gpus_match"]
    expected = {
        "index": 0,
        "uuid": FAKE_UUID,
        "name": "Stand-in GPU",
        "total_bytes": 80 * GIB,
        "free_bytes": 60 * GIB,
        "utilization_pct": 7.0,
    }
    assert result["gpus"] == [expected] and result["leader_gpus"] == [expected]
    # No TensorFlow: the fellow's probe fails, the leader offers none of its GPUs and says why.
    assert result["tf_gpu_count"] is None and "tensorflow" in result["tf_probe_error"]
    assert "TensorFlow GPU probe failed" in result["gpu_warning"]
    assert result["placement"]["as_received"]["device"] == "cpu"
    on_gpu = result["placement"]["if_tensorflow_saw_all"]
    assert on_gpu["placed"] and on_gpu["device"] == "gpu"
    assert on_gpu["memory_offered_bytes"] == 60 * GIB and on_gpu["plan_gpu_slots_match"]
    slot = {"gpu_index": 0, "gpu_uuid": FAKE_UUID, "layer_start": 0, "layer_end": 4}
    assert result["gpu_slots"] == [slot]
    assert_nothing_left(result)
