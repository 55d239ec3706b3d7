"""CPU budget benchmark: a fellow's threads sized by its quota against the host's cores.

A fellow in a container's CPU quota used to run as many TensorFlow threads as its host has
cores; it now runs its budget (silentswarm.cpus: the affinity mask capped by the quota,
rounded up). For each quota in ``--shares`` (a cgroup v1 CPU group, exp/bench/cpuquota.py),
the agent's own compute-speed probe (one standard transformer block, forward and backward)
runs with the host's threads and with the budget's (and, where the quota is not whole, with
the quota rounded down: ``budget_over_floor``), in ``--rounds`` rounds whose order
alternates; ``budget_over_host`` is the median of the per-round ratios. On a host with few
cores the overdraft is small (2 threads in a 0.5-core quota); on a many-core host it is
what the ratio grows with.

    python exp/bench/cpu_budget.py                      # quotas 0.5, 1 and 1.5 cores
    python exp/bench/cpu_budget.py --quick              # a smoke run: quota 0.5, one round

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import time
from typing import Any

from _common import emit, load_avg  # puts the repo on sys.path
from cpuquota import cpu_quota

from silentswarm.agent.hardware import probe_compute_speed
from silentswarm.cpus import budget


def probe(threads: int, prefix: list[str], seconds: float) -> float:
    speed, error = asyncio.run(
        probe_compute_speed(threads=threads, prefix=prefix, seconds=seconds, key="wall_clock_speed")
    )
    if speed is None:
        raise SystemExit(f"the probe failed: {error}")
    return speed


def arm(share: float, rounds: int, seconds: float) -> dict[str, Any]:
    host = os.cpu_count() or 1
    threads = {"host": host, "budget": budget(host, host, share).cores}
    if 1 <= math.floor(share) < threads["budget"]:
        threads["floor"] = math.floor(share)  # the quota rounded down, for the rounding's sake
    why: list[str] = []
    per_round: list[dict[str, float]] = []
    with cpu_quota(share, why=why) as prefix:
        if prefix is None:
            raise SystemExit(why[0])
        for r in range(rounds):
            order = list(threads) if r % 2 == 0 else list(threads)[::-1]
            got = {name: probe(threads[name], prefix, seconds) for name in order}
            print(
                f"  quota {share:g}: round {r + 1}: "
                + ", ".join(f"{name} {threads[name]} threads {got[name]:.2f}" for name in threads)
                + " blocks/s",
                flush=True,
            )
            per_round.append(got)
    figures: dict[str, Any] = {
        "quota_cores": share,
        "host_threads": threads["host"],
        "budget_threads": threads["budget"],
        "host_threads_speed": statistics.median(r["host"] for r in per_round),
        "budget_threads_speed": statistics.median(r["budget"] for r in per_round),
        "budget_over_host": statistics.median(r["budget"] / r["host"] for r in per_round),
        "per_round": per_round,
    }
    if "floor" in threads:
        figures["floor_threads"] = threads["floor"]
        figures["floor_threads_speed"] = statistics.median(r["floor"] for r in per_round)
        ratios = [r["budget"] / r["floor"] for r in per_round]
        figures["budget_over_floor"] = statistics.median(ratios)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.5, 1.0, 1.5])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0, help="each probe's timed passes")
    parser.add_argument("--quick", action="store_true", help="quota 0.5, one short round")
    args = parser.parse_args()
    if args.quick:
        args.shares, args.rounds, args.seconds = [0.5], 1, 0.5
    started, load = time.time(), load_avg()
    arms = [arm(share, args.rounds, args.seconds) for share in args.shares]
    emit(
        {
            "bench": "cpu_budget",
            "quick": args.quick,
            "arms": arms,
            "host_cores": os.cpu_count(),
            "rounds": args.rounds,
            "probe_seconds": args.seconds,
            "load_avg": load,
            "seconds": round(time.time() - started, 1),
        }
    )


if __name__ == "__main__":
    main()
