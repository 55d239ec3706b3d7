"""Run real swarm-stage processes for a chain of plans and collect their JSON lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

from swarm.plan import StagePlan
from tests.helpers import Processes, child_env


def write_plans(plans: list[StagePlan], directory: Path) -> list[Path]:
    paths = []
    for plan in plans:
        path = directory / f"plan-{plan.job_id}-{plan.stage}.json"
        path.write_bytes(msgspec.json.encode(plan))
        paths.append(path)
    return paths


def run_stages(
    procs: Processes, plans: list[StagePlan], directory: Path, *, timeout: float = 240
) -> list[list[dict[str, Any]]]:
    """Start one process per stage (last first), wait for all; return each one's events."""
    started = []
    for path, plan in reversed(list(zip(write_plans(plans, directory), plans, strict=True))):
        out = directory / f"stage-{plan.job_id}-{plan.stage}.out"
        with open(out, "wb") as stdout, open(out.with_suffix(".err"), "wb") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "agent.runtime.main", "--plan", str(path)],
                stdout=stdout,
                stderr=stderr,
                env=child_env(TF_CPP_MIN_LOG_LEVEL="2"),
            )
        procs.started.append(proc)
        started.append((plan.stage, proc, out))
    results: dict[int, list[dict[str, Any]]] = {}
    for stage, proc, out in started:
        code = proc.wait(timeout=timeout)
        events = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        if code != 0:
            err = out.with_suffix(".err").read_text()[-3000:]
            raise AssertionError(f"stage {stage} exited {code}:\n{err}")
        results[stage] = events
    return [results[s] for s in sorted(results)]


def steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "step"]


def done(events: list[dict[str, Any]]) -> dict[str, Any]:
    return next(e for e in events if e["event"] == "done")
