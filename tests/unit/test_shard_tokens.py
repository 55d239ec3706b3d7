"""Shard download tokens, the pure parts: one per stage and attempt, in a header, never in a
URL; a stage's token opens only its own files, and only while its attempt is the job's."""

from __future__ import annotations

from pathlib import Path

import pytest

from silentswarm.agent.shardpush import SHARD_TOKEN_HEADER
from silentswarm.leader.errors import ShardAccessError
from silentswarm.leader.exports import ExportService
from silentswarm.leader.jobs import JobManager, plan_schedule
from tests.fakes import Clock
from tests.unit.test_resume import fellow, push, running


def service(manager: JobManager, tmp_path: Path) -> ExportService:
    # The bus carries pushes only: tokens and downloads never touch it.
    return ExportService(
        bus=None,  # type: ignore[arg-type]
        jobs=manager,
        prefix="swarm",
        export_root=tmp_path,
        secret=b"operator-token",
        public_url="http://leader:8000/",
    )


def shard(directory: Path, step: int, stage: int) -> None:
    step_dir = directory / "shards" / f"step-{step}"
    step_dir.mkdir(parents=True, exist_ok=True)
    for suffix in ("npz", "json"):
        (step_dir / f"stage-{stage}.{suffix}").write_bytes(b"x")
        (step_dir / f"stage-{stage}.{suffix}.sha256").write_text("ab" * 32)


def test_the_agent_sends_the_header_the_leader_reads():
    assert SHARD_TOKEN_HEADER == ExportService.TOKEN_HEADER == "X-Swarm-Shard-Token"


def test_tokens_are_per_stage_and_attempt_and_only_in_a_header(tmp_path):
    clock = Clock()
    manager = JobManager(wall=clock)
    job = running(manager, clock, [fellow("f1", 4), fellow("f2", 8)])
    exports = service(manager, tmp_path)
    job.export_dir = str(tmp_path / "export")
    push(manager, job, 40)
    for stage in (0, 1):
        shard(Path(job.export_dir), 40, stage)
    tokens = {s: exports.token(job.job_id, job.attempt, s) for s in (0, 1)}
    assert tokens[0] != tokens[1] != exports.token(job.job_id, job.attempt + 1, 1)

    # Each stage's token opens its own files; not its neighbour's, not an odd name.
    path = exports.shard_file(job.job_id, 40, "stage-1.npz", tokens[1])
    assert path == Path(job.export_dir) / "shards" / "step-40" / "stage-1.npz"
    assert exports.shard_file(job.job_id, 40, "stage-0.json", tokens[0]).name == "stage-0.json"
    for name, token, says in [
        ("stage-1.npz", tokens[0], "stage 0's shard files, not 'stage-1.npz'"),
        ("stage-01.npz", tokens[0], "stage 0's"),
        ("stage-1.npz", "", "does not open"),
        ("stage-1.npz", "ab" * 32, "does not open"),
        ("stage-1.npz", "é" * 64, "does not open"),  # not ASCII: refused, not a crash
    ]:
        with pytest.raises(ShardAccessError, match=says) as refused:
            exports.shard_file(job.job_id, 40, name, token)
        assert refused.value.http_status == 403

    # The route takes the header only; a token in the URL is refused, with or without one.
    assert ExportService.download_token(f" {tokens[0]} ", {}) == tokens[0]
    assert ExportService.download_token(None, {"other": "1"}) == ""
    for header in (None, tokens[0]):
        with pytest.raises(ShardAccessError, match="never accepted in the URL"):
            ExportService.download_token(header, {"token": tokens[0]})

    # A lost fellow: the job resumes in a new attempt, whose tokens are new and the old die.
    manager.fail(job.job_id, "fellow f1 went offline")
    [assignment], _ = plan_schedule(manager.pending(), [fellow("f2", 8), fellow("f3", 8)])
    manager.begin_start(job.job_id, assignment.placement)
    manager.start_succeeded(job.job_id)
    with pytest.raises(ShardAccessError):
        exports.shard_file(job.job_id, 40, "stage-1.npz", tokens[1])
    resume = exports.resume_args(job, 1)
    assert resume is not None and resume.step == 40
    assert resume.token == exports.token(job.job_id, job.attempt, 1) != tokens[1]
    assert [f.url for f in resume.files] == [
        f"http://leader:8000/api/v1/jobs/{job.job_id}/shards/40/stage-1.{suffix}"
        for suffix in ("npz", "json")
    ]
    assert exports.shard_file(job.job_id, 40, "stage-1.json", resume.token).is_file()
