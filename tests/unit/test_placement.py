"""Placement and the job spec: pure functions."""

import json

import pytest

from leader.placement import Candidate, Unplaceable, place, weighted_ranges
from swarm.jobspec import FieldError, JobSpec, JobSpecError, decode_job_spec, stage_plans
from swarm.plan import ModelConfig, Transport
from swarm.protocol import GpuInfo

GIB = 1 << 30


def gpu(index: int, free_gib: float) -> GpuInfo:
    return GpuInfo(
        index=index,
        uuid=f"GPU-{index}",
        name="Test",
        memory_total_bytes=int(80 * GIB),
        memory_free_bytes=int(free_gib * GIB),
        memory_used_bytes=0,
    )


def cand(fid: str, *gpus: GpuInfo, address: str | None = "tcp://h:1", host: str = "h", cores=8):
    return Candidate(
        fellow_id=fid,
        hostname=host,
        data_address=address,
        cpu_cores=cores,
        ram_available_bytes=16 * GIB,
        gpus=tuple(gpus),
    )


def spec(**kw) -> JobSpec:
    return JobSpec(model=ModelConfig(n_layers=kw.pop("layers", 8)), **kw)


def test_equal_split_with_the_most_vram_last_and_threads_shared_per_host():
    fellows = [cand("a", gpu(0, 10)), cand("b", gpu(0, 40)), cand("c", gpu(0, 20))]
    placement = place(spec(stages=3), fellows)
    assert placement.fellow_ids == ["c", "a", "b"]
    assert [(s.layer_start, s.layer_end) for s in placement.stages] == [(0, 3), (3, 6), (6, 8)]
    assert placement.stages[-1].gpu_slots[0].gpu_uuid == "GPU-0"
    assert {s.intra_op_threads for s in placement.stages} == {8 // 3}


def test_preserve_keeps_the_ranked_order():
    fellows = [cand("a", gpu(0, 10)), cand("b", gpu(0, 40))]
    assert place(spec(stages=2, pipeline_last_stage_placement="preserve"), fellows).fellow_ids == [
        "b",
        "a",
    ]


def test_not_enough_fellows_is_a_reason_not_an_error():
    result = place(spec(stages=3), [cand("a"), cand("b")])
    assert isinstance(result, Unplaceable)
    assert result.reason == "waiting for 3 ready fellows; 2 available"
    result = place(spec(stages=1, allow_cpu=False), [cand("a")])
    assert "usable GPU" in result.reason


def test_without_stages_every_ready_fellow_up_to_the_layers_is_used():
    fellows = [cand(f"f{i}") for i in range(5)]
    assert len(place(spec(layers=3), fellows).stages) == 3
    assert isinstance(place(spec(layers=8, min_fellows=6), fellows), Unplaceable)


def test_gpu_floor_and_cap():
    fellows = [cand("a", gpu(0, 1), gpu(1, 30)), cand("b", gpu(0, 0.5))]
    placement = place(spec(stages=1, allow_cpu=False, placement_min_gpu_free_gb=2), fellows)
    assert placement.fellow_ids == ["a"]
    assert placement.stages[0].gpu_slots[0].gpu_index == 1


def test_missing_data_address_falls_back_to_the_tunnel_or_is_refused_for_p2p():
    # The last stage (most VRAM) must bind for its upstream: without an address, the relay.
    fellows = [cand("a", gpu(0, 40), address=None), cand("b")]
    assert place(spec(stages=2), fellows).transport is Transport.TUNNEL
    refused = place(spec(stages=2, transport="p2p"), fellows)
    assert isinstance(refused, Unplaceable) and "on a" in refused.reason


def test_weighted_ranges_follow_the_weights_and_give_every_stage_a_layer():
    assert weighted_ranges(8, [1, 1]) == [(0, 4), (4, 8)]
    assert weighted_ranges(10, [3, 1]) == [(0, 7), (7, 10)]
    assert weighted_ranges(3, [100, 1, 1]) == [(0, 1), (1, 2), (2, 3)]
    sizes = [e - s for s, e in weighted_ranges(12, [40, 10, 30])]
    assert sum(sizes) == 12 and sizes[0] > sizes[2] > sizes[1] >= 1
    fellows = [cand("a", gpu(0, 30)), cand("b", gpu(0, 10))]
    placement = place(spec(stages=2, partition="weighted"), fellows)
    sizes = {s.fellow_id: s.layer_end - s.layer_start for s in placement.stages}
    assert sizes["a"] > sizes["b"]


def test_stage_plans_chain_the_placed_stages():
    fellows = [cand("a", address="tcp://a:1"), cand("b", address="tcp://b:1")]
    s = spec(stages=2)
    placement = place(s, fellows)
    plans = stage_plans(
        job_id="j-1", attempt=3, spec=s, placement=placement, subject_prefix="swarm"
    )
    first, last = plans
    assert first.next.fellow_id == last.fellow_id and last.prev.fellow_id == first.fellow_id
    assert first.next.data_address == last.data_address
    assert last.problems() == [] and first.problems() == []
    assert {p.attempt for p in plans} == {3}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"stepz": 1}, "stepz"),
        ({"model": {"nheads": 3}}, "model.nheads"),
        ({"steps": "ten"}, "steps"),
        ({"transport": "carrier-pigeon"}, "transport"),
        ({"artifact_paths": {"export": "x"}}, "artifact_paths.export"),
    ],
)
def test_a_wrong_or_unknown_field_is_named(body, field):
    with pytest.raises(FieldError) as err:
        decode_job_spec(json.dumps(body).encode())
    assert err.value.field == field
    assert err.value.message.startswith(field)
    assert err.value.to_dict()["field"] == field


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"stages": 9, "model": {"n_layers": 4}}, "stages (9)"),
        ({"model": {"d_model": 100, "n_heads": 3}}, "n_heads (3) must divide"),
        ({"compression": "zip"}, "compression"),
        ({"batch_size": 6, "micro_batches": 4}, "micro_batches"),
    ],
)
def test_an_impossible_job_says_why(body, words):
    with pytest.raises(JobSpecError) as err:
        decode_job_spec(json.dumps(body).encode())
    assert words in err.value.message


def test_defaults_train_something_and_the_quickstart_config_is_valid():
    assert decode_job_spec(b"{}") == JobSpec()
    from tests.helpers import REPO

    spec = decode_job_spec((REPO / "exp/configs/quickstart.json").read_bytes())
    assert spec.stages == 2
