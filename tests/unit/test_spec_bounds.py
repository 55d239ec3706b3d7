"""Every number and string of a job spec is bounded: out of bounds is a FieldError naming the
field (the leader's 400 and ``swarm submit``'s local check both decode with these Structs),
and the bound itself is still accepted."""

from __future__ import annotations

import json

import msgspec
import pytest

from silentswarm.errors import FieldError, JobSpecError
from silentswarm.jobspec import JobSpec, decode_job_spec, decode_strict
from silentswarm.plan import StagePlan

# (field path, the largest accepted value, a value past it)
BOUNDS = [
    ("steps", 10**9, 10**23),
    ("batch_size", 2**20, 2**20 + 1),
    ("micro_batches", 2**16, 2**16 + 1),
    ("in_flight", 2**16, 2**16 + 1),
    ("learning_rate", 100.0, 1e300),
    ("warmup_steps", 10**9, 10**12),
    ("weight_decay", 100.0, 1e9),
    ("seed", 2**63 - 1, 2**64),
    ("val_every", 10**9, 10**12),
    ("val_batches", 10**6, 10**6 + 1),
    ("min_lr_ratio", 1.0, 1.5),
    ("stages", 1024, 10**6),
    ("min_fellows", 1024, 10**6),
    ("max_data_bytes", 2**50, 2**62),
    ("placement_min_gpu_free_gb", 100_000.0, 1e12),
    ("max_gpus_per_worker", 1024, 10**6),
    ("shard_push_interval_steps", 10**9, 10**12),
    ("max_resumes", 1000, 10**9),
    ("resume_wait_s", 30 * 86400.0, 1e12),
    ("peer_timeout_s", 86400.0, 1e12),
    ("model.vocab_size", 2**22, 2**40),
    ("model.seq_len", 2**20, 2**40),
    ("model.n_layers", 4096, 10**9),
    ("model.d_model", 2**16, 10**9),
    ("model.n_heads", 4096, 10**9),
    ("model.mlp_ratio", 64, 10**6),
]
# (field path, a value below the lowest accepted one)
FLOORS = [
    ("steps", 0),
    ("batch_size", 0),
    ("micro_batches", -1),
    ("in_flight", 0),
    ("learning_rate", 0.0),
    ("warmup_steps", -1),
    ("seed", -1),
    ("val_batches", 0),
    ("val_fraction", 0.0),
    ("val_fraction", 1.0),
    ("min_lr_ratio", -0.1),
    ("max_resumes", -1),
    ("resume_wait_s", 0.0),
    ("peer_timeout_s", -5.0),
    ("model.d_model", 0),
    ("model.dropout", 1.0),
]


def body(path: str, value) -> bytes:
    spec: dict = {}
    head, _, tail = path.partition(".")
    if tail:
        spec[head] = {tail: value}
    else:
        spec[head] = value
    return json.dumps(spec).encode()


@pytest.mark.parametrize(("field", "value"), [(f, bad) for f, _, bad in BOUNDS] + FLOORS)
def test_out_of_bounds_names_the_field(field, value):
    with pytest.raises(FieldError) as err:
        decode_job_spec(body(field, value))
    assert err.value.field == field and err.value.message.startswith(field)
    assert err.value.http_status == 400


@pytest.mark.parametrize(("field", "value"), [(f, ok) for f, ok, _ in BOUNDS])
def test_the_bound_itself_decodes(field, value):
    spec = decode_strict(body(field, value), JobSpec)  # bounds only; semantics aside
    head, _, tail = field.partition(".")
    got = getattr(getattr(spec, head), tail) if tail else getattr(spec, head)
    assert got == value


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"name": "x" * 129}, "name"),
        ({"name": ""}, "name"),
        ({"data": []}, "data"),
        ({"data": ["a" * 5000]}, "data[0]"),
        ({"data": ["x"] * 1025}, "data"),
        ({"compression": "fixed_int8" * 10}, "compression"),
        ({"jit_compile": "yes"}, "jit_compile"),
        ({"artifact_paths": {"model_export_dir": "d" * 5000}}, "artifact_paths.model_export_dir"),
        ({"artifact_paths": {"model_export_dir": ""}}, "artifact_paths.model_export_dir"),
    ],
)
def test_strings_and_lists_are_bounded_too(raw, field):
    with pytest.raises(FieldError) as err:
        decode_job_spec(json.dumps(raw).encode())
    assert err.value.field == field


def test_a_stage_plan_carries_the_same_bounds():
    plan = {"job_id": "j", "stage": 0, "n_stages": 1, "layer_start": 0, "layer_end": 1}
    with pytest.raises(msgspec.ValidationError, match=r"train\.steps"):
        msgspec.json.decode(json.dumps({**plan, "train": {"steps": 10**12}}), type=StagePlan)


def test_an_in_flight_window_past_the_micro_batches_names_the_field():
    with pytest.raises(JobSpecError) as err:
        decode_job_spec(b'{"batch_size": 8, "micro_batches": 4, "in_flight": 5}')
    assert str(err.value.message).startswith("in_flight (5) must be in [1, micro_batches (4)]")
    assert err.value.http_status == 400
    spec = decode_job_spec(b'{"batch_size": 8, "micro_batches": 4, "in_flight": 4}')
    assert spec.in_flight == 4 and spec.train_config().in_flight == 4
