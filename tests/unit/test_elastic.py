"""Elastic membership of replicas (issue 23 item 2), the leader's pure side: which replica a
lost stage drops, when a ring change takes effect, the members' ring changes (fresh secrets,
the donor, the lead's checkpoint duty), a replacement for a lost slot, the joiner's plans,
and the job record through a loss, a replacement, its join and a digest that disagrees."""

from __future__ import annotations

import msgspec
import pytest

from silentswarm.jobspec import JobSpec, Placement
from silentswarm.leader import elastic
from silentswarm.leader.jobs import JobManager
from silentswarm.leader.placement import Candidate, Unplaceable, place
from silentswarm.natsauth import attempt_permissions
from silentswarm.plan import ModelConfig, Transport
from silentswarm.protocol import JobState, Progress, ProgressEvent, StageOutcome, StageResult
from silentswarm.types.jobs import JobRecord
from tests.fakes import Clock, offline_orchestrator

GIB = 1 << 30
DIGEST_A, DIGEST_B = "a" * 64, "b" * 64


def cand(fid: str, *, sync: bool = True) -> Candidate:
    return Candidate(
        fellow_id=fid,
        hostname=fid,
        data_address=f"tcp://{fid}:1",
        sync_address=f"tcp://{fid}:2" if sync else None,
        cpu_cores=8,
        ram_available_bytes=16 * GIB,
    )


def spec(**kw) -> JobSpec:
    base = dict(model=ModelConfig(n_layers=4), steps=100, allow_cpu=True, transport="p2p")
    base.update(kw)
    return JobSpec(**base)


def running(k: int = 2, p: int = 2, **kw) -> tuple[JobManager, JobRecord, Clock]:
    """A RUNNING job of ``k`` replicas of ``p`` stages on fellows f0.. (f<k*p>.. stay idle)."""
    clock = Clock()
    jobs = JobManager(wall=clock)
    s = spec(replicas=k, stages=p, **kw)
    job = jobs.submit(s)
    placement = place(s, [cand(f"f{i}") for i in range(k * p)])
    assert isinstance(placement, Placement), placement
    jobs.begin_start(job.job_id, placement)
    jobs.start_succeeded(job.job_id)
    assert job.state is JobState.RUNNING
    return jobs, job, clock


def fellow(job: JobRecord, replica: int, stage: int) -> str:
    assert job.placement is not None
    return job.placement.pipeline(replica)[stage].fellow_id


def step(job: JobRecord, fid: str, n: int, **kw) -> Progress:
    placed = job.placement.stage_of(fid) if job.placement else None
    assert placed is not None
    return Progress(
        job_id=job.job_id,
        fellow_id=fid,
        attempt=job.attempt,
        stage=placed.stage,
        replica=placed.replica,
        step=n,
        **kw,
    )


# --- which replica goes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "lost", "expected"),
    [
        (2, (1, 0), 1),  # the replica of the lost stage
        (2, (0, 1), 0),  # replica 0 too: the others go on
        (3, (2, 1), 2),
        (1, (0, 0), None),  # no replicas: the job fails (or resumes) as ever
    ],
)
def test_the_replica_of_a_lost_stage_is_dropped_when_another_goes_on(k, lost, expected):
    _, job, _ = running(k=k)
    assert elastic.replica_to_drop(job, fellow(job, *lost)) == expected
    assert elastic.replica_to_drop(job, "stranger") is None


def test_the_last_training_replica_is_never_dropped():
    jobs, job, _ = running(k=2)
    jobs.lose_stage(job.job_id, fellow(job, 1, 0), "went offline")
    assert job.state is JobState.RUNNING and job.placement.live_replicas == [0]
    assert elastic.replica_to_drop(job, fellow(job, 0, 1)) is None


# --- when -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "times", "sync", "expected"),
    [
        ([10, 12], [None, None], {}, 14),  # the furthest stage + MIN_AHEAD
        ([10, 12], [0.5, 0.25], {}, 18),  # 3 s of the slowest step (0.5 s)
        ([10, 12], [10.0, 1.0], {}, 14),  # slow steps: still MIN_AHEAD
        ([10, 12], [None, None], {"sync": "diloco", "sync_every": 20}, 20),  # after a sync
        ([95, 98], [None, None], {}, None),  # the run ends first
        ([95, 98], [None, None], {"sync": "diloco", "sync_every": 20}, None),
    ],
)
def test_a_ring_change_takes_effect_a_little_ahead_of_the_furthest_stage(
    steps, times, sync, expected
):
    _, job, _ = running(k=2, p=1, **sync)
    for p, n, t in zip(job.progress, steps, times, strict=False):
        p.step, p.step_time_s = n, t
    assert elastic.switch_step(job) == expected


