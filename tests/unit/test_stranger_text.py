"""A fellow's words reach the operator's terminal and the job's record: what a terminal
would act on is escaped in the CLI, and cleaned and cut where the leader keeps it."""

from __future__ import annotations

import pytest

from silentswarm.cli import render
from silentswarm.cli.commands.fellows import _print_log
from silentswarm.cli.context import CliContext
from silentswarm.leader.jobs import STAGE_MESSAGE_CHARS
from silentswarm.protocol import Progress, ProgressEvent, StageOutcome, StageResult
from silentswarm.settings import Settings
from silentswarm.types.fleet import LogEntry
from silentswarm.types.jobs import CheckpointRecord, CheckpointStage
from tests.unit.test_elastic import fellow, running

SAFE = {
    "plain words stay": ("step 3 done", "step 3 done"),
    "a traceback keeps its lines and tabs": ("Traceback:\n\tline 1", "Traceback:\n\tline 1"),
    "a screen clear is shown, not done": ("a\x1b[2Jb", "a\\x1b[2Jb"),
    "a title change and its bell": ("\x1b]0;owned\x07", "\\x1b]0;owned\\x07"),
    "an 8-bit CSI": ("\x9b31m", "\\x9b31m"),
    "a carriage return that would overwrite the line": ("ok\rFAILED", "ok\\rFAILED"),
    "a bidi override that reverses what follows": ("abc\u202edef", "abc\\u202edef"),
}


@pytest.mark.parametrize(("text", "shown"), SAFE.values(), ids=SAFE.keys())
def test_what_a_terminal_would_act_on_is_shown_escaped(text, shown):
    assert render.terminal_safe(text) == shown


@pytest.mark.parametrize("epoch", [1e300, float("nan"), -1e300])
def test_a_time_no_clock_shows_prints_as_question_marks(epoch):
    assert render.clock(epoch) == "??:??:??"


def test_a_log_line_prints_escaped(capsys):
    entry = LogEntry(
        seq=1, fellow_id="f1", ts=1e300, level="INFO\x1b[8m", logger="x\x07", message="hi\x1b[2J"
    )
    _print_log(CliContext(settings=Settings(), json_flag=False, tty=False), entry)
    assert capsys.readouterr().out == "??:??:?? f1 INFO\\x1b[8m x\\x07: hi\\x1b[2J\n"


def test_how_a_stage_ended_is_kept_cleaned_and_cut():
    jobs, job, _ = running(k=1, p=2)
    failed = fellow(job, 0, 1)
    words = "boom\x1b[2J\nnext " + "x" * 4000
    outcome = StageOutcome(
        job_id=job.job_id, attempt=job.attempt, result=StageResult.FAILED, message=words
    )
    jobs.record_outcome(failed, outcome)
    stage = job.stage_progress(failed)
    assert stage is not None and stage.message.startswith("boom [2J next x")
    assert len(stage.message) == STAGE_MESSAGE_CHARS
    assert "\x1b" not in job.reason and "\n" not in job.reason


def test_a_failed_checkpoint_s_words_are_kept_cleaned():
    jobs, job, _ = running(k=1, p=2)
    stage0 = fellow(job, 0, 0)
    job.checkpoints.append(
        CheckpointRecord(
            checkpoint_id="c1",
            requested_at=0.0,
            attempt=job.attempt,
            at_step=4,
            stages=[CheckpointStage(fellow_id=stage0, acknowledged=True)],
        )
    )
    jobs.record_progress(
        Progress(
            job_id=job.job_id,
            fellow_id=stage0,
            attempt=job.attempt,
            stage=0,
            step=4,
            event=ProgressEvent.CHECKPOINT,
            checkpoint_id="c1",
            ok=False,
            message="disk\x1b[2J full",
            checkpoint_path="/ck/\x1b]0;x\x07",
        )
    )
    stage = job.checkpoints[-1].stages[0]
    assert (stage.ok, stage.message, stage.path) == (False, "disk [2J full", "/ck/ ]0;x")


def test_a_table_cell_an_account_wrote_prints_escaped():
    """A job's name or a dataset's source is an account's words: in a table as escaped text."""
    grid = render.table(["NAME", "SOURCE"], [["job\x1b[2J", "notes.txt\x1b]0;owned\x07"]])
    cells = [str(column._cells[0]) for column in grid.columns]
    assert cells == ["job\\x1b[2J", "notes.txt\\x1b]0;owned\\x07"]
