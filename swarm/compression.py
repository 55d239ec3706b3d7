"""Compression specs for stage boundaries: a public string interface kept in job records.

``none``, ``fp16``, ``fixed_intN`` (N in 2..8), ``learned_dimN``, ``learned_dimN_int8``
(any ``_intN``), ``learned_dimN_fp16``. A learned spec puts a trained down-projection to N
dims at the end of stage k and an up-projection at the start of stage k+1; the wire codec
then applies to the N-dim tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from swarm.errors import ConfigError

_FIXED = re.compile(r"^fixed_int([2-8])$")
_LEARNED = re.compile(r"^learned_dim([1-9][0-9]*)(?:_(int[2-8]|fp16))?$")
ACCEPTED = "none, fp16, fixed_intN (N 2-8), learned_dimN, learned_dimN_intK, learned_dimN_fp16"


@dataclass(frozen=True)
class CompressionSpec:
    spec: str
    wire: str  # the wire codec of agent/pipe/wire.py: none | fp16 | fixed_intN
    bottleneck_dim: int | None = None


def _is_wire_spec(spec: str) -> bool:
    return spec in ("none", "fp16") or _FIXED.fullmatch(spec) is not None


def parse_wire_spec(spec: str) -> str:
    """A gradient codec: only the wire forms (``none``, ``fp16``, ``fixed_intN``)."""
    if _is_wire_spec(spec):
        return spec
    raise ConfigError(f"grad_compression {spec!r} is not one of: none, fp16, fixed_intN (N 2-8)")


def parse_compression(spec: str, *, d_model: int | None = None) -> CompressionSpec:
    """The parsed spec; ConfigError naming the spec and the accepted forms otherwise."""
    if _is_wire_spec(spec):
        return CompressionSpec(spec=spec, wire=spec)
    match = _LEARNED.fullmatch(spec)
    if match is None:
        raise ConfigError(f"compression {spec!r} is not one of: {ACCEPTED}")
    dim = int(match.group(1))
    if d_model is not None and dim >= d_model:
        raise ConfigError(
            f"compression {spec!r}: the bottleneck ({dim}) must be smaller than d_model ({d_model})"
        )
    suffix = match.group(2)
    wire = "none" if suffix is None else ("fp16" if suffix == "fp16" else f"fixed_{suffix}")
    return CompressionSpec(spec=spec, wire=wire, bottleneck_dim=dim)
