"""Steps 4 and 5 of glue: the glued model reproduces the pipeline, and its validation loss.

The check
---------
The reference is the chain of restored stage models run the way the pipeline runs them: each
stage's compiled forward (XLA when ``train.jit_compile``, like the pipeline), and between
stages the real numpy wire codec (``encode_frame``/``decode_frame`` of agent/pipe/wire.py).
Three comparisons, on every validation batch:

- per stage, teacher-forced: the glued model's part for stage *s*
  (:meth:`GluedTransformer.stage_forward`) on exactly the input stage *s* received must give
  its output within ``1e-3 * max(1, max|reference|)``. Both sides do the same float32 ops on
  the same weights; only op fusion and kernels differ (XLA or not): about 1e-6 measured. This
  is the check that catches wrong wiring or weights, whatever the compression.
- the codec: :class:`WireRoundTrip` on the activations stage *s* sent must give what the
  numpy wire decoded. Same formula, same float32 input: bit-identical on CPU, eager, in a
  ``tf.function`` and under XLA (tested; this check found Grappler's reciprocal rewrite). At
  most ``1e-4`` of the values may differ, each by at most one codec step, for accelerators
  whose kernels round differently (not measured on one).
- end to end, the final logits (``max_abs_diff`` in the manifest): ``1e-3 * R`` without a
  lossy codec, where ``R = max(1, max|reference logits|)``. With ``fp16`` or ``fixed_intN`` the
  glued model quantizes its *own* activations, which differ from the chain's by float noise;
  a value on a rounding edge (``x / scale`` within ~1e-7 of a half-integer, or near a float16
  tie) then lands one step apart: one float16 ulp (2**-11 relative), or one quantization
  step, ``absmax / qmax`` of its row (1/127 of the row's range at int8, 1/7 at int4, all of
  it at int2). Such flips are rare (measured: 0 to 4 in 10 000 boundary values) but each
  moves later logits by up to about that fraction of their range, so the end-to-end
  tolerance is ``1e-2 * R`` for ``fp16`` and ``max(1e-2, 2 / qmax) * R`` for ``fixed_intN``.
  Measured (4 layers, d=128, 3 stages, trained, 4 batches of 8 x 64, R about 4.5): 1.4e-6
  (none), 6.8e-5 (fp16), 7.8e-4 (int8, tolerance 0.071), 1.7e-2 (int4, tolerance 1.3); up to
  4.5e-4 (fp16) and 8.4e-3 (int8) with other weights. At int4 and below the end-to-end bound
  says little; the two checks above still pin every stage and every boundary down exactly.

The losses are means of per-batch means over the pipeline's validation batches, as
:meth:`agent.runtime.stage.StageRunner.evaluate` computes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from silentswarm.agent.errors import GlueMismatchError
from silentswarm.agent.pipe.wire import CodecKind, WireCodec, parse_wire_codec
from silentswarm.agent.runtime.tfsetup import graph_function
from silentswarm.types.manifests import GlueCheck

if TYPE_CHECKING:
    import numpy as np

    from silentswarm.agent.runtime.model import GluedTransformer
    from silentswarm.agent.runtime.stage_model import StageModel

STAGE_RTOL = 1e-3  # per stage and end to end without a lossy codec, times max(1, max|ref|)
CODEC_MISMATCH_FRACTION = 1e-4


def end_to_end_rtol(wire: str) -> float:
    """The end-to-end tolerance, relative to ``max(1, max|logits|)`` (see the module doc)."""
    codec = parse_wire_codec(wire)
    if codec.kind is CodecKind.NONE:
        return STAGE_RTOL
    if codec.kind is CodecKind.FP16:
        return 1e-2
    assert codec.qmax is not None
    return max(1e-2, 2.0 / codec.qmax)


def _codec_step(codec: WireCodec, sent: np.ndarray) -> np.ndarray:
    """Per row, the largest difference one rounding flip of the codec can make."""
    import numpy as np

    rows = np.max(np.abs(sent), axis=-1, keepdims=True)
    if codec.kind is CodecKind.FP16:
        return rows * 2.0**-10 + 2.0**-24
    assert codec.qmax is not None
    return rows / codec.qmax * 1.01 + 2.0**-24


class Chain:
    """The restored stage models run like the pipeline runs them, numpy wire codec between."""

    def __init__(self, models: list[StageModel]) -> None:

        from silentswarm.agent.runtime.model import HEADS
        from silentswarm.compression import parse_compression

        self.models = models
        last = models[-1]
        spec = parse_compression(last.plan.compression, d_model=last.plan.model.d_model)
        self.codec = parse_wire_codec(spec.wire)

        def logits(x):
            for piece in last.pieces:
                layer = piece.layer
                if isinstance(layer, HEADS):
                    return layer(x)
                x = layer(x, training=False) if layer.name.startswith("block_") else layer(x)
            raise AssertionError("the last stage has no head")

        # The last stage's forward as StageModel compiles it (the pipeline asks it for the
        # loss only; here the logits are wanted too).
        self.last_logits = graph_function(
            logits, reduce_retracing=True, jit_compile=last.plan.train.jit_compile
        )

    def wire(self, array: np.ndarray, *, step: int = 0, micro: int = 0) -> np.ndarray:
        """What the next stage receives: encoded into a frame, over "the wire", decoded."""
        from silentswarm.agent.pipe.wire import Direction, decode_frame, encode_frame

        plan = self.models[0].plan
        _, parts = encode_frame(
            array,
            self.codec,
            job=plan.job_id,
            attempt=plan.attempt,
            step=step,
            micro=micro,
            direction=Direction.FWD,
            phase="eval",
        )
        return decode_frame([bytes(part) for part in parts]).array

    def run(self, tokens: np.ndarray, targets: np.ndarray | None = None):
        """Each stage's input and output (numpy) and the last stage's loss, if targets."""
        import numpy as np
        import tensorflow as tf

        inputs, outputs = [], []
        x: np.ndarray = tokens
        loss = None
        for model in self.models:
            inputs.append(x)
            if model.plan.is_last:
                outputs.append(self.last_logits(tf.constant(x)).numpy())
                if targets is not None:
                    loss = float(
                        model.forward_loss(tf.constant(x), tf.constant(targets), training=False)
                    )
            else:
                out = model.forward(tf.constant(x), training=False).numpy()
                outputs.append(out)
                x = self.wire(np.ascontiguousarray(out, dtype=np.float32))
        return inputs, outputs, loss


@dataclass
class CheckResult:
    batches: int
    max_abs_diff: float
    tolerance: float
    logit_scale: float  # R = max(1, max|reference logits|)
    stage_max_abs_diff: list[float]
    stage_tolerance: list[float]
    codec_mismatches: list[int]
    codec_elements: list[int]
    val_loss: float | None
    chain_val_loss: float | None
    reference_logits: np.ndarray  # of the first batch, for the reload check
    first_batch: np.ndarray

    def summary(self, reload_max_abs_diff: float) -> GlueCheck:
        """What the inference manifest records, with the saved model's reload difference."""
        return GlueCheck(
            batches=self.batches,
            max_abs_diff=self.max_abs_diff,
            tolerance=self.tolerance,
            logit_scale=self.logit_scale,
            stage_max_abs_diff=self.stage_max_abs_diff,
            stage_tolerance=self.stage_tolerance,
            codec_mismatches=self.codec_mismatches,
            codec_elements=self.codec_elements,
            reload_max_abs_diff=reload_max_abs_diff,
        )


