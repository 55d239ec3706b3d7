"""The numbers of a finished job that sweeps and suites record (pure): bytes on the wire per
step per stage boundary, and the compression they achieved against float32."""

from __future__ import annotations

from silentswarm.compression import parse_compression
from silentswarm.jobspec import JobSpec
from silentswarm.types.jobs import JobRecord

# What a finished job gives a sweep's CSV row and a suite's summary, in that order.
RESULT_FIELDS = (
    "final_loss",
    "final_val_loss",
    "tokens_per_s",
    "step_time_s",
    "bytes_per_step_per_boundary",
    "compression_ratio_vs_fp32",
)

FP32_BYTES = 4


def n_boundaries(job: JobRecord) -> int:
    """The job's boundaries: each replica's pipeline has ``stages - 1``."""
    if job.placement is not None and job.placement.stages:
        return job.placement.n_replicas * (job.placement.n_stages - 1)
    return max(len(job.progress) - 1, 0)


def steps_done(job: JobRecord) -> int:
    """Steps every stage finished (the pipeline's step)."""
    return job.current_view().step or 0


def bytes_per_step_per_boundary(job: JobRecord) -> float | None:
    """Bytes on the wire per optimizer step per stage boundary, both directions (activations
    forward, gradients back): every stage's ``bytes_sent`` summed, over steps and boundaries.
    None for a single stage (no wire) or before a step."""
    boundaries, steps = n_boundaries(job), steps_done(job)
    if boundaries == 0 or steps == 0:
        return None
    return job.current_view().bytes_sent / steps / boundaries


def fp32_bytes_per_step_per_boundary(spec: JobSpec) -> float:
    """What an uncompressed boundary carries per step: the float32 activations of the whole
    batch forward and their gradients back (``2 * batch * seq_len * d_model * 4``)."""
    return 2.0 * spec.batch_size * spec.model.seq_len * spec.model.d_model * FP32_BYTES


def nominal_compression_ratio(compression: str, d_model: int) -> float:
    """fp32 bytes over the codec's payload bytes per value, ignoring headers and scales: what
    the spec promises (the measured ratio also pays for frames, scales and validation)."""
    return parse_compression(compression, d_model=d_model).ratio(d_model)


def compression_ratio(job: JobRecord) -> float | None:
    """Measured: fp32 bytes per step per boundary over the bytes actually sent."""
    measured = bytes_per_step_per_boundary(job)
    if not measured:
        return None
    return fp32_bytes_per_step_per_boundary(job.spec) / measured
