"""JobManager, scheduling and reconciling: pure logic with an injected clock."""

import itertools

import msgspec
import pytest

from silentswarm.errors import ConflictError, ErrorCode, IllegalTransitionError, NotFoundError
from silentswarm.jobspec import JobSpec
from silentswarm.leader.jobs import FellowState, JobManager, offered_to, plan_schedule, reconcile
from silentswarm.leader.placement import Candidate
from silentswarm.lifecycle import JOB_TRANSITIONS, JobEvent, next_job_state
from silentswarm.plan import ModelConfig
from silentswarm.protocol import (
    FellowStatus,
    GpuInfo,
    JobState,
    Progress,
    ProgressEvent,
    StageOutcome,
)
from silentswarm.protocol import StageResult as R
from silentswarm.types.views import JobView
from tests.fakes import Clock

J = JobState


def fellow(fid: str, **kw) -> Candidate:
    return Candidate(
        fellow_id=fid,
        hostname=kw.pop("hostname", "h"),
        data_address=kw.pop("data_address", f"tcp://127.0.0.1:1{fid[-1]}"),
        cpu_cores=2,
        ram_available_bytes=kw.pop("ram", 8 << 30),
        **kw,
    )


def spec(**kw) -> JobSpec:
    return JobSpec(model=ModelConfig(n_layers=4), **kw)


# --- the job lifecycle ----------------------------------------------------------------------

EXPECTED = {
    (J.PENDING, JobEvent.STARTED): J.RUNNING,
    (J.RUNNING, JobEvent.COMPLETED): J.COMPLETED,
    (J.RUNNING, JobEvent.FAILED): J.FAILED,
    (J.PENDING, JobEvent.CANCELLED): J.CANCELLED,
    (J.RUNNING, JobEvent.CANCELLED): J.CANCELLED,
    (J.RUNNING, JobEvent.RESUMED): J.PENDING,
    (J.PENDING, JobEvent.FAILED): J.FAILED,
}


def test_job_table_is_exactly_the_documented_lifecycle():
    assert JOB_TRANSITIONS == EXPECTED


@pytest.mark.parametrize(("state", "event"), list(itertools.product(J, JobEvent)))
def test_every_job_pair_is_an_edge_or_rejected(state, event):
    if (state, event) in EXPECTED:
        assert next_job_state(state, event) is EXPECTED[(state, event)]
    else:
        with pytest.raises(IllegalTransitionError) as err:
            next_job_state(state, event)
        assert state.value in err.value.message and event.value in err.value.message


# --- scheduling ------------------------------------------------------------------------------


def submit(manager: JobManager, clock: Clock, **kw):
    clock.now += 1
    return manager.submit(spec(**kw))


def test_oldest_job_that_fits_goes_first_and_a_big_one_does_not_block_smaller_ones():
    clock = Clock()
    manager = JobManager(wall=clock)
    big = submit(manager, clock, name="big", stages=3)
    small = submit(manager, clock, name="small", stages=1)
    also = submit(manager, clock, name="also", stages=1)
    assignments, waiting = plan_schedule(manager.pending(), [fellow("f1"), fellow("f2")])
    assert [a.job_id for a in assignments] == [small.job_id, also.job_id]
    assert "waiting for 3 ready fellows; 2 available" in waiting[big.job_id]
    used = [a.placement.fellow_ids for a in assignments]
    assert sorted(itertools.chain(*used)) == ["f1", "f2"]


def test_the_oldest_job_takes_the_fellows_when_it_fits():
    clock = Clock()
    manager = JobManager(wall=clock)
    first = submit(manager, clock, stages=2)
    submit(manager, clock, stages=1)
    assignments, waiting = plan_schedule(manager.pending(), [fellow("f1"), fellow("f2")])
    assert [a.job_id for a in assignments] == [first.job_id]
    assert len(waiting) == 1


