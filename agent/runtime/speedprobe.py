"""``python -m silentswarm.agent.runtime.speedprobe``: the fellow's compute speed, as JSON.

Trains one standard transformer block (gpt2, d_model 256, seq 128, batch 8, fp32: the
unit of :data:`silentswarm.protocol.ComputeSpeed`), forward and backward through a compiled
step, on the device a stage would train on (TensorFlow's default: the first GPU it sees,
else the CPU), for about ``--seconds`` after two warm-up passes, and prints
``{"compute_speed": passes per second, "wall_clock_speed": ...}``: the first over the
seconds it ran, the second over the wall clock. They differ under a CPU quota (a
container's limit), which holds the process back for part of every period: the fellow
reports its quota beside the first (``HardwareSnapshot.cpu_quota``) and placement models
the quota's stalls itself (silentswarm.leader.balance). The agent runs it once at start
in a subprocess (it never imports TensorFlow itself), bounded by a timeout; the leader's
``balanced`` partition splits layers by it until the fellow's own stages have measured
better.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from silentswarm.cpus import ThrottleClock, usable_cores
from silentswarm.plan import ModelConfig
from silentswarm.protocol import (
    SPEED_UNIT_BATCH,
    SPEED_UNIT_D_MODEL,
    SPEED_UNIT_HEADS,
    SPEED_UNIT_SEQ_LEN,
)

STANDARD = ModelConfig(
    d_model=SPEED_UNIT_D_MODEL, seq_len=SPEED_UNIT_SEQ_LEN, n_heads=SPEED_UNIT_HEADS, n_layers=1
)
BATCH = SPEED_UNIT_BATCH
WARMUP_PASSES = 2
MAX_PASSES = 200


def measure(seconds: float, threads: int | None) -> tuple[float, float]:
    """Passes per second of the standard block's training step: while it ran (the seconds a
    CPU quota held the process back left out), and over the wall clock."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    from silentswarm.agent.runtime.model import block
    from silentswarm.agent.runtime.tfsetup import graph_function

    layer = block(STANDARD, job_seed=0, layer=0, name="probe")
    x = tf.random.stateless_normal((BATCH, STANDARD.seq_len, STANDARD.d_model), seed=(1, 2))
    layer(x)  # build

    @graph_function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(layer(x, training=True)))
        grads = tape.gradient(loss, layer.trainable_variables)
        return loss + tf.add_n([tf.reduce_sum(g) for g in grads])

    for _ in range(WARMUP_PASSES):
        step(x).numpy()
    throttle = ThrottleClock(threads or usable_cores())
    passes, start, mark = 0, time.perf_counter(), throttle.read()
    while passes < MAX_PASSES:
        step(x).numpy()
        passes += 1
        if time.perf_counter() - start >= seconds:
            break
    elapsed, held = time.perf_counter() - start, throttle.held(mark)
    return passes / max(elapsed - held, elapsed * 0.01), passes / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="timed passes for about this")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads")
    args = parser.parse_args()
    speed, wall = measure(max(0.1, args.seconds), args.threads)
    print(json.dumps({"compute_speed": round(speed, 4), "wall_clock_speed": round(wall, 4)}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
