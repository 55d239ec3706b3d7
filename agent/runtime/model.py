"""Decoder-only transformers (the ``gpt2`` and ``llama`` families), built in pieces so any
split initialises alike.

Every parameter's initializer seed derives from (job seed, layer index, parameter index), so
a stage holding layers [a, b) creates exactly the weights a single process holding every
layer would create for them.

Every layer is registered with Keras (package ``silentswarm``) and has a ``get_config``, so a
model made of them saves as one ``.keras`` file and loads back anywhere this module is
importable: :class:`GluedTransformer` is the whole pipeline as one single-device model
(``agent/runtime/glue/`` assembles it from stage checkpoints), and :class:`WireRoundTrip`
reproduces a boundary's wire codec in TensorFlow ops. ``ModelConfig`` travels in a config as
plain JSON (``msgspec.to_builtins``) and comes back through ``msgspec.convert``.

Variables are created in ``__init__``, in a fixed order: stage checkpoints restore by
position, so that order (and every initial value) must never change.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import msgspec
import tensorflow as tf

from silentswarm.agent.pipe.wire import MAX_SHIFT, SCALE_MAX, SCALE_MIN
from silentswarm.compression import CodecKind, parse_compression, parse_wire_codec
from silentswarm.plan import LORA_TARGETS, AdapterConfig, ModelConfig

EMBED_LAYER = -1  # seed index of the embedding
HEAD_LAYER = 10_000  # seed index of the final norm + LM head
BOTTLENECK_LAYER = 20_000  # + boundary index: learned compression projections


def layer_seed(job_seed: int, layer: int, param: int = 0) -> int:
    """A stable 31-bit seed for one parameter of one layer."""
    mixed = (job_seed * 1_000_003 + (layer + 7) * 10_007 + param * 101) % (2**31 - 1)
    return mixed or 1


def _normal(job_seed: int, layer: int, param: int, stddev: float = 0.02):
    return keras.initializers.RandomNormal(stddev=stddev, seed=layer_seed(job_seed, layer, param))


def _serializable(cls):
    return keras.saving.register_keras_serializable(package="silentswarm")(cls)


def _with_cfg(config: dict[str, Any]) -> dict[str, Any]:
    """A layer config with its ``cfg`` (plain JSON) turned back into a ``ModelConfig`` (and
    an ``adapter`` into an ``AdapterConfig``)."""
    config = dict(config)
    config["cfg"] = msgspec.convert(config["cfg"], ModelConfig)
    if config.get("adapter") is not None:
        config["adapter"] = msgspec.convert(config["adapter"], AdapterConfig)
    return config


class _ConfiguredLayer(keras.layers.Layer):
    """A layer built from the model's ``cfg`` and the job seed: how it is saved and rebuilt."""

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "cfg": msgspec.to_builtins(self.cfg),
            "job_seed": self.job_seed,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]):
        return super().from_config(_with_cfg(config))


