"""What the ``overlap`` schedule's one-step-delayed update costs, and what weight prediction buys.

An experiment, not a benchmark: the whole model as one :class:`StageModel` in this process,
trained three ways from the same weights on the same data (each arm a child process, two at a
time):

- ``sync``: the synchronous update (what ``schedule: "1f1b"`` computes);
- ``delay``: the ``overlap`` schedule's update, one step late (PipeDream-2BW:
  ``W[k+1] = W[k] - update(grad at W[k-1])``), with the model's own ``stash`` and
  ``apply_pending``, as the stages run it;
- ``predict``: the same delayed update, but each step's gradient taken at predicted weights
  (SpecTrain-style): the weights minus the step the optimizer would take on its first moment
  alone, ``alpha * m / (sqrt(v) + eps)``, the update that is still outstanding while the step
  runs. The optimizer applies the gradient to the unpredicted weights. Not in the runtime:
  this is where it was measured.

Each delayed arm may also run with a smaller Adam ``beta_1`` (``--beta1s``): a delay acts as
extra momentum (Mitliagkas et al., "Asynchrony begets momentum", 2016), so less explicit
momentum may give back what the delay costs. ``sync`` always runs at Keras's 0.9.

One JSON line per arm (the final validation loss), then a summary of each delayed arm against
``sync`` at the same learning rate and seed.

    python exp/overlap_loss.py --learning-rates 3e-4 1e-3 3e-3 --seeds 0 1
    python exp/overlap_loss.py --learning-rates 1e-3 3e-3 --beta1s 0.9 0.7 0.5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

MODES = ("sync", "delay", "predict")
SYNC_BETA1 = 0.9  # Keras's AdamW default, what the runtime trains with


def run_arm(args: argparse.Namespace) -> dict:
    """One arm in this process (the child's side)."""
    import numpy as np

    from silentswarm.agent.runtime.tfsetup import configure_tensorflow
    from silentswarm.plan import ModelConfig, TrainConfig, single_process_plan

    configure_tensorflow(intra_op_threads=1)
    import tensorflow as tf

    from silentswarm.agent.runtime.data import job_dataset, job_val_batches
    from silentswarm.agent.runtime.stage_model import StageModel

    model_config = ModelConfig(
        n_layers=args.layers, d_model=args.d_model, n_heads=4, seq_len=args.seq_len, dropout=0.0
    )
    train = TrainConfig(
        steps=args.steps,
        batch_size=16,
        micro_batches=2,
        learning_rate=args.lr,
        warmup_steps=min(20, args.steps // 5),
        schedule="overlap",
        val_batches=8,
        seed=args.seed,
        jit_compile=not args.quick,
    )
    plan = single_process_plan(job_id="overlap-loss", model=model_config, train=train)
    model, data, m = StageModel(plan), job_dataset(train, model_config.seq_len), 2
    opt = model.optimizer
    opt.beta_1 = args.beta1  # before the first apply traces it

    def directions():
        for v in model.variables:
            i = opt._get_variable_index(v)  # Keras keeps the moments by variable index
            yield v, opt._momentums[i] / (tf.sqrt(opt._velocities[i]) + opt.epsilon)

    @tf.function(jit_compile=train.jit_compile)
    def shift(c):
        for v, d in directions():
            v.assign_sub(c * d)

    def alpha() -> float:
        """Adam's step size for the next update (its bias corrections included)."""
        t = float(opt.iterations.numpy()) + 1
        lr = float(opt.learning_rate.numpy())
        return lr * (1 - opt.beta_2**t) ** 0.5 / (1 - opt.beta_1**t)

    predicted, held = 0.0, None  # the shift the weights hold now; the step set aside
    for step in range(train.steps):
        x, y = data.next_batch(train.batch_size)
        for xs, ys in zip(np.split(x, m), np.split(y, m), strict=True):
            model.local_micro(tf.constant(xs), tf.constant(ys))
        model.take_loss()
        if args.mode == "sync":
            model.apply(step, m)
            continue
        if held is not None:
            shift(tf.constant(-predicted))  # back to the weights the optimizer updates
            model.set_lr(held)
            model.apply_pending(m)
            predicted = alpha() if args.mode == "predict" else 0.0
            shift(tf.constant(predicted))
        model.stash()
        held = step
    if held is not None:
        shift(tf.constant(-predicted))
        model.set_lr(held)
        model.apply_pending(m)
    losses = [
        float(model.forward_loss(tf.constant(vx), tf.constant(vy), training=False))
        for vx, vy in job_val_batches(data, train)
    ]
    return {
        "mode": args.mode,
        "learning_rate": args.lr,
        "seed": args.seed,
        "beta1": args.beta1,
        "steps": args.steps,
        "val_loss": sum(losses) / len(losses),
    }


def child(args: argparse.Namespace, mode: str, lr: float, seed: int, beta1: float) -> dict:
    command = [
        sys.executable,
        __file__,
        "--arm",
        mode,
        "--lr",
        str(lr),
        "--seed",
        str(seed),
        "--beta1",
        str(beta1),
        "--steps",
        str(args.steps),
        "--layers",
        str(args.layers),
        "--d-model",
        str(args.d_model),
        "--seq-len",
        str(args.seq_len),
        *(["--quick"] if args.quick else []),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        arm = f"{mode} lr {lr} seed {seed} beta1 {beta1}"
        raise SystemExit(f"arm {arm} failed:\n{done.stderr[-3000:]}")
    line = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(line), flush=True)
    return line


def summary(arms: list[dict]) -> dict:
    """Each delayed arm's validation loss against ``sync`` of its rate and seed, and the mean
    over seeds per rate, mode and beta_1."""
    sync = {(a["learning_rate"], a["seed"]): a["val_loss"] for a in arms if a["mode"] == "sync"}
    rows: dict[tuple[float, str, float], list[float]] = {}
    for a in arms:
        ref = sync.get((a["learning_rate"], a["seed"]))
        if a["mode"] != "sync" and ref:
            key = (a["learning_rate"], a["mode"], a["beta1"])
            rows.setdefault(key, []).append(a["val_loss"] / ref - 1)
    return {
        "experiment": "overlap_loss",
        "vs_sync": [
            {
                "learning_rate": lr,
                "mode": mode,
                "beta1": beta1,
                "mean": sum(v) / len(v),
                "per_seed": v,
            }
            for (lr, mode, beta1), v in sorted(rows.items())
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learning-rates", type=float, nargs="+", default=[1e-3])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--beta1s", type=float, nargs="+", default=[SYNC_BETA1], help="the delayed arms' beta_1"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 6 steps, no XLA")
    parser.add_argument("--arm", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--lr", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--beta1", type=float, default=SYNC_BETA1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.layers, args.d_model, args.seq_len = 6, 2, 32, 16
    if args.arm:
        args.mode = args.arm
        print(json.dumps(run_arm(args)), flush=True)
        return
    arms = [
        (mode, lr, seed, beta1)
        for lr in args.learning_rates
        for seed in args.seeds
        for mode in args.modes
        for beta1 in ([SYNC_BETA1] if mode == "sync" else args.beta1s)
    ]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda a: child(args, *a), arms))
    print(json.dumps(summary(results)), flush=True)


if __name__ == "__main__":
    main()
