import contextlib
import math

import msgspec
import numpy as np
import pytest

from silentswarm.agent.errors import FrameError
from silentswarm.agent.pipe.wire import (
    PROTOCOL_VERSION,
    SCALE_MAX,
    TARGET_DTYPES,
    CodecKind,
    Direction,
    Frame,
    FrameHeader,
    WireCodec,
    bfloat16_up,
    bfloat16_value,
    decode_frame,
    dequantize,
    encode_frame,
    encoded_nbytes,
    frame_header,
    frame_nbytes,
    pack_bits,
    parse_wire_codec,
    quantize,
    token_dtype,
    token_ids,
    unpack_bits,
)
from silentswarm.errors import ConfigError

SHAPES = [(8, 64, 128), (3, 5), (1, 7)]
INT_BITS = range(2, 9)
META = dict(job="job-1", attempt=2, step=17, micro=3, direction=Direction.FWD)


def encode(x: np.ndarray, spec: str):
    return encode_frame(x, parse_wire_codec(spec), **META)


def roundtrip(x: np.ndarray, spec: str) -> np.ndarray:
    header, parts = encode(x, spec)
    # what the receiver sees: separate immutable byte strings
    got_header, y, targets = decode_frame([bytes(p) for p in parts])
    assert targets is None
    assert got_header == header
    assert y.dtype == np.float32
    assert y.shape == x.shape
    return y


def sample(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def reference_pack(values: list[int], bits: int) -> bytes:
    """The wire format spelled out: value i at bits i*N.., LSB first, little-endian bytes."""
    stream = 0
    for i, v in enumerate(values):
        stream |= v << (i * bits)
    return stream.to_bytes(math.ceil(len(values) * bits / 8), "little")


# -- codec specs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "kind", "bits"),
    [("none", CodecKind.NONE, 32), ("fp16", CodecKind.FP16, 16)]
    + [(f"fixed_int{n}", CodecKind.INT, n) for n in INT_BITS],
)
def test_parse_valid_specs(spec: str, kind: CodecKind, bits: int) -> None:
    codec = parse_wire_codec(spec)
    assert codec == WireCodec(kind, bits)
    assert codec.name == spec


@pytest.mark.parametrize(
    "spec",
    ["fixed_int1", "fixed_int9", "fixed_int08", "int8", "learned_dim8", "", "NONE", " fp16"],
)
def test_parse_invalid_specs(spec: str) -> None:
    with pytest.raises(ConfigError, match="fixed_intN") as info:
        parse_wire_codec(spec)
    assert repr(spec) in info.value.message


def test_wire_codec_rejects_inconsistent_bits() -> None:
    with pytest.raises(ValueError):
        WireCodec(CodecKind.INT)  # default 32 bits is not an int width
    with pytest.raises(ValueError):
        WireCodec(CodecKind.FP16, 32)
    with pytest.raises(ValueError):
        WireCodec(CodecKind.INT, 9)


# -- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_none_roundtrip_is_exact(shape: tuple[int, ...]) -> None:
    x = sample(shape)
    np.testing.assert_array_equal(roundtrip(x, "none"), x)


@pytest.mark.parametrize("shape", SHAPES)
def test_fp16_roundtrip_within_fp16_rounding(shape: tuple[int, ...]) -> None:
    x = sample(shape)
    # atol: half a float16 subnormal step, for the few values below float16's normal range
    np.testing.assert_allclose(roundtrip(x, "fp16"), x, rtol=1e-3, atol=2.0**-25)


def int_error_bound(x: np.ndarray, bits: int) -> np.ndarray:
    """scale / 2 per element, scale = row absmax / qmax rounded up to bfloat16 (2**-7)."""
    qmax = 2 ** (bits - 1) - 1
    rows = x.reshape(-1, x.shape[-1])
    scale = np.abs(rows).max(axis=1, keepdims=True) / qmax
    bound = scale / 2 * (1 + 2.0**-7) + 2.0**-127
    return np.broadcast_to(bound, rows.shape).reshape(x.shape)


