"""A job's fellows all run one SilentSwarm version (their stages speak its wire layouts):
which group of fellows a job is tried on, why it waits, and whom a lost replica's slot takes.
Pure functions, table-driven."""

from __future__ import annotations

import pytest

from silentswarm.jobspec import JobSpec
from silentswarm.leader import elastic
from silentswarm.leader.jobs import JobManager, plan_schedule
from silentswarm.leader.placement import Candidate, by_version, versions_note
from silentswarm.plan import ModelConfig
from tests.fakes import Clock

GIB = 1 << 30


def cand(fid: str, version: str, ram_gib: int = 8) -> Candidate:
    return Candidate(
        fellow_id=fid,
        hostname=f"h-{fid}",
        data_address=f"tcp://{fid}:1",
        sync_address=f"tcp://{fid}:2",
        cpu_cores=2,
        ram_available_bytes=ram_gib * GIB,
        version=version,
    )


def spec(**kw) -> JobSpec:
    base = dict(model=ModelConfig(n_layers=4), steps=100, allow_cpu=True, transport="p2p")
    base.update(kw)
    return JobSpec(**base)


GROUPS = [
    # (case, fellows as id:version, the leader's version, the groups in order)
    ("one version", ["a:1.0", "b:1.0"], "1.0", [["a", "b"]]),
    ("the leader's first, though fewer", ["a:0.9", "b:0.9", "c:1.0"], "1.0", [["c"], ["a", "b"]]),
    ("then the most fellows", ["a:0.8", "b:0.9", "c:0.9"], "1.0", [["b", "c"], ["a"]]),
    ("a tie: by version", ["a:0.9", "b:0.8"], "1.0", [["b"], ["a"]]),
    ("none", [], "1.0", []),
]


@pytest.mark.parametrize(
    ("case", "fellows", "leader", "groups"), GROUPS, ids=[g[0] for g in GROUPS]
)
def test_by_version(case, fellows, leader, groups):
    candidates = [cand(*f.split(":")) for f in fellows]
    assert [[c.fellow_id for c in g] for g in by_version(candidates, leader)] == groups


def schedule(fellows: list[Candidate], leader: str = "1.0", **kw):
    manager = JobManager(wall=Clock())
    job = manager.submit(spec(**kw))
    assignments, waiting = plan_schedule(manager.pending(), fellows, leader_version=leader)
    return job, assignments, waiting


def test_a_job_goes_to_the_leaders_version_when_its_fellows_can_hold_it():
    """Though more fellows run the older version, and offer more memory."""
    old = [cand(f"old{i}", "0.9", ram_gib=32) for i in (1, 2, 3)]
    new = [cand(f"new{i}", "1.0") for i in (1, 2)]
    _, [assignment], _ = schedule([*old, *new], stages=2)
    assert sorted(assignment.placement.fellow_ids) == ["new1", "new2"]


def test_else_to_fellows_of_one_other_version_never_across_two():
    _, [assignment], _ = schedule(
        [cand("new1", "1.0"), cand("old1", "0.9"), cand("old2", "0.9")], stages=2
    )
    assert sorted(assignment.placement.fellow_ids) == ["old1", "old2"]


def test_a_job_that_only_mixed_versions_could_hold_waits_saying_why():
    job, assignments, waiting = schedule([cand("new1", "1.0"), cand("old1", "0.9")], stages=2)
    assert assignments == []
    reason = waiting[job.job_id]
    assert reason.startswith("waiting for 2 ready fellows"), reason
    assert "the ready fellows run 2 versions (1.0: 1, 0.9: 1)" in reason
    assert "`swarm update`" in reason


def test_one_version_adds_nothing_to_a_reason():
    assert versions_note([[cand("a", "1.0")]]) == ""


def test_a_lost_replicas_slot_takes_only_fellows_of_the_jobs_version():
    jobs = JobManager(wall=Clock())
    job = jobs.submit(spec(replicas=2, stages=1))
    [assignment], _ = plan_schedule(
        jobs.pending(), [cand("a", "1.0"), cand("b", "1.0")], leader_version="1.0"
    )
    jobs.begin_start(job.job_id, assignment.placement)
    jobs.start_succeeded(job.job_id)
    jobs.lose_stage(job.job_id, job.placement.pipeline(1)[0].fellow_id, "went offline")
    other = cand("other", "1.1")
    assert isinstance(elastic.replacement(job, [other]), list), "without a version: any"
    refused = elastic.replacement(job, [other], version="1.0")
    assert not isinstance(refused, list), "a fellow of another version does not join"
    [stage] = elastic.replacement(job, [other, cand("same", "1.0")], version="1.0")
    assert stage.fellow_id == "same" and stage.replica == 1
