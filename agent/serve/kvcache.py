"""The model's steppers: next-token logits for several sequences at once, each in a slot.

:class:`CachedStepper` keeps a KV cache: per block, the keys and values of every slot's
positions (``(slots, seq_len, kv_heads, head_dim)`` variables). :meth:`~CachedStepper.start`
runs a prompt through the model once (padded to the window, so one trace serves every
prompt) and caches its positions; :meth:`~CachedStepper.step` runs one new token of each
given slot at that slot's next position: the new keys and values are written into the cache,
then each query attends to its slot's cached positions up to its own. A token so costs one
position, not the window.

:class:`WindowStepper` is the same interface without a cache: every step runs each
sequence's whole window (``agent/runtime/generate.py``'s way), which is what the cache is
measured against (``exp/bench/serve.py``) and checked against (token for token).

A sequence holds at most ``seq_len`` tokens (the positions the model was trained on): the
server refuses a request whose prompt and ``max_tokens`` do not fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import tensorflow as tf

from silentswarm.agent.runtime.model import shared_heads
from silentswarm.agent.runtime.tfsetup import graph_function


class Stepper(Protocol):
    slots: int
    seq_len: int

    def start(self, slot: int, ids: Sequence[int]) -> np.ndarray:
        """Logits (vocab,) of the token after ``ids``; the slot now holds that sequence."""

    def step(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> Any:
        """Logits (len(slots), vocab): each slot's ``token`` put at ``position`` (its
        sequence's length so far), the logits of the token after it."""


def cached_attention(q, keys, values, positions):
    """Attention of new queries ``q`` (batch, new, heads, head_dim) at ``positions``
    (batch, new) on cached ``keys``/``values`` (batch, seq_len, heads, head_dim): each on the
    positions up to its own (the later ones hold stale or padding entries)."""
    batch, heads, head_dim = tf.shape(q)[0], q.shape[2], q.shape[3]
    seq_len = tf.shape(keys)[1]
    q, keys, values = (tf.transpose(t, [0, 2, 1, 3]) for t in (q, keys, values))
    scores = tf.matmul(q, keys, transpose_b=True) * (1.0 / math.sqrt(head_dim))
    visible = tf.range(seq_len)[tf.newaxis, tf.newaxis, :] <= positions[:, :, tf.newaxis]
    scores = scores + (1.0 - tf.cast(visible, scores.dtype))[:, tf.newaxis] * -1e9
    att = tf.matmul(tf.nn.softmax(scores, axis=-1), values)
    return tf.reshape(tf.transpose(att, [0, 2, 1, 3]), [batch, -1, heads * head_dim])


class CachedStepper:
    """Next-token logits with a KV cache of ``slots`` sequences (see the module)."""

    def __init__(self, model: Any, slots: int) -> None:
        cfg = model.cfg
        self.model, self.slots, self.seq_len = model, slots, cfg.seq_len
        self.heads = cfg.n_heads
        shape = (slots, cfg.seq_len, cfg.kv_heads, cfg.d_model // cfg.n_heads)
        self.keys = [tf.Variable(tf.zeros(shape), trainable=False) for _ in range(cfg.n_layers)]
        self.values = [tf.Variable(tf.zeros(shape), trainable=False) for _ in range(cfg.n_layers)]
        window = tf.TensorSpec((1, cfg.seq_len), tf.int32)
        scalar = tf.TensorSpec((), tf.int32)
        self._start = graph_function(self._prefill, input_signature=[window, scalar, scalar])
        column = tf.TensorSpec((None, 1), tf.int32)
        self._step = graph_function(
            self._run, input_signature=[column, column, tf.TensorSpec((None,), tf.int32)]
        )

    def _attention(self, layer: int, positions, slots):
        keys, values = self.keys[layer], self.values[layer]

        def attend(q, k, v):
            new = tf.shape(k)[1]
            where = tf.stack([tf.repeat(slots, new), tf.reshape(positions, [-1])], axis=1)
            flat = tf.concat([[-1], tf.shape(k)[2:]], axis=0)
            keys.scatter_nd_update(where, tf.reshape(k, flat))
            values.scatter_nd_update(where, tf.reshape(v, flat))
            # Read after the write (automatic control dependencies keep the order).
            cached_k, cached_v = shared_heads(
                tf.gather(keys, slots), tf.gather(values, slots), self.heads
            )
            return cached_attention(q, cached_k, cached_v, positions)

        return attend

    def _forward(self, tokens, positions, slots):
        """The logits of ``tokens`` (batch, new) at ``positions`` of ``slots``, their keys
        and values written into the cache."""
        return self.model.forward(
            tokens,
            positions=positions,
            attention=lambda layer: self._attention(layer, positions, slots),
        )

    def _run(self, tokens, positions, slots):
        return self._forward(tokens, positions, slots)[:, -1]

    def _prefill(self, window, slot, length):
        positions = tf.range(self.seq_len)[tf.newaxis]
        return self._forward(window, positions, slot[tf.newaxis])[0, length - 1]

    def start(self, slot: int, ids: Sequence[int]) -> np.ndarray:
        window = _window(ids, self.seq_len)
        return self._start(window, np.int32(slot), np.int32(len(ids))).numpy()

    def step(
        self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]
    ) -> np.ndarray:
        column = np.asarray(tokens, dtype=np.int32)[:, np.newaxis]
        where = np.asarray(positions, dtype=np.int32)[:, np.newaxis]
        return self._step(column, where, np.asarray(slots, dtype=np.int32)).numpy()


class WindowStepper:
    """The same logits without a cache: each step runs every given sequence's window."""

    def __init__(self, model: Any, slots: int) -> None:
        self.model, self.slots, self.seq_len = model, slots, model.cfg.seq_len
        self.contexts: list[list[int]] = [[] for _ in range(slots)]

        @graph_function(
            input_signature=[
                tf.TensorSpec((None, self.seq_len), tf.int32),
                tf.TensorSpec((None,), tf.int32),
            ]
        )
        def last_logits(windows, last):
            logits = model(windows, training=False)
            return tf.gather(logits, last, axis=1, batch_dims=1)

        self._logits = last_logits

    def start(self, slot: int, ids: Sequence[int]) -> np.ndarray:
        self.contexts[slot] = list(ids)
        return self._logits(_window(ids, self.seq_len), np.array([len(ids) - 1], np.int32))[
            0
        ].numpy()

    def step(
        self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]
    ) -> np.ndarray:
        windows = np.zeros((len(slots), self.seq_len), dtype=np.int32)
        for row, (slot, token, position) in enumerate(zip(slots, tokens, positions, strict=True)):
            context = self.contexts[slot]
            del context[position:]
            context.append(int(token))
            windows[row, : len(context)] = context
        return self._logits(windows, np.asarray(positions, dtype=np.int32)).numpy()


def _window(ids: Sequence[int], seq_len: int) -> np.ndarray:
    """``ids`` padded on the right to one ``(1, seq_len)`` window (causal attention: the
    padding after the last real position changes nothing before it)."""
    if not 1 <= len(ids) <= seq_len:
        raise ValueError(f"a sequence of {len(ids)} tokens does not fit a window of {seq_len}")
    window = np.zeros((1, seq_len), dtype=np.int32)
    window[0, : len(ids)] = ids
    return window
