"""One stage's slice of the model, its compiled forward, gradient accumulation and optimizer.

How each kind of stage runs a micro-batch (the choice measured, see docs/performance.md):

- The last stage needs no gradient from a peer, so forward, loss, backward (to its
  variables and to its input), gradient accumulation and the running loss sum are one
  compiled XLA call (:meth:`StageModel.last_micro`). The optimizer step stays a call of its
  own, after the last input gradient has gone upstream, so it overlaps the upstream stage's
  last backward instead of delaying it. A stage that is the whole model is the same with no
  input gradient (:meth:`StageModel.local_micro`); with one micro-batch per step it needs no
  accumulators at all, and forward, backward and the optimizer step are one call
  (:meth:`StageModel.local_step`), a plain training loop's step.
- The other stages keep a GradientTape around their compiled forward for each micro-batch in
  flight; the backward is ``tape.gradient(outputs, variables, output_gradients=g)`` with the
  gradient received from the next stage. With ``recompute`` they keep no tape: the backward
  runs the forward again inside one compiled call with that gradient and the accumulation
  (:meth:`StageModel.recompute_backward`), so a micro-batch in flight holds only its input.
  Which is faster depends on the machine and the micro-batch (docs/performance.md); choosing
  per run is not built yet.

The loss is summed on the device and read once per step (:meth:`StageModel.take_loss`), not
once per micro-batch.

Under the ``overlap`` schedule a step's accumulated gradient is set aside
(:meth:`StageModel.stash`) into a second set of variables, so the next step accumulates while
the update waits (:meth:`StageModel.apply_pending`, when
:class:`~silentswarm.agent.runtime.schedule.DelayedUpdates` says).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from silentswarm.agent.runtime.checkpoint import is_adapter_variable
from silentswarm.agent.runtime.devices import tf_gpu_index
from silentswarm.agent.runtime.model import (
    BLOCKS,
    HEADS,
    POLICIES,
    Projection,
    block,
    embedding,
    head,
    token_loss,
)
from silentswarm.agent.runtime.replicas import ROW
from silentswarm.agent.runtime.schedule import lr_at
from silentswarm.agent.runtime.tfsetup import graph_function
from silentswarm.compression import parse_compression
from silentswarm.plan import StagePlan

log = logging.getLogger(__name__)
NO_DECAY = ["gamma", "beta", "^b$", "^b_", "tok", "pos", "scale"]


@dataclass
class Piece:
    device: str | None
    layer: keras.layers.Layer
    # The model layer it sits at: a block's own; the embedding or an "up" projection the
    # stage's first, the head or a "down" projection its last (which ring of the replicas
    # keeps it in sync: silentswarm.rings).
    at: int = 0


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


def _zeros_like(variables: list[tf.Variable]) -> list[tf.Variable]:
    """A zero variable beside each of ``variables``, on its device."""
    out = []
    for v in variables:
        with tf.device(v.device):
            out.append(tf.Variable(tf.zeros(v.shape), trainable=False))
    return out


def freeze_all_but_adapters(layers: list[Any]) -> None:
    """Make every trainable variable of ``layers`` but the LoRA adapters' non-trainable."""
    for layer in layers:
        for v in layer.trainable_variables:
            if not is_adapter_variable(v):
                v.trainable = False


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

        def add(device: str | None, make, at: int) -> None:
            with tf.device(device):
                self.pieces.append(Piece(device, make(), at))

        dtype = POLICIES[plan.train.precision]
        if plan.is_first:
            add(first_dev, lambda: embedding(cfg, seed, dtype=dtype), plan.layer_start)
        elif k:
            add(
                first_dev,
                lambda: Projection(k, cfg.d_model, seed, plan.stage - 1, 1, name="up", dtype=dtype),
                plan.layer_start,
            )
        for layer in range(plan.layer_start, plan.layer_end):
            add(
                devices[layer],
                lambda layer=layer: block(
                    cfg, seed, layer, f"block_{layer}", dtype=dtype, adapter=plan.train.adapter
                ),
                layer,
            )
        if plan.is_last:
            add(last_dev, lambda: head(cfg, seed, dtype=dtype), plan.layer_end - 1)
        elif k:
            add(
                last_dev,
                lambda: Projection(cfg.d_model, k, seed, plan.stage, 0, name="down", dtype=dtype),
                plan.layer_end - 1,
            )
        if plan.train.adapter is not None:  # only the adapter learns: the rest is frozen
            freeze_all_but_adapters([piece.layer for piece in self.pieces])
        self.variables: list[tf.Variable] = [
            v for piece in self.pieces for v in piece.layer.trainable_variables
        ]
        self.accumulators = []
        for piece in self.pieces:
            with tf.device(piece.device):
                for v in piece.layer.trainable_variables:
                    self.accumulators.append(tf.Variable(tf.zeros(v.shape), trainable=False))
        # The gradient set aside for a delayed update (the overlap schedule only).
        self.pending: list[tf.Variable] = (
            _zeros_like(self.accumulators) if plan.train.overlap else []
        )
        # DiLoCo (replicas, sync "diloco"): the weights at the last outer step (the anchor)
        # and the outer optimizer's momentum, one beside each variable; checkpointed.
        diloco = plan.replicated and plan.train.sync == "diloco"
        self.anchor: list[tf.Variable] = _zeros_like(self.accumulators) if diloco else []
        self.outer_momentum: list[tf.Variable] = _zeros_like(self.accumulators) if diloco else []
        train = plan.train
        self.optimizer = keras.optimizers.AdamW(
            learning_rate=train.learning_rate, weight_decay=train.weight_decay
        )
        self.optimizer.exclude_from_weight_decay(var_names=NO_DECAY)
        self.optimizer.build(self.variables)
        self.loss_sum = tf.Variable(0.0, trainable=False, name="loss_sum")
        # An XLA cluster cannot span devices: compile only a stage that lives on one.
        jit = train.jit_compile and len({p.device for p in self.pieces}) <= 1

        def compiled(fn):
            return graph_function(fn, reduce_retracing=True, jit_compile=jit)

        self.forward = compiled(self._forward)
        self.forward_loss = compiled(self._forward_loss)
        self._accumulate = graph_function(self._accumulate_impl)
        self._apply = graph_function(self._apply_impl, jit_compile=jit)
        self._apply_pending = graph_function(self._apply_pending_impl, jit_compile=jit)
        self._stash = graph_function(self._stash_impl)
        self._packed = graph_function(self._packed_impl, jit_compile=jit)
        self._set_packed = graph_function(self._set_packed_impl, jit_compile=jit)
        # Each is one XLA compilation (seconds): a run traces only those its plan uses.
        self.local_micro = compiled(self._local_micro)
        self.local_step = compiled(self._local_step)
        self.last_micro = compiled(self._last_micro)
        self.recompute_backward = compiled(self._recompute_backward)
        self.input_grad = compiled(self._input_grad)

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
            if isinstance(piece.layer, HEADS):
                break
            with tf.device(piece.device):
                x = (
                    piece.layer(x, training=training)
                    if isinstance(piece.layer, BLOCKS)
                    else (piece.layer(x))
                )
        return x

    def _forward(self, x, training: bool = True):
        """The stage's output activations (stages before the last), float32 whatever the
        compute dtype: what the wire's codecs take."""
        return tf.cast(self._run(x, training), tf.float32)

    def _forward_loss(self, x, targets, training: bool = True):
        """The last stage: mean next-token cross-entropy of this micro-batch."""
        h = self._run(x, training)
        head = self.pieces[-1]
        with tf.device(head.device):
            return token_loss(head.layer(h), targets)

    @staticmethod
    def _taped(forward, x, input_grad: bool):
        """``forward(x)`` under a tape of its own (``input_grad``: watching ``x`` too)."""
        with tf.GradientTape() as tape:
            if input_grad:
                tape.watch(x)
            out = forward(x)
        return tape, out

    def _gradients(self, tape, x, out, input_grad: bool, received=None):
        """The variables' gradients of ``out`` (``received``: its own gradient, from the next
        stage), and the input's (None without ``input_grad``)."""
        sources = [*self.variables, x] if input_grad else self.variables
        grads = tape.gradient(out, sources, output_gradients=received)
        n_vars = len(self.variables)
        return grads[:n_vars], (grads[n_vars] if input_grad else None)

    def _loss_grads(self, x, targets, *, input_grad: bool):
        """This micro-batch's loss (added to the running sum), the variables' gradients and
        the input's (None without ``input_grad``); the last stage."""
        tape, loss = self._taped(
            lambda v: self._forward_loss(v, targets, training=True), x, input_grad
        )
        grads, dx = self._gradients(tape, x, loss, input_grad)
        self.loss_sum.assign_add(loss)
        return grads, dx

    def _local_micro(self, x, targets) -> None:
        grads, _ = self._loss_grads(x, targets, input_grad=False)
        self._accumulate_impl(grads)

    def _local_step(self, x, targets) -> None:
        """A whole step of one micro-batch: the optimizer applies the gradients themselves."""
        grads, _ = self._loss_grads(x, targets, input_grad=False)
        self._apply_impl(tf.constant(1.0), grads)

    def _last_micro(self, x, targets):
        """Forward, loss, backward and accumulation; returns the gradient for upstream."""
        grads, dx = self._loss_grads(x, targets, input_grad=True)
        self._accumulate_impl(grads)
        return dx

    def _input_grad(self, x, targets):
        """The last stage: the gradient of this micro-batch's loss for its input alone, what
        upstream waits for (XLA leaves out the weights' gradients, about a third of the
        whole call); the loss is not added to the running sum. Its weights' pass is
        :meth:`last_micro` later (deferred weight gradients)."""
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = self._forward_loss(x, targets, training=True)
        return tape.gradient(loss, x)

    def _recompute_backward(self, x, received, input_grad: bool):
        """``recompute``: the forward again, its backward with the next stage's gradient, the
        variables' gradients accumulated; the input's gradient (None without ``input_grad``)."""
        tape, out = self._taped(self._forward, x, input_grad)
        grads, dx = self._gradients(tape, x, out, input_grad, received)
        self._accumulate_impl(grads)
        return dx

    def _accumulate_impl(self, grads) -> None:
        for acc, g in zip(self.accumulators, grads, strict=True):
            acc.assign_add(tf.convert_to_tensor(g))  # the embedding's gradient is sparse

    def _apply_impl(self, scale, grads=None) -> None:
        """The optimizer step on the accumulated gradients times ``scale``, and the
        accumulators start again from zero; or, given ``grads`` (a step of one micro-batch,
        nothing accumulated), on those, and the accumulators are neither read nor cleared."""
        if grads is None:
            totals = [acc * scale for acc in self.accumulators]
        else:  # dense, as accumulation makes them (the embedding's gradient is sparse)
            totals = [tf.convert_to_tensor(g) * scale for g in grads]
        self.optimizer.apply_gradients(zip(totals, self.variables, strict=True))
        if grads is None:
            for acc in self.accumulators:
                acc.assign(tf.zeros_like(acc))

    def _apply_pending_impl(self, scale) -> None:
        totals = [p * scale for p in self.pending]
        self.optimizer.apply_gradients(zip(totals, self.variables, strict=True))

    def _stash_impl(self) -> None:
        for pending, acc in zip(self.pending, self.accumulators, strict=True):
            pending.assign(acc)
            acc.assign(tf.zeros_like(acc))

    def stash(self) -> None:
        """Set the accumulated gradient aside for a delayed update; accumulate from zero."""
        self._stash()

    def apply_pending(self, micro_batches: int) -> None:
        """One optimizer step on the mean of the gradient set aside (``micro_batches`` of
        them summed), at the learning rate :meth:`set_lr` set."""
        self._apply_pending(tf.constant(1.0 / micro_batches, tf.float32))

    def accumulate(self, grads: list[tf.Tensor]) -> None:
        self._accumulate(grads)

    def tape_forward(
        self, x: tf.Tensor, *, input_grad: bool
    ) -> tuple[tf.GradientTape | None, tf.Tensor]:
        """A stage before the last: the compiled forward under a tape of its own, kept until
        :meth:`tape_backward` (``input_grad``: the tape watches the input too); with
        ``recompute``, no tape (None): the backward runs the forward again."""
        if self.plan.train.recompute:
            return None, self.forward(x)
        return self._taped(self.forward, x, input_grad)

    def tape_backward(
        self,
        tape: tf.GradientTape | None,
        x: tf.Tensor,
        out: tf.Tensor,
        received: tf.Tensor,
        *,
        input_grad: bool,
    ) -> tf.Tensor | None:
        """The backward of :meth:`tape_forward` with the next stage's gradient: the variables'
        gradients accumulated, the input's returned (None without ``input_grad``). Without a
        tape (``recompute``), forward again, backward and accumulation in one compiled call."""
        if tape is None:
            return self.recompute_backward(x, received, input_grad)
        grads, dx = self._gradients(tape, x, out, input_grad, received)
        self.accumulate(grads)
        return dx

    def reset_anchor(self) -> None:
        """DiLoCo: the weights as they are now become the anchor (a run's start)."""
        for anchor, v in zip(self.anchor, self.variables, strict=False):  # none: not DiLoCo
            anchor.assign(v)

    def _packed_impl(self, scale):
        parts = []
        for acc in self.accumulators:
            flat = tf.reshape(acc, [-1]) * scale
            pad = -flat.shape[0] % ROW
            parts.append(tf.pad(flat, [[0, pad]]) if pad else flat)
        return tf.reshape(tf.concat(parts, 0), [-1, ROW])

    def _set_packed_impl(self, matrix):
        flat = tf.reshape(matrix, [-1])
        start = 0
        for acc in self.accumulators:
            n = acc.shape.num_elements()
            acc.assign(tf.reshape(flat[start : start + n], acc.shape))
            start += -(-n // ROW) * ROW

    def accumulated_packed(self, scale: float) -> np.ndarray:
        """The accumulated gradients times ``scale`` as one float32 matrix laid out as
        :func:`~silentswarm.agent.runtime.replicas.pack` lays them out: built in one compiled
        call, not a numpy copy per array (a replica's allreduce sends it every step)."""
        return self._packed(tf.constant(scale, tf.float32)).numpy()

    def set_accumulated_packed(self, matrix: np.ndarray) -> None:
        """Replace the accumulated gradients with the arrays of a :meth:`accumulated_packed`
        matrix (the replicas' average), in one compiled call."""
        self._set_packed(tf.convert_to_tensor(matrix, tf.float32))

    def weights(self) -> list[np.ndarray]:
        """The trainable variables' values, as numpy."""
        return [v.numpy() for v in self.variables]

    def lr_of(self, step: int) -> float:
        """The learning rate of ``step``'s update."""
        train = self.plan.train
        return lr_at(
            step,
            base=train.learning_rate,
            warmup=train.warmup_steps,
            total=train.steps,
            min_ratio=train.min_lr_ratio,
        )

    def set_lr(self, step: int) -> float:
        """The learning rate of ``step``, set on the optimizer before its apply."""
        lr = self.lr_of(step)
        self.optimizer.learning_rate.assign(lr)
        return lr

    def apply_mean(self, micro_batches: int) -> None:
        """One optimizer step on the mean of the accumulated micro-batch gradients, at the
        learning rate :meth:`set_lr` set."""
        self._apply(tf.constant(1.0 / micro_batches, tf.float32))

    def apply(self, step: int, micro_batches: int) -> float:
        """:meth:`apply_mean` at ``step``'s learning rate; the rate, returned."""
        lr = self.set_lr(step)
        self.apply_mean(micro_batches)
        return lr

    def take_loss(self) -> float:
        """The loss summed since the last call (one read per step), and a fresh sum."""
        total = float(self.loss_sum.numpy())
        self.loss_sum.assign(0.0)
        return total
