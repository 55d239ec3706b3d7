"""Placement, memory estimates, telemetry views and the job spec: pure functions."""

import json

import msgspec
import pytest

from silentswarm.errors import FieldError, JobSpecError
from silentswarm.jobspec import JobSpec, decode_job_spec, stage_plans
from silentswarm.leader.memory import block_params, stage_memory
from silentswarm.leader.placement import (
    Candidate,
    PlacementDefaults,
    Unplaceable,
    gpu_slots,
    place,
    weighted_ranges,
)
from silentswarm.natsconn import NatsAccess
from silentswarm.plan import ModelConfig, Transport, stage_in_flight
from silentswarm.protocol import FellowLimits, GpuInfo, HardwareSnapshot
from silentswarm.telemetry import gpu_warning, offered_ram, usable_gpus

GIB = 1 << 30


def gpu(index: int, free_gib: float, total_gib: float = 80) -> GpuInfo:
    return GpuInfo(
        index=index,
        uuid=f"GPU-{index}",
        name="Test",
        memory_total_bytes=int(total_gib * GIB),
        memory_free_bytes=int(free_gib * GIB),
        memory_used_bytes=int((total_gib - free_gib) * GIB),
    )


def cand(fid, *gpus, address="tcp://h:1", host="h", cores=8, ram_gib=16.0):
    return Candidate(
        fellow_id=fid,
        hostname=host,
        data_address=address,
        cpu_cores=cores,
        ram_available_bytes=int(ram_gib * GIB),
        gpus=tuple(gpus),
    )


def spec(**kw) -> JobSpec:
    return JobSpec(model=ModelConfig(n_layers=kw.pop("layers", 8)), **kw)


def layers_of(placement):
    return {s.fellow_id: s.layer_end - s.layer_start for s in placement.stages}


# --- the planner, table-driven ---------------------------------------------------------------