@pytest.mark.parametrize("bits", INT_BITS)
@pytest.mark.parametrize("shape", SHAPES)
def test_int_roundtrip_error_is_half_a_step(shape: tuple[int, ...], bits: int) -> None:
    x = sample(shape, seed=bits)
    y = roundtrip(x, f"fixed_int{bits}")
    assert np.all(np.abs(y - x) <= int_error_bound(x, bits))


@pytest.mark.parametrize("bits", INT_BITS)
def test_int_zero_rows_and_mixed_magnitudes(bits: int) -> None:
    x = sample((6, 33), seed=bits)
    x[0] = 0.0
    x[1] *= 1e4
    x[2] *= 1e-3
    x[3] *= 1e-9  # below float16's scale resolution, well inside bfloat16's
    x[4, 5] = 3e4  # one outlier dominates its row
    y = roundtrip(x, f"fixed_int{bits}")
    assert np.all(np.isfinite(y))
    np.testing.assert_array_equal(y[0], np.zeros(33, dtype=np.float32))
    assert np.all(np.abs(y - x) <= int_error_bound(x, bits))


def test_all_zero_tensor_decodes_to_zeros() -> None:
    x = np.zeros((4, 16), dtype=np.float32)
    for spec in ("fixed_int2", "fixed_int5", "fixed_int8"):
        y = roundtrip(x, spec)
        assert not np.any(np.isnan(y))
        np.testing.assert_array_equal(y, x)


def test_int_beyond_the_scale_range_saturates_without_inf() -> None:
    x = np.array([[3.4e38, -3.4e38, 1.0]], dtype=np.float32)
    y = roundtrip(x, "fixed_int2")
    assert np.all(np.isfinite(y)) and y[0, 0] == SCALE_MAX


@pytest.mark.parametrize("bits", INT_BITS)
def test_small_gradients_keep_every_bit(bits: int) -> None:
    """Rows as small as a late step's gradients (absmax 1e-9 to 1e-4): the scale keeps 8
    significant bits (float16 had a few or none down there), so the largest value of a row
    still takes the top code and every value is within half a step."""
    rng = np.random.default_rng(bits)
    x = (rng.standard_normal((64, 256)) * 10.0 ** rng.uniform(-9, -4, (64, 1))).astype(np.float32)
    q, scales = quantize(x, bits)
    qmax = 2 ** (bits - 1) - 1
    assert np.all(np.abs(q).max(axis=1) >= qmax - 1)  # the scale rounded up by <= 2**-7
    assert np.all(np.abs(dequantize(q, scales) - x) <= int_error_bound(x, bits))


def test_scales_are_bfloat16_rounded_up() -> None:
    wanted = np.array([1.0, 1.0 + 2.0**-10, 3.0e-7, 1e-30, SCALE_MAX], dtype=np.float32)
    up = bfloat16_value(bfloat16_up(wanted))
    np.testing.assert_array_equal(up[:2], [1.0, 1.0 + 2.0**-7])
    assert np.all(up >= wanted) and np.all(up[:-1] <= wanted[:-1] * (1 + 2.0**-7))
    assert up[-1] == SCALE_MAX and np.isfinite(up).all()


@pytest.mark.parametrize("magnitude", [1e-7, 1e-5, 1.0, 1e6, 1e30])
def test_fp16_keeps_every_bit_at_any_magnitude(magnitude: float) -> None:
    """A late step's gradients (~1e-6) lie in float16's subnormals (below 6.1e-5), where a
    plain cast kept a few bits; shifted by a power of two they keep float16's 11."""
    x = sample((16, 64), seed=5) * np.float32(magnitude)
    header, parts = encode(x, "fp16")
    absmax = float(np.abs(x).max())
    assert header.shift == 14 - math.floor(math.log2(absmax))
    y = decode_frame(parts).array
    big = np.abs(x) >= absmax * 2.0**-14  # in float16's normal range once shifted
    np.testing.assert_allclose(y[big], x[big], rtol=2.0**-11, atol=0)


