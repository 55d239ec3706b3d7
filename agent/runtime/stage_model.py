"""One stage's slice of the model, its compiled forward, gradient accumulation and optimizer.

The forward is a ``tf.function``; each in-flight micro-batch keeps its own GradientTape
around it, and the backward is ``tape.gradient(outputs, variables, output_gradients=g)``
with the gradient received from the next stage: no recomputation, no eager fallback.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import keras
import tensorflow as tf

from silentswarm.agent.runtime.devices import tf_gpu_index
from silentswarm.agent.runtime.model import Block, Embedding, Head, Projection, token_loss
from silentswarm.agent.runtime.schedule import lr_at
from silentswarm.compression import parse_compression
from silentswarm.plan import StagePlan

log = logging.getLogger(__name__)
NO_DECAY = ["gamma", "beta", "^b$", "^b_", "tok", "pos"]


@dataclass
class Piece:
    device: str | None
    layer: keras.layers.Layer


def layer_devices(plan: StagePlan) -> dict[int, str | None]:
    """Device of each local layer, from the plan's GPU slots.

    GPU slots map to TensorFlow's GPU for the slot's NVML index/UUID (see
    :func:`tf_gpu_index`; CUDA_DEVICE_ORDER=PCI_BUS_ID makes the numberings agree). Without
    GPUs each slot maps to its own logical CPU device, so the placement code runs on
    CPU-only machines too. No slots: let TensorFlow place.
    """
    layers = range(plan.layer_start, plan.layer_end)
    if not plan.gpu_slots:
        return dict.fromkeys(layers)
    gpus = tf.config.list_logical_devices("GPU")
    cpus = tf.config.list_logical_devices("CPU")
    out: dict[int, str | None] = {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    for slot_index, slot in enumerate(plan.gpu_slots):
        tf_index = tf_gpu_index(slot.gpu_index, slot.gpu_uuid, visible) if gpus else None
        if tf_index is not None and tf_index < len(gpus):
            device = gpus[tf_index].name
        else:
            if gpus:
                log.warning(
                    "GPU %s (index %d) is not visible here; its layers run on the CPU",
                    slot.gpu_uuid,
                    slot.gpu_index,
                )
            device = cpus[min(slot_index, len(cpus) - 1)].name
        for layer in range(slot.layer_start, slot.layer_end):
            out[layer] = device
    for layer in layers:
        out.setdefault(layer, None)
    return out


class StageModel:
    def __init__(self, plan: StagePlan) -> None:
        self.plan = plan
        cfg, seed = plan.model, plan.train.seed
        spec = parse_compression(plan.compression, d_model=cfg.d_model)
        devices = layer_devices(plan)
        first_dev = devices.get(plan.layer_start)
        last_dev = devices.get(plan.layer_end - 1, first_dev)
        self.pieces: list[Piece] = []
        k = spec.bottleneck_dim

        def add(device: str | None, make) -> None:
            with tf.device(device):
                self.pieces.append(Piece(device, make()))

        if plan.is_first:
            add(first_dev, lambda: Embedding(cfg, seed, name="embed"))
        elif k:
            add(first_dev, lambda: Projection(k, cfg.d_model, seed, plan.stage - 1, 1, name="up"))
        for layer in range(plan.layer_start, plan.layer_end):
            add(devices[layer], lambda layer=layer: Block(cfg, seed, layer, name=f"block_{layer}"))
        if plan.is_last:
            add(last_dev, lambda: Head(cfg, seed, name="head"))
        elif k:
            add(last_dev, lambda: Projection(cfg.d_model, k, seed, plan.stage, 0, name="down"))
        self.variables: list[tf.Variable] = [
            v for piece in self.pieces for v in piece.layer.trainable_variables
        ]
        self.accumulators = []
        for piece in self.pieces:
            with tf.device(piece.device):
                for v in piece.layer.trainable_variables:
                    self.accumulators.append(tf.Variable(tf.zeros(v.shape), trainable=False))
        train = plan.train
        self.optimizer = keras.optimizers.AdamW(
            learning_rate=train.learning_rate, weight_decay=train.weight_decay
        )
        self.optimizer.exclude_from_weight_decay(var_names=NO_DECAY)
        self.optimizer.build(self.variables)
        # An XLA cluster cannot span devices: compile only a stage that lives on one.
        jit = train.jit_compile and len({p.device for p in self.pieces}) <= 1
        self.forward = tf.function(self._forward, reduce_retracing=True, jit_compile=jit)
        self.forward_loss = tf.function(self._forward_loss, reduce_retracing=True, jit_compile=jit)
        self._accumulate = tf.function(self._accumulate_impl)
        self._apply = tf.function(self._apply_impl, jit_compile=jit)
        # A stage that is the whole model needs no gradient from a peer: its forward,
        # backward and accumulation compile into one call per micro-batch.
        self.local_step = tf.function(self._local_step, reduce_retracing=True, jit_compile=jit)

    def devices(self) -> dict[str, str]:
        """Where each piece's variables actually live, e.g. ``{"block_2": "/job:.../CPU:1"}``."""
        out = {}
        for piece in self.pieces:
            variables = piece.layer.trainable_variables
            if variables:
                out[piece.layer.name] = variables[0].value.device
        return out

    @property
    def n_params(self) -> int:
        return int(sum(v.shape.num_elements() for v in self.variables))

    def _run(self, x, training: bool):
        for piece in self.pieces:
            if isinstance(piece.layer, Head):
                break
            with tf.device(piece.device):
                x = (
                    piece.layer(x, training=training)
                    if isinstance(piece.layer, Block)
                    else (piece.layer(x))
                )
        return x

    def _forward(self, x, training: bool = True):
        """The stage's output activations (stages before the last)."""
        return self._run(x, training)

    def _forward_loss(self, x, targets, training: bool = True):
        """The last stage: mean next-token cross-entropy of this micro-batch."""
        h = self._run(x, training)
        head = self.pieces[-1]
        with tf.device(head.device):
            return token_loss(head.layer(h), targets)

    def _local_step(self, x, targets):
        with tf.GradientTape() as tape:
            loss = self._forward_loss(x, targets, training=True)
        self._accumulate_impl(tape.gradient(loss, self.variables))
        return loss

    def _accumulate_impl(self, grads) -> None:
        for acc, g in zip(self.accumulators, grads, strict=True):
            acc.assign_add(tf.convert_to_tensor(g))  # the embedding's gradient is sparse

    def _apply_impl(self, scale) -> None:
        grads = [acc * scale for acc in self.accumulators]
        self.optimizer.apply_gradients(zip(grads, self.variables, strict=True))
        for acc in self.accumulators:
            acc.assign(tf.zeros_like(acc))

    def accumulate(self, grads: list[tf.Tensor]) -> None:
        self._accumulate(grads)

    def apply(self, step: int, micro_batches: int) -> float:
        """One optimizer step on the mean of the accumulated micro-batch gradients."""
        train = self.plan.train
        lr = lr_at(
            step,
            base=train.learning_rate,
            warmup=train.warmup_steps,
            total=train.steps,
            min_ratio=train.min_lr_ratio,
        )
        self.optimizer.learning_rate.assign(lr)
        self._apply(tf.constant(1.0 / micro_batches, tf.float32))
        return lr