def test_job_lifecycle_through_the_manager():
    clock = Clock()
    manager = JobManager(wall=clock)
    job = submit(manager, clock, stages=2, steps=10)
    [assignment], _ = plan_schedule(manager.pending(), [fellow("f1"), fellow("f2")])
    manager.begin_start(job.job_id, assignment.placement)
    assert job.attempt == 1 and manager.pending() == []
    assert set(manager.busy_fellows()) == {"f1", "f2"}
    manager.start_succeeded(job.job_id)
    assert job.state is J.RUNNING and job.started_at == clock.now
    f_last = job.placement.stages[-1].fellow_id
    manager.record_progress(
        Progress(job_id=job.job_id, fellow_id=f_last, attempt=1, step=5, loss=2.0, total_steps=10)
    )
    assert job.stage_progress(f_last).step == 5
    # A report of another attempt changes nothing.
    assert (
        manager.record_progress(Progress(job_id=job.job_id, fellow_id=f_last, attempt=2, step=9))
        is None
    )
    for placed in job.placement.stages:
        outcome = StageOutcome(job_id=job.job_id, attempt=1, result=R.COMPLETED, step=10, loss=1.5)
        manager.record_outcome(placed.fellow_id, outcome)
    assert job.state is J.COMPLETED and job.final_loss == 1.5
    assert [h.to_state for h in job.history] == [J.PENDING, J.RUNNING, J.COMPLETED]
    assert manager.busy_fellows() == {}
    assert job.job_id in manager.dirty


def test_a_failed_stage_fails_the_job_with_the_fellow_and_the_error():
    clock = Clock()
    manager = JobManager(wall=clock)
    job = submit(manager, clock, stages=2)
    [assignment], _ = plan_schedule(manager.pending(), [fellow("f1"), fellow("f2")])
    manager.begin_start(job.job_id, assignment.placement)
    manager.start_succeeded(job.job_id)
    bad = StageOutcome(job_id=job.job_id, attempt=1, result=R.FAILED, message="OOM")
    manager.record_outcome("f2", bad)
    assert job.state is J.FAILED
    assert "f2" in job.reason and "OOM" in job.reason


def one_stage_running(manager: JobManager, clock: Clock, fellows: list[Candidate]):
    """A resumable one-stage job started where placement puts it: (job, the stage's fellow,
    its memory estimate)."""
    job = submit(manager, clock, stages=1, resume_from_scratch=True)
    [assignment], _ = plan_schedule(manager.pending(), fellows)
    manager.begin_start(job.job_id, assignment.placement)
    manager.start_succeeded(job.job_id)
    (stage,) = assignment.placement.stages
    return job, stage.fellow_id, stage.memory_estimate_bytes


def out_of_memory(job, message: str) -> StageOutcome:
    return StageOutcome(
        job_id=job.job_id,
        attempt=1,
        result=R.FAILED,
        message=message,
        code=ErrorCode.STAGE_OUT_OF_MEMORY,
    )


def test_a_fellow_whose_stage_ran_out_of_memory_gets_no_stage_as_large_again():
    clock = Clock()
    manager = JobManager(wall=clock)
    roomy, smaller = fellow("f1", ram=8 << 30), fellow("f2", ram=4 << 30)
    job, placed_on, estimate = one_stage_running(manager, clock, [roomy, smaller])
    assert placed_on == "f1", "the most RAM first"
    killed = out_of_memory(job, "the kernel's out-of-memory killer ended the stage runtime")
    manager.record_outcome("f1", killed)
    assert job.state is J.PENDING and job.out_of_memory == {"f1": estimate}
    # The heartbeats that repeat the outcome after the resume add nothing.
    reason = job.resumes[-1].reason
    manager.record_late_outcome("f1", killed)
    assert job.resumes[-1].reason == reason and "said later" not in reason
    # Its estimate fell short on f1: the resumed job goes to the other fellow...
    [again], _ = plan_schedule(manager.pending(), [roomy, smaller])
    assert again.placement.fellow_ids == ["f2"]
    # ...or waits, saying why f1 will not do, where f1 is all there is.
    assert plan_schedule(manager.pending(), [roomy])[0] == []
    waiting = plan_schedule(manager.pending(), [roomy])[1][job.job_id]
    assert "a stage of this job ran out of memory on f1: they get only smaller" in waiting
    # A failure of another kind teaches nothing about memory.
    other = submit(manager, clock, stages=1, resume_from_scratch=True)
    [placed] = [a for a in plan_schedule([other], [roomy])[0]]
    manager.begin_start(other.job_id, placed.placement)
    manager.start_succeeded(other.job_id)
    manager.record_outcome(
        "f1", StageOutcome(job_id=other.job_id, attempt=1, result=R.FAILED, message="boom")
    )
    assert other.state is J.PENDING and other.out_of_memory == {}


