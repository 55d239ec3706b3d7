"""The codec table: every compression spec parsed once, into a spec that carries its
properties (wire codec, bits, lossy, bottleneck, ratio)."""

from __future__ import annotations

import pytest

from silentswarm.compression import (
    CODECS,
    CodecKind,
    WireCodec,
    parse_compression,
    parse_wire_codec,
)
from silentswarm.errors import ConfigError
from silentswarm.plan import ModelConfig, StagePlan

# spec, wire codec, bits, bottleneck, lossy, ratio at d_model 256
SPECS = [
    ("none", "none", 32, None, False, 1.0),
    ("fp16", "fp16", 16, None, True, 2.0),
    ("fixed_int8", "fixed_int8", 8, None, True, 4.0),
    ("fixed_int4", "fixed_int4", 4, None, True, 8.0),
    ("fixed_int2", "fixed_int2", 2, None, True, 16.0),
    ("learned_dim32", "none", 32, 32, True, 8.0),
    ("learned_dim32_int8", "fixed_int8", 8, 32, True, 32.0),
    ("learned_dim16_int4", "fixed_int4", 4, 16, True, 128.0),
    ("learned_dim32_fp16", "fp16", 16, 32, True, 16.0),
]


@pytest.mark.parametrize(("spec", "wire", "bits", "dim", "lossy", "ratio"), SPECS)
def test_a_spec_is_parsed_once_into_its_properties(spec, wire, bits, dim, lossy, ratio):
    parsed = parse_compression(spec, d_model=256)
    assert parsed.spec == spec
    assert (parsed.wire, parsed.codec.bits, parsed.bottleneck_dim) == (wire, bits, dim)
    assert parsed.learned is (dim is not None)
    assert parsed.lossy is lossy
    assert parsed.dims(256) == (dim or 256)
    assert parsed.ratio(256) == pytest.approx(ratio)
    assert parse_wire_codec(parsed.wire) == parsed.codec  # the wire part round-trips


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "zip",
        "int8",
        "NONE",
        " fp16",
        "fixed_int1",
        "fixed_int9",
        "fixed_int08",
        "fixed_int8\n",
        "learned_dim0",
        "learned_dim08",
        "learned_dim8_int9",
        "learned_dim8_fixed_int8",
        "learned_dim256",
        "learned_dim8_bf16",
    ],
)
def test_bad_compression_specs_name_the_spec(spec):
    with pytest.raises(ConfigError) as err:
        parse_compression(spec, d_model=256)
    assert repr(spec) in err.value.message


def test_a_bottleneck_must_be_narrower_than_the_model_only_when_the_model_is_known():
    assert parse_compression("learned_dim512").bottleneck_dim == 512
    with pytest.raises(ConfigError, match="smaller than d_model"):
        parse_compression("learned_dim512", d_model=256)


def test_the_table_has_a_row_per_codec_kind():
    assert set(CODECS) == set(CodecKind)
    assert not CODECS[CodecKind.NONE].lossy
    assert all(CODECS[k].lossy for k in (CodecKind.FP16, CodecKind.INT))


@pytest.mark.parametrize(
    ("codec", "name", "int_bits", "qmax", "ratio"),
    [
        (WireCodec(CodecKind.NONE), "none", None, None, 1.0),
        (WireCodec(CodecKind.FP16, 16), "fp16", None, None, 2.0),
        (WireCodec(CodecKind.INT, 8), "fixed_int8", 8, 127, 4.0),
        (WireCodec(CodecKind.INT, 2), "fixed_int2", 2, 1, 16.0),
    ],
)
def test_wire_codecs_carry_their_numbers(codec, name, int_bits, qmax, ratio):
    assert (codec.name, str(codec), codec.int_bits, codec.qmax) == (name, name, int_bits, qmax)
    assert codec.ratio == ratio


def test_gradient_codecs_are_wire_forms_only_and_name_the_field():
    assert parse_wire_codec("fixed_int4", what="grad_compression").name == "fixed_int4"
    with pytest.raises(ConfigError, match=r"grad_compression 'learned_dim8'.*wire part"):
        parse_wire_codec("learned_dim8", what="grad_compression")


def test_a_plan_gives_its_codecs_from_the_table():
    plan = StagePlan(
        job_id="j",
        stage=0,
        n_stages=1,
        layer_start=0,
        layer_end=4,
        model=ModelConfig(d_model=64, n_heads=4),
        compression="learned_dim8_int4",
    )
    spec, grad = plan.codecs()
    assert (spec.bottleneck_dim, spec.codec, grad) == (8, WireCodec(CodecKind.INT, 4), spec.codec)
    fp16 = StagePlan(**{**_fields(plan), "grad_compression": "fp16"})
    assert fp16.codecs()[1] == WireCodec(CodecKind.FP16, 16)


def _fields(plan: StagePlan) -> dict:
    return {name: getattr(plan, name) for name in plan.__struct_fields__}


def test_auto_is_a_compression_that_starts_at_full_precision():
    from silentswarm.compression import parse_compression

    spec = parse_compression("auto", d_model=64)
    assert spec.auto and spec.codec.name == "none" and not spec.learned and spec.lossy
    assert spec.dims(64) == 64
