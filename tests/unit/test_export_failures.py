"""No silent loss of the final model: what the leader's record says when a job completes
without it (pure decisions, table tests), what the fellow reports, what the CLI does with it,
and that a failed write on the leader leaves no partial upload (real files; a real file-size
limit in a child process stands in for the full disk)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from silentswarm.agent.errors import CheckpointWriteError
from silentswarm.agent.runner import PUSH_DRAIN_S
from silentswarm.agent.runner import final_export_error as fellow_export_error
from silentswarm.cli.watch import check_export
from silentswarm.errors import ExportMissingError, JobEndedBadlyError
from silentswarm.leader.artifacts import ExportStore
from silentswarm.leader.jobs import clean_report, final_export_error
from silentswarm.protocol import EXPORT_ERROR_CHARS, StageOutcome, StageResult
from silentswarm.types.jobs import JobRecord, ShardReceipt
from tests.unit.test_artifacts import chunks, placed_job, send_shard

REPO = Path(__file__).resolve().parents[2]

# --- the fellow: why its final shard is not on the leader ------------------------------------

FULL = "cannot write /f/stage-1.npz: [Errno 28] No space left on device"


@pytest.mark.parametrize(
    ("submitted", "checkpoint_error", "drained", "push_error", "want"),
    [
        (True, None, True, None, None),
        (False, FULL, True, None, FULL),
        (False, FULL, False, "refused", FULL),  # the first failure is the cause
        (True, None, True, "cannot push /f/stage-1.npz: the leader refused it: x", "refused it"),
        (True, None, False, None, f"still running after {PUSH_DRAIN_S:.0f}s"),
        (False, None, True, None, "wrote no final checkpoint"),
    ],
)
def test_a_fellow_says_why_its_final_shard_is_missing(
    submitted, checkpoint_error, drained, push_error, want
):
    got = fellow_export_error(
        submitted=submitted,
        checkpoint_error=checkpoint_error,
        drained=drained,
        push_error=push_error,
    )
    if want is None:
        assert got is None
    else:
        assert got is not None and want in got


def test_a_checkpoint_write_error_names_the_file_and_the_cause():
    error = CheckpointWriteError(Path("/x/y/stage-1.npz"), OSError(28, "No space left on device"))
    assert str(error) == "cannot write /x/y/stage-1.npz: [Errno 28] No space left on device"


def test_the_outcome_bounds_what_a_fellow_may_say():
    import msgspec

    from silentswarm import subjects

    ok = StageOutcome(
        job_id="j", attempt=1, result=StageResult.COMPLETED, export_error="x" * EXPORT_ERROR_CHARS
    )
    assert msgspec.msgpack.decode(subjects.encode(ok), type=StageOutcome) == ok
    too_long = msgspec.structs.replace(ok, export_error="x" * (EXPORT_ERROR_CHARS + 1))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(subjects.encode(too_long), type=StageOutcome)


# --- the leader: what a completed job's record says ------------------------------------------


def receipt(stage: int, step: int, attempt: int = 1) -> ShardReceipt:
    return ShardReceipt(
        fellow_id="any", stage=stage, step=step, attempt=attempt, size=1, sha256="", at=0
    )


def job_with(*, pushed_step, receipts=(), leader_error=None, reports=None):
    """A 2-stage, 30-step job as it completes."""
    job = placed_job()
    job.pushed_step = pushed_step
    job.latest_shard_pushes = list(receipts)
    job.export_error = leader_error
    for stage, report in (reports or {}).items():
        job.progress[stage].export_error = report
    return job


@pytest.mark.parametrize(
    ("job", "want", "absent"),
    [
        # The final step is complete: nothing to say.
        (job_with(pushed_step=30, receipts=[receipt(0, 30), receipt(1, 30)]), None, []),
        # ... but the manifest could not be written: the leader's own error stays.
        (
            job_with(pushed_step=30, leader_error="cannot write /e/run_manifest.json: x"),
            ["cannot write /e/run_manifest.json"],
            ["final model"],
        ),
        # A fellow's full disk: its stage, its id, its path and the cause.
        (
            job_with(pushed_step=20, receipts=[receipt(0, 30)], reports={1: FULL}),
            ["(step 30) is not in the export", "stage 1 on fellow {s1}: " + FULL],
            ["stage 0"],
        ),
        # Nobody said why: said so, per stage that sent nothing.
        (
            job_with(pushed_step=None),
            [
                "stage 0 on fellow {s0}: no final shard arrived and the fellow did not say why",
                "stage 1 on fellow {s1}: no final shard arrived",
            ],
            [],
        ),
        # The leader could not store it: its error first; the silent stages add nothing.
        (
            job_with(pushed_step=20, leader_error="cannot store stage-1.npz: File too large"),
            ["the leader: cannot store stage-1.npz: File too large"],
            ["did not say why"],
        ),
        # A fellow whose final shard arrived cannot blame its disk; a shard of an earlier
        # attempt is no shard of this one.
        (
            job_with(
                pushed_step=20,
                receipts=[receipt(0, 30), receipt(1, 30, attempt=0)],
                reports={0: "lies"},
            ),
            ["stage 1 on fellow {s1}: no final shard arrived"],
            ["lies"],
        ),
    ],
)
def test_a_completed_job_says_why_its_final_model_is_missing(job, want, absent):
    got = final_export_error(job)
    if want is None:
        assert got is None
        return
    assert got is not None
    on = {f"s{p.stage}": p.fellow_id for p in job.progress}  # "{s1}": stage 1's fellow
    for text in want:
        assert text.format(**on) in got, got
    for text in absent:
        assert text not in got, got


def test_completing_sets_the_export_error_with_the_state_from_the_fellows_outcome():
    from silentswarm.leader.jobs import JobManager

    manager = JobManager()
    job = placed_job()
    manager.restore([job])
    manager.start_succeeded(job.job_id)
    for stage, report in ((0, None), (1, "\x1b[31mcannot write /f: [Errno 28] full\x1b[0m\n")):
        outcome = StageOutcome(
            job_id=job.job_id,
            attempt=job.attempt,
            result=StageResult.COMPLETED,
            step=30,
            export_error=report,
        )
        manager.record_outcome(job.progress[stage].fellow_id, outcome)
    assert job.state.value == "COMPLETED"
    assert job.export_error is not None
    fellow = job.progress[1].fellow_id
    assert (
        f"stage 1 on fellow {fellow}: [31mcannot write /f: [Errno 28] full [0m" in job.export_error
    )
    assert "\x1b" not in job.export_error and "\n" not in job.export_error


@pytest.mark.parametrize(
    ("text", "limit", "want"),
    [
        ("plain", 100, "plain"),
        ("a\x00b\x1b[2Jc\r\nd\u202ee", 100, "a b [2Jc d e"),
        ("x" * 50, 10, "xxxxxxx..."),
        ("  padded\t", 100, "padded"),
    ],
)
def test_a_fellows_words_are_cleaned_and_bounded(text, limit, want):
    assert clean_report(text, limit) == want


# --- the CLI ----------------------------------------------------------------------------------


def record(state: str, export_error: str | None = None) -> JobRecord:
    """A job record as the CLI decodes it from the leader's JSON."""
    body = {"job_id": "j", "name": "j", "spec": {}, "state": state, "created_at": 0}
    body |= {"updated_at": 0, "export_error": export_error}
    return msgspec.convert(body, JobRecord)