@_serializable
class TokenEmbedding(_ConfiguredLayer):
    """The token embedding (llama: positions are rotary, applied to queries and keys)."""

    def __init__(self, cfg: ModelConfig, job_seed: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cfg = cfg
        self.job_seed = job_seed
        self.tok = self.add_weight(
            shape=(cfg.vocab_size, cfg.d_model),
            initializer=_normal(job_seed, EMBED_LAYER, 0),
            name="tok",
        )

    def call(self, tokens, positions=None):
        """``positions`` (batch, seq): where the tokens are (rotary positions need none here)."""
        return tf.gather(self.tok, tokens)


@_serializable
class Embedding(TokenEmbedding):
    """Token + learned position embedding (gpt2)."""

    def __init__(self, cfg: ModelConfig, job_seed: int, **kwargs) -> None:
        super().__init__(cfg, job_seed, **kwargs)
        self.pos = self.add_weight(
            shape=(cfg.seq_len, cfg.d_model),
            initializer=_normal(job_seed, EMBED_LAYER, 1, 0.01),
            name="pos",
        )

    def call(self, tokens, positions=None):
        """Positions 0..seq-1, or ``positions`` (batch, seq)."""
        if positions is not None:
            return super().call(tokens) + tf.gather(self.pos, positions)
        seq = tf.shape(tokens)[1]
        return super().call(tokens) + self.pos[tf.newaxis, :seq, :]


@_serializable
class LayerNorm(keras.layers.Layer):
    def __init__(self, dim: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.dim = dim
        self.gamma = self.add_weight(shape=(dim,), initializer="ones", name="gamma")
        self.beta = self.add_weight(shape=(dim,), initializer="zeros", name="beta")

    def call(self, x):
        # In float32 whatever the compute dtype (mixed precision): the casts are no-ops else.
        x32 = tf.cast(x, tf.float32)
        mean, var = tf.nn.moments(x32, axes=[-1], keepdims=True)
        gamma, beta = tf.cast(self.gamma, tf.float32), tf.cast(self.beta, tf.float32)
        return tf.cast((x32 - mean) * tf.math.rsqrt(var + 1e-5) * gamma + beta, x.dtype)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "dim": self.dim}


def causal_attention(q, k, v):
    """Scaled dot-product attention of each position on itself and those before it: ``q``,
    ``k``, ``v`` (batch, seq, heads, head_dim), the heads' outputs side by side
    (batch, seq, heads * head_dim)."""
    batch, seq, heads, head_dim = tf.shape(q)[0], tf.shape(q)[1], q.shape[2], q.shape[3]
    q, k, v = (tf.transpose(t, [0, 2, 1, 3]) for t in (q, k, v))
    scores = tf.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(head_dim))
    causal = tf.linalg.band_part(tf.ones([seq, seq], dtype=scores.dtype), -1, 0)
    scores = scores + (1.0 - causal) * -1e9
    att = tf.matmul(tf.nn.softmax(scores, axis=-1), v)
    return tf.reshape(tf.transpose(att, [0, 2, 1, 3]), [batch, seq, heads * head_dim])