@pytest.mark.parametrize(
    ("k", "steps", "times", "expected"),
    [
        # one stage's report far beyond the others' is not believed: the furthest step and
        # the slowest step time another member vouches for (spread: 4 + 1 stage steps)
        (3, [10, 12, 1000], [None] * 3, 14),
        (3, [10, 12, 99], [None] * 3, 14),  # it would have ended the run first
        (3, [10, 12, 17], [None] * 3, 19),  # within the spread of another: believed
        (3, [10, 12, 18], [None] * 3, 14),
        (3, [10, 12, 12], [0.5, 0.25, 3600.0], 18),  # 3 s of 0.5 s steps, not MIN_AHEAD
        (3, [10, 12, 12], [0.5, 0.25, 1.0], 15),  # 1.0 is within twice 0.5: believed
        (3, [10, 12, 12], [0.5, 0.25, 1e-9], 18),  # a tiny time moves nothing
        (3, [50, 50, 0], [None] * 3, 52),  # a stage far behind (stuck) moves nothing
        # two reports: neither outvotes the other, the furthest and the slowest hold
        (2, [10, 1000], [None] * 2, None),
        (2, [50, 0], [None] * 2, 52),
        (2, [10, 12], [0.25, 3600.0], 14),
        # both absurdly fast: counted as 1 ms steps (3000 ahead, past the run), no overflow
        (2, [10, 12], [1e-308, 1e-308], None),
    ],
)
def test_one_report_far_from_the_others_does_not_move_a_ring_change(k, steps, times, expected):
    _, job, _ = running(k=k, p=1)
    for p, n, t in zip(job.progress, steps, times, strict=True):
        p.step, p.step_time_s = n, t
    assert elastic.switch_step(job) == expected


def test_under_diloco_the_replicas_may_drift_a_sync_interval_apart():
    _, job, _ = running(k=3, p=1, sync="diloco", sync_every=20)
    for p, n in zip(job.progress, [10, 12, 35], strict=True):
        p.step = n  # 35 is within 4 + 1 + 20 steps of 12: believed
    assert elastic.switch_step(job) == 40
    job.progress[2].step = 38  # beyond: the furthest vouched for is 12
    assert elastic.switch_step(job) == 20


def test_after_a_loss_each_step_until_the_switch_counts_as_a_sync_timeout():
    _, job, _ = running(k=2, p=1, sync_timeout_s=3.0)
    for p in job.progress:
        p.step, p.step_time_s = 20, 0.05  # measured before the loss
    assert elastic.switch_step(job) == 20 + 60  # 3 s of 0.05 s steps
    assert elastic.switch_step(job, after_loss=True) == 20 + 2  # each will wait 3 s


# --- the changes ----------------------------------------------------------------------------


def test_ring_changes_give_every_member_its_new_neighbours_and_fresh_secrets():
    jobs, job, _ = running(k=3, p=2)
    before = {fid: None for fid in job.placement.fellow_ids}
    jobs.lose_stage(job.job_id, fellow(job, 1, 1), "went offline")
    assert job.placement.live_replicas == [0, 2]
    changes = elastic.ring_changes(job, members=[0, 2], epoch=1, at_step=14)
    assert set(changes) == {fellow(job, r, i) for r in (0, 2) for i in (0, 1)}
    for i in (0, 1):
        a, b = changes[fellow(job, 0, i)], changes[fellow(job, 2, i)]
        assert a.members == b.members == [0, 2] and a.donor == 0 and a.epoch == 1
        assert a.at_step == 14 and not a.problems(0, (2 * i, 2 * i + 2))
        assert not b.problems(2, (2 * i, 2 * i + 2))
        # One split for both: one ring per stage, of its layers, bound at port 0.
        (ra,), (rb,) = a.rings, b.rings
        assert (ra.layer_start, ra.layer_end, ra.port) == (2 * i, 2 * i + 2, 0)
        # 0 -> 2 -> 0: each connects to the other, at its sync address, with the key pair
        # the other binds with, and the relay tokens match end to end.
        assert ra.next.fellow_id == fellow(job, 2, i)
        assert rb.next.fellow_id == fellow(job, 0, i)
        assert (ra.prev.fellow_id, rb.prev.fellow_id) == (fellow(job, 2, i), fellow(job, 0, i))
        assert ra.next.data_address == job.placement.pipeline(2)[i].sync_address
        assert ra.curve_down.peer_public == rb.curve_up.public
        assert rb.curve_down.peer_public == ra.curve_up.public
        assert ra.relay_down_token == rb.relay_up_token
        assert ra.relay_up_token == rb.relay_down_token
    # Stages' rings are apart: another stage's ring has other keys.
    keys = {c.rings[0].curve_down.secret for c in changes.values()}
    assert len(keys) == 4
    # Replica 0 leads (its checkpoints are the job's); replica 2 checkpoints nothing.
    assert changes[fellow(job, 0, 0)].checkpoint_at_end is True
    assert changes[fellow(job, 2, 0)].checkpoint_at_end is False
    assert not set(before) - set(job.placement.fellow_ids) & set(changes)  # none for the lost


