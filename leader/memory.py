"""How much memory a stage needs: a pure estimate, so a plan never assigns more than fits.

fp32 everywhere. Per parameter a stage holds the weight, its gradient accumulator, Adam's
two moments and the gradient of the micro-batch in flight; under the ``overlap`` schedule
also the gradient set aside for its delayed update and the weights' previous version, which
the backwards of the step in flight still read. Per layer and micro-batch it keeps
what the backward pass needs; under 1F1B stage ``s`` of ``p`` holds at most ``min(m, p - s)``
micro-batches at once, or the job's larger ``in_flight`` window (``plan.stage_in_flight``).
The last stage adds the head: its weights and the logits (with their softmax and gradient)
of its micro-batches, and the inputs it keeps for the weight-gradient passes it defers.
Each process also pays a fixed runtime cost (TensorFlow itself, and a CUDA context per
GPU). Estimates err on the high side.
"""

from __future__ import annotations

import msgspec

from silentswarm.plan import AdapterConfig, ModelConfig, stage_in_flight

FLOAT = 4
BYTES_PER_PARAM = 5 * FLOAT
OVERLAP_BYTES_PER_PARAM = 7 * FLOAT
# Measured: `import tensorflow` is ~670 MB of RSS on the CPU; a CUDA context is ~0.5 GiB.
CPU_RUNTIME_BYTES = 768 << 20
GPU_RUNTIME_BYTES = 512 << 20


class StageMemory(msgspec.Struct, kw_only=True, frozen=True):
    """Bytes one stage needs, without the fixed runtime cost."""

    per_layer: tuple[int, ...]  # each block, in order
    first_extra: int  # embedding (stage 0) or the incoming boundary's buffers
    last_extra: int  # head and logits (last stage) or the outgoing boundary's buffers

    @property
    def total(self) -> int:
        return sum(self.per_layer) + self.first_extra + self.last_extra

    def slot(self, start: int, end: int, *, first: bool, last: bool) -> int:
        """Bytes of layers ``[start, end)`` (stage-local indices), plus the ends they host."""
        return (
            sum(self.per_layer[start:end])
            + (self.first_extra if first else 0)
            + (self.last_extra if last else 0)
        )


def projections(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """A block's weight matrices by name (the LoRA targets'), as (inputs, outputs)."""
    d, hidden = m.d_model, m.hidden_dim
    if m.family == "llama":
        kv = m.kv_heads * (d // m.n_heads)
        return {
            "w_q": (d, d),
            "w_k": (d, kv),
            "w_v": (d, kv),
            "w_o": (d, d),
            "w_gate": (d, hidden),
            "w_up": (d, hidden),
            "w_down": (hidden, d),
        }
    return {"w_qkv": (d, 3 * d), "w_o": (d, d), "w_fc": (d, hidden), "w_proj": (hidden, d)}


def block_params(m: ModelConfig) -> int:
    """One block's parameters: its projections, gpt2's biases and two LayerNorms (scale and
    shift), or llama's two RMSNorms (scale)."""
    d, hidden = m.d_model, m.hidden_dim
    weights = sum(a * b for a, b in projections(m).values())
    if m.family == "llama":
        return weights + 2 * d
    return weights + (3 * d + d + hidden + d) + 4 * d


def embedding_params(m: ModelConfig) -> int:
    """The first stage's embedding: tokens, and gpt2's learned positions."""
    return (m.vocab_size + (m.seq_len if m.family == "gpt2" else 0)) * m.d_model


def head_params(m: ModelConfig) -> int:
    """The last stage's head: its final norm (gpt2's LayerNorm, llama's RMSNorm) and the
    untied output projection."""
    return m.d_model * m.vocab_size + (2 if m.family == "gpt2" else 1) * m.d_model


def adapter_block_params(m: ModelConfig, adapter: AdapterConfig) -> int:
    """One block's LoRA parameters: ``A`` and ``B`` of each targeted projection."""
    shapes = projections(m)
    return sum(adapter.rank * sum(shapes[t]) for t in adapter.target_names(m.family))


def stage_memory(
    m: ModelConfig,
    *,
    batch_size: int,
    micro_batches: int,
    stage: int,
    n_stages: int,
    layers: int,
    in_flight: int | None = None,
    overlap: bool = False,
    recompute: bool = False,
    deferred: int | None = 0,
) -> StageMemory:
    """``in_flight``: the job's window (``TrainConfig.in_flight``; None: 1F1B's);
    ``overlap``: the job's schedule is ``overlap`` (``TrainConfig.overlap``); ``recompute``:
    stages before the last keep only each held micro-batch's input, and one micro-batch's
    intermediates while its backward runs the forward again (``TrainConfig.recompute``);
    ``deferred``: the last stage's deferred weight-gradient passes
    (``TrainConfig.defer_weight_grads``; None: "auto", up to a whole batch), each keeping
    its micro-batch's input until its pass."""
    per_param = OVERLAP_BYTES_PER_PARAM if overlap else BYTES_PER_PARAM
    mb = max(1, batch_size // max(1, micro_batches))
    held = stage_in_flight(stage, n_stages, micro_batches, in_flight)
    saved = 1 if recompute and stage < n_stages - 1 else held  # whose intermediates are kept
    tokens = mb * m.seq_len
    # Saved for backward: LayerNorm outputs, q/k/v, attention output, MLP hidden (twice),
    # residuals; plus scores and probabilities per head.
    activations = FLOAT * saved * (tokens * m.d_model * (8 + 2 * m.mlp_ratio))
    activations += FLOAT * saved * 2 * mb * m.n_heads * m.seq_len * m.seq_len
    per_layer = block_params(m) * per_param + activations
    boundary = 2 * FLOAT * held * tokens * m.d_model  # a frame out and a frame in
    if stage == 0:
        first = embedding_params(m) * per_param
        first += FLOAT * saved * tokens * m.d_model  # the embedding's output
    else:
        first = boundary
    if stage == n_stages - 1:
        last = head_params(m) * per_param
        last += 3 * FLOAT * held * tokens * m.vocab_size  # logits, softmax, their gradient
        kept = batch_size if deferred is None else min(deferred, micro_batches - 1) * mb
        last += FLOAT * kept * m.seq_len * m.d_model  # the deferred passes' inputs
    else:
        last = boundary
    return StageMemory(per_layer=(per_layer,) * layers, first_extra=first, last_extra=last)