def test_fp16_without_a_shift_for_zeros_and_non_finite_values() -> None:
    assert encode(np.zeros((2, 4), dtype=np.float32), "fp16")[0].shift == 0
    x = np.array([[1e-6, np.inf, np.nan]], dtype=np.float32)
    header, parts = encode(x, "fp16")
    assert header.shift == 0
    y = decode_frame(parts)[1]
    assert y[0, 1] == np.inf and np.isnan(y[0, 2])


@pytest.mark.parametrize(("codec", "shift"), [("fixed_int4", 3), ("none", -1), ("fp16", 101)])
def test_a_shift_where_none_may_be_is_a_frame_error(codec: str, shift: int) -> None:
    _, parts = encode(sample((2, 8)), codec)
    fields = msgspec.to_builtins(msgspec.msgpack.decode(bytes(parts[0]), type=FrameHeader))
    fields["shift"] = shift
    expect_frame_error([msgspec.msgpack.encode(fields), *parts[1:]], f"frame shift {shift}")


@pytest.mark.parametrize("pattern", [0x7F80, 0xFFC0, 0xBF80])  # inf, NaN, -1.0
def test_a_scale_that_is_not_finite_and_positive_is_a_frame_error(pattern: int) -> None:
    parts = int4_parts()
    scales = np.frombuffer(bytes(parts[2]), dtype="<u2").copy()
    scales[0] = pattern
    expect_frame_error([parts[0], parts[1], scales.view(np.uint8).tobytes()], "scales must be")


def test_quantize_rejects_non_finite() -> None:
    x = np.array([[1.0, np.nan]], dtype=np.float32)
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, 8)


@pytest.mark.parametrize("bits", INT_BITS)
def test_quantize_dequantize(bits: int) -> None:
    x = sample((4, 3, 10), seed=bits)
    q, scales = quantize(x, bits)
    qmax = 2 ** (bits - 1) - 1
    assert q.shape == x.shape
    assert scales.shape == (12,)
    assert scales.dtype == np.float32
    np.testing.assert_array_equal(bfloat16_value(bfloat16_up(scales)), scales)
    assert q.min() >= -qmax and q.max() <= qmax
    # the row maximum uses (nearly) the full range
    assert np.all(np.abs(q.reshape(12, 10)).max(axis=1) >= qmax - 1)
    y = dequantize(q, scales)
    assert y.dtype == np.float32
    assert np.all(np.abs(y - x) <= int_error_bound(x, bits))


def test_non_float32_input_is_converted() -> None:
    x = sample((3, 4)).astype(np.float64)
    np.testing.assert_array_equal(roundtrip(x, "none"), x.astype(np.float32))
    strided = sample((4, 6))[:, ::2]
    np.testing.assert_array_equal(roundtrip(strided, "none"), strided)


# -- byte counts ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_payload_sizes(shape: tuple[int, ...]) -> None:
    x = sample(shape)
    numel, rows = x.size, x.size // shape[-1]
    header, parts = encode(x, "none")
    assert len(parts) == 2
    assert header.payload_nbytes == memoryview(parts[1]).nbytes == 4 * numel
    header, parts = encode(x, "fp16")
    assert len(parts) == 2
    assert header.payload_nbytes == memoryview(parts[1]).nbytes == 2 * numel
    for bits in INT_BITS:
        header, parts = encode(x, f"fixed_int{bits}")
        assert len(parts) == 3
        assert header.payload_nbytes == memoryview(parts[1]).nbytes == math.ceil(numel * bits / 8)
        assert header.scales_nbytes == memoryview(parts[2]).nbytes == 2 * rows
        codec = parse_wire_codec(f"fixed_int{bits}")
        assert encoded_nbytes(codec, shape) == header.payload_nbytes + header.scales_nbytes
        assert frame_nbytes(parts) == sum(memoryview(p).nbytes for p in parts)


def test_fixed_int8_is_at_most_26_percent_of_none() -> None:
    x = sample((8, 128, 256))
    _, none_parts = encode(x, "none")
    _, int8_parts = encode(x, "fixed_int8")
    assert frame_nbytes(int8_parts) <= 0.26 * frame_nbytes(none_parts)


