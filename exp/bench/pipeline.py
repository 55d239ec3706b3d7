"""Pipeline benchmark: speedup of a 2-stage pipeline over one process, and what each
compression spec costs in bytes and in validation loss.

Everything is measured side by side in one invocation (these machines are noisy):

1. Speed: the same model as one process doing m micro-batches with gradient accumulation
   (1 intra-op thread) and as a 2-stage pipeline (2 processes, 1 thread each, loopback
   ZeroMQ). Prints tokens/s of each, the speedup, and the ideal min(p, cores) * m / (m+p-1).
2. Compression: for each spec, a 2-stage run long enough that ``none`` ends at least 30%
   below the corpus's unigram entropy; bytes per step relative to ``none`` (both
   directions, headers and scales included, as counted on the wire) and final validation
   loss.

The last line is one JSON object with every figure.

    python exp/bench/pipeline.py            # the full run (several minutes)
    python exp/bench/pipeline.py --quick    # a smoke run
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

from agent.runtime.data import TextDataset  # noqa: E402
from agent.runtime.launch import done, run_plans  # noqa: E402
from agent.runtime.schedule import ideal_speedup  # noqa: E402
from swarm.plan import (  # noqa: E402
    ModelConfig,
    TrainConfig,
    Transport,
    chain_plans,
    single_process_plan,
)
from swarm.procs import free_port  # noqa: E402

SPECS = [
    "none",
    "fp16",
    "fixed_int8",
    "fixed_int4",
    "learned_dim{k}",
    "learned_dim{k}_fp16",
    "learned_dim{k}_int8",
]


def pipeline_plans(job: str, model: ModelConfig, train: TrainConfig, compression: str = "none"):
    return chain_plans(
        job_id=job,
        model=model,
        train=train,
        addresses=[None, f"tcp://127.0.0.1:{free_port()}"],
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
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="compression run length")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--only", choices=["speed", "compression"], default=None)
    parser.add_argument("--specs", nargs="*", default=None, help="compression specs to run")
    parser.add_argument(
        "--compression-layers", type=int, default=2, help="blocks of the compression model"
    )
    args = parser.parse_args()

    if args.quick:
        model = comp_model = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32)
        speed_train = TrainConfig(steps=6, batch_size=8, micro_batches=4, max_data_bytes=500_000)
        comp_steps = args.steps or 6
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
    comp_train = TrainConfig(
        steps=comp_steps,
        batch_size=8,
        micro_batches=2,
        learning_rate=3e-3,
        warmup_steps=max(1, comp_steps // 30),
        val_batches=128,  # 1024 windows spread over the whole validation split
        max_data_bytes=None if not args.quick else 500_000,
    )
    work = args.work or Path(tempfile.mkdtemp(prefix="swarm-bench-"))
    print(f"model {model}\nwork dir {work}", flush=True)
    print(
        f"speed: {speed_train.steps} steps, batch {speed_train.batch_size}, "
        f"m={speed_train.micro_batches}",
        flush=True,
    )
    speed_figures = (
        speed(work, model, speed_train, args.repeats) if args.only != "compression" else {}
    )
    if speed_figures:
        print(
            f"  speedup {speed_figures['speedup']:.2f}x, "
            f"ideal {speed_figures['ideal_speedup']:.2f}x "
            f"-> {100 * speed_figures['fraction_of_ideal']:.0f}% of ideal",
            flush=True,
        )
    if args.only == "speed":
        print(json.dumps({"speed_model": msgspec.to_builtins(model), "speed": speed_figures}))
        return
    print(f"compression: {comp_steps} steps per spec, 2 stages", flush=True)
    print(f"compression model {comp_model}", flush=True)
    comp_figures = compression(work, comp_model, comp_train, args.specs)
    print(
        f"  none ends {100 * comp_figures['none_below_entropy']:.0f}% below the unigram "
        f"entropy ({comp_figures['unigram_entropy_nats']:.3f} nats)",
        flush=True,
    )
    for spec, row in comp_figures["specs"].items():
        print(
            f"  {spec:22s} bytes {100 * row['bytes_vs_none']:6.2f}% of none, "
            f"val loss {100 * row['val_loss_vs_none']:+6.2f}% vs none",
            flush=True,
        )
    print(
        json.dumps(
            {
                "speed_model": msgspec.to_builtins(model),
                "compression_model": msgspec.to_builtins(comp_model),
                "speed": speed_figures,
                "compression": comp_figures,
            }
        )
    )


if __name__ == "__main__":
    main()
