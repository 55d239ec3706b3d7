"""The codec table: every compression spec of a stage boundary, parsed once into a typed spec.

A compression spec is a public string, kept as is in job specs, stage plans, job records and
manifests: ``auto``, ``none``, ``fp16``, ``fixed_intN`` (N in 2..8), ``learned_dimK``,
``learned_dimK_intN`` and ``learned_dimK_fp16``. ``auto`` lets each boundary direction choose
its wire codec from its measured link (``agent/runtime/tuning.py``). A learned spec puts a trained
down-projection to K dims at the end of stage k and an up-projection at the start of stage
k+1; the wire codec then applies to the K-dim tensor.

:class:`CodecKind` keys :data:`CODECS`, what each wire codec is (its bits per value, whether it
loses information); ``agent/pipe/wire.py`` keys its encoders by the same enum. Everything
that reads a spec (the job spec's and the plan's checks, the runtime, the glue, sweeps) calls
:func:`parse_compression` or :func:`parse_wire_codec` here and reads the properties of what
they return, never the string.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from silentswarm.errors import ConfigError

FP32_BITS = 32  # what an uncompressed value takes: the reference of every ratio
MIN_INT_BITS = 2
MAX_INT_BITS = 8


class CodecKind(enum.StrEnum):
    """The wire codecs: how a boundary tensor's values are encoded."""

    NONE = "none"  # float32 as is
    FP16 = "fp16"  # cast to float16
    INT = "int"  # fixed_intN: per-row absmax scales, N bits packed, N in 2..8


@dataclass(frozen=True)
class CodecInfo:
    """One row of the table: what a wire codec of this kind is."""

    bits: int | None  # bits per value on the wire; None: the spec's N
    lossy: bool


CODECS: Mapping[CodecKind, CodecInfo] = MappingProxyType(
    {
        CodecKind.NONE: CodecInfo(bits=FP32_BITS, lossy=False),
        CodecKind.FP16: CodecInfo(bits=16, lossy=True),
        CodecKind.INT: CodecInfo(bits=None, lossy=True),
    }
)

AUTO = "auto"
_WIRE_ACCEPTED = f"none, fp16, fixed_intN (N {MIN_INT_BITS}-{MAX_INT_BITS})"
ACCEPTED = f"{AUTO}, {_WIRE_ACCEPTED}, learned_dimN, learned_dimN_intK, learned_dimN_fp16"
_FIXED = re.compile(rf"fixed_int([{MIN_INT_BITS}-{MAX_INT_BITS}])")
_LEARNED = re.compile(
    rf"learned_dim([1-9][0-9]*)(?:_(?:int([{MIN_INT_BITS}-{MAX_INT_BITS}])|(fp16)))?"
)


@dataclass(frozen=True)
class WireCodec:
    """How a tensor is encoded on the wire. ``bits`` is 32 for NONE, 16 for FP16, N for INT."""

    kind: CodecKind
    bits: int = FP32_BITS

    def __post_init__(self) -> None:
        kind = CodecKind(self.kind)
        object.__setattr__(self, "kind", kind)
        fixed = CODECS[kind].bits
        if fixed is None:
            if not MIN_INT_BITS <= self.bits <= MAX_INT_BITS:
                raise ValueError(
                    f"fixed_intN needs N in {MIN_INT_BITS}..{MAX_INT_BITS}, got bits={self.bits}"
                )
        elif self.bits != fixed:
            raise ValueError(f"codec {kind.value!r} has {fixed} bits, got {self.bits}")

    @property
    def name(self) -> str:
        """The spec string: ``none``, ``fp16``, ``fixed_int8``, ``fixed_int4``, ..."""
        if self.kind is CodecKind.INT:
            return f"fixed_int{self.bits}"
        return self.kind.value

    @property
    def lossy(self) -> bool:
        return CODECS[self.kind].lossy

    @property
    def int_bits(self) -> int | None:
        """N for ``fixed_intN``; None for the float codecs."""
        return self.bits if self.kind is CodecKind.INT else None

    @property
    def qmax(self) -> int | None:
        """The largest quantized magnitude of ``fixed_intN`` (``2**(N-1) - 1``); None otherwise."""
        return None if self.kind is not CodecKind.INT else (1 << (self.bits - 1)) - 1

    @property
    def ratio(self) -> float:
        """float32 bits over the codec's bits per value (payload only: no headers, scales)."""
        return FP32_BITS / self.bits

    def __str__(self) -> str:
        return self.name