def test_an_out_of_memory_death_said_after_the_attempt_was_given_up_is_still_noted():
    """A fellow whose group thrashed at its limit missed heartbeats and was taken for
    offline; its stage's outcome (the out-of-memory killer's) comes after the resume."""
    clock = Clock()
    manager = JobManager(wall=clock)
    roomy, smaller = fellow("f1", ram=8 << 30), fellow("f2", ram=4 << 30)
    job, _, estimate = one_stage_running(manager, clock, [roomy, smaller])
    manager.lose_stage(job.job_id, "f1", "fellow f1 went offline (no heartbeat for 3.0s)")
    assert job.state is J.PENDING and job.out_of_memory == {}
    late = out_of_memory(job, "the kernel's out-of-memory killer ended the stage runtime (exit -9)")
    # Only a fellow placed in that attempt is heard.
    manager.record_late_outcome("f2", late)
    assert job.out_of_memory == {}
    manager.dirty.clear()
    manager.record_late_outcome("f1", late)
    assert job.out_of_memory == {"f1": estimate} and job.job_id in manager.dirty
    assert job.resumes[-1].reason == (
        "fellow f1 went offline (no heartbeat for 3.0s); its stage said later: the kernel's "
        "out-of-memory killer ended the stage runtime (exit -9)"
    )
    manager.dirty.clear()
    manager.record_late_outcome("f1", late)  # every heartbeat repeats it: noted once
    assert job.resumes[-1].reason.count("said later") == 1 and not manager.dirty
    [again], _ = plan_schedule(manager.pending(), [roomy, smaller])
    assert again.placement.fellow_ids == ["f2"]


def gpu(fid: str, free_gib: int) -> GpuInfo:
    return GpuInfo(
        index=0,
        uuid=f"GPU-{fid}",
        name="H100",
        memory_total_bytes=80 << 30,
        memory_free_bytes=free_gib << 30,
        memory_used_bytes=(80 - free_gib) << 30,
    )


def test_a_gpu_fellow_whose_stage_ran_out_of_vram_offers_the_job_less_of_it():
    clock = Clock()
    manager = JobManager(wall=clock)
    big, other = fellow("f1", gpus=(gpu("f1", 40),)), fellow("f2", gpus=(gpu("f2", 20),))
    job, placed_on, estimate = one_stage_running(manager, clock, [big, other])
    assert placed_on == "f1", "the most free VRAM first"
    said = "the stage ran out of device memory (ResourceExhaustedError: OOM)"
    manager.record_outcome("f1", out_of_memory(job, said))
    assert job.out_of_memory == {"f1": estimate}
    [offered] = offered_to(job, [big])
    assert sum(g.memory_free_bytes for g in offered.gpus) < estimate
    [again], _ = plan_schedule(manager.pending(), [big, other])
    assert again.placement.fellow_ids == ["f2"]


def test_start_failure_returns_the_job_to_waiting_and_cancel_is_final():
    clock = Clock()
    manager = JobManager(wall=clock)
    job = submit(manager, clock, stages=1)
    [assignment], _ = plan_schedule(manager.pending(), [fellow("f1")])
    manager.begin_start(job.job_id, assignment.placement)
    manager.start_failed(job.job_id, "f1: FELLOW_BUSY")
    assert job.state is J.PENDING and job.placement is None and "FELLOW_BUSY" in job.reason
    # It backs off (2 s, then 4 s, ...) before it is placed again.
    assert manager.pending() == [] and "retrying in 2s" in job.reason
    clock.now += 2
    assert manager.pending() == [job]
    manager.begin_start(job.job_id, assignment.placement)
    manager.start_failed(job.job_id, "again")
    clock.now += 3
    assert manager.pending() == []
    clock.now += 1
    assert manager.pending() == [job]
    manager.cancel(job.job_id)
    assert job.state is J.CANCELLED
    with pytest.raises(ConflictError):
        manager.cancel(job.job_id)
    with pytest.raises(NotFoundError):
        manager.get("nope")


def test_checkpoint_target_is_ahead_of_the_furthest_stage_but_not_past_the_end():
    clock = Clock()
    manager = JobManager(wall=clock)
    job = submit(manager, clock, stages=2, steps=100)
    [assignment], _ = plan_schedule(manager.pending(), [fellow("f1"), fellow("f2")])
    with pytest.raises(ConflictError):
        manager.checkpoint_target(job.job_id)
    manager.begin_start(job.job_id, assignment.placement)
    manager.start_succeeded(job.job_id)
    for fid, step in (("f1", 40), ("f2", 39)):
        manager.record_progress(
            Progress(job_id=job.job_id, fellow_id=fid, attempt=1, step=step, step_time_s=0.1)
        )
    _, at = manager.checkpoint_target(job.job_id)
    assert at == 40 + 20  # 2 s ahead at 0.1 s a step
    for fid in ("f1", "f2"):
        manager.record_progress(Progress(job_id=job.job_id, fellow_id=fid, attempt=1, step=95))
    assert manager.checkpoint_target(job.job_id)[1] == 100