def test_a_ring_of_one_has_no_links():
    jobs, job, _ = running(k=2, p=1)
    jobs.lose_stage(job.job_id, fellow(job, 1, 0), "went offline")
    (change,) = elastic.ring_changes(job, members=[0], epoch=1, at_step=5).values()
    (ring,) = change.rings
    assert change.members == [0] and ring.prev is None and ring.next is None
    assert not change.problems(0, (0, 4))


def test_losing_replica_0_hands_its_checkpoints_to_the_lowest_that_goes_on():
    jobs, job, _ = running(k=3, p=1, shard_push_interval_steps=10, shard_push_to_leader=True)
    jobs.lose_stage(job.job_id, fellow(job, 0, 0), "went offline")
    assert job.placement.lead == 1 and job.placement.n_replicas == 3
    changes = elastic.ring_changes(job, members=[1, 2], epoch=1, at_step=5)
    lead = changes[fellow(job, 1, 0)]
    assert (lead.checkpoint_at_end, lead.checkpoint_every, lead.donor) == (True, 10, 1)
    assert changes[fellow(job, 2, 0)].checkpoint_every == 0


# --- the record -----------------------------------------------------------------------------


def test_a_lost_replica_leaves_the_record_and_the_job_completes_without_it():
    jobs, job, _ = running(k=2, p=2)
    lost, other = fellow(job, 1, 1), fellow(job, 1, 0)
    jobs.lose_stage(job.job_id, lost, f"fellow {lost} went offline")
    assert job.state is JobState.RUNNING and job.attempt == 1 and not job.resumes
    assert [p.replica for p in job.dropped] == [1, 1]
    assert {p.replica for p in job.progress} == {0}
    assert jobs.drops == {job.job_id: [other, lost]}  # both still running: STOP them
    # ... and lose their NATS users of the attempt (the ring subjects of their stage)
    assert jobs.revokes == [(other, job.job_id, 1), (lost, job.job_id, 1)]
    assert jobs.ring_due == {job.job_id}
    (change,) = job.membership
    assert (change.kind, change.replica) == ("lost", 1) and "went offline" in change.reason
    # A second stage of the same replica lost: already dropped, nothing more.
    jobs.lose_stage(job.job_id, other, "stopped")
    assert job.state is JobState.RUNNING and len(job.membership) == 1
    for fid in job.placement.fellow_ids:
        outcome = StageOutcome(job_id=job.job_id, attempt=1, result=StageResult.COMPLETED, step=100)
        jobs.record_outcome(fid, outcome)
    assert job.state is JobState.COMPLETED


def test_a_failed_stage_of_a_replica_is_a_lost_replica_not_a_resume():
    jobs, job, _ = running(k=2, p=1, max_resumes=3, resume_from_scratch=True)
    fid = fellow(job, 1, 0)
    outcome = StageOutcome(
        job_id=job.job_id, attempt=1, result=StageResult.FAILED, message="sync failed"
    )
    jobs.record_outcome(fid, outcome)
    assert job.state is JobState.RUNNING and job.placement.live_replicas == [0]
    assert not job.resumes and fid not in jobs.drops.get(job.job_id, [])
    assert jobs.revokes == [(fid, job.job_id, 1)]  # a failed stage's fellow is revoked too
    # The last replica failing: the job resumes (a new attempt) as without replicas.
    jobs.record_outcome(fellow(job, 0, 0), outcome)
    assert job.state is JobState.PENDING and job.resumes


