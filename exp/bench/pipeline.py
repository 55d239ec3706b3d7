"""Pipeline benchmark: speedup of a 2-stage pipeline over one process, and what each
compression spec costs in bytes and in validation loss.

Everything is measured side by side in one invocation (these machines are noisy):

1. Speed: the same model as one process doing m micro-batches with gradient accumulation
   (1 intra-op thread, the fused XLA path) and as a 2-stage pipeline (2 processes, 1 thread
   each, loopback ZeroMQ), and as a 3-stage one beside it. Prints tokens/s of each, the
   speedup, and the ideal min(p, cores) * m / (m+p-1). The formula assumes equal halves and
   no contention, so the run also measures the **ceiling**: every stage's own compute (the
   same StageModel calls, synthetic inputs, no links) run as concurrent processes, each op
   timed, and the 1F1B step period those op times allow (``schedule.step_period``: the
   bubble is in it, the links are not). ``fraction_of_ceiling`` is the pipeline's share of
   that.
1b. Sweep: 2 and 3 stages against one process at several micro-batch counts m (a 6-block
   model, so 3 stages split it evenly): speedup, ideal and % of ideal for each (p, m). On
   2 cores 3 stages cannot beat 2x; the sweep shows how much of that the bubble and the
   third process's contention leave. (``--quick``: one point, the speed arms' own rounds.)
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
from _common import REPO, load_avg  # puts the repo on sys.path

from silentswarm.agent.runtime.data import TextDataset
from silentswarm.agent.runtime.launch import done, run_plans, stage_env
from silentswarm.agent.runtime.schedule import (
    OpTimes,
    ideal_speedup,
    one_f_one_b,
    step_period,
)
from silentswarm.plan import (
    ModelConfig,
    StagePlan,
    TrainConfig,
    Transport,
    chain_plans,
    single_process_plan,
)
from silentswarm.procs import free_port

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


def pipeline_tps(work: Path, job: str, model: ModelConfig, train: TrainConfig, p: int) -> float:
    """Tokens/s of a p-stage pipeline: its slowest stage's steady state."""
    stages = run_plans(pipeline_plans(job, model, train, stages=p), work)
    return min(done(s)["tokens_per_s"] for s in stages)


