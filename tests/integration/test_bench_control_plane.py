"""The control-plane bench runs end to end (--quick) and ends with its JSON line of figures.

Only that the figures exist and are positive is checked, never the targets: those depend on
the machine, and the bench reports them without failing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, child_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
FIGURES = ("fellows", "leader_cpu_pct", "visibility_p99_s", "api_p99_ms")


def test_the_quick_bench_ends_with_positive_figures_as_json():
    result = subprocess.run(
        [sys.executable, str(REPO / "exp" / "bench" / "control_plane.py"), "--quick"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bench"] == "control_plane"
    (run,) = report["runs"]
    for key in FIGURES:
        value = run[key]
        assert isinstance(value, int | float) and value > 0, (key, value)