def test_a_replacement_is_placed_joins_and_counts_once_it_trains():
    jobs, job, _ = running(k=2, p=2)
    lost = fellow(job, 1, 0)
    jobs.lose_stage(job.job_id, lost, "went offline")
    jobs.ring_due.clear()
    idle = [cand("f1"), cand("f3"), cand("n1"), cand("n2"), cand("n3", sync=False)]
    stages = elastic.replacement(job, idle)
    assert isinstance(stages, list)
    # Neither fellow of the lost replica, nor one without a sync address under p2p.
    assert {s.fellow_id for s in stages} == {"n1", "n2"}
    assert {s.replica for s in stages} == {1}
    ranges = [(s.layer_start, s.layer_end) for s in job.placement.pipeline(0)]
    assert [(s.layer_start, s.layer_end) for s in stages] == ranges
    assert isinstance(elastic.replacement(job, idle[:3]), Unplaceable)

    jobs.place_replacement(job.job_id, stages)
    assert elastic.free_slot(job) is None and elastic.joining_replicas(job) == {1}
    view_fellows = job.view.fellows
    assert set(view_fellows) == {fellow(job, 0, 0), fellow(job, 0, 1)}  # not counted yet
    plans = elastic.joiner_plans(job, stages, subject_prefix="swarm")
    assert all(p.joining and p.replica == 1 and p.n_replicas == 2 for p in plans)
    assert all(not p.checkpoint_at_end and p.checkpoint_every == 0 for p in plans)
    assert plans[0].next.fellow_id == plans[1].fellow_id  # its own pipeline
    assert not any(p.problems() for p in plans)

    # Ready one stage at a time: the ring changes once both are.
    first, second = (s.fellow_id for s in stages)
    jobs.record_progress(step(job, first, 0, event=ProgressEvent.JOINING))
    assert jobs.ready_to_join(job) == []
    jobs.record_progress(step(job, second, 0, event=ProgressEvent.JOINING))
    assert jobs.ready_to_join(job) == [1] and job.job_id in jobs.ring_due
    changes = elastic.ring_changes(job, members=[0, 1], epoch=2, at_step=30, joining=[1])
    assert changes[first].joining == [1] and changes[first].donor == 0
    jobs.ring_changed(job.job_id, 2, 30, 0, members=job.placement.live_replicas, joined=[1])
    assert [m.kind for m in job.membership][-1] == "joined"
    assert job.ring_epoch == 2 and job.ring_donor == 0
    jobs.record_progress(step(job, first, 31, sync_epoch=2, state_digests={0: DIGEST_A}))
    assert job.stage_progress(first).joining is None
    assert first in job.view.fellows


def test_a_member_outvoted_on_the_state_it_took_is_dropped():
    jobs, job, _ = running(k=4, p=1)
    jobs.lose_stage(job.job_id, fellow(job, 3, 0), "went offline")
    jobs.ring_changed(job.job_id, 1, 10, 0, members=job.placement.live_replicas, joined=[])
    a, b, c = (fellow(job, r, 0) for r in range(3))
    jobs.record_progress(step(job, a, 11, sync_epoch=1, state_digests={0: DIGEST_B}))
    jobs.record_progress(step(job, b, 11, sync_epoch=1, state_digests={0: DIGEST_A}))
    assert job.placement.live_replicas == [0, 1, 2]  # not every member has said yet
    jobs.record_progress(step(job, c, 11, sync_epoch=1, state_digests={0: DIGEST_A}))
    # The donor (replica 0) is outvoted: what it says it sent is not what the others got.
    assert job.placement.live_replicas == [1, 2] and job.placement.lead == 1
    assert "outvoted" in job.membership[-1].reason


def test_two_members_that_disagree_on_the_state_keep_the_donor():
    """Nobody can tell which of two lies: the job keeps the replica it trusted before (the
    donor) and goes on, instead of failing the attempt."""
    jobs, job, _ = running(k=3, p=1, max_resumes=2, resume_from_scratch=True)
    jobs.lose_stage(job.job_id, fellow(job, 2, 0), "went offline")
    jobs.ring_changed(job.job_id, 1, 10, 0, members=job.placement.live_replicas, joined=[])
    a, b = fellow(job, 0, 0), fellow(job, 1, 0)
    jobs.record_progress(step(job, a, 11, sync_epoch=1, state_digests={0: DIGEST_A}))
    jobs.record_progress(step(job, b, 11, sync_epoch=1, state_digests={0: DIGEST_B}))
    assert job.state is JobState.RUNNING and job.attempt == 1
    assert job.placement.live_replicas == [0]
    lost = [m for m in job.membership if m.kind == "lost"]
    assert [m.replica for m in lost] == [2, 1] and "outvoted" in lost[-1].reason