CASES = {
    "mixed GPUs: most VRAM runs the last stage": (
        dict(stages=3),
        [cand("a", gpu(0, 10)), cand("b", gpu(0, 40)), cand("c", gpu(0, 20))],
        ["c", "a", "b"],
    ),
    "preserve keeps the ranked order": (
        dict(stages=3, pipeline_last_stage_placement="preserve"),
        [cand("a", gpu(0, 10)), cand("b", gpu(0, 40)), cand("c", gpu(0, 20))],
        ["b", "c", "a"],
    ),
    "GPU fellows rank before CPU-only ones, whatever their RAM": (
        dict(stages=2, pipeline_last_stage_placement="preserve"),
        [cand("cpu", ram_gib=500), cand("gpu", gpu(0, 8))],
        ["gpu", "cpu"],
    ),
    "a GPU under the threshold makes its fellow CPU-only": (
        dict(stages=2, pipeline_last_stage_placement="preserve"),
        [cand("small", gpu(0, 3), ram_gib=64), cand("big", gpu(0, 8))],
        ["big", "small"],
    ),
    "CPU-only fellows rank by RAM": (
        dict(stages=2, pipeline_last_stage_placement="preserve"),
        [cand("a", ram_gib=4), cand("b", ram_gib=32), cand("c", ram_gib=8)],
        ["b", "c"],
    ),
    "without stages, every ready fellow up to one per layer": (
        dict(layers=3),
        [cand(f"f{i}", ram_gib=10 + i) for i in range(5)],
        ["f3", "f2", "f4"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_ranking_and_order(name):
    overrides, fellows, order = CASES[name]
    result = place(spec(**overrides), fellows)
    assert not isinstance(result, Unplaceable), result
    assert result.fellow_ids == order


UNPLACEABLE = {
    "too few fellows": (dict(stages=3), [cand("a"), cand("b")], "waiting for 3 ready fellows; 2"),
    "no GPU fellow when CPUs are not allowed": (
        dict(stages=1, allow_cpu=False),
        [cand("a"), cand("b", gpu(0, 2))],
        "ready fellows with an eligible GPU; 0 available",
    ),
    "min_fellows not met": (dict(min_fellows=3), [cand("a"), cand("b")], "waiting for 3"),
    "p2p without a data address": (
        dict(stages=2, transport="p2p"),
        [cand("a", gpu(0, 40), address=None), cand("b")],
        "data address (SWARM_DATA_ADDRESS) on a",
    ),
}


@pytest.mark.parametrize("name", list(UNPLACEABLE))
def test_why_a_job_cannot_be_placed(name):
    overrides, fellows, words = UNPLACEABLE[name]
    result = place(spec(**overrides), fellows)
    assert isinstance(result, Unplaceable)
    assert words in result.reason


def test_a_model_too_big_for_a_cpu_fellow_says_how_much_it_needs():
    huge = ModelConfig(n_layers=2, d_model=4096, n_heads=32, vocab_size=50000, seq_len=2048)
    result = place(JobSpec(model=huge, stages=1), [cand("a", ram_gib=2)])
    assert isinstance(result, Unplaceable)
    assert (
        result.reason.startswith("needs ~") and "of RAM, best fellow has 2.0 GiB" in result.reason
    )


def test_cannot_fit_names_the_stage_and_the_numbers():
    big = ModelConfig(n_layers=4, d_model=2048, n_heads=16, vocab_size=32000, seq_len=1024)
    job = JobSpec(model=big, stages=2, batch_size=8, micro_batches=4)
    result = place(job, [cand("a", gpu(0, 12)), cand("b", gpu(0, 5))])
    assert isinstance(result, Unplaceable)
    assert "on the last stage (a)" in result.reason or "on stage 0 (b)" in result.reason
    assert "GiB" in result.reason and "best fellow has" in result.reason


def test_equal_split_and_threads_shared_per_host():
    fellows = [
        cand("a", address="tcp://h1:1", host="h1"),
        cand("b", address="tcp://h1:2", host="h1"),
        cand("c", address="tcp://h2:1", host="h2", cores=4),
    ]
    placement = place(spec(stages=3), fellows)
    assert [(s.layer_start, s.layer_end) for s in placement.stages] == [(0, 3), (3, 6), (6, 8)]
    threads = {s.fellow_id: s.intra_op_threads for s in placement.stages}
    assert threads == {"a": 4, "b": 4, "c": 4}
    assert all(s.memory_estimate_bytes < s.memory_offered_bytes for s in placement.stages)


def test_weighted_split_follows_aggregate_eligible_memory():
    fellows = [cand("a", gpu(0, 30), gpu(1, 30)), cand("b", gpu(0, 20)), cand("c", gpu(0, 3))]
    placement = place(spec(stages=2, layers=8, partition="weighted"), fellows)
    assert layers_of(placement) == {"a": 6, "b": 2}  # 60 GiB vs 20 GiB
    cpu = [cand("x", ram_gib=2), cand("y", ram_gib=4), cand("z", ram_gib=6)]
    placement = place(spec(stages=3, layers=6, partition="weighted"), cpu)
    assert layers_of(placement) == {"x": 1, "y": 2, "z": 3}


def test_gpu_slots_split_a_stage_by_free_vram_with_the_largest_last():
    fellows = [cand("a", gpu(0, 10), gpu(1, 30), gpu(2, 2))]
    placement = place(spec(stages=1, layers=8), fellows)
    [stage] = placement.stages
    slots = [(s.gpu_index, s.layer_start, s.layer_end) for s in stage.gpu_slots]
    assert slots == [(0, 0, 2), (1, 2, 8)]  # GPU 2 is under the 4 GiB floor
    capped = place(spec(stages=1, layers=8, max_gpus_per_worker=1), fellows)
    assert [s.gpu_index for s in capped.stages[0].gpu_slots] == [1]
    floor = place(spec(stages=1, layers=8, placement_min_gpu_free_gb=1), fellows)
    assert [s.gpu_index for s in floor.stages[0].gpu_slots] == [2, 0, 1]
    lower_default = place(spec(stages=1), fellows, PlacementDefaults(min_gpu_free_gb=1))
    assert len(lower_default.stages[0].gpu_slots) == 3


def test_gpu_slots_never_outnumber_layers_and_cover_the_range():
    slots = gpu_slots([gpu(0, 10), gpu(1, 20), gpu(2, 30)], 5, 7)
    assert [(s.gpu_index, s.layer_start, s.layer_end) for s in slots] == [(1, 5, 6), (2, 6, 7)]


def test_missing_data_address_uses_the_relay_under_auto():
    fellows = [cand("a", gpu(0, 40), address=None), cand("b")]
    assert place(spec(stages=2), fellows).transport is Transport.TUNNEL
    # Stage 0 never binds, so its address does not matter.
    fellows = [cand("a", gpu(0, 40)), cand("b", address=None)]
    assert place(spec(stages=2), fellows).transport is Transport.AUTO


@pytest.mark.parametrize(
    ("n", "weights", "sizes"),
    [
        (8, [1, 1], [4, 4]),
        (10, [3, 1], [8, 2]),  # 7.5 / 2.5: the tie goes to the earlier stage
        (3, [100, 1, 1], [1, 1, 1]),  # every stage gets a layer
        (6, [1, 2, 3], [1, 2, 3]),
        (5, [1, 1, 1], [2, 2, 1]),
        (4, [0, 0], [2, 2]),  # nothing to go by: equal
        (7, [1000, 1, 1, 1], [4, 1, 1, 1]),
    ],
)
def test_weighted_ranges_rounding(n, weights, sizes):
    ranges = weighted_ranges(n, weights)
    assert [b - a for a, b in ranges] == sizes
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a == prev_b for (a, _), (_, prev_b) in zip(ranges[1:], ranges, strict=False))


# --- memory estimates ------------------------------------------------------------------------


def test_memory_estimate_grows_with_layers_micro_batches_in_flight_and_the_head():
    m = ModelConfig(n_layers=4, d_model=128, n_heads=4, seq_len=64, vocab_size=256)
    assert block_params(m) == 12 * 128 * 128 + 13 * 128
    first = stage_memory(m, batch_size=8, micro_batches=4, stage=0, n_stages=2, layers=2)
    last = stage_memory(m, batch_size=8, micro_batches=4, stage=1, n_stages=2, layers=2)
    assert stage_in_flight(0, 2, 4) == 2 and stage_in_flight(1, 2, 4) == 1
    assert first.per_layer[0] > last.per_layer[0]  # stage 0 holds more micro-batches
    wide = ModelConfig(n_layers=4, d_model=128, n_heads=4, seq_len=64, vocab_size=50_000)
    head = stage_memory(wide, batch_size=8, micro_batches=4, stage=1, n_stages=2, layers=2)
    assert head.last_extra > 20 * last.last_extra
    assert head.slot(0, 1, first=False, last=False) == head.per_layer[0]


# --- telemetry views -------------------------------------------------------------------------


def snapshot(*gpus, tf=None, error=None, **limits) -> HardwareSnapshot:
    return HardwareSnapshot(
        hostname="h",
        cpu_cores=8,
        ram_total_bytes=64 * GIB,
        ram_available_bytes=48 * GIB,
        gpus=list(gpus),
        tf_gpu_count=tf,
        tf_probe_error=error,
        limits=FellowLimits(**limits),
    )


def test_only_gpus_tensorflow_sees_are_offered_and_the_fix_is_named():
    assert usable_gpus(snapshot(gpu(0, 40), tf=0)) == []
    assert "pip install 'silentswarm[cuda]'" in gpu_warning(snapshot(gpu(0, 40), tf=0))
    assert usable_gpus(snapshot(gpu(0, 40), tf=None)) == []
    assert "still running" in gpu_warning(snapshot(gpu(0, 40)))
    assert "failed" in gpu_warning(snapshot(gpu(0, 40), error="timeout"))
    assert [g.index for g in usable_gpus(snapshot(gpu(0, 40), gpu(1, 40), tf=1))] == [0]
    assert gpu_warning(snapshot(gpu(0, 40), tf=1)) is None
    assert gpu_warning(snapshot()) is None and usable_gpus(snapshot(tf=0)) == []


def test_operator_caps_bound_what_a_fellow_offers():
    capped = usable_gpus(snapshot(gpu(0, 40), gpu(1, 60), tf=2, max_vram_bytes=70 * GIB))
    assert [(g.index, g.memory_free_bytes // GIB) for g in capped] == [(0, 10), (1, 60)]
    assert offered_ram(snapshot(max_memory_bytes=2 * GIB)) == 2 * GIB
    assert offered_ram(snapshot()) == 48 * GIB


# --- the job spec ----------------------------------------------------------------------------


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
    # Fresh CURVE keys per boundary: each end trusts exactly the other.
    assert first.curve_up is None and last.curve_down is None
    assert first.curve_down.peer_public == last.curve_up.public
    assert last.curve_up.peer_public == first.curve_down.public
    again = stage_plans(job_id="j-1", attempt=4, spec=s, placement=placement, subject_prefix="x")
    assert again[0].curve_down.secret != first.curve_down.secret
    tunnel = place(s, [cand("a", address=None), cand("b", address=None)])
    plans = stage_plans(job_id="j-2", attempt=1, spec=s, placement=tunnel, subject_prefix="swarm")
    assert all(p.curve_up is None and p.curve_down is None for p in plans)  # relay: no CURVE
    # Over the relay no stage needs an address; each fellow fills in its NATS URL.
    with_nats = [msgspec.structs.replace(p, nats=NatsAccess(url="nats://x:1")) for p in plans]
    assert [p.problems() for p in with_nats] == [[], []]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"stepz": 1}, "stepz"),
        ({"model": {"nheads": 3}}, "model.nheads"),
        ({"steps": "ten"}, "steps"),
        ({"transport": "carrier-pigeon"}, "transport"),
        ({"artifact_paths": {"export": "x"}}, "artifact_paths.export"),
        ({"pipeline_last_stage_placement": "middle"}, "pipeline_last_stage_placement"),
        # Out of bounds is caught while decoding (msgspec.Meta), so it names the field too.
        ({"placement_min_gpu_free_gb": -1}, "placement_min_gpu_free_gb"),
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


def test_an_in_flight_window_is_in_the_memory_estimate():
    m = ModelConfig(n_layers=4, d_model=128, n_heads=4, seq_len=64, vocab_size=256)
    kw = dict(batch_size=16, micro_batches=8, n_stages=2, layers=2)
    plain = stage_memory(m, stage=0, **kw)
    deep = stage_memory(m, stage=0, in_flight=8, **kw)
    assert deep.per_layer[0] > plain.per_layer[0] and deep.first_extra > plain.first_extra
    # the last stage holds one micro-batch whatever the window
    assert stage_memory(m, stage=1, in_flight=8, **kw) == stage_memory(m, stage=1, **kw)


def test_recompute_keeps_a_windows_activations_out_of_the_estimate():
    m = ModelConfig(n_layers=4, d_model=128, n_heads=4, seq_len=64, vocab_size=256)
    kw = dict(batch_size=16, micro_batches=8, n_stages=2, layers=2)
    tape = stage_memory(m, stage=0, in_flight=8, **kw)
    recomputed = stage_memory(m, stage=0, in_flight=8, recompute=True, **kw)
    assert recomputed.per_layer[0] < tape.per_layer[0] and recomputed.first_extra < tape.first_extra
    # one micro-batch's intermediates (its backward's), whatever the window
    narrow = stage_memory(m, stage=0, in_flight=1, recompute=True, **kw)
    assert recomputed.per_layer == narrow.per_layer
    # the last stage's fused call holds one micro-batch either way
    assert stage_memory(m, stage=1, recompute=True, **kw) == stage_memory(m, stage=1, **kw)


def test_placement_estimates_the_jobs_window():
    fellows = [cand("a"), cand("b")]
    plain = place(spec(stages=2, micro_batches=8, batch_size=16), fellows)
    deep = place(spec(stages=2, micro_batches=8, batch_size=16, in_flight=8), fellows)
    assert deep.stages[0].memory_estimate_bytes > plain.stages[0].memory_estimate_bytes
    assert deep.stages[1].memory_estimate_bytes == plain.stages[1].memory_estimate_bytes


def test_placement_counts_a_whole_batch_for_micro_batches_auto():
    """Whatever count and window the stages choose, a stage holds at most a batch's
    activations: that is what an "auto" job is placed with."""
    fellows = [cand("a"), cand("b")]
    auto = place(spec(stages=2, micro_batches="auto", batch_size=16), fellows)
    for m in (1, 2, 4, 8, 16):
        chosen = place(spec(stages=2, micro_batches=m, batch_size=16, in_flight=m), fellows)
        for a, c in zip(auto.stages, chosen.stages, strict=True):
            assert a.memory_estimate_bytes >= c.memory_estimate_bytes


def test_the_overlap_schedule_is_placed_with_a_second_gradient_and_weight_copy():
    """Two more fp32 values per parameter (the gradient set aside, the weights' previous
    version); activations as before, since the window does not change."""
    from silentswarm.leader.memory import FLOAT, block_params

    m = ModelConfig(n_layers=4, d_model=128, n_heads=4, seq_len=64, vocab_size=256)
    kw = dict(batch_size=16, micro_batches=8, n_stages=2, layers=2)
    for stage in range(2):
        plain = stage_memory(m, stage=stage, **kw)
        both = stage_memory(m, stage=stage, overlap=True, **kw)
        assert both.per_layer[0] - plain.per_layer[0] == 2 * FLOAT * block_params(m)
        assert both.first_extra > plain.first_extra or stage == 1
        assert both.last_extra > plain.last_extra or stage == 0
    fellows = [cand("a"), cand("b")]
    sync = place(spec(stages=2, micro_batches=8, batch_size=16), fellows)
    over = place(spec(stages=2, micro_batches=8, batch_size=16, schedule="overlap"), fellows)
    for a, b in zip(sync.stages, over.stages, strict=True):
        assert b.memory_estimate_bytes > a.memory_estimate_bytes
