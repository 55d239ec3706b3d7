"""The export's manifests as types: each one's writer and reader agree, the JSON is the format
exports already have on disk, and a reader's error names the file and the field."""

from __future__ import annotations

import json

import msgspec
import pytest

from silentswarm.errors import ManifestError
from silentswarm.jobspec import JobSpec, PlacedStage, Placement
from silentswarm.plan import ModelConfig, Transport
from silentswarm.types.manifests import (
    DataInfo,
    FileEntry,
    GlueCheck,
    InferenceManifest,
    decode_inference_manifest,
    decode_run_manifest,
    describe,
    encode_inference_manifest,
    encode_run_manifest,
)

SPEC = JobSpec(name="tiny", model=ModelConfig(n_layers=2, d_model=32, n_heads=2), steps=6)
PLACEMENT = Placement(
    stages=[
        PlacedStage(stage=i, fellow_id=f"f{i}", hostname="h", layer_start=i, layer_end=i + 1)
        for i in range(2)
    ],
    transport=Transport.AUTO,
)


def legacy_run_manifest() -> dict:
    """``run_manifest.json`` as the leader wrote it before the manifest was a Struct."""
    stages = [
        {
            "stage": i,
            "fellow_id": f"f{i}",
            "layer_start": i,
            "layer_end": i + 1,
            "checkpoint": f"shards/step-6/stage-{i}.json",
            "checkpoint_sha256": "a" * 64,
            "weights": f"shards/step-6/stage-{i}.npz",
            "weights_sha256": "b" * 64,
            "bytes": 1234,
        }
        for i in range(2)
    ]
    return {
        "format": 1,
        "job_id": "j-tiny",
        "name": "tiny",
        "attempt": 1,
        "state": "completed",
        "package_version": "0.1.0",
        "spec": msgspec.to_builtins(SPEC),
        "placement": msgspec.to_builtins(PLACEMENT),
        "compression": "none",
        "step": 6,
        "total_steps": 6,
        "loss": 4.5,
        "val_loss": None,
        "stages": stages,
        "updated_at": 1764500000.0,
    }


def test_the_run_manifest_is_the_format_exports_have():
    raw = legacy_run_manifest()
    manifest = decode_run_manifest(json.dumps(raw, indent=1).encode())
    assert manifest.spec == SPEC and manifest.placement == PLACEMENT
    assert manifest.stages[1].weights == "shards/step-6/stage-1.npz"
    written = encode_run_manifest(manifest)
    assert json.loads(written) == raw, "same keys, same values"
    assert list(json.loads(written)) == list(raw), "in the same order"
    assert decode_run_manifest(written) == manifest


def test_a_diverged_loss_written_by_json_dumps_still_reads():
    raw = {**legacy_run_manifest(), "loss": float("nan")}
    manifest = decode_run_manifest(json.dumps(raw).encode())
    assert manifest.loss != manifest.loss  # NaN
    assert json.loads(encode_run_manifest(manifest))["loss"] is None  # valid JSON now


def test_a_shard_entry_loses_only_the_leaders_bytes_in_the_inference_manifest():
    shard = decode_run_manifest(json.dumps(legacy_run_manifest()).encode()).stages[0]
    files = msgspec.to_builtins(shard.files())
    assert files == {k: v for k, v in legacy_run_manifest()["stages"][0].items() if k != "bytes"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": 2}, "run_manifest.json: format 2, this version reads format 1"),
        ({"format": None}, "run_manifest.json: format None, this version reads format 1"),
        ({"step": None}, "run_manifest.json: step must be int, got null"),
        ({"step": True}, "run_manifest.json: step must be int, got bool"),
        ({"attempt": 1.0}, "run_manifest.json: attempt must be int, got float"),
        ({"job_id": None}, "run_manifest.json: job_id must be str, got null"),
        ({"stages": [{"stage": 0}]}, "run_manifest.json: stages[0]: missing layer_start"),
        ({"stages": {}}, "run_manifest.json: stages must be array, got object"),
        ({"spec": {"steps": 0}}, "run_manifest.json: spec.steps must be int >= 1"),
        ({"spec": {"nope": 1}}, "run_manifest.json: spec: Object contains unknown field `nope`"),
    ],
)
def test_a_bad_run_manifest_names_the_file_and_the_field(change, message):
    body = json.dumps({**legacy_run_manifest(), **change}).encode()
    with pytest.raises(ManifestError) as info:
        decode_run_manifest(body)
    assert info.value.message == message


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[]", "m.json: not a JSON object"),
        (b"{", "m.json: not valid JSON"),
        (b"\xff", "m.json: not valid JSON"),
        (b'{"format": 1}', "m.json: missing job_id"),
    ],
)
def test_what_is_not_a_manifest_at_all(body, message):
    with pytest.raises(ManifestError) as info:
        decode_run_manifest(body, "m.json")
    assert info.value.message.startswith(message)
    assert info.value.code == "MANIFEST_INVALID" and info.value.exit_code == 2