def test_a_member_lost_before_it_reported_its_digest_no_longer_holds_the_vote_up():
    jobs, job, _ = running(k=4, p=1)
    jobs.lose_stage(job.job_id, fellow(job, 3, 0), "went offline")
    jobs.ring_changed(job.job_id, 1, 10, 0, members=job.placement.live_replicas, joined=[])
    a, b = fellow(job, 0, 0), fellow(job, 1, 0)
    jobs.record_progress(step(job, a, 11, sync_epoch=1, state_digests={0: DIGEST_A}))
    jobs.record_progress(step(job, b, 11, sync_epoch=1, state_digests={0: DIGEST_B}))
    assert job.placement.live_replicas == [0, 1, 2], "replica 2 has not said yet"
    jobs.lose_stage(job.job_id, fellow(job, 2, 0), "went offline before it reported")
    assert job.state is JobState.RUNNING and job.placement.live_replicas == [0]


def refused(job: JobRecord, code: str = "DONOR_REFUSED") -> StageOutcome:
    """A stage ends refusing the donor's state (``DONOR_REFUSED``), or what its predecessor
    forwarded as that state (``FORWARD_REFUSED``)."""
    return StageOutcome(
        job_id=job.job_id,
        attempt=1,
        result=StageResult.FAILED,
        code=code,
        message=f"{code}: the state of donor replica 0",
    )


def test_a_refused_donor_is_lost_with_the_member_that_refused_it():
    jobs, job, _ = running(k=3, p=1)
    jobs.lose_stage(job.job_id, fellow(job, 2, 0), "went offline")
    jobs.ring_changed(job.job_id, 1, 10, 0, members=job.placement.live_replicas, joined=[])
    jobs.record_outcome(fellow(job, 1, 0), refused(job))
    # Neither can be trusted: with no replica left, the attempt fails as without replicas.
    assert job.state is JobState.FAILED
    assert [m.replica for m in job.membership if m.kind == "lost"] == [2, 1]


@pytest.mark.parametrize(
    ("code", "members", "donor", "replica", "accused"),
    [
        ("DONOR_REFUSED", [0, 1, 2], 0, 2, 0),
        ("DONOR_REFUSED", [0, 1, 2], 0, 0, None),  # the donor accusing itself
        ("FORWARD_REFUSED", [0, 1, 2], 0, 2, 1),  # its predecessor
        ("FORWARD_REFUSED", [0, 1, 2], 1, 0, 2),  # the first member's: the last
        ("FORWARD_REFUSED", [0, 2, 5], 0, 5, 2),  # in ring order, not by number
        ("FORWARD_REFUSED", [0, 1], 0, 1, 0),  # a ring of two: the donor forwarded it
        ("FORWARD_REFUSED", [0, 1], 0, 3, None),  # not a member of the rings
        ("FORWARD_REFUSED", [], None, 1, None),  # no ring change recorded
        ("SUCCESSOR_STALLED", [0, 1, 2], 0, 0, 1),  # the member that took no more of it
        ("SUCCESSOR_STALLED", [0, 2, 5], 2, 5, 0),  # the last member's: the first
        ("SUCCESSOR_STALLED", [0, 2, 5], 0, 5, None),  # it hands nothing on to the donor
        ("SUCCESSOR_STALLED", [0, 1], 0, 3, None),  # not a member of the rings
        ("STAGE_FAILED", [0, 1, 2], 0, 2, None),
        (None, [0, 1, 2], 0, 2, None),
    ],
)
def test_a_refusal_at_a_ring_change_accuses_the_donor_the_predecessor_or_the_successor(
    code, members, donor, replica, accused
):
    _, job, _ = running(k=3, p=1)
    job.ring_members, job.ring_donor = members, donor
    assert elastic.accused_replica(job, replica, code) == accused