def test_none_encode_is_zero_copy() -> None:
    x = sample((8, 64, 128))
    _, parts = encode(x, "none")
    assert np.shares_memory(np.frombuffer(parts[1], dtype=np.float32), x)


def test_none_decode_is_zero_copy() -> None:
    _, parts = encode(sample((5, 8)), "none")
    received = [bytes(p) for p in parts]
    y = decode_frame(received).array
    assert np.shares_memory(y, np.frombuffer(received[1], dtype=np.uint8))


class FakeZmqFrame:
    """Like zmq.Frame: the data is behind a ``.buffer`` memoryview."""

    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


def test_decode_accepts_frame_like_parts_and_memoryviews() -> None:
    x = sample((3, 9))
    _, parts = encode(x, "fixed_int6")
    y = decode_frame([FakeZmqFrame(bytes(p)) for p in parts]).array
    z = decode_frame([memoryview(bytes(p)) for p in parts]).array
    np.testing.assert_array_equal(y, z)
    assert frame_nbytes([FakeZmqFrame(bytes(p)) for p in parts]) == frame_nbytes(parts)


# -- bit packing ------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 15, 16, 17, 100, 1001])
def test_pack_unpack_roundtrip(bits: int, count: int) -> None:
    u = np.random.default_rng(count).integers(0, 2**bits, size=count, dtype=np.uint8)
    packed = pack_bits(u, bits)
    assert packed.dtype == np.uint8
    assert packed.size == math.ceil(count * bits / 8)
    assert packed.tobytes() == reference_pack(u.tolist(), bits)
    np.testing.assert_array_equal(unpack_bits(packed, bits, count), u)


def test_pack_rejects_values_too_wide() -> None:
    with pytest.raises(ValueError, match="3 bits"):
        pack_bits(np.array([8], dtype=np.uint8), 3)


def test_unpack_rejects_wrong_length() -> None:
    with pytest.raises(ValueError, match="need 4 bytes"):
        unpack_bits(np.zeros(5, dtype=np.uint8), 4, 8)


# -- decode errors ----------------------------------------------------------------------------


def raw_header(**changes: object) -> dict:
    header, _ = encode(sample((2, 8)), "fixed_int4")
    fields = msgspec.to_builtins(header)
    fields.update(changes)
    return fields


def int4_parts() -> list[bytes]:
    _, parts = encode(sample((2, 8)), "fixed_int4")
    return [bytes(p) for p in parts]


