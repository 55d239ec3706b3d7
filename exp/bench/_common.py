"""Helpers the benchmarks share: the repository on sys.path, medians, target verdicts."""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def verdict(label: str, value: float, target: str, met: bool) -> bool:
    """Print one target line (never fails the run) and return whether it is met."""
    print(f"  target {label}: {value:.3f} ({target}) -> {'met' if met else 'NOT met'}", flush=True)
    return met


def emit(figures: dict[str, Any]) -> None:
    """The benchmark's last line: one JSON object with every figure."""
    print(json.dumps(figures), flush=True)


def load_avg() -> list[float]:
    """The 1, 5 and 15 minute load averages: the machine's other work while a bench runs."""
    return [round(v, 2) for v in os.getloadavg()]


def wire_per_step(events: list[dict[str, Any]]) -> float:
    """Median bytes one training step moves across stage 0's downstream boundary, both
    directions, from its step events (validation's forwards left out; the stages leave the
    link probes' bytes out of what they report)."""
    totals = [
        e["down_bytes_sent"] + e["down_bytes_received"] for e in events if e["event"] == "step"
    ]
    deltas = [b - a for a, b in itertools.pairwise(totals)]
    return median(deltas) if deltas else float(totals[0])