def test_a_forward_refusal_loses_the_member_and_the_predecessor_that_forwarded_the_state():
    """Ring of replicas 0, 2, 3 (1 lost), donor 0: replica 3 refuses what replica 2 handed
    on; both go, the donor and the job stay."""
    jobs, job, _ = running(k=4, p=1)
    jobs.lose_stage(job.job_id, fellow(job, 1, 0), "went offline")
    jobs.ring_changed(job.job_id, 1, 10, 0, members=job.placement.live_replicas, joined=[])
    assert job.ring_members == [0, 2, 3]
    jobs.record_outcome(fellow(job, 3, 0), refused(job, "FORWARD_REFUSED"))
    assert job.state is JobState.RUNNING and job.placement.live_replicas == [0]
    lost = [m for m in job.membership if m.kind == "lost"]
    assert [m.replica for m in lost] == [1, 3, 2]
    assert "the state it sent was refused" in lost[-1].reason


def test_a_forward_refusal_from_a_member_that_trains_in_the_new_rings_takes_nobody_along():
    jobs, job, _ = running(k=4, p=1)
    jobs.lose_stage(job.job_id, fellow(job, 1, 0), "went offline")
    jobs.ring_changed(job.job_id, 1, 10, 0, members=job.placement.live_replicas, joined=[])
    jobs.record_progress(step(job, fellow(job, 3, 0), 11, sync_epoch=1))
    jobs.record_outcome(fellow(job, 3, 0), refused(job, "FORWARD_REFUSED"))
    assert job.state is JobState.RUNNING and job.placement.live_replicas == [0, 2]


def test_a_donor_refusal_from_a_member_that_trains_in_the_new_rings_takes_no_donor():
    jobs, job, _ = running(k=4, p=1)
    jobs.lose_stage(job.job_id, fellow(job, 3, 0), "went offline")
    jobs.ring_changed(job.job_id, 1, 10, 0, members=job.placement.live_replicas, joined=[])
    jobs.record_progress(step(job, fellow(job, 1, 0), 11, sync_epoch=1))
    jobs.record_outcome(fellow(job, 1, 0), refused(job))
    assert job.state is JobState.RUNNING and job.placement.live_replicas == [0, 2]


@pytest.mark.parametrize(
    ("progress", "outvoted", "undecided"),
    [
        # The state is signed by the donor: a digest that differs is its reporter's own.
        ([(0, 0, DIGEST_A), (1, 0, DIGEST_A), (2, 0, DIGEST_B)], ["r2s0"], []),
        ([(0, 0, DIGEST_A), (1, 0, DIGEST_B), (2, 0, DIGEST_A)], ["r1s0"], []),
        # The donor sent a state it does not report: the others outvote it; nobody passed
        # the donor anything, so its predecessor stays.
        ([(0, 0, DIGEST_A), (1, 0, DIGEST_B), (2, 0, DIGEST_B)], ["r0s0"], []),
        ([(0, 0, DIGEST_A), (1, 0, DIGEST_A)], [], []),
        # Two that disagree: the donor stays, the other goes (the attempt goes on).
        ([(0, 0, DIGEST_A), (1, 0, DIGEST_B)], ["r1s0"], []),
        ([(0, 0, DIGEST_A), (1, 0, DIGEST_B), (2, 0, None)], [], []),  # not all said yet
        # Four in a tie: nobody can tell who lies.
        ([(0, 0, DIGEST_A), (1, 0, DIGEST_A), (2, 0, DIGEST_B), (3, 0, DIGEST_B)], [], [0]),
        (
            [(0, 0, DIGEST_A), (0, 1, DIGEST_B), (1, 1, DIGEST_B), (1, 0, DIGEST_A),
             (2, 0, DIGEST_B), (2, 1, DIGEST_B)],
            ["r2s0"],
            [],
        ),
    ],
)  # fmt: skip
def test_the_digests_of_each_rings_members_are_put_to_a_vote(progress, outvoted, undecided):
    from silentswarm.types.views import StageProgress

    # One split: stage s holds one segment, named 10 * s here; each also claims a digest for
    # a segment it does not hold (ignored: only its own rings' count). Replica 0 donated.
    stages = [
        StageProgress(
            stage=s,
            replica=r,
            fellow_id=f"r{r}s{s}",
            sync_epoch=3,
            state_digests={} if digest is None else {10 * s: digest, 99: DIGEST_B},
        )
        for r, s, digest in progress
    ]
    starting = StageProgress(stage=0, replica=5, fellow_id="new", joining="starting")
    segments_of = {p.fellow_id: [10 * p.stage] for p in [*stages, starting]}
    verdict = elastic.digest_verdict([*stages, starting], epoch=3, segments_of=segments_of, donor=0)
    assert (sorted(verdict.outvoted), verdict.undecided) == (
        sorted(outvoted),
        [10 * u for u in undecided],
    )