def speed(
    work: Path, model: ModelConfig, train: TrainConfig, repeats: int, compare_recompute: bool
) -> dict[str, Any]:
    """One process, the 2- and 3-stage pipelines and the 2-stage ceiling, interleaved rounds;
    with ``compare_recompute`` also the 2-stage pipeline with ``recompute`` the other way."""
    arms = ["single", "p2", "p3", "ceiling", *(["p2_other"] if compare_recompute else [])]
    other = msgspec.structs.replace(train, recompute=not train.recompute)
    rounds: list[dict[str, float]] = []
    ceiling_ops: list[list[dict[str, float]]] = []
    for r in range(repeats):
        got: dict[str, float] = {}
        for arm in arms if r % 2 == 0 else arms[::-1]:
            if arm == "single":
                (one,) = run_plans(
                    [single_process_plan(job_id=f"speed-one-{r}", model=model, train=train)], work
                )
                got[arm] = done(one)["tokens_per_s"]
            elif arm == "ceiling":
                got[arm], ops = ceiling(work, f"speed-ceiling-{r}", model, train)
                ceiling_ops.append(ops)
            elif arm == "p2_other":
                got[arm] = pipeline_tps(work, f"speed-{arm}-{r}", model, other, 2)
            else:
                got[arm] = pipeline_tps(work, f"speed-{arm}-{r}", model, train, int(arm[1:]))
        rounds.append(got)
        print(
            f"  round {r + 1}: one process {got['single']:8.0f} tok/s, 2-stage pipeline "
            f"{got['p2']:8.0f} (ceiling {got['ceiling']:8.0f}), 3-stage {got['p3']:8.0f}",
            flush=True,
        )
    cores = os.cpu_count() or 1
    m = train.micro_batches

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    def ratio(a: str, b: str) -> float:
        return statistics.median(r[a] / r[b] for r in rounds)

    ideal, ideal3 = ideal_speedup(2, m, cores), ideal_speedup(3, m, cores)
    figures = {
        "single_tokens_per_s": med("single"),
        "pipeline_tokens_per_s": med("p2"),
        "speedup": ratio("p2", "single"),
        "ideal_speedup": ideal,
        "fraction_of_ideal": ratio("p2", "single") / ideal,
        "ceiling_tokens_per_s": med("ceiling"),
        "fraction_of_ceiling": ratio("p2", "ceiling"),
        "ceiling_speedup": ratio("ceiling", "single"),
        "ceiling_stage_ops_ms": ceiling_ops[len(ceiling_ops) // 2],
        "p3": {
            "pipeline_tokens_per_s": med("p3"),
            "speedup": ratio("p3", "single"),
            "ideal_speedup": ideal3,
            "fraction_of_ideal": ratio("p3", "single") / ideal3,
        },
        "micro_batches": m,
        "in_flight": train.in_flight,  # None: 1F1B's (n_stages - stage)
        "recompute": train.recompute,
        "rounds": repeats,
        "per_round": rounds,
    }
    if compare_recompute:
        on, off = ("p2", "p2_other") if train.recompute else ("p2_other", "p2")
        figures["recompute_vs_tape"] = {
            "recompute_tokens_per_s": med(on),
            "tape_tokens_per_s": med(off),
            "ratio": ratio(on, off),
        }
        print(f"  recompute / tape (2 stages): {ratio(on, off):.3f}", flush=True)
    return figures


def ceiling(
    work: Path, job: str, model: ModelConfig, train: TrainConfig, p: int = 2
) -> tuple[float, list[dict[str, float]]]:
    """Tokens/s the 1F1B schedule allows with each stage's compute measured concurrently.

    Every stage's :func:`compute_child` runs at once, each in its own process with the
    pipeline's thread count, so the op times include two processes' contention on the cores.
    """
    plans = pipeline_plans(job, model, train, stages=p)
    procs = []
    for plan in plans:
        path = work / f"ceiling-{job}-{plan.stage}.json"
        path.write_bytes(msgspec.json.encode(plan))
        argv = [sys.executable, str(Path(__file__).resolve()), "--compute-child", str(path)]
        with open(path.with_suffix(".err"), "wb") as stderr:
            procs.append(
                subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                    env=stage_env({"PYTHONPATH": str(REPO)}),
                )
            )

    def failed(plan: StagePlan) -> RuntimeError:
        err = work / f"ceiling-{job}-{plan.stage}.err"
        return RuntimeError(f"compute child failed:\n{err.read_text()[-3000:]}")

    try:
        # A barrier: the timed steps start together, after every child has compiled and warmed
        # up (one child's XLA compilation would otherwise run beside the other's timed ops).
        for proc, plan in zip(procs, plans, strict=True):
            if proc.stdout.readline().strip() != "ready":
                proc.wait(timeout=60)
                raise failed(plan)
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        times = []
        for proc, plan in zip(procs, plans, strict=True):
            out, _ = proc.communicate(timeout=900)
            if proc.returncode:
                raise failed(plan)
            times.append(OpTimes(**json.loads(out.strip().splitlines()[-1])))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    schedules = [one_f_one_b(s, p, train.micro_batches, train.in_flight) for s in range(p)]
    period = step_period(schedules, times)
    ops = [{k: round(1e3 * v, 3) for k, v in t._asdict().items() if v is not None} for t in times]
    return train.batch_size * model.seq_len / period, ops