# --- reconcile ------------------------------------------------------------------------------


def running_job(clock: Clock):
    manager = JobManager(wall=clock)
    job = manager.submit(spec(stages=2))
    [assignment], _ = plan_schedule(manager.pending(), [fellow("f1"), fellow("f2")])
    manager.begin_start(job.job_id, assignment.placement)
    manager.start_succeeded(job.job_id)
    return manager, job


def state(fid, status=FellowStatus.TRAINING, job=None, attempt=1, outcome=None, heard=None):
    return FellowState(
        fellow_id=fid,
        status=status,
        job_id=job,
        attempt=attempt,
        outcome=outcome,
        last_heartbeat_at=heard,
    )


def test_reconcile_reads_outcomes_offline_fellows_and_fellows_doing_something_else():
    clock = Clock()
    _, job = running_job(clock)
    jid, t0 = job.job_id, job.started_at
    done = StageOutcome(job_id=jid, attempt=1, result=R.COMPLETED)
    fellows = {
        "f1": state("f1", FellowStatus.READY, outcome=done, heard=t0 + 10),
        "f2": state("f2", FellowStatus.TRAINING, job=jid, heard=t0 + 10),
    }
    assert reconcile(job, fellows, now=t0 + 10) == [("f1", done)]

    def f2_finding(now):
        return dict(reconcile(job, fellows, now=now)).get("f2")

    fellows["f2"] = state("f2", FellowStatus.OFFLINE, job=jid, heard=t0 + 1)
    assert "offline" in f2_finding(t0 + 10)
    # Ready with no word of the job: lost, but only once the START grace has passed.
    fellows["f2"] = state("f2", FellowStatus.READY, heard=t0 + 1)
    assert f2_finding(t0 + 1) is None
    fellows["f2"] = state("f2", FellowStatus.READY, heard=t0 + 5)
    assert "no longer running the job" in f2_finding(t0 + 5)
    del fellows["f2"]
    assert "removed" in f2_finding(t0 + 5)
    # An outcome of an older attempt is not this job's.
    old = StageOutcome(job_id=jid, attempt=0, result=R.FAILED)
    fellows = {fid: state(fid, job=jid, outcome=old, heard=t0 + 5) for fid in ("f1", "f2")}
    assert reconcile(job, fellows, now=t0 + 5) == []


def test_progress_event_ended_carries_the_outcome():
    clock = Clock()
    manager, job = running_job(clock)
    for fid in ("f1", "f2"):
        outcome = StageOutcome(job_id=job.job_id, attempt=1, result=R.COMPLETED, loss=1.0)
        manager.record_progress(
            Progress(
                job_id=job.job_id,
                fellow_id=fid,
                attempt=1,
                step=200,
                event=ProgressEvent.ENDED,
                outcome=outcome,
            )
        )
    assert job.state is J.COMPLETED


def test_the_served_view_is_the_pipeline_step_and_the_last_stage_loss():
    clock = Clock()
    manager = JobManager(wall=clock)
    job = submit(manager, clock, stages=2, steps=10)
    assert (job.view.step, job.view.total_steps, job.view.loss) == (None, 10, None)
    [assignment], _ = plan_schedule(manager.pending(), [fellow("f1"), fellow("f2")])
    manager.begin_start(job.job_id, assignment.placement)
    first, last = (s.fellow_id for s in job.placement.stages)
    assert (job.view.step, job.view.total_steps, job.view.fellows) == (0, 10, [first, last])
    manager.start_succeeded(job.job_id)
    for fid, step, loss in ((first, 7, None), (last, 5, 2.5)):
        progress = Progress(job_id=job.job_id, fellow_id=fid, attempt=1, step=step, loss=loss)
        manager.record_progress(progress)
    assert (job.view.step, job.view.loss) == (5, 2.5)  # the slowest stage; the last stage
    for fid in (first, last):
        outcome = StageOutcome(job_id=job.job_id, attempt=1, result=R.COMPLETED, step=10, loss=1.5)
        manager.record_outcome(fid, outcome)
    assert (job.view.step, job.view.loss, job.view) == (10, 1.5, job.current_view())
    # A record from the store (an older leader's has no view) gets its view on restore.
    stale = msgspec.structs.replace(job, view=JobView())
    restored = JobManager(wall=clock)
    restored.restore([stale])
    assert restored.get(job.job_id).view == job.view
