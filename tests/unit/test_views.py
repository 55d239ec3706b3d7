"""The one rule for a job's numbers: the pipeline's step is the slowest stage's, its loss the
last stage's (the final loss once completed). Table tests of swarm/types/views.py."""

from __future__ import annotations

import msgspec
import pytest

from silentswarm.types.jobs import JobRecord
from silentswarm.types.views import (
    JobView,
    StageProgress,
    is_last_stage,
    job_view,
    last_stage,
    pipeline_loss,
    pipeline_step,
)


def stages(*rows: tuple[int, int, float | None]) -> list[StageProgress]:
    """(stage, step, loss) rows, in any order."""
    return [StageProgress(stage=s, fellow_id=f"f{s}", step=n, loss=loss) for s, n, loss in rows]


@pytest.mark.parametrize(
    ("rows", "step", "last", "loss"),
    [
        ((), None, None, None),
        (((0, 3, None),), 3, 0, None),
        (((0, 7, None), (1, 5, 2.5)), 5, 1, 2.5),  # the slowest stage; the last stage's loss
        (((1, 5, 2.5), (0, 7, None)), 5, 1, 2.5),  # in any order
        (((0, 4, 9.0), (2, 6, None), (1, 2, 8.0)), 2, 2, None),  # the last has no loss yet
    ],
)
def test_step_and_loss(rows, step, last, loss):
    given = stages(*rows)
    assert pipeline_step(given) == step
    found = last_stage(given)
    assert (found.stage if found else None) == last
    assert pipeline_loss(given) == loss


@pytest.mark.parametrize(
    ("final", "live", "want"),
    [(None, 2.5, 2.5), (1.5, 2.5, 1.5), (0.0, 2.5, 0.0), (None, None, None)],
)
def test_the_final_loss_wins_once_there_is_one(final, live, want):
    assert pipeline_loss(stages((0, 1, None), (1, 1, live)), final) == want


@pytest.mark.parametrize(
    ("stage", "known", "last"),
    [(1, (0, 1), True), (0, (0, 1), False), (0, (0,), True), (None, (0,), False), (2, (), True)],
)
def test_is_last_stage(stage, known, last):
    assert is_last_stage(stage, stages(*((s, 0, None) for s in known))) is last


def test_the_job_view_takes_the_last_stage_numbers_and_sums_the_bytes():
    progress = [
        StageProgress(stage=1, fellow_id="b", step=5, total_steps=9, loss=2.0, val_loss=2.2,
                    lr=1e-3, step_time_s=0.5, tokens_per_s=1000.0, bytes_sent=30,
                    bytes_received=40),
        StageProgress(stage=0, fellow_id="a", step=6, loss=None, step_time_s=0.7,
                    tokens_per_s=900.0, bytes_sent=10, bytes_received=20),
    ]  # fmt: skip
    view = job_view(progress, total_steps=100)
    assert view == JobView(
        step=5,
        total_steps=9,  # the stages' own count wins over the spec's
        loss=2.0,
        val_loss=2.2,
        lr=1e-3,
        step_time_s=0.5,
        tokens_per_s=1000.0,
        bytes_sent=40,
        bytes_received=60,
        fellows=["a", "b"],
    )
    done = job_view(progress, total_steps=100, final_loss=1.0, final_val_loss=1.1)
    assert (done.loss, done.val_loss) == (1.0, 1.1)
    assert job_view([], total_steps=100) == JobView(total_steps=100)


def test_the_view_of_a_job_record_as_the_cli_decodes_it():
    record = {
        "job_id": "j",
        "name": "j",
        "state": "RUNNING",
        "created_at": 0,
        "updated_at": 0,
        "spec": {"steps": 50, "model": {"n_layers": 4}},
        "progress": [
            {"stage": 1, "fellow_id": "b", "step": 3, "loss": 2.0, "result": None, "extra": 1},
            {"stage": 0, "fellow_id": "a", "step": 4, "loss": None, "bytes_sent": 8},
        ],
        "final_loss": None,
        "view": {"step": 99},  # what the leader served is not trusted: computed again here
    }
    job = msgspec.convert(record, JobRecord)
    view = job.current_view()
    assert (view.step, view.total_steps, view.loss, view.fellows) == (3, 50, 2.0, ["a", "b"])
    assert [s.fellow_id for s in job.stages()] == ["a", "b"]
    bare = {k: record[k] for k in ("job_id", "name", "state", "created_at", "updated_at")}
    assert msgspec.convert({**bare, "spec": {"steps": 5}}, JobRecord).current_view() == JobView(
        total_steps=5
    )
