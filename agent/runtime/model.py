"""A GPT-style decoder-only transformer, built in pieces so any split initialises alike.

Every parameter's initializer seed derives from (job seed, layer index, parameter index), so
a stage holding layers [a, b) creates exactly the weights a single process holding every
layer would create for them.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from swarm.plan import ModelConfig

EMBED_LAYER = -1  # seed index of the embedding
HEAD_LAYER = 10_000  # seed index of the final norm + LM head
BOTTLENECK_LAYER = 20_000  # + boundary index: learned compression projections


def layer_seed(job_seed: int, layer: int, param: int = 0) -> int:
    """A stable 31-bit seed for one parameter of one layer."""
    mixed = (job_seed * 1_000_003 + (layer + 7) * 10_007 + param * 101) % (2**31 - 1)
    return mixed or 1


def _normal(job_seed: int, layer: int, param: int, stddev: float = 0.02):
    return keras.initializers.RandomNormal(stddev=stddev, seed=layer_seed(job_seed, layer, param))


class Embedding(keras.layers.Layer):
    """Token + learned position embedding."""

    def __init__(self, cfg: ModelConfig, job_seed: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cfg = cfg
        self.tok = self.add_weight(
            shape=(cfg.vocab_size, cfg.d_model),
            initializer=_normal(job_seed, EMBED_LAYER, 0),
            name="tok",
        )
        self.pos = self.add_weight(
            shape=(cfg.seq_len, cfg.d_model),
            initializer=_normal(job_seed, EMBED_LAYER, 1, 0.01),
            name="pos",
        )

    def call(self, tokens):
        seq = tf.shape(tokens)[1]
        return tf.gather(self.tok, tokens) + self.pos[tf.newaxis, :seq, :]


class LayerNorm(keras.layers.Layer):
    def __init__(self, dim: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.gamma = self.add_weight(shape=(dim,), initializer="ones", name="gamma")
        self.beta = self.add_weight(shape=(dim,), initializer="zeros", name="beta")

    def call(self, x):
        mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
        return (x - mean) * tf.math.rsqrt(var + 1e-5) * self.gamma + self.beta


class Block(keras.layers.Layer):
    """Pre-LayerNorm block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, cfg: ModelConfig, job_seed: int, layer: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cfg = cfg
        d, hidden = cfg.d_model, cfg.d_model * cfg.mlp_ratio
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        self.ln1 = LayerNorm(d, name="ln1")
        self.ln2 = LayerNorm(d, name="ln2")
        self.w_qkv = self.add_weight(
            shape=(d, 3 * d), initializer=_normal(job_seed, layer, 0), name="w_qkv"
        )
        self.b_qkv = self.add_weight(shape=(3 * d,), initializer="zeros", name="b_qkv")
        self.w_o = self.add_weight(
            shape=(d, d), initializer=_normal(job_seed, layer, 1, out_std), name="w_o"
        )
        self.b_o = self.add_weight(shape=(d,), initializer="zeros", name="b_o")
        self.w_fc = self.add_weight(
            shape=(d, hidden), initializer=_normal(job_seed, layer, 2), name="w_fc"
        )
        self.b_fc = self.add_weight(shape=(hidden,), initializer="zeros", name="b_fc")
        self.w_proj = self.add_weight(
            shape=(hidden, d), initializer=_normal(job_seed, layer, 3, out_std), name="w_proj"
        )
        self.b_proj = self.add_weight(shape=(d,), initializer="zeros", name="b_proj")
        self.dropout = keras.layers.Dropout(cfg.dropout, seed=layer_seed(job_seed, layer, 9))

    def call(self, x, training=False):
        cfg = self.cfg
        batch, seq = tf.shape(x)[0], tf.shape(x)[1]
        heads, head_dim = cfg.n_heads, cfg.d_model // cfg.n_heads
        qkv = tf.einsum("btd,de->bte", self.ln1(x), self.w_qkv) + self.b_qkv
        qkv = tf.reshape(qkv, [batch, seq, 3, heads, head_dim])
        q, k, v = (tf.transpose(qkv[:, :, i], [0, 2, 1, 3]) for i in range(3))
        scores = tf.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(head_dim))
        causal = tf.linalg.band_part(tf.ones([seq, seq], dtype=scores.dtype), -1, 0)
        scores = scores + (1.0 - causal) * -1e9
        att = tf.matmul(tf.nn.softmax(scores, axis=-1), v)
        att = tf.reshape(tf.transpose(att, [0, 2, 1, 3]), [batch, seq, cfg.d_model])
        x = x + self.dropout(tf.einsum("btd,de->bte", att, self.w_o) + self.b_o, training=training)
        h = tf.nn.gelu(tf.einsum("btd,dh->bth", self.ln2(x), self.w_fc) + self.b_fc)
        return x + self.dropout(
            tf.einsum("bth,hd->btd", h, self.w_proj) + self.b_proj, training=training
        )


class Head(keras.layers.Layer):
    """Final LayerNorm and the LM head (logits over the vocabulary)."""

    def __init__(self, cfg: ModelConfig, job_seed: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.ln = LayerNorm(cfg.d_model, name="ln_f")
        self.w = self.add_weight(
            shape=(cfg.d_model, cfg.vocab_size),
            initializer=_normal(job_seed, HEAD_LAYER, 0),
            name="w_head",
        )

    def call(self, x):
        return tf.einsum("btd,dv->btv", self.ln(x), self.w)


class Projection(keras.layers.Layer):
    """A learned bottleneck projection (down at the end of stage k, up at the start of k+1)."""

    def __init__(self, d_in: int, d_out: int, job_seed: int, boundary: int, param: int, **kw):
        super().__init__(**kw)
        std = 1.0 / math.sqrt(d_in)
        self.w = self.add_weight(
            shape=(d_in, d_out),
            initializer=_normal(job_seed, BOTTLENECK_LAYER + boundary, param, std),
            name="w",
        )
        self.b = self.add_weight(shape=(d_out,), initializer="zeros", name="b")

    def call(self, x):
        return tf.einsum("btd,de->bte", x, self.w) + self.b


def token_loss(logits, targets):
    """Mean next-token cross-entropy in nats."""
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits)
    return tf.reduce_mean(losses)