def compute_child(plan_path: Path) -> None:
    """One stage's compute without links: the calls :class:`StageRunner` makes, timed.

    Inputs are synthetic (tokens on the first stage, activations and gradients of the
    boundary's shape elsewhere). The first 20% of the steps warm up (compilation included, as
    the runtime leaves them out); then the child prints ``ready`` and waits for a line on
    stdin, so that every child's timed steps run at the same time. Prints
    ``{"forward": s, "backward": s, "apply": s}`` medians per op.
    """
    plan = msgspec.json.decode(plan_path.read_bytes(), type=StagePlan)
    from silentswarm.agent.runtime.tfsetup import configure_tensorflow

    configure_tensorflow(intra_op_threads=plan.intra_op_threads or 1)
    import numpy as np
    import tensorflow as tf

    from silentswarm.agent.runtime.schedule import Op
    from silentswarm.agent.runtime.stage_model import StageModel

    model = StageModel(plan)
    cfg, train = plan.model, plan.train
    m, mb = train.micro_batches, train.batch_size // train.micro_batches
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (mb, cfg.seq_len)).astype(np.int32)
    boundary = rng.standard_normal((mb, cfg.seq_len, cfg.d_model)).astype(np.float32) * 0.1
    spans: dict[str, list[float]] = {"forward": [], "backward": [], "apply": []}
    first_kept = train.steps // 5
    for step in range(train.steps):
        if step == first_kept:
            print("ready", flush=True)
            sys.stdin.readline()
        took: dict[str, list[float]] = {"forward": [], "backward": [], "apply": []}
        model.set_lr(step)
        if plan.is_last:
            for _ in range(m):
                started = time.perf_counter()
                model.last_micro(tf.constant(boundary), tf.constant(tokens)).numpy()
                took["forward"].append(time.perf_counter() - started)
            started = time.perf_counter()
            model.apply_mean(m)
            took["apply"].append(time.perf_counter() - started)
            model.take_loss()
        else:
            inflight = {}
            input_grad = not plan.is_first
            for op, i in one_f_one_b(plan.stage, plan.n_stages, m, plan.train.in_flight):
                started = time.perf_counter()
                if op is Op.FORWARD:
                    x = tf.constant(tokens if plan.is_first else boundary)
                    tape, out = model.tape_forward(x, input_grad=input_grad)
                    out.numpy()
                    inflight[i] = (tape, x, out)
                    took["forward"].append(time.perf_counter() - started)
                else:
                    tape, x, out = inflight.pop(i)
                    g = tf.constant(boundary)
                    dx = model.tape_backward(tape, x, out, g, input_grad=input_grad)
                    if dx is not None:
                        dx.numpy()
                    took["backward"].append(time.perf_counter() - started)
            started = time.perf_counter()
            model.apply_mean(m)
            took["apply"].append(time.perf_counter() - started)
        if step >= first_kept:
            for key, values in took.items():
                spans[key].extend(values)
    print(json.dumps({k: statistics.median(v) if v else 0.0 for k, v in spans.items()}))


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
    measured: tuple[ModelConfig, TrainConfig, list[dict[str, float]]] | None = None,
) -> dict[str, Any]:
    """Speedup of each pipeline depth over one process at each m, medians over rounds.

    ``measured``: the speed arms' model, config and rounds; a point of the same model and
    config takes those rounds instead of running them again (``--quick``: its one point)."""
    cores = os.cpu_count() or 1
    rows: list[dict[str, Any]] = []
    for m in micro_batches:
        config = msgspec.structs.replace(train, micro_batches=m)
        if measured is not None and (measured[0], measured[1]) == (model, config):
            rounds = measured[2]
        else:
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
    return {"cores": cores, "recompute": train.recompute, "rows": rows}


COMPRESSION_RUN_TIMEOUT_S = 3 * 3600.0  # one spec's run


