"""A job spec embeds the training config: flat JSON as before, one default and one bound per
field, and the plans get every training field the spec sets."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from silentswarm.errors import FieldError, JobSpecError
from silentswarm.jobspec import JobSpec, decode_job_spec, stage_plans
from silentswarm.plan import TrainConfig

REPO = Path(__file__).resolve().parents[2]
TRAINING = msgspec.structs.fields(TrainConfig)


def test_every_training_field_is_a_top_level_job_field_with_the_same_default():
    spec = JobSpec()
    job_fields = {f.name: f for f in msgspec.structs.fields(JobSpec)}
    for field in TRAINING:
        assert field.name in job_fields
        assert getattr(spec, field.name) == getattr(TrainConfig(), field.name), field.name
    assert JobSpec().train_config() == TrainConfig()
    assert TrainConfig().steps == 200  # the README's default


def test_the_train_config_of_a_spec_is_exactly_a_train_config():
    spec = decode_job_spec(
        b'{"steps": 7, "jit_compile": false, "val_batches": 2, "min_lr_ratio": 0.0,'
        b' "val_fraction": 0.1, "batch_size": 4, "micro_batches": 2}'
    )
    train = spec.train_config()
    assert type(train) is TrainConfig
    assert (train.steps, train.jit_compile, train.val_batches) == (7, False, 2)
    assert (train.min_lr_ratio, train.val_fraction, train.batch_size) == (0.0, 0.1, 4)
    # What goes to the fellows decodes strictly as a plan's train (no job-only field leaks).
    assert msgspec.json.decode(msgspec.json.encode(train), type=TrainConfig) == train


def test_existing_job_files_decode_unchanged():
    quickstart = decode_job_spec((REPO / "exp/configs/quickstart.json").read_bytes())
    assert (quickstart.steps, quickstart.batch_size, quickstart.stages) == (700, 16, 2)
    # The sweep configs' bases and points are job specs too: tests/unit/test_sweep.py.


def test_the_spec_is_flat_a_nested_train_is_an_unknown_field():
    with pytest.raises(FieldError) as err:
        decode_job_spec(json.dumps({"train": {"steps": 5}}).encode())
    assert err.value.field == "train"


@pytest.mark.parametrize(
    ("raw", "field", "expected"),
    [
        ({"replicas": "auto "}, "replicas", 'expected "auto" or an integer'),
        ({"micro_batches": "x"}, "micro_batches", 'expected "auto" or an integer'),
        ({"sync": "foo"}, "sync", 'expected one of "allreduce", "diloco"'),
        ({"transport": "x"}, "transport", 'expected one of "auto", "p2p", "tunnel"'),
        ({"partition": "x"}, "partition", '"equal", "weighted", "balanced"'),
    ],
)
def test_a_wrong_word_names_the_field_and_what_it_takes(raw, field, expected):
    with pytest.raises(FieldError) as err:
        decode_job_spec(json.dumps(raw).encode())
    assert err.value.field == field and err.value.message.startswith(f"{field}: Invalid enum")
    assert err.value.message.endswith(expected)


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"batch_size": 6, "micro_batches": 4}, "micro_batches (4) must divide batch_size (6)"),
        ({"compression": "zip"}, "compression: compression 'zip'"),
        ({"stages": 5}, "stages (5)"),
        ({"micro_batches": "auto", "in_flight": 9}, "in_flight (9) must be in [1, batch_size (8)]"),
    ],
)
def test_semantic_problems_name_the_top_level_field(raw, needle):
    with pytest.raises(JobSpecError) as err:
        decode_job_spec(json.dumps(raw).encode())
    assert needle in err.value.message and "train." not in err.value.message


def test_plans_carry_the_training_fields_the_spec_sets():
    from silentswarm.jobspec import PlacedStage, Placement
    from silentswarm.plan import Transport

    spec = JobSpec(jit_compile=False, val_batches=3, min_lr_ratio=0.5, steps=9)
    placement = Placement(
        stages=[
            PlacedStage(stage=0, fellow_id="a", hostname="h", layer_start=0, layer_end=4),
        ],
        transport=Transport.TUNNEL,
    )
    [plan] = stage_plans(
        job_id="j", attempt=1, spec=spec, placement=placement, subject_prefix="swarm"
    )
    assert plan.train == spec.train_config()
    assert (plan.train.jit_compile, plan.train.val_batches, plan.train.min_lr_ratio) == (
        False,
        3,
        0.5,
    )


def test_auto_compression_and_micro_batches_are_accepted_and_nothing_else_is():
    spec = decode_job_spec(b'{"compression": "auto", "micro_batches": "auto", "batch_size": 12}')
    assert spec.auto_micro_batches and spec.initial_micro_batches == 4
    assert spec.initial_in_flight == 1
    assert spec.memory_schedule() == (1, None)  # a whole batch's activations at once
    odd = decode_job_spec(b'{"micro_batches": "auto", "batch_size": 9, "in_flight": 2}')
    assert (odd.initial_micro_batches, odd.initial_in_flight) == (3, 2)
    fixed = decode_job_spec(b'{"micro_batches": 2, "in_flight": 2}')
    assert fixed.memory_schedule() == (2, 2) and not fixed.auto_micro_batches
    with pytest.raises(FieldError) as err:
        decode_job_spec(b'{"micro_batches": "fast"}')
    assert err.value.field == "micro_batches"
    with pytest.raises(FieldError) as err:
        decode_job_spec(b'{"link_probe_every": -1}')
    assert err.value.field == "link_probe_every"


def test_the_schedule_is_1f1b_unless_a_spec_asks_for_overlap():
    assert decode_job_spec(b"{}").schedule == "1f1b" and not decode_job_spec(b"{}").overlap
    assert decode_job_spec(b'{"schedule": "overlap"}').overlap
    with pytest.raises(FieldError) as err:
        decode_job_spec(b'{"schedule": "async"}')
    assert err.value.field == "schedule"


@pytest.mark.parametrize(
    ("body", "default", "expected"),
    [
        (b"{}", "p2p", "p2p"),  # unset: the leader's SWARM_PIPELINE_TRANSPORT
        (b"{}", "auto", "auto"),
        (b'{"transport": "auto"}', "tunnel", "auto"),  # named, even auto: kept
        (b'{"transport": "tunnel"}', "p2p", "tunnel"),
    ],
)
def test_a_spec_without_a_transport_takes_the_leaders_default(body, default, expected):
    from silentswarm.jobspec import with_default_transport

    spec = decode_job_spec(body)
    assert with_default_transport(spec, default).transport == expected