def expect_frame_error(parts: list, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        decode_frame(parts)


def test_truncated_payload() -> None:
    _, parts = encode(sample((4, 64)), "none")
    parts = [bytes(p) for p in parts]
    expect_frame_error([parts[0], parts[1][:100]], "payload is 100 bytes, header says 1024")


def test_extra_payload_bytes() -> None:
    parts = int4_parts()
    expect_frame_error([parts[0], parts[1] + b"\0", parts[2]], "payload is 9 bytes, header says 8")


def test_wrong_scales_size() -> None:
    parts = int4_parts()
    expect_frame_error([parts[0], parts[1], parts[2][:3]], "scales are 3 bytes, header says 4")


def test_missing_scales_part() -> None:
    parts = int4_parts()
    expect_frame_error(parts[:2], "frame has 2 parts, codec 'fixed_int4' needs 3")


def test_extra_part() -> None:
    _, parts = encode(sample((2, 8)), "fp16")
    expect_frame_error([*map(bytes, parts), b"x"], "frame has 3 parts")


def test_empty_frame() -> None:
    expect_frame_error([], "no header")


@pytest.mark.parametrize("garbage", [b"", b"\xc1", b"not msgpack at all", b"\x93\x01\x02\x03"])
def test_garbage_header(garbage: bytes) -> None:
    expect_frame_error([garbage, *int4_parts()[1:]], "bad frame header")


def test_header_with_wrong_field_types() -> None:
    header = msgspec.msgpack.encode(raw_header(step="seventeen"))
    expect_frame_error([header, *int4_parts()[1:]], "bad frame header")


def test_header_missing_field() -> None:
    fields = raw_header()
    del fields["shape"]
    expect_frame_error([msgspec.msgpack.encode(fields), *int4_parts()[1:]], "bad frame header")


@pytest.mark.parametrize("version", [0, 1, 3, 99])
def test_wrong_version(version: int) -> None:
    # a newer peer may also change other fields: the version is what gets reported; version 1
    # (float16 scales) is refused rather than decoded with the wrong scales
    fields = raw_header(v=version, shape="something new")
    expect_frame_error(
        [msgspec.msgpack.encode(fields), *int4_parts()[1:]],
        f"version {version}.*version {PROTOCOL_VERSION}",
    )


def test_unknown_codec() -> None:
    header = msgspec.msgpack.encode(raw_header(codec="zstd"))
    expect_frame_error([header, *int4_parts()[1:]], "unknown wire codec 'zstd'")


def test_bits_disagree_with_codec() -> None:
    header = msgspec.msgpack.encode(raw_header(bits=8))
    expect_frame_error([header, *int4_parts()[1:]], "has 4 bits, header says 8")


def test_unsupported_dtype() -> None:
    header = msgspec.msgpack.encode(raw_header(dtype="bfloat16"))
    expect_frame_error([header, *int4_parts()[1:]], "dtype 'bfloat16'")


@pytest.mark.parametrize("shape", [[2, 9], [3, 8], [16]])
def test_shape_disagrees_with_sizes(shape: list[int]) -> None:
    # header sizes kept from (2, 8); the shape implies other sizes
    header = msgspec.msgpack.encode(raw_header(shape=shape))
    expect_frame_error([header, *int4_parts()[1:]], "needs")


def test_shape_and_sizes_consistent_but_parts_are_not() -> None:
    header = msgspec.msgpack.encode(raw_header(shape=[2, 16], payload_nbytes=16))
    expect_frame_error([header, *int4_parts()[1:]], "payload is 8 bytes, header says 16")


@pytest.mark.parametrize("shape", [[], [-1, 8]])
def test_bad_shape(shape: list[int]) -> None:
    header = msgspec.msgpack.encode(raw_header(shape=shape))
    expect_frame_error([header, *int4_parts()[1:]], "bad frame shape")


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ([0, 2**63 - 1, 8], "bad frame shape"),
        ([0, 2**31 + 1, 8], "bad frame shape"),
        ([0] + [1] * 70, r"bad frame header: .*length <= 8 - at `\$.shape`"),
    ],
    ids=["a dimension numpy cannot hold", "past the bound", "rank 71"],
)
def test_an_empty_frame_of_an_impossible_shape_is_a_frame_error(
    shape: list[int], match: str
) -> None:
    """Every byte count of a shape with a 0 in it is 0, so the sizes agree: the shape's own
    bounds must refuse it before numpy does (with a ValueError); a rank past the bound is
    refused as the header is parsed."""
    fields = raw_header(
        codec="none",
        bits=32,
        shape=shape,
        payload_nbytes=0,
        scales_nbytes=0,
        targets_dtype="uint8",
        targets_nbytes=0,
    )
    expect_frame_error([msgspec.msgpack.encode(fields), b"", b""], match)


def test_non_buffer_part() -> None:
    expect_frame_error([int4_parts()[0], 12345, b""], "not a contiguous byte buffer")


def test_random_corruption_only_raises_frame_error() -> None:
    rng = np.random.default_rng(0)
    good = int4_parts()
    for _ in range(200):
        parts = list(good)
        i = int(rng.integers(0, 3))
        data = bytearray(parts[i])
        if data and rng.random() < 0.5:
            data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        else:
            data = data[: int(rng.integers(0, len(data) + 1))]
        parts[i] = bytes(data)
        with contextlib.suppress(FrameError):
            decode_frame(parts)


# -- header ---------------------------------------------------------------------------------