# The codecs of one width, by spec string: ``none`` and ``fp16``.
_FIXED_WIDTH = {k.value: WireCodec(k, r.bits) for k, r in CODECS.items() if r.bits is not None}


@dataclass(frozen=True)
class CompressionSpec:
    """A parsed compression spec: its wire codec and its learned bottleneck, if any."""

    spec: str
    codec: WireCodec
    bottleneck_dim: int | None = None
    # "auto": each boundary direction's codec is chosen from the measured link
    # (agent/runtime/tuning.py); ``codec`` is the one used until then.
    auto: bool = False

    @property
    def wire(self) -> str:
        """The wire codec's spec string (what frames, manifests and ``WireRoundTrip`` carry)."""
        return self.codec.name

    @property
    def learned(self) -> bool:
        return self.bottleneck_dim is not None

    @property
    def lossy(self) -> bool:
        """Whether a boundary changes the activations (a bottleneck or a lossy wire codec,
        which "auto" may choose)."""
        return self.learned or self.codec.lossy or self.auto

    def dims(self, d_model: int) -> int:
        """Values per position on the wire: the bottleneck's, else the model's width."""
        return self.bottleneck_dim or d_model

    def ratio(self, d_model: int) -> float:
        """fp32 bytes over the payload bytes per position, ignoring headers and scales: what
        the spec promises (a measured ratio also pays for frames, scales and validation)."""
        return (FP32_BITS * d_model) / (self.codec.bits * self.dims(d_model))


def parse_wire_codec(spec: str, *, what: str = "unknown wire codec") -> WireCodec:
    """A wire codec (``none``, ``fp16``, ``fixed_intN``): exact and case-sensitive, it is a
    public interface. ConfigError naming ``what``, the spec and the accepted forms otherwise."""
    if isinstance(spec, str):
        if spec in _FIXED_WIDTH:
            return _FIXED_WIDTH[spec]
        if match := _FIXED.fullmatch(spec):
            return WireCodec(CodecKind.INT, int(match.group(1)))
    hint = ""
    if isinstance(spec, str) and spec.startswith("learned_"):
        hint = " (learned_dimN specs are compressions: pass only their wire part)"
    raise ConfigError(f"{what} {spec!r} is not one of: {_WIRE_ACCEPTED}{hint}")


def parse_compression(spec: str, *, d_model: int | None = None) -> CompressionSpec:
    """The parsed spec; ConfigError naming the spec and the accepted forms otherwise.

    With ``d_model``, a bottleneck must also be narrower than the model. ``auto`` starts with
    ``none`` on the wire.
    """
    if spec == AUTO:
        return CompressionSpec(spec=spec, codec=_FIXED_WIDTH[CodecKind.NONE.value], auto=True)
    match = _LEARNED.fullmatch(spec) if isinstance(spec, str) else None
    if match is None:
        try:
            return CompressionSpec(spec=spec, codec=parse_wire_codec(spec))
        except ConfigError:
            raise ConfigError(f"compression {spec!r} is not one of: {ACCEPTED}") from None
    dim, int_bits, fp16 = int(match.group(1)), match.group(2), match.group(3)
    if d_model is not None and dim >= d_model:
        raise ConfigError(
            f"compression {spec!r}: the bottleneck ({dim}) must be smaller than d_model ({d_model})"
        )
    if int_bits is not None:
        codec = WireCodec(CodecKind.INT, int(int_bits))
    else:
        codec = _FIXED_WIDTH[fp16 or CodecKind.NONE.value]
    return CompressionSpec(spec=spec, codec=codec, bottleneck_dim=dim)
