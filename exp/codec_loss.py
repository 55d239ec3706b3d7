"""What a boundary's rounding costs in validation loss, direction by direction, in one process.

An experiment, not a benchmark: the speed model of ``exp/bench/pipeline.py`` split in two
:class:`StageModel` halves in this process, the activations and the gradients between them put
through one of these roundings (``FWD/BWD`` per arm):

- ``row``: the wire's own ``quantize``/``dequantize``: ``fixed_intN`` as the stages send it
  (per-row absmax, the scale rounded up to bfloat16);
- ``row16``: the same with the scale rounded up to float16 instead (the wire before protocol
  2, whose scales lost their bits when a late step's gradients got small);
- ``row32``: the same with an exact float32 scale;
- ``blockN``: the wire's rounding with a scale per N values of a row instead of per row;
- ``e4m3`` and ``e5m2``: 8-bit floats (ml_dtypes) with a per-row float32 scale that puts the
  row's absmax at the format's largest value: int8's bytes with an error relative to each
  value instead of absolute (measured 2026-12-03: less faithful than int8 on these tensors,
  so not a wire codec);
- ``stochastic``: the wire's per-row scales, each value rounded up with the probability of its
  distance from the lower code (the rounded tensor is unbiased);
- ``fp16``: the wire's ``fp16`` frames (the tensor moved by a power of two into float16's
  normal range, cast, moved back): a perturbation far smaller than int8's, to tell a codec's
  cost from any perturbation's; ``fp16cast``: a plain cast (the wire before protocol 2, which
  left a late step's gradients in float16's subnormals); ``none``: nothing.

Every arm trains the same steps on the same data from the same weights; several seeds tell the
codec's cost from the chaos of a training trajectory. One JSON line per arm and a summary.
``--fidelity BATCHES`` measures without a trajectory: after ``--steps`` unrounded steps, each
arm's gradients of the same batches against the unrounded ones (relative error and cosine per
half, and how much of stage 0's gradient keeps its sign); deterministic.

    python exp/codec_loss.py --arms none/none row/row row16/row16 --seeds 0 1 2
    python exp/codec_loss.py --fidelity 8 --steps 200 --arms fp16/fp16 row/row e4m3/e4m3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import msgspec
import numpy as np

from silentswarm.agent.pipe.wire import (
    _qmax,
    decode_frame,
    dequantize,
    encode_frame,
    parse_wire_codec,
    quantize,
)
from silentswarm.agent.runtime.data import job_dataset, job_val_batches
from silentswarm.agent.runtime.stage_model import StageModel
from silentswarm.agent.runtime.tfsetup import configure_tensorflow
from silentswarm.plan import ModelConfig, TrainConfig, chain_plans

ROUNDINGS = (
    "none",
    "fp16",
    "fp16cast",
    "row",
    "row16",
    "row32",
    "stochastic",
    "blockN",
    "e4m3",
    "e5m2",
)


def rounded(x: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """Per row: ``rint(x / scale)`` clipped to the codes, times the scale."""
    qmax = _qmax(bits)
    rows = x.reshape(-1, x.shape[-1])
    q = np.clip(np.rint(rows / scales[:, None]), -qmax, qmax)
    return (q * scales[:, None]).reshape(x.shape).astype(np.float32)


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


def fp8_rows(x: np.ndarray, kind: str) -> np.ndarray:
    """Per row: scaled so its absmax is the 8-bit float's largest value, cast, scaled back (the
    scale exact): a relative rounding error of at most 2**-4 (e4m3) or 2**-3 (e5m2) per value
    down to the format's subnormals, where int8's error is absolute (absmax / 254)."""
    import ml_dtypes

    dtype = ml_dtypes.float8_e4m3fn if kind == "e4m3" else ml_dtypes.float8_e5m2
    top = np.float32(ml_dtypes.finfo(dtype).max)
    rows = x.reshape(-1, x.shape[-1])
    absmax = np.abs(rows).max(axis=1, keepdims=True)
    scales = np.where(absmax > 0, absmax / top, np.float32(1.0)).astype(np.float32)
    q = (rows / scales).astype(dtype).astype(np.float32)
    return (q * scales).reshape(x.shape).astype(np.float32)


def float16_scales(x: np.ndarray, bits: int) -> np.ndarray:
    """Protocol 1's scales: absmax / qmax clamped to float16's range and rounded up to it."""
    absmax = np.abs(x.reshape(-1, x.shape[-1])).max(axis=1)
    tiny, big = float(np.finfo(np.float16).smallest_subnormal), float(np.finfo(np.float16).max)
    wanted = np.clip(absmax / np.float32(_qmax(bits)), tiny, big).astype(np.float32)
    scales = wanted.astype(np.float16)
    low = scales.astype(np.float32) < wanted
    scales[low] = np.nextafter(scales[low], np.float16(np.inf))
    return scales.astype(np.float32)


def through(x: np.ndarray, rounding: str, bits: int, rng: np.random.Generator) -> np.ndarray:
    if rounding == "none":
        return x
    if rounding == "fp16":
        codec = parse_wire_codec(rounding)
        _, parts = encode_frame(x, codec, job="j", attempt=0, step=0, micro=0, direction="fwd")
        return decode_frame(parts)[1]
    if rounding == "fp16cast":
        return x.astype(np.float16).astype(np.float32)
    if rounding == "stochastic":
        return stochastic(x, bits, rng)
    if rounding == "row16":
        return rounded(x, float16_scales(x, bits), bits)
    if rounding == "row32":
        absmax = np.abs(x.reshape(-1, x.shape[-1])).max(axis=1)
        return rounded(x, np.maximum(absmax / np.float32(_qmax(bits)), 1e-38), bits)
    if rounding in ("e4m3", "e5m2"):
        return fp8_rows(x, rounding)
    if rounding.startswith("block"):  # a row per block of N values: the wire's scale per block
        n = int(rounding.removeprefix("block"))
        blocks = x.reshape(*x.shape[:-1], x.shape[-1] // n, n)
        return dequantize(*quantize(blocks, bits)).reshape(x.shape)
    return dequantize(*quantize(x, bits))


def known(rounding: str) -> bool:
    if rounding.startswith("block"):
        return rounding.removeprefix("block").isdigit() and int(rounding[5:]) > 0
    return rounding in ROUNDINGS


def halves(model: ModelConfig, train: TrainConfig):
    """The two halves, fresh, the job's dataset and the roundings' generator: ``(first, last,
    data, rng)``."""
    plans = chain_plans(
        job_id="codec-loss", model=model, train=train, addresses=[None, "tcp://127.0.0.1:1"]
    )
    first, last = StageModel(plans[0]), StageModel(plans[1])
    data = job_dataset(train, model.seq_len)
    return first, last, data, np.random.default_rng(train.seed + 1000)


def one_batch(first, last, x, y, fwd: str, bwd: str, bits: int, m: int, rng) -> float:
    """Forward and backward of one batch through the roundings, gradients accumulated in both
    halves (not applied); the batch's mean loss."""
    import tensorflow as tf

    for xs, ys in zip(np.split(x, m), np.split(y, m), strict=True):
        tokens = tf.constant(xs)
        tape, out = first.tape_forward(tokens, input_grad=False)
        h = tf.constant(through(out.numpy(), fwd, bits, rng))
        dx = last.last_micro(h, tf.constant(ys))
        g = tf.constant(through(dx.numpy(), bwd, bits, rng))
        first.tape_backward(tape, tokens, out, g, input_grad=False)
    return last.take_loss() / m