@pytest.mark.parametrize(
    ("job", "raises"),
    [
        (record("COMPLETED", None), None),
        (record("COMPLETED", FULL), ExportMissingError),
        # A failed job's missing model is no news: the failure is (exit 1, elsewhere).
        (record("FAILED", FULL), None),
    ],
)
def test_watch_turns_a_missing_export_into_its_own_exit_code(job, raises):
    if raises is None:
        check_export(job)
        return
    with pytest.raises(raises) as err:
        check_export(job)
    assert err.value.exit_code == 4 != JobEndedBadlyError.exit_code
    assert FULL in err.value.message and "COMPLETED" in err.value.message


# --- partial uploads on the leader ------------------------------------------------------------

# Runs in a child whose files may not grow past LIMIT bytes (RLIMIT_FSIZE: EFBIG, as a full
# disk gives ENOSPC): a complete step first, then a push too large for the limit.
CHILD = """
import json, resource, sys
from pathlib import Path
from silentswarm.leader.artifacts import ExportStore
from tests.unit.test_artifacts import chunks, send_shard

directory, limit = Path(sys.argv[1]), int(sys.argv[2])
store = ExportStore()
for stage in (0, 1):
    send_shard(store, directory, stage=stage, step=10)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
errors = []
for chunk in chunks("stage-0.npz", b"w" * (4 * limit), stage=0, step=20, piece=limit):
    try:
        store.receive(directory, chunk, 2)
    except OSError as exc:
        errors.append(exc.errno)
        break
print(json.dumps({"errors": errors, "transfers": len(store._transfers)}))
"""


def test_a_failed_write_leaves_no_partial_upload_and_keeps_the_complete_step(tmp_path):
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), "1024"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=True,
    )
    result = json.loads(child.stdout)
    assert result == {"errors": [27], "transfers": 0}  # EFBIG, and the transfer forgotten
    assert list((tmp_path / ".incoming").iterdir()) == []
    store = ExportStore()
    assert store.complete_steps(tmp_path, 2) == [10]
    stored = tmp_path / "shards" / "step-10" / "stage-0.npz"
    assert store.sha256_of(stored) == hashlib.sha256(stored.read_bytes()).hexdigest()
    assert not (tmp_path / "shards" / "step-20").exists() or not any(
        (tmp_path / "shards" / "step-20").iterdir()
    )


def test_the_sweep_empties_incoming_and_touches_nothing_stored(tmp_path):
    store = ExportStore(root=tmp_path)
    export = tmp_path / "run"
    for stage in (0, 1):
        send_shard(store, export, stage=stage, step=10)
    store.write_manifest(export, placed_job())
    before = {p: p.read_bytes() for p in export.rglob("*") if p.is_file()}
    # A transfer cut off half way (the leader died, or the fellow did).
    first, _second = chunks("stage-1.npz", b"abcdefgh", stage=1, step=20)
    store.receive(export, first, 2)
    (export / ".incoming" / "leftover").write_bytes(b"x")
    assert len(list((export / ".incoming").iterdir())) == 2
    assert sorted(store.sweep_incoming(export)) == ["f1-a1-s20-stage-1.npz", "leftover"]
    assert not (export / ".incoming").exists()
    assert {p: p.read_bytes() for p in export.rglob("*") if p.is_file()} == before
    assert store.sweep_incoming(export) == []  # nothing there: nothing to do
    assert store.sweep_incoming(tmp_path / "never-exported") == []


def test_the_sweep_removes_a_planted_incoming_symlink_and_never_follows_it(tmp_path):
    store = ExportStore(root=tmp_path)
    export = tmp_path / "run"
    send_shard(store, export, stage=0, step=10)
    victim = tmp_path.parent / f"{tmp_path.name}-victim"
    victim.mkdir()
    (victim / "precious").write_bytes(b"keep me")
    (export / ".incoming").rmdir()
    (export / ".incoming").symlink_to(victim)
    assert store.sweep_incoming(export) == [".incoming"]
    assert not (export / ".incoming").exists()
    assert (victim / "precious").read_bytes() == b"keep me"
