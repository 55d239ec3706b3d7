"""What a boundary's rounding costs in validation loss, direction by direction, in one process.

An experiment, not a benchmark: the speed model of ``exp/bench/pipeline.py`` split in two
:class:`StageModel` halves in this process, the activations and the gradients between them put
through the wire's own ``quantize``/``dequantize`` (``nearest``) or through the same per-row
absmax with stochastic rounding (``stochastic``: each value rounds up with the probability of
its distance from the lower code, so the rounded tensor is unbiased), through a scale per 32
values instead of per row (``block32``), or through float16 (``fp16``: a perturbation far
smaller than int8's, to tell a codec's cost from any perturbation's). Every arm trains the
same steps on the same data from the same weights; several seeds tell the codec's cost from
the chaos of a training trajectory. One JSON line per arm and a summary.

    python exp/codec_loss.py --arms none/none nearest/nearest nearest/stochastic --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import msgspec
import numpy as np

from silentswarm.agent.pipe.wire import _qmax, dequantize, quantize
from silentswarm.agent.runtime.data import job_dataset, job_val_batches
from silentswarm.agent.runtime.stage_model import StageModel
from silentswarm.agent.runtime.tfsetup import configure_tensorflow
from silentswarm.plan import ModelConfig, TrainConfig, chain_plans

ROUNDINGS = ("none", "fp16", "nearest", "stochastic", "block32")
BLOCK = 32


def stochastic(x: np.ndarray, bits: int, rng: np.random.Generator) -> np.ndarray:
    """Per-row absmax with the wire's scales, rounded stochastically; dequantized."""
    _, scales = quantize(x, bits)
    qmax = _qmax(bits)
    rows = x.reshape(-1, x.shape[-1])
    s = scales.astype(np.float32)[:, None]
    scaled = rows / s
    low = np.floor(scaled)
    q = low + (rng.random(scaled.shape, dtype=np.float32) < (scaled - low))
    np.clip(q, -qmax, qmax, out=q)
    return (q * s).reshape(x.shape).astype(np.float32)


def through(x: np.ndarray, rounding: str, bits: int, rng: np.random.Generator) -> np.ndarray:
    if rounding == "none":
        return x
    if rounding == "fp16":
        return x.astype(np.float16).astype(np.float32)
    if rounding == "block32":  # a scale per 32 values of a row, not one per row
        blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
        return dequantize(*quantize(blocks, bits)).reshape(x.shape)
    if rounding == "nearest":
        return dequantize(*quantize(x, bits))
    return stochastic(x, bits, rng)


def run_arm(model: ModelConfig, train: TrainConfig, fwd: str, bwd: str, bits: int, m: int) -> dict:
    import tensorflow as tf

    plans = chain_plans(
        job_id="codec-loss", model=model, train=train, addresses=[None, "tcp://127.0.0.1:1"]
    )
    first, last = StageModel(plans[0]), StageModel(plans[1])
    data = job_dataset(train, model.seq_len)
    rng = np.random.default_rng(train.seed + 1000)
    started = time.perf_counter()
    losses = []
    for step in range(train.steps):
        x, y = data.next_batch(train.batch_size)
        for xs, ys in zip(np.split(x, m), np.split(y, m), strict=True):
            tokens = tf.constant(xs)
            tape, out = first.tape_forward(tokens, input_grad=False)
            h = tf.constant(through(out.numpy(), fwd, bits, rng))
            dx = last.last_micro(h, tf.constant(ys))
            g = tf.constant(through(dx.numpy(), bwd, bits, rng))
            first.tape_backward(tape, tokens, out, g, input_grad=False)
        losses.append(last.take_loss() / m)
        first.apply(step, m)
        last.apply(step, m)
    val = []
    for vx, vy in job_val_batches(data, train):
        h = through(first.forward(tf.constant(vx), training=False).numpy(), fwd, bits, rng)
        val.append(float(last.forward_loss(tf.constant(h), tf.constant(vy), training=False)))
    return {
        "fwd": fwd,
        "bwd": bwd,
        "seed": train.seed,
        "val_loss": statistics.fmean(val),
        "train_loss_last20": statistics.fmean(losses[-20:]),
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=["none/none", "nearest/nearest"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    configure_tensorflow(intra_op_threads=2)
    if args.quick:
        model = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32)
        base = TrainConfig(steps=4, batch_size=8, max_data_bytes=500_000, val_batches=2)
    else:
        model = ModelConfig(n_layers=4, d_model=256, n_heads=8, seq_len=128)
        base = TrainConfig(steps=args.steps, batch_size=16, warmup_steps=20, val_batches=64)
    base = msgspec.structs.replace(base, learning_rate=args.lr)
    rows = []
    for seed in args.seeds:
        for arm in args.arms:
            fwd, bwd = arm.split("/")
            if fwd not in ROUNDINGS or bwd not in ROUNDINGS:
                sys.exit(f"codec_loss.py: arm {arm!r}: each side is one of {ROUNDINGS}")
            train = msgspec.structs.replace(base, seed=seed)
            row = run_arm(model, train, fwd, bwd, args.bits, args.micro_batches)
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for arm in args.arms:
        fwd, bwd = arm.split("/")
        rel = []
        for seed in args.seeds:
            ref = next(r for r in rows if r["seed"] == seed and r["fwd"] == r["bwd"] == "none")
            got = next(r for r in rows if r["seed"] == seed and (r["fwd"], r["bwd"]) == (fwd, bwd))
            rel.append(got["val_loss"] / ref["val_loss"] - 1.0)
        summary[arm] = {"vs_none": rel, "mean": statistics.fmean(rel)}
    print(json.dumps({"experiment": "codec_loss", "bits": args.bits, "summary": summary}))


if __name__ == "__main__":
    main()