def compression(
    work: Path, model: ModelConfig, train: TrainConfig, specs: list[str] | None = None
) -> dict[str, Any]:
    entropy = TextDataset(
        train.data, seq_len=model.seq_len, seed=train.seed, max_bytes=train.max_data_bytes
    ).unigram_entropy_nats()
    k = model.d_model // 8
    rows: dict[str, dict[str, Any]] = {}
    for spec in ["none", *[s for s in specs or [t.format(k=k) for t in SPECS] if s != "none"]]:
        # 1500 steps of d_model 256 take about 10 minutes on a fast day: no 600 s limit here.
        stages = run_plans(
            pipeline_plans(f"c-{spec.replace('_', '-')}", model, train, spec),
            work,
            timeout=COMPRESSION_RUN_TIMEOUT_S,
        )
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
        "--seed", type=int, default=0, help="the compression runs' seed (weights, data order)"
    )
    parser.add_argument(
        "--compression-layers", type=int, default=2, help="blocks of the compression model"
    )
    parser.add_argument(
        "--sweep-m", type=int, nargs="+", default=None, help="the sweep's micro-batch counts"
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        default=None,
        help="the speed arms' forward window per stage (TrainConfig.in_flight; default 1F1B's)",
    )
    parser.add_argument(
        "--recompute",
        action="store_true",
        help="the speed arms' and the sweep's stages before the last recompute their forward "
        "in the backward (TrainConfig.recompute)",
    )
    parser.add_argument(
        "--compare-recompute",
        action="store_true",
        help="also run the 2-stage pipeline with recompute the other way, in the same rounds "
        "(speed.recompute_vs_tape)",
    )
    parser.add_argument("--compute-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compute_child:
        compute_child(args.compute_child)
        return

    if args.quick:
        model = ModelConfig(n_layers=3, d_model=64, n_heads=4, seq_len=32)  # 3 stages fit
        comp_model = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32)
        speed_train = TrainConfig(
            steps=6,
            batch_size=8,
            micro_batches=4,
            max_data_bytes=500_000,
            in_flight=args.in_flight,
            recompute=args.recompute,
        )
        comp_steps = args.steps or 6
        # the sweep's one point is the speed arms' (sweep() takes their rounds)
        sweep_model, sweep_train = model, speed_train
        sweep_m = [speed_train.micro_batches]
        specs = args.specs or ["none", "fixed_int8"]
    else:
        # Speed: the 4-block model of FACTS.md, micro-batches enough to keep the bubble small.
        model = ModelConfig(n_layers=4, d_model=256, n_heads=8, seq_len=128)
        speed_train = TrainConfig(
            steps=40,
            batch_size=16,
            micro_batches=8,
            in_flight=args.in_flight,
            recompute=args.recompute,
        )
        # Compression: one block per stage at d_model 256; 1500 steps take `none` about a
        # third below the unigram entropy of the full stdlib corpus (measured: 2.11 vs 3.15).
        comp_model = ModelConfig(
            n_layers=args.compression_layers, d_model=256, n_heads=8, seq_len=128
        )
        comp_steps = args.steps or 1500
        # Sweep: 6 blocks split evenly by 2 and by 3 stages; small enough for 9 points.
        sweep_model = ModelConfig(n_layers=6, d_model=128, n_heads=4, seq_len=64)
        sweep_train = TrainConfig(
            steps=30, batch_size=16, micro_batches=2, recompute=args.recompute
        )
        sweep_m = args.sweep_m or [2, 4, 8]
        specs = args.specs
    comp_train = TrainConfig(
        steps=comp_steps,
        batch_size=8,
        micro_batches=2,
        learning_rate=3e-3,
        warmup_steps=max(1, comp_steps // 30),
        val_batches=4 if args.quick else 128,  # 1024 windows over the whole validation split
        max_data_bytes=None if not args.quick else 500_000,
        seed=args.seed,
    )
    repeats = args.repeats or (1 if args.quick else 2)
    work = args.work or Path(tempfile.mkdtemp(prefix="swarm-bench-"))
    print(f"model {model}\nwork dir {work}", flush=True)
    load_start = load_avg()
    speed_figures = sweep_figures = comp_figures = {}
    if args.only in (None, "speed"):
        print(
            f"speed: {speed_train.steps} steps, batch {speed_train.batch_size}, "
            f"m={speed_train.micro_batches}",
            flush=True,
        )
        speed_figures = speed(work, model, speed_train, repeats, args.compare_recompute)
        p3 = speed_figures["p3"]
        print(
            f"  speedup {speed_figures['speedup']:.2f}x, "
            f"ideal {speed_figures['ideal_speedup']:.2f}x "
            f"-> {100 * speed_figures['fraction_of_ideal']:.0f}% of ideal, "
            f"{100 * speed_figures['fraction_of_ceiling']:.0f}% of the ceiling "
            f"({speed_figures['ceiling_speedup']:.2f}x); 3 stages {p3['speedup']:.2f}x "
            f"of ideal {p3['ideal_speedup']:.2f}x -> {100 * p3['fraction_of_ideal']:.0f}%",
            flush=True,
        )
        speed_figures["targets"] = {
            "fraction_of_ideal_ge_0.85": speed_figures["fraction_of_ideal"] >= 0.85,
            "fraction_of_ceiling_ge_0.95": speed_figures["fraction_of_ceiling"] >= 0.95,
        }
    if args.only in (None, "sweep"):
        print(
            f"sweep: {sweep_model}, {sweep_train.steps} steps, batch {sweep_train.batch_size}, "
            f"p in (2, 3), m in {tuple(sweep_m)}",
            flush=True,
        )
        measured = (model, speed_train, speed_figures["per_round"]) if speed_figures else None
        sweep_figures = sweep(
            work, sweep_model, sweep_train, [2, 3], sweep_m, repeats, measured=measured
        )
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
                "cpu_count": os.cpu_count(),
                "load_avg": {
                    "start": load_start,
                    "end": load_avg(),
                },
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
