"""Automatic resume, the pure parts: where a job resumes, what its record keeps, how it is
placed again (same layer ranges), and when it gives up."""

from __future__ import annotations

from silentswarm.jobspec import JobSpec, Partition
from silentswarm.leader.jobs import JobManager, plan_schedule, resume_from
from silentswarm.leader.placement import Candidate
from silentswarm.plan import ModelConfig
from silentswarm.protocol import JobState, StageOutcome
from silentswarm.protocol import StageResult as R
from silentswarm.types.jobs import ShardReceipt
from tests.fakes import Clock


def fellow(fid: str, gib: float) -> Candidate:
    return Candidate(
        fellow_id=fid,
        hostname=fid,
        data_address=f"tcp://127.0.0.1:1{fid[-1]}",
        cpu_cores=2,
        ram_available_bytes=int(gib * 2**30),
    )


def running(manager: JobManager, clock: Clock, fellows: list[Candidate], **kw):
    clock.now += 1
    job = manager.submit(JobSpec(model=ModelConfig(n_layers=6), stages=2, steps=100, **kw))
    [assignment], _ = plan_schedule(manager.pending(), fellows)
    manager.begin_start(job.job_id, assignment.placement)
    manager.start_succeeded(job.job_id)
    return job


def push(manager: JobManager, job, step: int) -> None:
    for placed in job.placement.stages:
        receipt = ShardReceipt(
            fellow_id=placed.fellow_id,
            stage=placed.stage,
            step=step,
            attempt=job.attempt,
            size=10,
            sha256="x",
            at=1.0,
        )
        manager.record_push(job.job_id, receipt, step)


def test_resume_from_the_newest_complete_push_else_from_scratch_if_allowed():
    manager, clock = JobManager(wall=Clock()), Clock()
    job = running(manager, clock, [fellow("a1", 4), fellow("a2", 8)])
    assert resume_from(job).startswith("no shard push")
    push(manager, job, 40)
    assert resume_from(job) == 40 and job.pushed_step == 40
    assert len(job.latest_shard_pushes) == 2
    scratch = running(manager, clock, [fellow("b1", 4), fellow("b2", 8)], resume_from_scratch=True)
    assert resume_from(scratch) == 0
    never = running(manager, clock, [fellow("c1", 4), fellow("c2", 8)], max_resumes=0)
    push(manager, never, 20)
    assert resume_from(never).startswith("gave up after 0 resume(s)")


def test_a_lost_fellow_sends_the_job_back_to_pending_keeping_its_layer_ranges():
    clock = Clock()
    manager = JobManager(wall=clock)
    # Weighted: a 4 GiB and an 8 GiB fellow get 2 and 4 of the 6 layers.
    job = running(manager, clock, [fellow("f1", 4), fellow("f2", 8)], partition=Partition.WEIGHTED)
    ranges = [(s.layer_start, s.layer_end) for s in job.placement.stages]
    assert ranges == [(0, 2), (2, 6)]
    push(manager, job, 60)
    lost = job.placement.stages[0].fellow_id
    manager.fail(job.job_id, f"fellow {lost} (stage 0) went offline")
    assert job.state is JobState.PENDING and job.resume_step == 60
    [record] = job.resumes
    assert (record.failed_attempt, record.from_step) == (1, 60) and lost in record.reason
    # The orchestrator stops what still runs of attempt 1.
    assert manager.resumed == {job.job_id: (1, ["f1", "f2"])}
    assert "resuming from step 60" in job.reason

    # Placed again on whoever is ready, with the same boundaries (a plain weighted split of
    # these two would be 3 + 3).
    [assignment], _ = plan_schedule(manager.pending(), [fellow("f2", 8), fellow("f3", 8)])
    assert [(s.layer_start, s.layer_end) for s in assignment.placement.stages] == ranges
    manager.begin_start(job.job_id, assignment.placement)
    manager.start_succeeded(job.job_id)
    assert job.attempt == 2 and job.state is JobState.RUNNING
    # Reports of the old attempt change nothing.
    stale = StageOutcome(job_id=job.job_id, attempt=1, result=R.FAILED, message="peer gone")
    assert manager.record_outcome("f2", stale) is None and job.state is JobState.RUNNING


def test_the_job_fails_with_its_history_after_max_resumes_or_when_nobody_comes():
    clock = Clock()
    manager = JobManager(wall=clock)
    job = running(manager, clock, [fellow("f1", 4), fellow("f2", 8)], max_resumes=1)
    push(manager, job, 20)
    manager.fail(job.job_id, "fellow f1 went offline")
    [assignment], _ = plan_schedule(manager.pending(), [fellow("f2", 8), fellow("f3", 8)])
    manager.begin_start(job.job_id, assignment.placement)
    manager.start_succeeded(job.job_id)
    manager.fail(job.job_id, "fellow f3 went offline")
    assert job.state is JobState.FAILED
    assert "gave up after 1 resume(s)" in job.reason
    assert "attempt 1: fellow f1 went offline" in job.reason

    waiting = running(manager, clock, [fellow("g1", 4), fellow("g2", 8)], resume_wait_s=30)
    push(manager, waiting, 20)
    manager.fail(waiting.job_id, "fellow g1 went offline")
    clock.now += 10
    assert manager.expire_resumes() == [] and waiting.state is JobState.PENDING
    clock.now += 25
    assert manager.expire_resumes() == [waiting] and waiting.state is JobState.FAILED
    assert "could not resume within 30s" in waiting.reason