def shared_heads(k, v, heads: int):
    """Grouped-query attention's keys and values for ``heads`` query heads: each of the
    kv heads serves ``heads // kv`` query heads, in order (as they are when kv == heads)."""
    kv = k.shape[2]
    if kv == heads:
        return k, v
    return tf.repeat(k, heads // kv, axis=2), tf.repeat(v, heads // kv, axis=2)


def attend_causally(q, k, v):
    """:func:`causal_attention` of a whole window (keys and values shared across heads)."""
    k, v = shared_heads(k, v, q.shape[2])
    return causal_attention(q, k, v)


class _AdaptableBlock(_ConfiguredLayer):
    """A block whose projections may carry a LoRA adapter (``adapter``): ``lora_<w>_a`` and
    ``lora_<w>_b`` per targeted weight ``w``, created after the block's own weights (a block
    without one keeps its variables, their order and their values; with one, the others keep
    their order around them, and an adapter's checkpoint holds only these)."""

    def __init__(self, cfg: ModelConfig, job_seed: int, layer: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cfg = cfg
        self.job_seed = job_seed
        self.layer_index = layer

    def _add_lora(self, adapter: AdapterConfig | None, shapes: dict[str, tuple[int, int]]):
        self.adapter = adapter
        self.lora: dict[str, tuple[Any, Any]] = {}
        if adapter is None:
            return
        for i, target in enumerate(adapter.target_names(self.cfg.family)):
            d_in, d_out = shapes[target]
            a = self.add_weight(
                shape=(d_in, adapter.rank),
                initializer=_normal(self.job_seed, self.layer_index, 50 + i, 1 / math.sqrt(d_in)),
                name=f"lora_{target}_a",
            )
            b = self.add_weight(
                shape=(adapter.rank, d_out), initializer="zeros", name=f"lora_{target}_b"
            )
            self.lora[target] = (a, b)

    def _dense(self, equation: str, x, weight, target: str):
        """``x`` through the projection ``target`` (``weight``), its adapter added."""
        y = tf.einsum(equation, x, weight)
        if target in self.lora:
            a, b = self.lora[target]
            scale = tf.cast(self.adapter.scale, y.dtype)  # type: ignore[union-attr]
            y = y + tf.einsum(equation, tf.einsum(equation, x, a), b) * scale
        return y

    def get_config(self) -> dict[str, Any]:
        config = {**super().get_config(), "layer": self.layer_index}
        if self.adapter is not None:
            config["adapter"] = msgspec.to_builtins(self.adapter)
        return config


@_serializable
class Block(_AdaptableBlock):
    """Pre-LayerNorm block: causal self-attention and an MLP, each with a residual."""

    def __init__(
        self,
        cfg: ModelConfig,
        job_seed: int,
        layer: int,
        adapter: AdapterConfig | None = None,
        **kwargs,
    ) -> None:
        super().__init__(cfg, job_seed, layer, **kwargs)
        d, hidden = cfg.d_model, cfg.hidden_dim
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        policy = self.dtype_policy  # sublayers compute in the block's dtype
        self.ln1 = LayerNorm(d, name="ln1", dtype=policy)
        self.ln2 = LayerNorm(d, name="ln2", dtype=policy)
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
        self.dropout = keras.layers.Dropout(
            cfg.dropout, seed=layer_seed(job_seed, layer, 9), dtype=policy
        )
        shapes = {"w_qkv": (d, 3 * d), "w_o": (d, d), "w_fc": (d, hidden), "w_proj": (hidden, d)}
        self._add_lora(adapter, shapes)

    def qkv(self, x, positions=None):
        """Queries, keys and values of ``x``, each (batch, seq, heads, head_dim); learned
        positions came with the embedding, so ``positions`` is not needed here."""
        cfg = self.cfg
        batch, seq = tf.shape(x)[0], tf.shape(x)[1]
        heads, head_dim = cfg.n_heads, cfg.d_model // cfg.n_heads
        qkv = self._dense("btd,de->bte", self.ln1(x), self.w_qkv, "w_qkv") + self.b_qkv
        qkv = tf.reshape(qkv, [batch, seq, 3, heads, head_dim])
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]

    def call(self, x, training=False, positions=None, attention=None):
        """``attention(q, k, v)``: how the new positions attend (default: causally among
        themselves; a KV cache's attends to the cached positions too)."""
        att = (attention or attend_causally)(*self.qkv(x, positions))
        out = self._dense("btd,de->bte", att, self.w_o, "w_o") + self.b_o
        x = x + self.dropout(out, training=training)
        h = tf.nn.gelu(self._dense("btd,dh->bth", self.ln2(x), self.w_fc, "w_fc") + self.b_fc)
        return x + self.dropout(
            self._dense("bth,hd->btd", h, self.w_proj, "w_proj") + self.b_proj, training=training
        )


@_serializable
class Head(_ConfiguredLayer):
    """Final LayerNorm and the LM head (logits over the vocabulary)."""

    def __init__(self, cfg: ModelConfig, job_seed: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cfg = cfg
        self.job_seed = job_seed
        self.ln = LayerNorm(cfg.d_model, name="ln_f", dtype=self.dtype_policy)
        self.w = self.add_weight(
            shape=(cfg.d_model, cfg.vocab_size),
            initializer=_normal(job_seed, HEAD_LAYER, 0),
            name="w_head",
        )

    def call(self, x):
        return tf.einsum("btd,dv->btv", self.ln(x), self.w)


# --- the llama family -------------------------------------------------------------------------


@_serializable
class RMSNorm(keras.layers.Layer):
    """``x / rms(x) * scale``, in float32 (keras-hub's LlamaLayerNorm)."""

    def __init__(self, dim: int, eps: float = 1e-6, **kwargs) -> None:
        super().__init__(**kwargs)
        self.dim, self.eps = dim, eps
        self.scale = self.add_weight(shape=(dim,), initializer="ones", name="scale")

    def call(self, x):
        x32 = tf.cast(x, tf.float32)
        var = tf.reduce_mean(tf.square(x32), axis=-1, keepdims=True)
        scale = tf.cast(self.scale, tf.float32)
        return tf.cast(x32 * tf.math.rsqrt(var + self.eps) * scale, x.dtype)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "dim": self.dim, "eps": self.eps}


def rotary(x, theta: float, positions=None):
    """Rotary position embedding of ``x`` (batch, seq, heads, head_dim), positions 0..seq-1
    or ``positions`` (batch, seq): the two halves of each head rotated by
    ``pos / theta**(2i / head_dim)`` (keras-hub's RotaryEmbedding, and HF Llama's
    ``rotate_half``)."""
    head_dim = x.shape[-1]
    inverse = 1.0 / (theta ** (tf.range(0, head_dim, 2, dtype=tf.float32) / head_dim))
    if positions is None:
        freqs = tf.einsum("i,j->ij", tf.cast(tf.range(tf.shape(x)[1]), tf.float32), inverse)
        freqs = freqs[tf.newaxis]
    else:
        freqs = tf.einsum("bi,j->bij", tf.cast(positions, tf.float32), inverse)
    angles = tf.concat([freqs, freqs], axis=-1)[:, :, tf.newaxis, :]
    cos, sin = tf.cast(tf.cos(angles), x.dtype), tf.cast(tf.sin(angles), x.dtype)
    first, second = tf.split(x, 2, axis=-1)
    return x * cos + tf.concat([-second, first], axis=-1) * sin


@_serializable
class LlamaBlock(_AdaptableBlock):
    """Pre-RMSNorm block: causal grouped-query self-attention with rotary positions, and a
    SwiGLU MLP (``down(silu(gate(x)) * up(x))``), each with a residual; no biases."""

    def __init__(
        self,
        cfg: ModelConfig,
        job_seed: int,
        layer: int,
        adapter: AdapterConfig | None = None,
        **kwargs,
    ) -> None:
        super().__init__(cfg, job_seed, layer, **kwargs)
        d, hidden = cfg.d_model, cfg.hidden_dim
        head_dim = d // cfg.n_heads
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        policy = self.dtype_policy  # sublayers compute in the block's dtype
        self.attn_norm = RMSNorm(d, cfg.norm_eps, name="attn_norm", dtype=policy)
        self.mlp_norm = RMSNorm(d, cfg.norm_eps, name="mlp_norm", dtype=policy)

        def weight(shape, param, name, std=0.02):
            return self.add_weight(
                shape=shape, initializer=_normal(job_seed, layer, param, std), name=name
            )

        self.w_q = weight((d, cfg.n_heads * head_dim), 0, "w_q")
        self.w_k = weight((d, cfg.kv_heads * head_dim), 4, "w_k")
        self.w_v = weight((d, cfg.kv_heads * head_dim), 5, "w_v")
        self.w_o = weight((cfg.n_heads * head_dim, d), 1, "w_o", out_std)
        self.w_gate = weight((d, hidden), 2, "w_gate")
        self.w_up = weight((d, hidden), 6, "w_up")
        self.w_down = weight((hidden, d), 3, "w_down", out_std)
        self.dropout = keras.layers.Dropout(
            cfg.dropout, seed=layer_seed(job_seed, layer, 9), dtype=policy
        )
        shapes = {name: tuple(getattr(self, name).shape) for name in LORA_TARGETS["llama"]}
        self._add_lora(adapter, shapes)

    def qkv(self, x, positions=None):
        """Queries (batch, seq, heads, head_dim), keys and values (batch, seq, kv_heads,
        head_dim) of ``x``, rotated for positions 0..seq-1 or ``positions`` (batch, seq)."""
        cfg = self.cfg
        batch, seq = tf.shape(x)[0], tf.shape(x)[1]
        head_dim = cfg.d_model // cfg.n_heads
        h = self.attn_norm(x)

        def project(w, n, target):
            projected = self._dense("btd,de->bte", h, w, target)
            return tf.reshape(projected, [batch, seq, n, head_dim])

        q = rotary(project(self.w_q, cfg.n_heads, "w_q"), cfg.rope_theta, positions)
        k = rotary(project(self.w_k, cfg.kv_heads, "w_k"), cfg.rope_theta, positions)
        return q, k, project(self.w_v, cfg.kv_heads, "w_v")

    def call(self, x, training=False, positions=None, attention=None):
        """``attention(q, k, v)``: as :meth:`Block.call`'s."""
        att = (attention or attend_causally)(*self.qkv(x, positions))
        x = x + self.dropout(self._dense("bte,ed->btd", att, self.w_o, "w_o"), training=training)
        h = self.mlp_norm(x)
        gated = tf.nn.silu(self._dense("btd,dh->bth", h, self.w_gate, "w_gate"))
        up = self._dense("btd,dh->bth", h, self.w_up, "w_up")
        return x + self.dropout(
            self._dense("bth,hd->btd", gated * up, self.w_down, "w_down"), training=training
        )


@_serializable
class LlamaHead(_ConfiguredLayer):
    """Final RMSNorm and the LM head (its own weights: not tied to the embedding)."""

    def __init__(self, cfg: ModelConfig, job_seed: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cfg = cfg
        self.job_seed = job_seed
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, name="norm_f", dtype=self.dtype_policy)
        self.w = self.add_weight(
            shape=(cfg.d_model, cfg.vocab_size),
            initializer=_normal(job_seed, HEAD_LAYER, 0),
            name="w_head",
        )

    def call(self, x):
        return tf.einsum("btd,dv->btv", self.norm(x), self.w)


# The layers of each family: what a stage (or the glued model) builds for its part.
HEADS = (Head, LlamaHead)
BLOCKS = (Block, LlamaBlock)


# A job's "precision" as the Keras dtype policy of its layers (float32 weights either way).
POLICIES = {"float32": "float32", "bfloat16": "mixed_bfloat16"}


def embedding(
    cfg: ModelConfig, job_seed: int, name: str = "embed", dtype: str | None = None
) -> keras.layers.Layer:
    kind = TokenEmbedding if cfg.family == "llama" else Embedding
    return kind(cfg, job_seed, name=name, dtype=dtype)


def block(
    cfg: ModelConfig,
    job_seed: int,
    layer: int,
    name: str,
    dtype: str | None = None,
    adapter: AdapterConfig | None = None,
) -> keras.layers.Layer:
    kind = LlamaBlock if cfg.family == "llama" else Block
    return kind(cfg, job_seed, layer, adapter, name=name, dtype=dtype)


def head(
    cfg: ModelConfig, job_seed: int, name: str = "head", dtype: str | None = None
) -> keras.layers.Layer:
    return (LlamaHead if cfg.family == "llama" else Head)(cfg, job_seed, name=name, dtype=dtype)


@_serializable
class Projection(keras.layers.Layer):
    """A learned bottleneck projection (down at the end of stage k, up at the start of k+1)."""

    def __init__(self, d_in: int, d_out: int, job_seed: int, boundary: int, param: int, **kw):
        super().__init__(**kw)
        self.d_in, self.d_out = d_in, d_out
        self.job_seed, self.boundary, self.param = job_seed, boundary, param
        std = 1.0 / math.sqrt(d_in)
        self.w = self.add_weight(
            shape=(d_in, d_out),
            initializer=_normal(job_seed, BOTTLENECK_LAYER + boundary, param, std),
            name="w",
        )
        self.b = self.add_weight(shape=(d_out,), initializer="zeros", name="b")

    def call(self, x):
        return tf.einsum("btd,de->bte", x, self.w) + self.b

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "d_in": self.d_in,
            "d_out": self.d_out,
            "job_seed": self.job_seed,
            "boundary": self.boundary,
            "param": self.param,
        }