def test_with_different_splits_each_segments_holders_vote_on_its_digest():
    from silentswarm.types.views import StageProgress

    # Replica 0 splits 4 layers 1-3, replicas 1 and 2 split them 2-2: segments 0, 1, 2.
    segments_of = {"r0s0": [0], "r0s1": [1, 2], "r1s0": [0, 1], "r1s1": [2], "r2s0": [0, 1],
                   "r2s1": [2]}  # fmt: skip
    digests = {
        "r0s0": {0: DIGEST_A},
        "r0s1": {1: DIGEST_A, 2: DIGEST_A},
        "r1s0": {0: DIGEST_A, 1: DIGEST_B},  # outvoted on segment 1 only: it goes
        "r1s1": {2: DIGEST_A},
        "r2s0": {0: DIGEST_A, 1: DIGEST_A},
        "r2s1": {2: DIGEST_A},
    }
    progress = [
        StageProgress(stage=int(f[3]), replica=int(f[1]), fellow_id=f, sync_epoch=2,
                      state_digests=d)
        for f, d in digests.items()
    ]  # fmt: skip
    verdict = elastic.digest_verdict(progress, epoch=2, segments_of=segments_of, donor=0)
    assert (verdict.outvoted, verdict.undecided) == (["r1s0"], [])


def test_a_loss_that_leaves_only_completed_stages_completes_the_job():
    jobs, job, _ = running(k=2, p=1)
    done = StageOutcome(job_id=job.job_id, attempt=1, result=StageResult.COMPLETED, step=100)
    jobs.record_outcome(fellow(job, 0, 0), done)
    assert job.state is JobState.RUNNING
    jobs.lose_stage(job.job_id, fellow(job, 1, 0), "went offline at the very end")
    assert job.state is JobState.COMPLETED


def test_a_replacement_still_joining_when_the_others_complete_is_dropped():
    jobs, job, _ = running(k=2, p=1)
    jobs.lose_stage(job.job_id, fellow(job, 1, 0), "went offline")
    stages = elastic.replacement(job, [cand("n1")])
    assert isinstance(stages, list)
    jobs.place_replacement(job.job_id, stages)
    done = StageOutcome(job_id=job.job_id, attempt=1, result=StageResult.COMPLETED, step=100)
    jobs.record_outcome(fellow(job, 0, 0), done)
    assert job.state is JobState.COMPLETED
    assert job.membership[-1].kind == "refused" and "n1" in jobs.drops[job.job_id]


def test_a_joiner_lost_after_its_ring_change_went_out_needs_a_new_one():
    jobs, job, _ = running(k=3, p=1)
    jobs.lose_stage(job.job_id, fellow(job, 2, 0), "went offline")
    jobs.ring_due.clear()
    jobs.after_loss.clear()
    stages = elastic.replacement(job, [cand("n1")])
    assert isinstance(stages, list)
    jobs.place_replacement(job.job_id, stages)
    jobs.record_progress(step(job, "n1", 0, event=ProgressEvent.JOINING))
    jobs.ring_changed(job.job_id, 2, 40, 0, members=job.placement.live_replicas, joined=[2])
    jobs.ring_due.clear()
    jobs.lose_stage(job.job_id, "n1", "crashed while joining")
    assert jobs.ring_due == {job.job_id} and jobs.after_loss == {job.job_id}


def test_a_late_answer_of_an_older_attempt_loses_nothing():
    jobs, job, _ = running(k=2, p=1)
    jobs.lose_stage(job.job_id, fellow(job, 1, 0), "refused RING", attempt=0)
    assert job.placement.live_replicas == [0, 1] and not job.membership


def test_a_ring_member_may_bind_for_any_replica_of_its_segments_and_no_other():
    perms = attempt_permissions(
        "swarm", fellow_id="f", job_id="j", attempt=1, stage=1, n_stages=2, replica=0,
        n_replicas=3, sync_segments=[2, 3],
    )  # fmt: skip
    ring = {s for s in perms.subscribe if ".g" in s}
    assert ring == {
        "swarm.relay.j.1.g2-0.bwd",
        "swarm.relay.j.1.g2-1.fwd",
        "swarm.relay.j.1.g2-2.fwd",
        "swarm.relay.j.1.g3-0.bwd",
        "swarm.relay.j.1.g3-1.fwd",
        "swarm.relay.j.1.g3-2.fwd",
    }


