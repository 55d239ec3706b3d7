"""Pipeline benchmark: speedup of a 2-stage pipeline over one process, and what each
compression spec costs in bytes and in validation loss.

Everything is measured side by side in one invocation (these machines are noisy):

1. Speed: the same model as one process doing m micro-batches with gradient accumulation
   (1 intra-op thread) and as a 2-stage pipeline (2 processes, 1 thread each, loopback
   ZeroMQ). Prints tokens/s of each, the speedup, and the ideal min(p, cores) * m / (m+p-1).
1b. Sweep: 2 and 3 stages against one process at several micro-batch counts m (a 6-block
   model, so 3 stages split it evenly): speedup, ideal and % of ideal for each (p, m). On
   2 cores 3 stages cannot beat 2x; the sweep shows how much of that the bubble and the
   third process's contention leave.
2. Compression: for each spec, a 2-stage run long enough that ``none`` ends at least 30%
   below the corpus's unigram entropy; bytes per step relative to ``none`` (both
   directions, headers and scales included, as counted on the wire) and final validation
   loss.

The last line is one JSON object with every figure.

    python exp/bench/pipeline.py            # the full run (several minutes)
    python exp/bench/pipeline.py --quick    # a smoke run
    python exp/bench/pipeline.py --only sweep
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402

from silentswarm.agent.runtime.data import TextDataset  # noqa: E402
from silentswarm.agent.runtime.launch import done, run_plans  # noqa: E402
from silentswarm.agent.runtime.schedule import ideal_speedup  # noqa: E402
from silentswarm.plan import (  # noqa: E402
    ModelConfig,
    TrainConfig,
    Transport,
    chain_plans,
    single_process_plan,
)
from silentswarm.procs import free_port  # noqa: E402

SPECS = [
    "none",
    "fp16",
    "fixed_int8",
    "fixed_int4",
    "learned_dim{k}",
    "learned_dim{k}_fp16",
    "learned_dim{k}_int8",
]


def pipeline_plans(
    job: str, model: ModelConfig, train: TrainConfig, compression: str = "none", stages: int = 2
):
    return chain_plans(
        job_id=job,
        model=model,
        train=train,
        addresses=[None, *[f"tcp://127.0.0.1:{free_port()}" for _ in range(stages - 1)]],
        compression=compression,
        transport=Transport.P2P,
        intra_op_threads=1,
    )


def speed(work: Path, model: ModelConfig, train: TrainConfig, repeats: int) -> dict[str, Any]:
    single_tps, pipe_tps = [], []
    for r in range(repeats):
        (one,) = run_plans(
            [single_process_plan(job_id=f"speed-one-{r}", model=model, train=train)], work
        )
        single_tps.append(done(one)["tokens_per_s"])
        stages = run_plans(pipeline_plans(f"speed-pipe-{r}", model, train), work)
        pipe_tps.append(min(done(s)["tokens_per_s"] for s in stages))
        print(
            f"  round {r + 1}: one process {single_tps[-1]:8.0f} tok/s, "
            f"2-stage pipeline {pipe_tps[-1]:8.0f} tok/s",
            flush=True,
        )
    single, pipe = statistics.median(single_tps), statistics.median(pipe_tps)
    ideal = ideal_speedup(2, train.micro_batches, os.cpu_count() or 1)
    return {
        "single_tokens_per_s": single,
        "pipeline_tokens_per_s": pipe,
        "speedup": pipe / single,
        "ideal_speedup": ideal,
        "fraction_of_ideal": pipe / single / ideal,
        "micro_batches": train.micro_batches,
    }


def sweep_point(
    work: Path, model: ModelConfig, train: TrainConfig, stages: list[int], tag: str
) -> dict[str, float]:
    """tokens/s of one process and of each pipeline depth, for one micro-batch count."""
    (one,) = run_plans(
        [single_process_plan(job_id=f"sweep-one-{tag}", model=model, train=train)], work
    )
    out = {"single": done(one)["tokens_per_s"]}
    for p in stages:
        events = run_plans(pipeline_plans(f"sweep-p{p}-{tag}", model, train, stages=p), work)
        out[f"p{p}"] = min(done(s)["tokens_per_s"] for s in events)
    return out


def sweep(
    work: Path,
    model: ModelConfig,
    train: TrainConfig,
    stages: list[int],
    micro_batches: list[int],
    repeats: int,
) -> dict[str, Any]:
    """Speedup of each pipeline depth over one process at each m, medians over rounds."""
    cores = os.cpu_count() or 1
    rows: list[dict[str, Any]] = []
    for m in micro_batches:
        config = msgspec.structs.replace(train, micro_batches=m)
        rounds = [sweep_point(work, model, config, stages, f"m{m}-{r}") for r in range(repeats)]
        for p in stages:
            speedup = statistics.median(r[f"p{p}"] / r["single"] for r in rounds)
            ideal = ideal_speedup(p, m, cores)
            rows.append(
                {
                    "stages": p,
                    "micro_batches": m,
                    "single_tokens_per_s": statistics.median(r["single"] for r in rounds),
                    "pipeline_tokens_per_s": statistics.median(r[f"p{p}"] for r in rounds),
                    "speedup": speedup,
                    "ideal_speedup": ideal,
                    "fraction_of_ideal": speedup / ideal,
                }
            )
            print(
                f"  p={p} m={m}: speedup {speedup:.2f}x, ideal {ideal:.2f}x "
                f"-> {100 * speedup / ideal:.0f}% of ideal",
                flush=True,
            )
    return {"cores": cores, "rows": rows}


def compression(
    work: Path, model: ModelConfig, train: TrainConfig, specs: list[str] | None = None
) -> dict[str, Any]:
    entropy = TextDataset(
        train.data, seq_len=model.seq_len, seed=train.seed, max_bytes=train.max_data_bytes
    ).unigram_entropy_nats()
    k = model.d_model // 8
    rows: dict[str, dict[str, Any]] = {}
    for spec in ["none", *[s for s in specs or [t.format(k=k) for t in SPECS] if s != "none"]]:
        stages = run_plans(pipeline_plans(f"c-{spec.replace('_', '-')}", model, train, spec), work)
        first, last = done(stages[0]), done(stages[-1])
        wire = first["down_bytes_sent"] + first["down_bytes_received"]
        rows[spec] = {
            "bytes_per_step": wire / train.steps,
            "val_loss": last["val_loss"],
            "train_loss": last["loss"],
        }
        print(
            f"  {spec:22s} {wire / train.steps / 1024:9.1f} KiB/step  "
            f"val loss {last['val_loss']:.4f}",
            flush=True,
        )
    base = rows["none"]
    for row in rows.values():
        row["bytes_vs_none"] = row["bytes_per_step"] / base["bytes_per_step"]
        row["val_loss_vs_none"] = row["val_loss"] / base["val_loss"] - 1.0
    return {
        "unigram_entropy_nats": entropy,
        "none_below_entropy": 1.0 - base["val_loss"] / entropy,
        "bottleneck_dim": k,
        "specs": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 2, quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="compression run length")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--only", choices=["speed", "sweep", "compression"], default=None)
    parser.add_argument("--specs", nargs="*", default=None, help="compression specs to run")
    parser.add_argument(
        "--compression-layers", type=int, default=2, help="blocks of the compression model"
    )
    args = parser.parse_args()

    if args.quick:
        model = comp_model = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32)
        speed_train = TrainConfig(steps=6, batch_size=8, micro_batches=4, max_data_bytes=500_000)
        comp_steps = args.steps or 6
        sweep_model = ModelConfig(n_layers=3, d_model=64, n_heads=4, seq_len=32)
        sweep_train = TrainConfig(steps=6, batch_size=8, micro_batches=2, max_data_bytes=500_000)
        sweep_m = [4]
        specs = args.specs or ["none", "fixed_int8"]
    else:
        # Speed: the 4-block model of FACTS.md, micro-batches enough to keep the bubble small.
        model = ModelConfig(n_layers=4, d_model=256, n_heads=8, seq_len=128)
        speed_train = TrainConfig(steps=40, batch_size=16, micro_batches=8)
        # Compression: one block per stage at d_model 256; 1500 steps take `none` about a
        # third below the unigram entropy of the full stdlib corpus (measured: 2.11 vs 3.15).
        comp_model = ModelConfig(
            n_layers=args.compression_layers, d_model=256, n_heads=8, seq_len=128
        )
        comp_steps = args.steps or 1500
        # Sweep: 6 blocks split evenly by 2 and by 3 stages; small enough for 9 points.
        sweep_model = ModelConfig(n_layers=6, d_model=128, n_heads=4, seq_len=64)
        sweep_train = TrainConfig(steps=30, batch_size=16, micro_batches=2)
        sweep_m = [2, 4, 8]
        specs = args.specs
    comp_train = TrainConfig(
        steps=comp_steps,
        batch_size=8,
        micro_batches=2,
        learning_rate=3e-3,
        warmup_steps=max(1, comp_steps // 30),
        val_batches=4 if args.quick else 128,  # 1024 windows over the whole validation split
        max_data_bytes=None if not args.quick else 500_000,
    )
    repeats = args.repeats or (1 if args.quick else 2)
    work = args.work or Path(tempfile.mkdtemp(prefix="swarm-bench-"))
    print(f"model {model}\nwork dir {work}", flush=True)
    speed_figures = sweep_figures = comp_figures = {}
    if args.only in (None, "speed"):
        print(
            f"speed: {speed_train.steps} steps, batch {speed_train.batch_size}, "
            f"m={speed_train.micro_batches}",
            flush=True,
        )
        speed_figures = speed(work, model, speed_train, repeats)
        print(
            f"  speedup {speed_figures['speedup']:.2f}x, "
            f"ideal {speed_figures['ideal_speedup']:.2f}x "
            f"-> {100 * speed_figures['fraction_of_ideal']:.0f}% of ideal",
            flush=True,
        )
    if args.only in (None, "sweep"):
        print(
            f"sweep: {sweep_model}, {sweep_train.steps} steps, batch {sweep_train.batch_size}, "
            f"p in (2, 3), m in {tuple(sweep_m)}",
            flush=True,
        )
        sweep_figures = sweep(work, sweep_model, sweep_train, [2, 3], sweep_m, repeats)
    if args.only in (None, "compression"):
        comp_figures = run_compression(work, comp_model, comp_train, specs)
    print(
        json.dumps(
            {
                "bench": "pipeline",
                "quick": args.quick,
                "speed_model": msgspec.to_builtins(model),
                "sweep_model": msgspec.to_builtins(sweep_model),
                "compression_model": msgspec.to_builtins(comp_model),
                "speed": speed_figures,
                "sweep": sweep_figures,
                "compression": comp_figures,
            }
        )
    )


def run_compression(
    work: Path, model: ModelConfig, train: TrainConfig, specs: list[str] | None
) -> dict[str, Any]:
    print(f"compression: {train.steps} steps per spec, 2 stages", flush=True)
    print(f"compression model {model}", flush=True)
    figures = compression(work, model, train, specs)
    print(
        f"  none ends {100 * figures['none_below_entropy']:.0f}% below the unigram "
        f"entropy ({figures['unigram_entropy_nats']:.3f} nats)",
        flush=True,
    )
    for spec, row in figures["specs"].items():
        print(
            f"  {spec:22s} bytes {100 * row['bytes_vs_none']:6.2f}% of none, "
            f"val loss {100 * row['val_loss_vs_none']:+6.2f}% vs none",
            flush=True,
        )
    return figures


if __name__ == "__main__":
    main()