def token_loss(logits, targets):
    """Mean next-token cross-entropy in nats (in float32, whatever the logits' dtype)."""
    logits = tf.cast(logits, tf.float32)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits)
    return tf.reduce_mean(losses)


# --- the whole pipeline as one model ----------------------------------------------------------


def _divide(a, b):
    """``a / b`` correctly rounded to float32, as numpy divides.

    Inside a ``tf.function`` Grappler turns a division by a constant into a multiplication by
    its reciprocal, which is one float32 ulp off for about half the values: enough to move a
    scale to the next float16 or a value across a rounding edge. Dividing in float64 and
    rounding once to float32 is correctly rounded (53 >= 2 * 24 + 2 bits), and a reciprocal
    in float64 is off by far less than a float32 quotient's distance from a rounding edge.
    """
    quotient = tf.cast(a, tf.float64) / tf.cast(b, tf.float64)
    return tf.cast(quotient, tf.float32)


def _power_of_two(exponent):
    """``2.0**exponent`` as float32, built from its exponent bits (exact; |exponent| <= 126)."""
    return tf.bitcast(tf.bitwise.left_shift(exponent + 127, 23), tf.float32)


def _fp16_round_trip(x):
    """``agent/pipe/wire.py``'s fp16 frame, encoded and decoded: the tensor's absmax moved into
    ``[2**14, 2**15)`` by a power of two (read from the float32's exponent bits, clipped to
    ``MAX_SHIFT``; none for an all-zero or non-finite tensor), the cast, the shift undone."""
    absmax = tf.reduce_max(tf.abs(x))
    exponent = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(tf.bitcast(absmax, tf.int32), 23), 0xFF
    )
    shift = tf.clip_by_value(14 - (exponent - 127), -MAX_SHIFT, MAX_SHIFT)
    shift = tf.where(tf.math.is_finite(absmax) & (absmax > 0), shift, 0)
    halved = tf.cast(x * _power_of_two(shift), tf.float16)
    return tf.cast(halved, tf.float32) * _power_of_two(-shift)