def test_a_placement_round_trips_its_slots_and_lead():
    jobs, job, _ = running(k=2, p=1)
    jobs.lose_stage(job.job_id, fellow(job, 0, 0), "went offline")
    again = msgspec.json.decode(msgspec.json.encode(job.placement), type=Placement)
    assert (again.n_replicas, again.lead, again.live_replicas) == (2, 1, [1])
    assert again.n_stages == 1 and again.transport is Transport.P2P


def test_a_restarted_leader_sends_the_ring_change_a_ready_replacement_waits_for():
    jobs, job, _ = running(k=2, p=1)
    jobs.lose_stage(job.job_id, fellow(job, 1, 0), "went offline")
    stages = elastic.replacement(job, [cand("n1")])
    assert isinstance(stages, list)
    jobs.place_replacement(job.job_id, stages)
    jobs.record_progress(step(job, "n1", 0, event=ProgressEvent.JOINING))
    again = JobManager(wall=Clock())
    again.restore([msgspec.json.decode(msgspec.json.encode(job), type=JobRecord)])
    assert again.ring_due == {job.job_id}


def test_a_restarted_leader_sends_the_ring_change_of_a_loss_it_had_not_sent():
    jobs, job, _ = running(k=3, p=1)
    jobs.lose_stage(job.job_id, fellow(job, 2, 0), "went offline")
    again = JobManager(wall=Clock())
    again.restore([msgspec.json.decode(msgspec.json.encode(job), type=JobRecord)])
    assert again.ring_due == {job.job_id} and again.after_loss == {job.job_id}
    jobs.ring_changed(
        job.job_id, 1, 10, 0, members=job.placement.live_replicas, joined=[]
    )  # sent: the loss has its epoch
    third = JobManager(wall=Clock())
    third.restore([msgspec.json.decode(msgspec.json.encode(job), type=JobRecord)])
    assert third.ring_due == set()


def test_a_ring_change_is_saved_before_any_member_hears_it():
    """A leader that died between the two would make the same epoch again with other
    secrets: the members that took the first would refuse the second."""
    import asyncio

    from silentswarm.leader.registry import FellowRegistry
    from silentswarm.types.jobs import SignalRecord

    jobs, job, _ = running(k=3, p=1)
    events: list[tuple[str, str, int]] = []

    class Store:  # the JetStream buckets' edge: what was written, in order
        jobs, fellows, purges = "jobs", "fellows", "purges"

        async def put(self, bucket, key, value):
            if bucket == "jobs":
                events.append(("saved", key, value.ring_epoch))

    class Hub:  # the signals' edge
        async def send(self, fellow_id, args, *, job_id, attempt):
            events.append(("sent", fellow_id, args.change.epoch))
            return SignalRecord(
                signal_id="s", fellow_id=fellow_id, ok=True, kind="ring", sent_at=0, attempts=1
            )

    registry = FellowRegistry(heartbeat_interval_s=1, offline_after_s=3, leader_version="t")
    orchestrator = offline_orchestrator(registry, jobs)
    orchestrator.store, orchestrator.hub = Store(), Hub()
    orchestrator.loaded.set()
    for r in range(3):
        jobs.record_progress(step(job, fellow(job, r, 0), 10))
    jobs.lose_stage(job.job_id, fellow(job, 2, 0), "went offline")

    async def scenario() -> None:
        await orchestrator._change_rings()
        await asyncio.gather(*orchestrator._tasks)

    asyncio.run(scenario())
    assert events[0] == ("saved", job.job_id, 1), events
    assert sorted(events[1:]) == [("sent", fellow(job, r, 0), 1) for r in (0, 1)]


def test_a_restarted_leader_revokes_what_the_attempt_dropped_again():
    """Revocations are queued in memory only: a leader that stopped before it revoked a
    dropped fellow's attempt user revokes it when it loads the job (a fellow that holds a
    stage of the job again is left alone)."""
    jobs, job, _ = running(k=3, p=1)
    jobs.lose_stage(job.job_id, fellow(job, 2, 0), "went offline")
    lost = [p.fellow_id for p in job.dropped]
    assert jobs.revokes == [(lost[0], job.job_id, 1)]
    again = JobManager(wall=jobs._wall)
    again.restore([msgspec.convert(msgspec.to_builtins(job), JobRecord)])
    assert again.revokes == [(lost[0], job.job_id, 1)]
