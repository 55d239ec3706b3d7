"""Retention of finished jobs: which series retire, which jobs are archived, which deleted."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from silentswarm.errors import ConfigError
from silentswarm.jobspec import JobSpec
from silentswarm.leader.jobs import JobManager
from silentswarm.leader.metrics import job_families
from silentswarm.leader.retention import (
    RetentionPolicy,
    jobs_to_archive,
    jobs_to_delete,
    retired_job_ids,
)
from silentswarm.protocol import JobState
from silentswarm.settings import Settings
from silentswarm.types.jobs import JobRecord

NOW = 1_000_000.0
DAY = 86400.0


def job(
    job_id: str,
    state: JobState = JobState.COMPLETED,
    *,
    ended: float | None = None,
    archived: bool = False,
    updated: float = 0.0,
) -> JobRecord:
    """A job that ended ``ended`` seconds before NOW (None: no finished_at on the record)."""
    return JobRecord(
        job_id=job_id,
        name=job_id,
        spec=JobSpec(name=job_id),
        state=state,
        created_at=0.0,
        updated_at=NOW - updated,
        finished_at=None if ended is None else NOW - ended,
        archived=archived,
    )


# --- series ---------------------------------------------------------------------------------

RETIRED_CASES = [
    # (jobs, retention_s, retired)
    pytest.param([], 3600, set(), id="no jobs"),
    pytest.param([job("r", JobState.RUNNING, updated=10 * DAY)], 0, set(), id="running: never"),
    pytest.param([job("p", JobState.PENDING, updated=10 * DAY)], 0, set(), id="pending: never"),
    pytest.param([job("c", ended=3599)], 3600, set(), id="finished within retention: kept"),
    pytest.param([job("c", ended=3600)], 3600, {"c"}, id="finished at retention: retired"),
    pytest.param([job("f", JobState.FAILED, ended=7200)], 3600, {"f"}, id="failed: retired"),
    pytest.param([job("x", JobState.CANCELLED, ended=0)], 0, {"x"}, id="retention 0: at once"),
    pytest.param([job("a", ended=1, archived=True)], 3600, {"a"}, id="archived: retired"),
    pytest.param([job("u", updated=4000)], 3600, {"u"}, id="no finished_at: its last change"),
    pytest.param(
        [job("r", JobState.RUNNING), job("old", ended=5000), job("new", ended=10)],
        3600,
        {"old"},
        id="mixed",
    ),
]


@pytest.mark.parametrize(("jobs", "retention_s", "retired"), RETIRED_CASES)
def test_retired_job_ids(jobs, retention_s, retired):
    assert retired_job_ids(jobs, now=NOW, retention_s=retention_s) == retired


def test_the_scrape_keeps_live_jobs_and_drops_retired_ones():
    live = job("live", JobState.RUNNING)
    old, recent = job("old", ended=5000), job("recent", ended=10)
    hidden = job("hidden", ended=10, archived=True)
    jobs = [live, old, recent, hidden]
    retired = retired_job_ids(jobs, now=NOW, retention_s=3600)

    class Collector:
        def collect(self):
            return job_families(jobs, retired)

    registry = CollectorRegistry()
    registry.register(Collector())
    text = generate_latest(registry).decode()
    labelled = {
        s.labels["job_id"]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "job_id" in s.labels
    }
    assert labelled == {"live", "recent"}
    by_state = {
        s.labels["state"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "swarm_jobs"
    }
    # The retired but listed job still counts; the archived one does not.
    assert by_state["COMPLETED"] == 2 and by_state["RUNNING"] == 1


# --- archive --------------------------------------------------------------------------------

WEEK = RetentionPolicy(keep_finished=200, archive_after_s=7 * DAY)

ARCHIVE_CASES = [
    # (jobs, policy, archived, oldest first)
    pytest.param([], WEEK, [], id="no jobs"),
    pytest.param([job("c", ended=DAY)], WEEK, [], id="young and few: kept"),
    pytest.param([job("c", ended=7 * DAY)], WEEK, ["c"], id="at the age: archived"),
    pytest.param(
        [job("r", JobState.RUNNING, updated=30 * DAY), job("p", JobState.PENDING)],
        RetentionPolicy(keep_finished=0, archive_after_s=1),
        [],
        id="live jobs: never",
    ),
    pytest.param(
        [job("a", ended=30), job("b", ended=20), job("c", ended=10)],
        RetentionPolicy(keep_finished=2, archive_after_s=0),
        ["a"],
        id="beyond the count: the oldest",
    ),
    pytest.param(
        [job("a", ended=30), job("b", ended=20), job("c", ended=10)],
        RetentionPolicy(keep_finished=0, archive_after_s=0),
        ["a", "b", "c"],
        id="keep 0: every finished job",
    ),
    pytest.param(
        [job("a", ended=30, archived=True), job("b", ended=20), job("c", ended=10)],
        RetentionPolicy(keep_finished=2, archive_after_s=0),
        [],
        id="archived ones neither counted nor archived again",
    ),
    pytest.param(
        [job("old", ended=400 * DAY)],
        RetentionPolicy(keep_finished=200, archive_after_s=0),
        [],
        id="age 0: never by age",
    ),
    pytest.param(
        [job("a", ended=8 * DAY), job("b", ended=20), job("c", ended=10), job("d", ended=5)],
        RetentionPolicy(keep_finished=2, archive_after_s=7 * DAY),
        ["a", "b"],
        id="count and age together",
    ),
    pytest.param(
        [job("y", ended=10), job("x", ended=10)],
        RetentionPolicy(keep_finished=1, archive_after_s=0),
        ["x"],
        id="same end: by id",
    ),
    pytest.param(
        [job("failed", JobState.FAILED, ended=2), job("cancelled", JobState.CANCELLED, ended=1)],
        RetentionPolicy(keep_finished=1, archive_after_s=0),
        ["failed"],
        id="every terminal state counts",
    ),
]


@pytest.mark.parametrize(("jobs", "policy", "archived"), ARCHIVE_CASES)
def test_jobs_to_archive(jobs, policy, archived):
    assert jobs_to_archive(jobs, now=NOW, policy=policy) == archived


# --- delete ---------------------------------------------------------------------------------

QUARTER = RetentionPolicy(delete_after_s=90 * DAY)

DELETE_CASES = [
    pytest.param([job("a", ended=90 * DAY, archived=True)], QUARTER, ["a"], id="at the age"),
    pytest.param([job("a", ended=89 * DAY, archived=True)], QUARTER, [], id="younger: kept"),
    pytest.param([job("c", ended=400 * DAY)], QUARTER, [], id="not archived: never"),
    pytest.param(
        [job("a", ended=400 * DAY, archived=True)],
        RetentionPolicy(delete_after_s=0),
        [],
        id="0: never",
    ),
    pytest.param(
        [job("b", ended=100 * DAY, archived=True), job("a", ended=200 * DAY, archived=True)],
        QUARTER,
        ["a", "b"],
        id="oldest first",
    ),
]


@pytest.mark.parametrize(("jobs", "policy", "deleted"), DELETE_CASES)
def test_jobs_to_delete(jobs, policy, deleted):
    assert jobs_to_delete(jobs, now=NOW, policy=policy) == deleted


# --- the manager, the record, the settings -------------------------------------------------


def test_manager_archives_only_finished_jobs_lists_them_apart_and_forgets_deleted_ones():
    clock = [NOW]
    manager = JobManager(wall=lambda: clock[0], retention=RetentionPolicy(metrics_retention_s=60))
    live = manager.submit(JobSpec(name="live"))
    clock[0] += 1
    done = manager.submit(JobSpec(name="done"))
    manager.cancel(done.job_id)
    manager.dirty.clear()

    assert not manager.archive(live.job_id) and not manager.archive("nope")
    assert manager.archive(done.job_id) and manager.dirty == {done.job_id}
    assert [j.job_id for j in manager.listed()] == [live.job_id]
    assert [j.job_id for j in manager.listed(archived=True)] == [live.job_id, done.job_id]
    assert manager.get(done.job_id).archived
    assert manager.retired() == {done.job_id}

    manager.forget(done.job_id)
    assert done.job_id not in manager.dirty
    assert [j.job_id for j in manager.listed(archived=True)] == [live.job_id]


def test_manager_retires_series_after_the_retention_on_its_clock():
    clock = [NOW]
    manager = JobManager(wall=lambda: clock[0], retention=RetentionPolicy(metrics_retention_s=60))
    done = manager.submit(JobSpec(name="done"))
    manager.cancel(done.job_id)
    clock[0] += 59
    assert manager.retired() == set()
    clock[0] += 1
    assert manager.retired() == {done.job_id}


def test_a_record_stored_before_archiving_existed_decodes_as_not_archived():
    stored = msgspec.to_builtins(job("old", ended=10))
    del stored["archived"]
    record = msgspec.json.decode(msgspec.json.encode(stored), type=JobRecord)
    assert record.archived is False


def test_retention_settings_come_from_the_environment_within_bounds():
    settings = Settings.from_env(
        {
            "SWARM_JOB_METRICS_RETENTION_S": "2.5",
            "SWARM_JOBS_KEEP_FINISHED": "3",
            "SWARM_JOBS_ARCHIVE_AFTER_S": "10",
            "SWARM_JOBS_DELETE_AFTER_S": "0",
        }
    )
    assert RetentionPolicy.from_settings(settings) == RetentionPolicy(
        metrics_retention_s=2.5, keep_finished=3, archive_after_s=10, delete_after_s=0
    )
    assert RetentionPolicy.from_settings(Settings()) == RetentionPolicy()


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SWARM_JOBS_KEEP_FINISHED": "-1"}, "SWARM_JOBS_KEEP_FINISHED"),
        ({"SWARM_JOB_METRICS_RETENTION_S": "-5"}, "SWARM_JOB_METRICS_RETENTION_S"),
        ({"SWARM_JOB_METRICS_RETENTION_S": "1e9"}, "SWARM_JOB_METRICS_RETENTION_S"),
        ({"SWARM_JOBS_ARCHIVE_AFTER_S": "soon"}, "SWARM_JOBS_ARCHIVE_AFTER_S"),
        ({"SWARM_JOBS_DELETE_AFTER_S": "60"}, "SWARM_JOBS_DELETE_AFTER_S"),  # < archive
    ],
)
def test_bad_retention_settings_name_their_variable(env, named):
    with pytest.raises(ConfigError, match=named):
        Settings.from_env(env)
