"""Frames and wire codecs for tensors crossing a pipeline boundary.

A frame is a list of parts, sent as one ZeroMQ multipart message (or relayed in chunks):

``[header, payload]`` for ``none`` and ``fp16``; ``[header, payload, scales]`` for
``fixed_intN``; a forward frame (activations, train or eval phase) has its micro-batch's
target token ids as one more, last part: ``[header, payload(, scales), targets]``.

- ``header``: msgpack of :class:`FrameHeader` (a map, so unknown fields from a newer peer are
  ignored; ``v`` is checked before anything else).
- ``payload``:
  ``none``  -- the float32 tensor's bytes, C order, native (little-endian) byte order; sent from
  the array's own buffer without a copy.
  ``fp16``  -- the tensor times ``2**shift`` (the header's ``shift``), cast to float16, C order;
  the decoder multiplies by ``2**-shift``. The sender picks the shift that puts the tensor's
  absmax in ``[2**14, 2**15)`` (:func:`fp16_shift`): a power of two changes no rounding in
  float16's normal range, and it keeps gradients, whose values late in a run are ~1e-6 to
  1e-5, out of float16's subnormals (below 6.1e-5), where they kept only a few bits.
  ``fixed_intN`` -- per element ``u = q + qmax`` (``qmax = 2**(N-1) - 1``, so ``0 <= u < 2**N``),
  packed densely at N bits per value, LSB first: value ``i`` occupies bits ``i*N .. i*N+N-1`` of
  the little-endian bit stream (bit ``b`` lives in byte ``b // 8`` at bit ``b % 8``). The payload
  is ``ceil(count * N / 8)`` bytes; the pad bits of the last byte are zero.
- ``scales``: one bfloat16 per row (``rows = prod(shape[:-1])``), ``x ~= q * scale``: the upper
  16 bits of the float32 scale, as little-endian uint16. bfloat16, not float16: the gradients
  a boundary sends back shrink as a run trains (the speed model's rows: absmax ~3e-3 at step
  0, 5e-6 to 7e-5 by step 29), and their scales (absmax / 127) fall below float16's smallest
  normal (6.1e-5) and then its smallest subnormal (6e-8), where rounding the scale up costs
  int8 one to several of its bits; bfloat16 has float32's range with 8 significant bits.
- ``targets``: the token ids the last stage scores this micro-batch's activations against,
  ``prod(shape[:-1])`` of them (one per position: the activations' shape without its last
  axis), as little-endian unsigned integers of the header's ``targets_dtype``, sent as they
  are whatever the codec. Only stage 0 reads data: the ids travel down the chain with the
  activations, every middle stage passing them on unchanged. The sender takes the smallest of
  ``uint8``, ``uint16``, ``uint32`` that holds the vocabulary (:func:`token_dtype`: ``uint8``
  for today's 256 byte tokens); ``targets_nbytes`` is the part's size. A frame without
  targets (a backward frame, always) has ``targets_dtype`` ``""`` and no such part. A
  receiver that knows the vocabulary (every stage does: the model config) refuses an id
  outside it.

An eval frame also says how many batches its validation pass has (``eval_batches``), so the
stages after stage 0 know when the pass ends without reading the data; a pass without a
batch is one frame of zero rows with ``eval_batches`` 0.

The codecs themselves (:class:`CodecKind`, :class:`WireCodec`, :func:`parse_wire_codec`) are
the codec table's, ``swarm/compression.py`` (pure Python); the rest is numpy and msgspec
only: no TensorFlow.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Annotated, Any, NamedTuple, Protocol

import msgspec
import numpy as np

from silentswarm.agent.errors import FrameError
from silentswarm.compression import (
    MAX_INT_BITS,
    MIN_INT_BITS,
    CodecKind,
    WireCodec,
    parse_wire_codec,
)
from silentswarm.errors import ConfigError

__all__ = [
    "MAX_SHIFT",
    "PROTOCOL_VERSION",
    "SCALE_MAX",
    "SCALE_MIN",
    "TARGET_DTYPES",
    "CodecKind",
    "Direction",
    "Frame",
    "FrameHeader",
    "WireCodec",
    "bfloat16_up",
    "bfloat16_value",
    "decode_frame",
    "dequantize",
    "encode_frame",
    "encoded_nbytes",
    "fp16_shift",
    "frame_nbytes",
    "pack_bits",
    "parse_wire_codec",
    "quantize",
    "token_dtype",
    "token_ids",
    "unpack_bits",
]

# 2: fixed_intN's scales are bfloat16 (version 1: float16); forward frames carry their
# targets, eval frames their pass's batch count.
PROTOCOL_VERSION = 2

# Scales are bfloat16. Clamp them into [smallest normal, largest finite] so a zero row gets a
# positive scale (decodes to exact zeros, never 0/0) and a huge row saturates instead of
# turning into inf.
SCALE_MIN = float(np.finfo(np.float32).tiny)  # 2**-126, bfloat16's smallest normal too
SCALE_MAX = float(np.uint32(0x7F7F0000).view(np.float32))  # bfloat16's largest, ~3.39e38
# fp16's shifts stay within float32's normal powers of two, so 2**shift is exact both ways.
MAX_SHIFT = 100
# A frame is at most a batch x sequence x width tensor (a ring's, a flat vector); numpy takes
# rank 64 at most and sizes below 2**63: a stranger's header must not reach either limit.
MAX_RANK = 8
MAX_DIM = 2**31
# The dtypes target ids travel as, by name (little-endian on the wire), smallest first.
TARGET_DTYPES: dict[str, np.dtype] = {
    "uint8": np.dtype("<u1"),
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
}


class Direction(enum.StrEnum):
    FWD = "fwd"
    BWD = "bwd"


# A header is a peer's: its strings and its shape are bounded when it is decoded, so a
# hostile peer's header costs what an honest one does (it is parsed, and may be logged,
# before anything else is checked).
Word = Annotated[str, msgspec.Meta(max_length=32)]


class FrameHeader(msgspec.Struct, kw_only=True):
    v: int = PROTOCOL_VERSION
    job: Annotated[str, msgspec.Meta(max_length=64)]  # the job's id (protocol.Id)
    attempt: int
    step: int
    micro: int
    direction: Direction
    phase: Word = "train"  # "train" or "eval" (forward-only validation passes)
    dtype: Word  # dtype of the decoded tensor; always "float32" for now
    shape: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_RANK)]
    codec: Annotated[str, msgspec.Meta(max_length=64)]  # WireCodec.name
    bits: int
    payload_nbytes: int
    scales_nbytes: int  # 0 unless INT
    shift: int = 0  # fp16: the payload is the tensor times 2**shift
    # Forward frames: the targets part's dtype (a TARGET_DTYPES name) and size; "" and 0: none.
    targets_dtype: Word = ""
    targets_nbytes: int = 0
    # Forward eval frames: how many batches the validation pass has (stage 0 counts them).
    eval_batches: int = 0


class Frame(NamedTuple):
    """A decoded frame: its header, the float32 tensor and, on a forward frame, the
    micro-batch's target token ids (shaped like the tensor without its last axis)."""

    header: FrameHeader
    array: np.ndarray
    targets: np.ndarray | None