def train_steps(first, last, data, train: TrainConfig, fwd: str, bwd: str, bits: int, m: int, rng):
    """``train.steps`` steps of both halves through the roundings; each step's mean loss."""
    losses = []
    for step in range(train.steps):
        x, y = data.next_batch(train.batch_size)
        losses.append(one_batch(first, last, x, y, fwd, bwd, bits, m, rng))
        first.apply(step, m)
        last.apply(step, m)
    return losses


def run_arm(model: ModelConfig, train: TrainConfig, fwd: str, bwd: str, bits: int, m: int) -> dict:
    import tensorflow as tf

    first, last, data, rng = halves(model, train)
    started = time.perf_counter()
    losses = train_steps(first, last, data, train, fwd, bwd, bits, m, rng)
    val, val_exact = [], []
    for vx, vy in job_val_batches(data, train):
        out = first.forward(tf.constant(vx), training=False).numpy()
        for sent, into in ((through(out, fwd, bits, rng), val), (out, val_exact)):
            into.append(
                float(last.forward_loss(tf.constant(sent), tf.constant(vy), training=False))
            )
    return {
        "fwd": fwd,
        "bwd": bwd,
        "seed": train.seed,
        "val_loss": statistics.fmean(val),
        # the same weights, the activations sent unrounded: what training cost, without what
        # rounding at inference costs
        "val_loss_exact_forward": statistics.fmean(val_exact),
        "train_loss_last20": statistics.fmean(losses[-20:]),
        "seconds": round(time.perf_counter() - started, 1),
    }


def sign_agreement(got: np.ndarray, ref: np.ndarray) -> float:
    """The fraction of ``ref``'s magnitude whose sign ``got`` keeps, summed in float64 and
    held to [0, 1]: float32 sums of a subset and of the whole, taken in different orders,
    can otherwise put an exact agreement a rounding above 1."""
    weight = np.abs(ref.astype(np.float64))
    kept = weight[np.sign(got) == np.sign(ref)].sum()
    return float(min(1.0, kept / weight.sum()))