def test_header_fields_and_roundtrip() -> None:
    header, parts = encode(sample((8, 64, 128)), "fixed_int8")
    assert header.v == PROTOCOL_VERSION
    assert (header.job, header.attempt, header.step, header.micro) == ("job-1", 2, 17, 3)
    assert header.direction is Direction.FWD
    assert header.dtype == "float32"
    assert header.shape == (8, 64, 128)
    assert (header.codec, header.bits) == ("fixed_int8", 8)
    assert header.payload_nbytes == 8 * 64 * 128
    assert header.scales_nbytes == 2 * 8 * 64
    assert msgspec.msgpack.decode(parts[0], type=FrameHeader) == header


def test_header_ignores_unknown_fields() -> None:
    x = sample((2, 8))
    fields = raw_header(trace_id="abc", future={"nested": [1, 2]})
    y = decode_frame([msgspec.msgpack.encode(fields), *int4_parts()[1:]]).array
    assert y.shape == x.shape


def test_bwd_direction_roundtrips() -> None:
    _, parts = encode_frame(
        sample((2, 3)), parse_wire_codec("fp16"), **{**META, "direction": Direction.BWD}
    )
    got = decode_frame(parts).header
    assert got.direction is Direction.BWD


# -- targets and eval counts ------------------------------------------------------------------

CODECS = ["none", "fp16", "fixed_int4", "fixed_int8"]


