"""Which jobs may start from which exports, and which source shards each stage needs: pure."""

from __future__ import annotations

import msgspec
import pytest

from silentswarm.errors import FieldError
from silentswarm.jobspec import JobSpec, PlacedStage, Placement, stage_plans
from silentswarm.leader.initsource import check_fits, source_stages
from silentswarm.plan import ModelConfig, TokenizerConfig, Transport
from silentswarm.types.manifests import ExportedShard, RunManifest

MODEL = ModelConfig(vocab_size=256, seq_len=32, n_layers=6, d_model=32, n_heads=2)


def manifest(ranges: list[tuple[int, int]], **spec) -> RunManifest:
    source = JobSpec(name="src", model=MODEL, stages=len(ranges), **spec)
    stages = [
        ExportedShard(
            stage=i,
            layer_start=a,
            layer_end=b,
            checkpoint=f"shards/step-9/stage-{i}.json",
            checkpoint_sha256="0" * 64,
            weights=f"shards/step-9/stage-{i}.npz",
            weights_sha256="0" * 64,
            bytes=1,
        )
        for i, (a, b) in enumerate(ranges)
    ]
    placement = Placement(
        stages=[
            PlacedStage(stage=i, fellow_id=f"f{i}", hostname="h", layer_start=a, layer_end=b)
            for i, (a, b) in enumerate(ranges)
        ],
        transport=Transport.AUTO,
    )
    return RunManifest(
        job_id="src-1",
        attempt=1,
        spec=source,
        placement=placement,
        compression="none",
        step=9,
        stages=stages,
    )


def spec(**changes) -> JobSpec:
    return JobSpec(**{"name": "new", "model": MODEL, "init_from": "job:src-1", **changes})


def test_a_job_of_the_same_model_fits_and_may_change_dropout():
    check_fits(spec(), manifest([(0, 6)]))
    check_fits(spec(model=msgspec.structs.replace(MODEL, dropout=0.1)), manifest([(0, 6)]))


@pytest.mark.parametrize(
    ("changes", "needles"),
    [
        ({"model": msgspec.structs.replace(MODEL, d_model=64)}, ["model.d_model is 64"]),
        (
            {"model": msgspec.structs.replace(MODEL, n_layers=4, seq_len=64)},
            ["model.seq_len is 64, the export's 32", "model.n_layers is 4"],
        ),
        ({"tokenizer": TokenizerConfig(kind="bpe")}, ["tokenizer.kind is 'bpe'"]),
    ],
)
def test_a_job_that_does_not_fit_is_refused_naming_every_difference(changes, needles):
    with pytest.raises(FieldError) as raised:
        check_fits(spec(**changes), manifest([(0, 6)]))
    assert raised.value.field == "init_from"
    assert all(needle in raised.value.message for needle in needles)


@pytest.mark.parametrize(
    ("source", "target", "want"),
    [
        ([(0, 6)], [(0, 3), (3, 6)], [[0], [0]]),  # one stage into two
        ([(0, 3), (3, 6)], [(0, 6)], [[0, 1]]),  # two into one
        ([(0, 2), (2, 4), (4, 6)], [(0, 3), (3, 6)], [[0, 1], [1, 2]]),  # across boundaries
        ([(0, 3), (3, 6)], [(0, 3), (3, 6)], [[0], [1]]),  # the same split
    ],
)
def test_each_stage_fetches_the_source_shards_that_hold_its_layers(source, target, want):
    target_spec = spec(stages=len(target))
    placement = Placement(
        stages=[
            PlacedStage(stage=i, fellow_id=f"g{i}", hostname="h", layer_start=a, layer_end=b)
            for i, (a, b) in enumerate(target)
        ],
        transport=Transport.AUTO,
    )
    plans = stage_plans(
        job_id="new-1", attempt=1, spec=target_spec, placement=placement, subject_prefix="swarm"
    )
    assert [source_stages(manifest(source), p) for p in plans] == want


@pytest.mark.parametrize(
    ("source", "mine", "needle"),
    [
        ("none", "fixed_int8", "compression is 'fixed_int8', the export's 'none'"),
        ("learned_dim8_int8", "learned_dim8_int8", "cannot train through a learned bottleneck"),
    ],
)
def test_an_adapter_trains_through_its_bases_wire_codec_only(source, mine, needle):
    from silentswarm.plan import AdapterConfig

    check_fits(
        spec(adapter=AdapterConfig(), compression="fixed_int8"),
        manifest([(0, 6)], compression="fixed_int8"),
    )
    with pytest.raises(FieldError) as raised:
        check_fits(
            spec(adapter=AdapterConfig(), compression=mine), manifest([(0, 6)], compression=source)
        )
    assert needle in raised.value.message