@pytest.mark.parametrize(
    ("error", "words"),
    [
        ("Object missing required field `job_id`", "missing job_id"),
        ("Object missing required field `a` - at `$.stages[0]`", "stages[0]: missing a"),
        ("Expected `int`, got `null` - at `$.step`", "step must be int, got null"),
        ("Expected `int` >= 1 - at `$.spec.steps`", "spec.steps must be int >= 1"),
        ("Expected `object`, got `array`", "the manifest must be object, got array"),
        (
            "Invalid enum value 'x' - at `$.placement.transport`",
            "placement.transport: Invalid enum value 'x'",
        ),
        ("Something else", "Something else"),
    ],
)
def test_msgspec_errors_in_the_manifests_words(error, words):
    assert describe(msgspec.ValidationError(error)) == words


def inference_manifest(**changes) -> InferenceManifest:
    shards = decode_run_manifest(json.dumps(legacy_run_manifest()).encode()).stages
    manifest = InferenceManifest(
        job_id="j-tiny",
        name="tiny",
        attempt=1,
        step=6,
        total_steps=6,
        model=SPEC.model,
        vocab_size=256,
        seq_len=64,
        seed=0,
        compression="none",
        wire_codec="none",
        bottleneck_dim=None,
        stages=[s.files() for s in shards],
        model_file="model.keras",
        config_file=None,
        files={"model.keras": FileEntry(sha256="c" * 64, bytes=10)},
        fallback=None,
        max_abs_diff=1e-6,
        tolerance=1e-3,
        check=GlueCheck(
            batches=4,
            max_abs_diff=1e-6,
            tolerance=1e-3,
            logit_scale=4.5,
            stage_max_abs_diff=[1e-7, 1e-6],
            stage_tolerance=[1e-3, 4.5e-3],
            codec_mismatches=[0],
            codec_elements=[100],
            reload_max_abs_diff=0.0,
        ),
        val_loss=4.4,
        chain_val_loss=4.4,
        pipeline_val_loss=4.4,
        pipeline_loss=None,
        data=DataInfo(
            patterns=["stdlib"],
            override=False,
            n_tokens=100,
            sha256="d" * 64,
            batch_size=8,
            val_batches=4,
        ),
        keras_version="3",
        tensorflow_version="2",
        package_version="0.1.0",
        run_package_version="0.1.0",
        run_manifest_sha256="e" * 64,
        export_dir="/e",
        created_at=1764500000.0,
    )
    return msgspec.structs.replace(manifest, **changes)


def test_the_inference_manifest_round_trips():
    manifest = inference_manifest()
    written = encode_inference_manifest(manifest)
    raw = json.loads(written)
    assert (raw["format"], raw["kind"]) == (1, "silentswarm-glued-transformer")
    assert raw["files"] == {"model.keras": {"sha256": "c" * 64, "bytes": 10}}
    assert "bytes" not in raw["stages"][0]
    assert decode_inference_manifest(written) == manifest


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seq_len": 0}, "seq_len must be int >= 1"),
        ({"files": {"x": {"sha256": "c"}}}, "files[...]: missing bytes"),
        ({"files": {}}, "files must describe every file, model_file's too"),
        ({"model_file": 3}, "model_file must be str, got int"),
    ],
)
def test_a_bad_inference_manifest_names_the_field(change, message):
    raw = {**json.loads(encode_inference_manifest(inference_manifest())), **change}
    with pytest.raises(ManifestError) as info:
        decode_inference_manifest(json.dumps(raw).encode(), "/m/inference_manifest.json")
    assert info.value.message == f"/m/inference_manifest.json: {message}"