@_serializable
class WireRoundTrip(keras.layers.Layer):
    """What a boundary's wire codec does to the activations, in TensorFlow ops.

    ``none`` is the identity, ``fp16`` the wire's power-of-two shift (:func:`fp16_shift`),
    a cast to float16 and back, and the shift undone. ``fixed_intN`` is
    ``agent/pipe/wire.py``'s ``dequantize(*quantize(x, N))`` step by step: per-row (last
    axis) absmax, the scale ``absmax / qmax`` clamped to ``[SCALE_MIN, SCALE_MAX]`` and
    rounded *up* to bfloat16 (the float32's upper 16 bits, one more unless the lower 16 are
    zero: the wire's integer ops), ``rint`` (half to even, like ``np.rint``), a clip to
    ``[-qmax, qmax]``, and ``q * scale``. On the same float32 input it gives bit for bit what
    the wire gives.
    """

    def __init__(self, codec: str = "none", **kwargs) -> None:
        super().__init__(**kwargs)
        self._wire = parse_wire_codec(codec)  # ConfigError for anything but a wire codec
        self.codec = codec

    def call(self, x):
        if self._wire.kind is CodecKind.NONE:
            return x
        if self._wire.kind is CodecKind.FP16:
            return _fp16_round_trip(x)
        qmax = float(self._wire.qmax)
        absmax = tf.reduce_max(tf.abs(x), axis=-1, keepdims=True)
        wanted = tf.clip_by_value(_divide(absmax, qmax), SCALE_MIN, SCALE_MAX)
        raw = tf.bitcast(wanted, tf.int32)  # positive: the sign bit is clear
        upper = tf.bitwise.right_shift(raw, 16)
        upper += tf.cast(tf.bitwise.bitwise_and(raw, 0xFFFF) != 0, tf.int32)
        scale = tf.bitcast(tf.bitwise.left_shift(upper, 16), tf.float32)
        q = tf.clip_by_value(tf.math.rint(_divide(x, scale)), -qmax, qmax)
        return q * scale  # exact: an integer of <= 8 bits times an 8-bit bfloat16 value

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "codec": self.codec}