class _Version(msgspec.Struct):
    """Only the version, read first so a newer header gets a version error, not a field error."""

    v: int = -1


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(FrameHeader)
_version_decoder = msgspec.msgpack.Decoder(_Version)


# ---------------------------------------------------------------------------------------------
# Bit packing and quantization


def _check_bits(bits: int, lo: int = 1) -> None:
    if not lo <= bits <= MAX_INT_BITS:
        raise ValueError(f"bits must be in {lo}..{MAX_INT_BITS}, got {bits}")


def _packed_nbytes(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def pack_bits(u: np.ndarray, bits: int) -> np.ndarray:
    """Pack uint8 values ``< 2**bits`` densely, ``bits`` per value, LSB first.

    Returns a 1-D uint8 array of ``ceil(u.size * bits / 8)`` bytes. Works on groups of 8 values,
    which fill exactly ``bits`` bytes: the group is assembled into one little-endian uint64.
    """
    _check_bits(bits)
    flat = np.ascontiguousarray(u).reshape(-1)
    if flat.dtype != np.uint8:
        raise ValueError(f"pack_bits needs uint8 values, got {flat.dtype}")
    if flat.size and int(flat.max()) >> bits:
        raise ValueError(f"value {int(flat.max())} does not fit in {bits} bits")
    if bits == 8:
        return flat.copy()
    count = flat.size
    groups = -(-count // 8)
    padded = np.zeros(groups * 8, dtype=np.uint64)
    padded[:count] = flat
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(bits)
    words = (padded.reshape(groups, 8) << shifts).sum(axis=1, dtype=np.uint64)
    packed = words.astype("<u8").view(np.uint8).reshape(groups, 8)[:, :bits]
    return packed.reshape(-1)[: _packed_nbytes(count, bits)].copy()


def unpack_bits(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: ``count`` uint8 values from exactly the packed bytes."""
    _check_bits(bits)
    flat = np.ascontiguousarray(packed).reshape(-1)
    if flat.dtype != np.uint8:
        raise ValueError(f"unpack_bits needs uint8 bytes, got {flat.dtype}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    expected = _packed_nbytes(count, bits)
    if flat.size != expected:
        raise ValueError(
            f"{count} values at {bits} bits need {expected} bytes, got {flat.size} bytes"
        )
    if bits == 8:
        return flat.copy()
    groups = -(-count // 8)
    raw = np.zeros((groups, 8), dtype=np.uint8)
    padded = np.zeros(groups * bits, dtype=np.uint8)
    padded[: flat.size] = flat
    raw[:, :bits] = padded.reshape(groups, bits)
    words = raw.view("<u8")  # (groups, 1)
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(bits)
    values = (words >> shifts) & np.uint64((1 << bits) - 1)
    return values.astype(np.uint8).reshape(-1)[:count]


def _rows(x: np.ndarray) -> np.ndarray:
    """View ``x`` as (rows, last_dim): every axis but the last is a row axis."""
    if x.ndim < 1:
        raise ValueError("need an array of rank >= 1")
    return x.reshape(-1, x.shape[-1]) if x.shape[-1] else x.reshape(math.prod(x.shape[:-1]), 0)


def _qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def bfloat16_up(x: np.ndarray) -> np.ndarray:
    """The smallest bfloat16 ``>= x`` for positive finite float32 ``x`` (at most
    :data:`SCALE_MAX`), as its 16 bits: the upper half of the float32, plus one ulp unless the
    lower half is zero. Integer ops only, which ``WireRoundTrip`` repeats bit for bit."""
    raw = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((raw >> 16) + ((raw & 0xFFFF) != 0)).astype(np.uint16)


def bfloat16_value(u: np.ndarray) -> np.ndarray:
    """The float32 values of bfloat16 bit patterns (uint16)."""
    return (np.asarray(u, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def quantize(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row absmax quantization to ``bits`` bits.

    Returns ``(q, scales)``: ``q`` int8 shaped like ``x`` with values in ``[-qmax, qmax]`` and
    ``scales`` float32 of shape ``(rows,)``, each a bfloat16 value, so that ``x ~= q * scale``
    with an error of at most ``scale / 2`` per element. The scale is ``absmax / qmax`` rounded
    *up* to bfloat16 (at most 2**-7 relative), so no value is clipped by the rounding; it is
    clamped to ``[SCALE_MIN, SCALE_MAX]`` (a zero row decodes to exact zeros). Non-finite input
    raises ValueError: NaN or inf have no integer code, and hiding them would hide a diverging
    step.
    """
    _check_bits(bits, MIN_INT_BITS)
    x2 = _rows(np.asarray(x, dtype=np.float32))
    qmax = _qmax(bits)
    absmax = np.max(np.abs(x2), axis=1, initial=0.0)
    if not np.all(np.isfinite(absmax)):
        raise ValueError("cannot quantize non-finite values (NaN or inf)")
    wanted = np.clip(absmax / np.float32(qmax), SCALE_MIN, SCALE_MAX).astype(np.float32)
    scales = bfloat16_value(bfloat16_up(wanted))
    q = np.rint(x2 / scales[:, None])
    np.clip(q, -qmax, qmax, out=q)
    return q.astype(np.int8).reshape(np.shape(x)), scales


def dequantize(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``q * scale`` per row, as float32 shaped like ``q``."""
    q = np.asarray(q)
    q2 = _rows(q)
    scales = np.asarray(scales).reshape(-1)
    if scales.size != q2.shape[0]:
        raise ValueError(f"{q2.shape[0]} rows but {scales.size} scales")
    out = q2.astype(np.float32) * scales.astype(np.float32)[:, None]
    return out.reshape(q.shape)


def fp16_shift(x: np.ndarray) -> int:
    """The power of two that puts ``x``'s absmax in ``[2**14, 2**15)``, within
    ``[-MAX_SHIFT, MAX_SHIFT]``: ``14 - floor(log2(absmax))``, read from the float32's exponent
    bits (a subnormal absmax counts as ``2**-127``); 0 for an all-zero or non-finite tensor
    (which casts as it is: NaN and inf stay what they are)."""
    if not x.size:
        return 0
    absmax = np.float32(np.max(np.abs(x)))
    if not np.isfinite(absmax) or absmax == 0:
        return 0
    exponent = int((absmax.view(np.uint32) >> 23) & 0xFF) - 127
    return max(-MAX_SHIFT, min(MAX_SHIFT, 14 - exponent))


# ---------------------------------------------------------------------------------------------
# Codec table


Buffer = bytes | bytearray | memoryview | np.ndarray


class _Codec(Protocol):
    def payload_nbytes(self, count: int, bits: int) -> int: ...

    def scales_nbytes(self, rows: int) -> int: ...

    def encode(self, x: np.ndarray, bits: int) -> tuple[Buffer, Buffer | None, int]:
        """``x`` is C-contiguous float32; returns (payload, scales or None, shift)."""
        ...

    def decode(
        self,
        payload: memoryview,
        scales: memoryview | None,
        shape: tuple[int, ...],
        bits: int,
        shift: int,
    ) -> np.ndarray:
        """Sizes and the shift's range have been checked; returns float32 of ``shape``."""
        ...


class _NoneCodec:
    def payload_nbytes(self, count: int, bits: int) -> int:
        return 4 * count

    def scales_nbytes(self, rows: int) -> int:
        return 0

    def encode(self, x: np.ndarray, bits: int) -> tuple[Buffer, Buffer | None, int]:
        # The array's own memory, as flat bytes: zero-copy; the caller must not modify the
        # array until the send has completed.
        return memoryview(x.reshape(-1)).cast("B"), None, 0

    def decode(
        self,
        payload: memoryview,
        scales: memoryview | None,
        shape: tuple[int, ...],
        bits: int,
        shift: int,
    ) -> np.ndarray:
        return np.frombuffer(payload, dtype=np.float32).reshape(shape)


class _Fp16Codec:
    def payload_nbytes(self, count: int, bits: int) -> int:
        return 2 * count

    def scales_nbytes(self, rows: int) -> int:
        return 0

    def encode(self, x: np.ndarray, bits: int) -> tuple[Buffer, Buffer | None, int]:
        shift = fp16_shift(x)
        shifted = x * np.float32(2.0**shift) if shift else x
        return shifted.astype(np.float16).reshape(-1).view(np.uint8), None, shift

    def decode(
        self,
        payload: memoryview,
        scales: memoryview | None,
        shape: tuple[int, ...],
        bits: int,
        shift: int,
    ) -> np.ndarray:
        values = np.frombuffer(payload, dtype=np.float16).astype(np.float32).reshape(shape)
        return values * np.float32(2.0**-shift) if shift else values


class _IntCodec:
    def payload_nbytes(self, count: int, bits: int) -> int:
        return _packed_nbytes(count, bits)

    def scales_nbytes(self, rows: int) -> int:
        return 2 * rows

    def encode(self, x: np.ndarray, bits: int) -> tuple[Buffer, Buffer | None, int]:
        q, scales = quantize(x, bits)
        u = (q.reshape(-1).astype(np.int16) + _qmax(bits)).astype(np.uint8)
        return pack_bits(u, bits), bfloat16_up(scales).astype("<u2").view(np.uint8), 0

    def decode(
        self,
        payload: memoryview,
        scales: memoryview | None,
        shape: tuple[int, ...],
        bits: int,
        shift: int,
    ) -> np.ndarray:
        assert scales is not None
        count = math.prod(shape)
        u = unpack_bits(np.frombuffer(payload, dtype=np.uint8), bits, count)
        q = u.astype(np.int16) - _qmax(bits)
        values = bfloat16_value(np.frombuffer(scales, dtype="<u2"))
        if not np.all(np.isfinite(values)) or np.any(values < 0):
            raise ValueError("scales must be finite and not negative")
        return dequantize(q.reshape(shape), values)


_CODECS: dict[CodecKind, _Codec] = {
    CodecKind.NONE: _NoneCodec(),
    CodecKind.FP16: _Fp16Codec(),
    CodecKind.INT: _IntCodec(),
}


def encoded_nbytes(codec: WireCodec, shape: tuple[int, ...]) -> int:
    """Bytes of payload and scales that a tensor of ``shape`` takes under ``codec`` (no
    header): what :func:`encode_frame` sends."""
    impl = _CODECS[codec.kind]
    return impl.payload_nbytes(math.prod(shape), codec.bits) + impl.scales_nbytes(
        math.prod(shape[:-1])
    )


# ---------------------------------------------------------------------------------------------
# Target ids


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a ``vocab_size`` vocabulary: the
    targets cost one byte per position for the byte vocabulary, not an int32's four (and a
    token cache's elements)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    for dtype in TARGET_DTYPES.values():
        if vocab_size <= 1 << (8 * dtype.itemsize):
            return dtype
    raise ValueError(f"no target dtype holds a vocabulary of {vocab_size} tokens")


def token_ids(targets: np.ndarray, vocab_size: int) -> np.ndarray:
    """``targets`` (integer token ids) as :func:`token_dtype`'s, for a forward frame.

    ValueError for an id outside ``[0, vocab_size)``: the data and the model disagree, and a
    wrapped id would train against the wrong token without a word."""
    ids = np.asarray(targets)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"target ids must be integers, got {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"target ids span [{int(ids.min())}, {int(ids.max())}], "
            f"outside the vocabulary of {vocab_size}"
        )
    return np.ascontiguousarray(ids, dtype=token_dtype(vocab_size))


def _targets_name(targets: np.ndarray, shape: tuple[int, ...]) -> str:
    """The header's name for ``targets``' dtype; ValueError unless it is one of
    :data:`TARGET_DTYPES` and the ids are shaped ``shape`` (the tensor's without its last
    axis)."""
    name = next((n for n, d in TARGET_DTYPES.items() if targets.dtype == d), None)
    if name is None:
        raise ValueError(f"targets must be one of {list(TARGET_DTYPES)}, got {targets.dtype}")
    if targets.shape != shape:
        raise ValueError(f"targets of shape {list(targets.shape)}, the frame needs {list(shape)}")
    return name


# ---------------------------------------------------------------------------------------------
# Frames


def encode_frame(
    array: np.ndarray,
    codec: WireCodec,
    *,
    job: str,
    attempt: int,
    step: int,
    micro: int,
    direction: Direction,
    phase: str = "train",
    targets: np.ndarray | None = None,
    eval_batches: int = 0,
) -> tuple[FrameHeader, list[memoryview | bytes]]:
    """Encode ``array`` (any rank >= 1) as ``[header_bytes, payload(, scales)(, targets)]``.

    ``targets`` (forward frames only): the micro-batch's target ids, shaped ``array.shape[:-1]``,
    of a :data:`TARGET_DTYPES` dtype (:func:`token_ids` makes them); sent from their own buffer.
    ``eval_batches``: on a forward eval frame, the number of batches of its validation pass.

    For ``none`` and a C-contiguous float32 array the payload is a memoryview of the array's own
    buffer: do not modify the array (or the targets) until the frame has been sent. Other dtypes
    or layouts are converted to C-contiguous float32 first (a copy). ValueError for targets on
    a backward frame or of the wrong dtype or shape.
    """
    x = np.ascontiguousarray(array, dtype=np.float32)
    if x.ndim < 1:
        raise ValueError("encode_frame needs an array of rank >= 1")
    direction = Direction(direction)
    if eval_batches and (direction is not Direction.FWD or phase != "eval"):
        raise ValueError("only a forward eval frame says how many batches its pass has")
    ids, ids_name = None, ""
    if targets is not None:
        if direction is not Direction.FWD:
            raise ValueError("only a forward frame carries targets")
        ids = np.ascontiguousarray(targets)
        ids_name = _targets_name(ids, x.shape[:-1])
    impl = _CODECS[codec.kind]
    payload, scales, shift = impl.encode(x, codec.bits)
    count = x.size
    rows = math.prod(x.shape[:-1])
    header = FrameHeader(
        job=job,
        attempt=int(attempt),
        step=int(step),
        micro=int(micro),
        direction=direction,
        phase=phase,
        dtype="float32",
        shape=tuple(int(d) for d in x.shape),
        codec=codec.name,
        bits=codec.bits,
        payload_nbytes=impl.payload_nbytes(count, codec.bits),
        scales_nbytes=impl.scales_nbytes(rows),
        shift=shift,
        targets_dtype=ids_name,
        targets_nbytes=0 if ids is None else ids.nbytes,
        eval_batches=int(eval_batches),
    )
    parts: list[memoryview | bytes] = [_header_encoder.encode(header), _as_bytes_view(payload)]
    if scales is not None:
        parts.append(_as_bytes_view(scales))
    if ids is not None:
        parts.append(_as_bytes_view(ids.reshape(-1)))
    return header, parts


def _as_bytes_view(buf: Any) -> memoryview:
    """A flat byte memoryview of ``buf`` (bytes, memoryview, numpy array or pyzmq Frame)."""
    buf = getattr(buf, "buffer", buf)  # pyzmq Frame
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")  # TypeError unless C-contiguous
    return view


def frame_nbytes(parts: Sequence[Any]) -> int:
    """Total bytes of all parts (header and targets included), i.e. what goes on the wire."""
    return sum(memoryview(getattr(p, "buffer", p)).nbytes for p in parts)


def _parse_header(part: Any) -> FrameHeader:
    try:
        version = _version_decoder.decode(part).v
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"bad frame header: {exc}") from None
    if version != PROTOCOL_VERSION:
        raise FrameError(
            f"frame protocol version {version}, this side speaks version {PROTOCOL_VERSION}"
        )
    try:
        return _header_decoder.decode(part)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"bad frame header: {exc}") from None


def frame_header(parts: Sequence[Any]) -> FrameHeader:
    """The header of the frame ``parts``, parsed alone: what a receiver checks (its job, its
    phase, its sender, its shape and codec, a signature) before it decodes a payload a
    stranger sized."""
    if not parts:
        raise FrameError("empty frame: no header part")
    try:
        view = _as_bytes_view(parts[0])
    except (TypeError, ValueError) as exc:
        raise FrameError(f"frame part is not a contiguous byte buffer: {exc}") from None
    return _parse_header(view)


def decode_frame(
    parts: Sequence[Any], *, vocab_size: int | None = None, header: FrameHeader | None = None
) -> Frame:
    """Decode ``[header, payload(, scales)(, targets)]`` into a :class:`Frame`.

    Parts may be bytes, bytearray, memoryview or pyzmq Frames (anything with ``.buffer``). For
    ``none`` the array is a (possibly read-only) view of the payload buffer, not a copy; the
    targets are always a read-only view of their part. With ``vocab_size`` a target id outside
    the vocabulary is refused. ``header``: the one :func:`frame_header` parsed from these
    parts already (it is not parsed again). Any inconsistency raises FrameError, never
    another exception type.
    """
    if header is None:
        header = frame_header(parts)
    try:
        views = [_as_bytes_view(p) for p in parts]
    except (TypeError, ValueError) as exc:
        raise FrameError(f"frame part is not a contiguous byte buffer: {exc}") from None
    codec = _header_codec(header)
    impl = _CODECS[codec.kind]
    shape = header.shape
    _check_sizes(header, codec, impl)
    ids_dtype = _check_extras(header)
    names = ["header", "payload"] + ["scales"] * (codec.kind is CodecKind.INT)
    names += ["targets"] * (ids_dtype is not None)
    if len(views) != len(names):
        raise FrameError(
            f"frame has {len(views)} parts, codec {codec.name!r} needs {len(names)} "
            f"({', '.join(names)})"
        )
    got = dict(zip(names, views, strict=True))
    payload = got["payload"]
    if payload.nbytes != header.payload_nbytes:
        raise FrameError(f"payload is {payload.nbytes} bytes, header says {header.payload_nbytes}")
    scales = got.get("scales")
    if scales is not None and scales.nbytes != header.scales_nbytes:
        raise FrameError(f"scales are {scales.nbytes} bytes, header says {header.scales_nbytes}")
    targets = None
    if ids_dtype is not None:
        targets = _decode_targets(got["targets"], header, ids_dtype, vocab_size)
    try:
        array = impl.decode(payload, scales, shape, codec.bits, header.shift)
    except (ValueError, TypeError) as exc:  # defensive: sizes were checked above
        raise FrameError(f"cannot decode {codec.name!r} payload: {exc}") from None
    return Frame(header, array, targets)


def _header_codec(header: FrameHeader) -> WireCodec:
    """The header's codec, checked against its bits, dtype and shape."""
    try:
        codec = parse_wire_codec(header.codec)
    except ConfigError as exc:
        raise FrameError(f"frame codec: {exc.message}") from None
    if header.bits != codec.bits:
        raise FrameError(
            f"frame codec {codec.name!r} has {codec.bits} bits, header says {header.bits}"
        )
    if header.dtype != "float32":
        raise FrameError(f"frame dtype {header.dtype!r} is not supported (only 'float32')")
    shape = header.shape
    if not 1 <= len(shape) <= MAX_RANK or any(not 0 <= d <= MAX_DIM for d in shape):
        raise FrameError(
            f"bad frame shape {list(shape)[: MAX_RANK + 1]}: need rank 1 to {MAX_RANK}, "
            f"sizes 0 to {MAX_DIM}"
        )
    if (header.shift and codec.kind is not CodecKind.FP16) or abs(header.shift) > MAX_SHIFT:
        raise FrameError(
            f"frame shift {header.shift}: only fp16 frames shift, by at most {MAX_SHIFT}"
        )
    return codec


def _check_sizes(header: FrameHeader, codec: WireCodec, impl: _Codec) -> None:
    """The payload and scales sizes the header claims are the ones its shape needs."""
    shape = header.shape
    want_payload = impl.payload_nbytes(math.prod(shape), codec.bits)
    want_scales = impl.scales_nbytes(math.prod(shape[:-1]))
    if header.payload_nbytes != want_payload:
        raise FrameError(
            f"header says payload_nbytes={header.payload_nbytes}, but shape {list(shape)} "
            f"with codec {codec.name!r} needs {want_payload}"
        )
    if header.scales_nbytes != want_scales:
        raise FrameError(
            f"header says scales_nbytes={header.scales_nbytes}, but shape {list(shape)} "
            f"with codec {codec.name!r} needs {want_scales}"
        )


def _check_extras(header: FrameHeader) -> np.dtype | None:
    """The targets' dtype (None: the frame has none) and size, and the eval batch count,
    checked against the header's direction, phase and shape."""
    forward_eval = header.direction is Direction.FWD and header.phase == "eval"
    if header.eval_batches < 0 or (header.eval_batches and not forward_eval):
        raise FrameError(
            f"frame says eval_batches={header.eval_batches}: only a forward eval frame counts "
            "its pass's batches, never below 0"
        )
    if not header.targets_dtype:
        if header.targets_nbytes:
            raise FrameError(f"header says targets_nbytes={header.targets_nbytes} but no dtype")
        return None
    dtype = TARGET_DTYPES.get(header.targets_dtype)
    if dtype is None:
        raise FrameError(
            f"frame targets dtype {header.targets_dtype!r} is not one of {list(TARGET_DTYPES)}"
        )
    if header.direction is not Direction.FWD:
        raise FrameError("a backward frame carries no targets")
    want = math.prod(header.shape[:-1]) * dtype.itemsize
    if header.targets_nbytes != want:
        raise FrameError(
            f"header says targets_nbytes={header.targets_nbytes}, but shape "
            f"{list(header.shape)} with {header.targets_dtype} targets needs {want}"
        )
    return dtype


def _decode_targets(
    part: memoryview, header: FrameHeader, dtype: np.dtype, vocab_size: int | None
) -> np.ndarray:
    """The targets part as ids shaped ``header.shape[:-1]``; FrameError on a size that is not
    the header's or, with ``vocab_size``, an id outside the vocabulary."""
    if part.nbytes != header.targets_nbytes:
        raise FrameError(f"targets are {part.nbytes} bytes, header says {header.targets_nbytes}")
    try:
        ids = np.frombuffer(part, dtype=dtype).reshape(header.shape[:-1])
    except ValueError as exc:  # defensive: the shape and size were checked
        raise FrameError(f"cannot shape the targets as {list(header.shape[:-1])}: {exc}") from None
    if vocab_size is not None and ids.size and int(ids.max()) >= vocab_size:
        raise FrameError(f"target id {int(ids.max())} is outside the vocabulary of {vocab_size}")
    return ids