def fidelity(
    model: ModelConfig, train: TrainConfig, arms: list[str], bits: int, m: int, batches: int
) -> dict:
    """What each arm does to one step's gradients, without a trajectory to diverge: the halves
    trained ``train.steps`` steps unrounded, then, on the same ``batches`` batches, each arm's
    accumulated gradients against the unrounded ones (per half: relative L2 error and cosine;
    ``adam_sign_agreement``: the fraction of stage 0's gradient, weighted by magnitude, whose
    sign survives, what Adam's early, sign-like updates follow). Deterministic."""
    first, last, data, rng = halves(model, train)
    train_steps(first, last, data, train, "none", "none", bits, m, rng)
    held = [data.next_batch(train.batch_size) for _ in range(batches)]
    pair = (first, last)

    def grads(fwd: str, bwd: str) -> list[list[np.ndarray]]:
        """Per held batch, each half's accumulated gradient (flat), the accumulators cleared
        after each: nothing is applied."""
        out = []
        for x, y in held:
            one_batch(first, last, x, y, fwd, bwd, bits, m, rng)
            out.append([np.concatenate([a.numpy().ravel() for a in h.accumulators]) for h in pair])
            for h in pair:
                for acc in h.accumulators:
                    acc.assign(np.zeros(acc.shape, np.float32))
        return out

    exact = grads("none", "none")
    result = {}
    for arm in arms:
        fwd, bwd = arm.split("/")
        got = grads(fwd, bwd)
        row: dict[str, float] = {}
        for s in (0, 1):
            ref = [e[s] for e in exact]
            mine = [g[s] for g in got]
            row[f"stage{s}_rel_err"] = statistics.fmean(
                float(np.linalg.norm(g - r) / np.linalg.norm(r))
                for g, r in zip(mine, ref, strict=True)
            )
            row[f"stage{s}_cosine"] = statistics.fmean(
                float(g @ r / (np.linalg.norm(g) * np.linalg.norm(r)))
                for g, r in zip(mine, ref, strict=True)
            )
        row["adam_sign_agreement"] = statistics.fmean(
            sign_agreement(g, r)
            for g, r in zip((g[0] for g in got), (e[0] for e in exact), strict=True)
        )
        result[arm] = row
        print(json.dumps({"arm": arm, **row}), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=["none/none", "nearest/nearest"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--fidelity",
        type=int,
        default=0,
        metavar="BATCHES",
        help="instead of loss runs: each arm's gradients on BATCHES batches after --steps "
        "unrounded steps, against the unrounded gradients (deterministic)",
    )
    args = parser.parse_args()
    configure_tensorflow(intra_op_threads=2)
    if args.quick:
        model = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32)
        # A smoke run of the loss arms compiles nothing (about 24 XLA programs over 3 arms);
        # --fidelity keeps XLA: its unrounded arm must repeat its gradients exactly.
        base = TrainConfig(
            steps=4,
            batch_size=8,
            max_data_bytes=500_000,
            val_batches=2,
            jit_compile=bool(args.fidelity),
        )
    else:
        model = ModelConfig(n_layers=4, d_model=256, n_heads=8, seq_len=128)
        base = TrainConfig(steps=args.steps, batch_size=16, warmup_steps=20, val_batches=64)
    base = msgspec.structs.replace(base, learning_rate=args.lr)
    for arm in args.arms:
        if not all(map(known, arm.split("/"))) or arm.count("/") != 1:
            sys.exit(f"codec_loss.py: arm {arm!r}: FWD/BWD, each side one of {ROUNDINGS}")
    if args.fidelity:
        train = msgspec.structs.replace(base, seed=args.seeds[0])
        by_arm = fidelity(model, train, args.arms, args.bits, args.micro_batches, args.fidelity)
        print(json.dumps({"experiment": "codec_fidelity", "steps": train.steps, "arms": by_arm}))
        return
    rows = []
    for seed in args.seeds:
        for arm in args.arms:
            fwd, bwd = arm.split("/")
            train = msgspec.structs.replace(base, seed=seed)
            row = run_arm(model, train, fwd, bwd, args.bits, args.micro_batches)
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    refs = {r["seed"]: r["val_loss"] for r in rows if r["fwd"] == r["bwd"] == "none"}
    for arm in args.arms:
        got = {r["seed"]: r["val_loss"] for r in rows if f"{r['fwd']}/{r['bwd']}" == arm}
        summary[arm] = {"val_loss": list(got.values())}
        if refs:  # with a none/none arm: each seed against its own
            rel = [got[seed] / refs[seed] - 1.0 for seed in args.seeds]
            summary[arm] |= {"vs_none": rel, "mean": statistics.fmean(rel)}
    print(json.dumps({"experiment": "codec_loss", "bits": args.bits, "summary": summary}))


if __name__ == "__main__":
    main()