def ids_for(shape: tuple[int, ...], vocab: int, seed: int = 0) -> np.ndarray:
    """Target ids for activations of ``shape``: the vocabulary's dtype, its extremes included."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=shape[:-1])
    ids.reshape(-1)[:2] = [0, vocab - 1]
    return token_ids(ids, vocab)


def forward(spec: str = "fixed_int4", vocab: int = 256, shape=(2, 3, 8), **kw):
    """A forward frame with targets: (header, parts as bytes, activations, ids)."""
    x, ids = sample(shape), ids_for(shape, vocab)
    header, parts = encode_frame(x, parse_wire_codec(spec), **META, targets=ids, **kw)
    return header, [bytes(p) for p in parts], x, ids


@pytest.mark.parametrize(
    ("vocab", "name"),
    [
        (1, "uint8"),
        (256, "uint8"),
        (257, "uint16"),
        (65536, "uint16"),
        (65537, "uint32"),
        (2**22, "uint32"),
    ],
)
def test_token_dtype_is_the_smallest_that_holds_the_vocabulary(vocab: int, name: str) -> None:
    assert token_dtype(vocab) == TARGET_DTYPES[name]
    assert token_ids(np.array([vocab - 1], dtype=np.int32), vocab)[0] == vocab - 1


@pytest.mark.parametrize("ids", [[0, 256], [-1, 3]])
def test_token_ids_refuse_ids_outside_the_vocabulary(ids: list[int]) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary of 256"):
        token_ids(np.array(ids, dtype=np.int32), 256)


def test_token_ids_refuse_non_integers() -> None:
    with pytest.raises(ValueError, match="integers"):
        token_ids(np.zeros(3, dtype=np.float32), 256)


@pytest.mark.parametrize("vocab", [256, 50_257, 100_000])
@pytest.mark.parametrize("spec", CODECS)
def test_forward_frames_carry_their_targets_exactly(spec: str, vocab: int) -> None:
    """uint8 targets for the byte vocabulary, uint16 and uint32 for larger ones: the last
    part, bit for bit, shaped like the activations without their last axis."""
    header, parts, x, ids = forward(spec, vocab, shape=(4, 5, 16))
    assert header.targets_dtype == {256: "uint8", 50_257: "uint16", 100_000: "uint32"}[vocab]
    assert header.targets_nbytes == 4 * 5 * ids.itemsize == len(parts[-1])
    assert len(parts) == (4 if spec.startswith("fixed") else 3)
    frame = decode_frame(parts, vocab_size=vocab)
    assert isinstance(frame, Frame) and frame.header == header
    assert frame.targets.dtype == ids.dtype and frame.targets.shape == (4, 5)
    np.testing.assert_array_equal(frame.targets, ids)
    np.testing.assert_array_equal(frame.targets.astype(np.int32), ids.astype(np.int32))
    without = decode_frame(encode(x, spec)[1])
    np.testing.assert_array_equal(frame.array, without.array)  # the tensor is untouched


def test_the_targets_are_counted_in_the_frame_bytes() -> None:
    x, ids = sample((8, 16, 32)), ids_for((8, 16, 32), 256)
    _, plain = encode(x, "fixed_int8")
    _, parts = encode_frame(x, parse_wire_codec("fixed_int8"), **META, targets=ids)
    header_growth = len(parts[0]) - len(plain[0])  # the two target fields
    assert frame_nbytes(parts) == frame_nbytes(plain) + header_growth + 8 * 16
    assert 0 < header_growth < 40


def test_a_frame_without_targets_says_so_in_its_header() -> None:
    header, parts = encode(sample((2, 8)), "fixed_int4")
    assert (header.targets_dtype, header.targets_nbytes, header.eval_batches) == ("", 0, 0)
    assert decode_frame(parts).targets is None


def test_eval_frames_count_the_batches_of_their_pass() -> None:
    header, parts, _, _ = forward("fp16", phase="eval", eval_batches=4)
    assert decode_frame(parts).header.eval_batches == header.eval_batches == 4


@pytest.mark.parametrize("spec", CODECS)
def test_an_empty_eval_frame_round_trips(spec: str) -> None:
    """A validation pass without a batch is one frame of zero rows that says 0 batches."""
    x = np.zeros((0, 16, 8), dtype=np.float32)
    ids = token_ids(np.zeros((0, 16), dtype=np.int32), 256)
    meta = {**META, "micro": 0}
    _, parts = encode_frame(
        x, parse_wire_codec(spec), **meta, phase="eval", targets=ids, eval_batches=0
    )
    frame = decode_frame([bytes(p) for p in parts], vocab_size=256)
    assert frame.array.shape == (0, 16, 8) and frame.targets.shape == (0, 16)
    assert frame.header.eval_batches == 0 and frame.header.phase == "eval"


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"direction": Direction.BWD}, "only a forward frame carries targets"),
        ({"targets": np.zeros((2, 3), dtype=np.int32)}, "targets must be one of"),
        ({"targets": np.zeros((2, 4), dtype=np.uint8)}, r"shape \[2, 4\], the frame needs"),
        ({"eval_batches": 2}, "only a forward eval frame"),
    ],
)
def test_encode_refuses_targets_or_counts_that_do_not_fit(changes: dict, match: str) -> None:
    kw = {**META, "targets": np.zeros((2, 3), dtype=np.uint8), **changes}
    with pytest.raises(ValueError, match=match):
        encode_frame(sample((2, 3, 8)), parse_wire_codec("none"), **kw)


def with_fields(parts: list[bytes], **changes: object) -> list[bytes]:
    fields = msgspec.to_builtins(msgspec.msgpack.decode(parts[0], type=FrameHeader))
    fields.update(changes)
    return [msgspec.msgpack.encode(fields), *parts[1:]]


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda p: p[:-1], r"frame has 3 parts, codec 'fixed_int4' needs 4 \(.*targets\)"),
        (lambda p: [*p, b"x"], "frame has 5 parts"),
        (lambda p: [*p[:-1], p[-1][:-1]], "targets are 5 bytes, header says 6"),
        (lambda p: [*p[:-1], p[-1] + b"\0"], "targets are 7 bytes, header says 6"),
        (lambda p: with_fields(p, targets_nbytes=12), "targets_nbytes=12.*needs 6"),
        (lambda p: with_fields(p, targets_dtype="uint16"), "targets_nbytes=6.*needs 12"),
        (lambda p: with_fields(p, targets_dtype="", targets_nbytes=6), "but no dtype"),
        (lambda p: with_fields(p, targets_dtype="int32"), "'int32' is not one of"),
        (lambda p: with_fields(p, targets_dtype="float32"), "'float32' is not one of"),
        (lambda p: with_fields(p, targets_dtype=8), "bad frame header"),
        (lambda p: with_fields(p, targets_nbytes="6"), "bad frame header"),
        (lambda p: with_fields(p, direction="bwd"), "backward frame carries no targets"),
        (lambda p: with_fields(p, eval_batches=3), "eval_batches=3"),
        (lambda p: with_fields(p, phase="eval", eval_batches=-1), "eval_batches=-1"),
        (
            lambda p: with_fields(
                p, shape=[2, 4, 8], payload_nbytes=32, scales_nbytes=16, targets_nbytes=8
            ),
            "payload is 24 bytes",
        ),
    ],
)
def test_every_targets_inconsistency_is_a_frame_error(mutate, match: str) -> None:
    _, parts, _, _ = forward("fixed_int4", shape=(2, 3, 8))
    expect_frame_error(mutate(parts), match)


def test_a_backward_frame_with_a_targets_part_is_a_frame_error() -> None:
    _, parts = encode_frame(
        sample((2, 3, 8)), parse_wire_codec("none"), **{**META, "direction": Direction.BWD}
    )
    parts = [bytes(p) for p in parts]
    forged = with_fields(parts, targets_dtype="uint8", targets_nbytes=6)
    expect_frame_error([*forged, bytes(6)], "backward frame carries no targets")
    expect_frame_error([*parts, bytes(6)], "frame has 3 parts, codec 'none' needs 2")


@pytest.mark.parametrize(("vocab", "bad"), [(100, 100), (255, 255), (300, 65535)])
def test_a_target_id_outside_the_vocabulary_is_a_frame_error(vocab: int, bad: int) -> None:
    """The receiver knows the vocabulary (its model config) and refuses an id beyond it."""
    x = sample((2, 3, 8))
    ids = np.full((2, 3), 1, dtype=token_dtype(bad + 1))
    ids[1, 2] = bad
    _, parts = encode_frame(x, parse_wire_codec("none"), **META, targets=ids)
    parts = [bytes(p) for p in parts]
    with pytest.raises(FrameError, match=f"target id {bad} is outside the vocabulary of {vocab}"):
        decode_frame(parts, vocab_size=vocab)
    assert decode_frame(parts).targets[1, 2] == bad  # without a vocabulary: not checked


@pytest.mark.parametrize("vocab", [256, 50_257])
def test_random_corruption_with_targets_only_raises_frame_error(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    _, good, _, _ = forward("fixed_int4", vocab, shape=(3, 4, 8))
    for _ in range(300):
        parts = list(good)
        i = int(rng.integers(0, len(parts)))
        data = bytearray(parts[i])
        roll = rng.random()
        if data and roll < 0.5:
            data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        elif roll < 0.9:
            data = data[: int(rng.integers(0, len(data) + 1))]
        else:
            data += bytes(int(rng.integers(1, 4)))
        parts[i] = bytes(data)
        if rng.random() < 0.1:
            parts = parts[: int(rng.integers(0, len(parts)))]
        with contextlib.suppress(FrameError):
            frame = decode_frame(parts, vocab_size=vocab)
            if frame.targets is not None:
                assert frame.targets.size == 0 or int(frame.targets.max()) < vocab


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("job", "j" * (16 << 20)),  # a 16 MiB job id would be logged with the frame's drop
        ("phase", "p" * 33),
        ("codec", "c" * 65),
        ("dtype", "d" * 33),
        ("targets_dtype", "t" * 33),
    ],
)
def test_a_headers_strings_are_bounded_as_it_is_parsed(field: str, value: str) -> None:
    parts = int4_parts()
    header = msgspec.msgpack.encode(raw_header(**{field: value}))
    with pytest.raises(FrameError, match=rf"bad frame header: .* - at `\$.{field}`"):
        frame_header([header, *parts[1:]])
    expect_frame_error([header, *parts[1:]], f"at `\\$.{field}`")