@_serializable
class GluedTransformer(keras.Model):
    """A trained pipeline as one single-device model: tokens (batch, seq) -> logits.

    ``stage_layers`` are the stages' half-open layer ranges, in order. Between two stages it
    does what the pipeline did there: the learned bottleneck's ``down_<b>`` projection (end of
    stage b), the wire codec's round trip (:class:`WireRoundTrip`), the ``up_<b>``
    projection (start of stage b + 1). So the glued model computes what the pipeline
    computed, including the compression it was trained through.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        job_seed: int,
        compression: str,
        stage_layers: list[list[int]] | list[tuple[int, int]],
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        ranges = [(int(a), int(b)) for a, b in stage_layers]
        ends = [0] + [b for _, b in ranges]
        in_order = [a for a, _ in ranges] == ends[:-1] and ends[-1] == cfg.n_layers
        if not ranges or not in_order or any(a >= b for a, b in ranges):
            raise ValueError(
                f"stage_layers {ranges}: need non-empty ranges covering layers "
                f"0..{cfg.n_layers - 1} in order"
            )
        spec = parse_compression(compression, d_model=cfg.d_model)
        self.cfg, self.job_seed, self.compression = cfg, job_seed, compression
        self.stage_layers = ranges
        self.wire_codec, self.bottleneck_dim = spec.wire, spec.bottleneck_dim
        d, k = cfg.d_model, spec.bottleneck_dim
        boundaries = range(len(ranges) - 1)
        self.embed = embedding(cfg, job_seed)
        self.blocks = [block(cfg, job_seed, i, name=f"block_{i}") for i in range(cfg.n_layers)]
        # The same seeds as the stages' "down" and "up" (the weights come from checkpoints).
        self.downs = (
            [Projection(d, k, job_seed, b, 0, name=f"down_{b}") for b in boundaries] if k else []
        )
        self.ups = (
            [Projection(k, d, job_seed, b, 1, name=f"up_{b}") for b in boundaries] if k else []
        )
        self.wire = WireRoundTrip(spec.wire, name="wire")
        self.head = head(cfg, job_seed)

    def build(self, input_shape=None) -> None:
        """Nothing to build: every variable exists from ``__init__`` on (so loading needs none)."""
        self.built = True

    def stage_forward(self, stage: int, x, training=False, positions=None, attention=None):
        """Stage ``stage``'s part, as its ``StageModel`` computes it.

        The embedding (stage 0) or the ``up`` projection (a learned bottleneck), the stage's
        blocks, then the ``down`` projection (a learned bottleneck) or the head (last stage).
        What comes in and goes out is what crossed the wire (before the codec).
        ``positions`` and ``attention``: as :meth:`forward`'s.
        """
        start, end = self.stage_layers[stage]
        if stage == 0:
            x = self.embed(x, positions=positions)
        elif self.ups:
            x = self.ups[stage - 1](x)
        for layer in range(start, end):
            hook = attention(layer) if attention is not None else None
            x = self.blocks[layer](x, training=training, positions=positions, attention=hook)
        if stage == len(self.stage_layers) - 1:
            return self.head(x)
        return self.downs[stage](x) if self.downs else x

    def call(self, tokens, training=False):
        return self.forward(tokens, training=training)

    def forward(self, tokens, training=False, positions=None, attention=None):
        """Logits of ``tokens`` (batch, seq) at positions 0..seq-1, or at ``positions``
        (batch, seq) with ``attention`` (a layer index -> that block's attention, see
        :meth:`Block.call`): how a KV cache (``agent/serve/kvcache.py``) runs new tokens only.
        The wire codecs act on each position's row alone (``fixed_intN``'s scale is per row),
        except ``fp16``, whose one shift per tensor may round a few values differently when
        fewer positions cross."""
        x = tokens
        for stage in range(len(self.stage_layers)):
            if stage > 0:
                x = self.wire(x)
            x = self.stage_forward(stage, x, training, positions, attention)
        return x

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "cfg": msgspec.to_builtins(self.cfg),
            "job_seed": self.job_seed,
            "compression": self.compression,
            "stage_layers": [list(r) for r in self.stage_layers],
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]):
        config = _with_cfg(config)
        return cls(**config)