def check_and_evaluate(
    glued: GluedTransformer,
    chain: Chain,
    batches: list[tuple[np.ndarray, np.ndarray]],
    *,
    score: bool,
) -> CheckResult:
    """Compare the glued model with the chain on ``batches``; GlueMismatchError if it differs.

    With ``score`` the batches are the pipeline's validation batches and both losses are
    computed (means of per-batch means, as :meth:`StageRunner.evaluate` does).
    """
    import numpy as np
    import tensorflow as tf

    from silentswarm.agent.runtime.model import token_loss

    n = len(chain.models)
    codec = chain.codec
    forward = graph_function(lambda t: glued(t, training=False), reduce_retracing=True)
    stage_fns = [
        graph_function(
            lambda x, s=s: glued.stage_forward(s, x, training=False), reduce_retracing=True
        )
        for s in range(n)
    ]
    codec_fn = graph_function(glued.wire, reduce_retracing=True)
    stage_diff = [0.0] * n
    stage_scale = [1.0] * n
    mismatches, elements = [0] * (n - 1), [0] * (n - 1)
    worst, scale = 0.0, 1.0
    glued_losses, chain_losses = [], []
    first_logits = None
    for tokens, targets in batches:
        inputs, outputs, chain_loss = chain.run(tokens, targets if score else None)
        for s in range(n):
            got = stage_fns[s](tf.constant(inputs[s])).numpy()
            stage_diff[s] = max(stage_diff[s], float(np.max(np.abs(got - outputs[s]))))
            stage_scale[s] = max(stage_scale[s], float(np.max(np.abs(outputs[s]))))
            if s + 1 < n:
                mine = codec_fn(tf.constant(outputs[s])).numpy()
                differ = mine != inputs[s + 1]
                mismatches[s] += int(differ.sum())
                elements[s] += int(differ.size)
                if differ.any() and (
                    codec.kind is CodecKind.NONE
                    or (np.abs(mine - inputs[s + 1]) > _codec_step(codec, outputs[s])).any()
                ):
                    raise GlueMismatchError(
                        f"boundary {s}: the glued model's {codec.name} codec gives "
                        f"{np.max(np.abs(mine - inputs[s + 1])):.3g} away from the wire's on "
                        f"{int(differ.sum())} of {differ.size} values"
                    )
        logits = forward(tf.constant(tokens)).numpy()
        reference = outputs[-1]
        worst = max(worst, float(np.max(np.abs(logits - reference))))
        scale = max(scale, float(np.max(np.abs(reference))))
        if first_logits is None:
            first_logits = logits
        if score:
            glued_losses.append(float(token_loss(tf.constant(logits), tf.constant(targets))))
            chain_losses.append(chain_loss)
    stage_tol = [STAGE_RTOL * s for s in stage_scale]
    for s in range(n):
        if not stage_diff[s] <= stage_tol[s]:  # NaN fails too
            raise GlueMismatchError(
                f"stage {s}: the glued model's part differs from the stage model by "
                f"{stage_diff[s]:.3g} (max abs difference; tolerance {stage_tol[s]:.3g}) on "
                f"the same input"
            )
    for s in range(n - 1):
        if mismatches[s] > max(1, CODEC_MISMATCH_FRACTION * elements[s]):
            raise GlueMismatchError(
                f"boundary {s}: the glued model's {codec.name} codec differs from the wire's on "
                f"{mismatches[s]} of {elements[s]} values"
            )
    tolerance = end_to_end_rtol(codec.name) * scale
    if not worst <= tolerance:
        raise GlueMismatchError(
            f"the glued model's logits differ from the pipeline's by {worst:.3g} (max abs "
            f"difference; tolerance {tolerance:.3g} for compression {glued.compression!r})"
        )
    assert first_logits is not None
    return CheckResult(
        batches=len(batches),
        max_abs_diff=worst,
        tolerance=tolerance,
        logit_scale=scale,
        stage_max_abs_diff=stage_diff,
        stage_tolerance=stage_tol,
        codec_mismatches=mismatches,
        codec_elements=elements,
        val_loss=sum(glued_losses) / len(glued_losses) if glued_losses else None,
        chain_val_loss=sum(chain_losses) / len(chain_losses) if chain_losses else None,
        reference_logits=first_logits,
        first_batch=batches[0][0],
    )
