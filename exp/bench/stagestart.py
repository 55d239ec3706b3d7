"""Stage start-up with and without the compile cache (agent/runtime/compilecache.py).

The quickstart's job (its model, ``--stages`` 2 over loopback ZeroMQ, one intra-op thread
each) trains ``--steps`` steps, three ways in each round, one after the other:

- ``off``: ``SWARM_COMPILE_CACHE=off``, every executable compiled;
- ``cold``: an empty cache: compiled, and kept;
- ``warm``: the cache ``cold`` filled: every executable loaded.

For each: seconds from launching the stage processes to the last stage's first step event
(``first_step_s``, what a user waits before training shows) and to both ending (``total_s``);
medians over rounds, ``warm_vs_off`` their ratios. The losses of the three must be the same
bit for bit (``same_losses``).

    python exp/bench/stagestart.py              # 3 rounds
    python exp/bench/stagestart.py --quick      # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import REPO, emit, load_avg, median  # puts the repo on sys.path

from silentswarm.agent.runtime import forkserver
from silentswarm.agent.runtime.launch import run_plans, steps
from silentswarm.plan import ModelConfig, TrainConfig, Transport, chain_plans
from silentswarm.procs import free_port

ARMS = ("off", "cold", "warm")


def quickstart() -> tuple[ModelConfig, dict[str, Any]]:
    spec = json.loads((REPO / "exp" / "configs" / "quickstart.json").read_text())
    return ModelConfig(**spec["model"]), spec


def run_arm(
    work: Path, model: ModelConfig, train: TrainConfig, stages: int, cache: str
) -> dict[str, Any]:
    plans = chain_plans(
        job_id="start",
        model=model,
        train=train,
        addresses=[None, *[f"tcp://127.0.0.1:{free_port()}" for _ in range(stages - 1)]],
        transport=Transport.P2P,
        intra_op_threads=1,
    )
    first: list[float] = []
    start = time.monotonic()

    def on_event(event: dict[str, Any]) -> None:
        if event["event"] == "step" and event["stage"] == len(plans) - 1 and not first:
            first.append(time.monotonic() - start)

    shutil.rmtree(work, ignore_errors=True)
    results = run_plans(plans, work, env={"SWARM_COMPILE_CACHE": cache}, on_event=on_event)
    return {
        "first_step_s": first[0],
        "total_s": time.monotonic() - start,
        "losses": [s["loss"] for s in steps(results[-1])],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: a tiny model, 1 stage, 1 round, 2 steps"
    )
    parser.add_argument("--stages", type=int, default=None, help="pipeline stages (default 2)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 5)")
    args = parser.parse_args()
    # What a user waits is a stage started as a fellow starts it, never one forked from a
    # process that imported TensorFlow already (the test suite's setting). A smoke run times
    # nothing worth reading and keeps the caller's setting: one import, not one per arm.
    if not args.quick:
        os.environ[forkserver.ENV_NAME] = "0"
    rounds = args.rounds or (1 if args.quick else 3)
    stages = args.stages or (1 if args.quick else 2)
    model, spec = quickstart()
    if args.quick:
        model = ModelConfig(vocab_size=256, seq_len=16, n_layers=2, d_model=32, n_heads=2)
    train = TrainConfig(
        steps=args.steps or (2 if args.quick else 5),
        batch_size=spec["batch_size"],
        micro_batches=spec["micro_batches"],
        max_data_bytes=200_000,
        val_batches=2,
        seed=spec["seed"],
    )
    load_start = load_avg()
    per_arm: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="swarm-stagestart-") as tmp:
        base = Path(tmp)
        for r in range(rounds):
            cache = base / f"cache-{r}"
            for arm in ARMS:
                where = "off" if arm == "off" else str(cache)
                got = run_arm(base / "work", model, train, stages, where)
                per_arm[arm].append(got)
                print(
                    f"  round {r + 1} {arm:4s}: first step {got['first_step_s']:5.2f} s, "
                    f"done {got['total_s']:5.2f} s",
                    flush=True,
                )
        cache_bytes = sum(p.stat().st_size for p in cache.glob("*/*.pb"))  # the last round's
    figures: dict[str, Any] = {
        "bench": "stagestart",
        "quick": args.quick,
        "model": {k: getattr(model, k) for k in ("n_layers", "d_model", "n_heads", "seq_len")},
        "stages": stages,
        "steps": train.steps,
        "rounds": rounds,
        "cache_bytes": cache_bytes,
        "cpu_count": os.cpu_count(),
    }
    for arm in ARMS:
        for key in ("first_step_s", "total_s"):
            figures[f"{arm}_{key}"] = round(median([g[key] for g in per_arm[arm]]), 3)
    figures["warm_vs_off"] = {
        key: round(figures[f"warm_{key}"] / figures[f"off_{key}"], 3)
        for key in ("first_step_s", "total_s")
    }
    losses = [g["losses"] for arm in ARMS for g in per_arm[arm]]
    figures["same_losses"] = all(run == losses[0] for run in losses)
    figures["load_avg"] = {"start": load_start, "end": load_avg()}
    emit(figures)


if __name__ == "__main__":
    main()
