"""How long finished jobs stay in the metrics, in the jobs list, and on the leader at all.

Three pure decisions over the job records, given the time and the policy (the settings
``SWARM_JOB_METRICS_RETENTION_S``, ``SWARM_JOBS_KEEP_FINISHED``, ``SWARM_JOBS_ARCHIVE_AFTER_S``
and ``SWARM_JOBS_DELETE_AFTER_S``):

- :func:`retired_job_ids`: jobs whose labelled series (per job, per stage) the leader's
  scrape no longer exports, so that finished sweeps do not grow ``/api/v1/metrics`` for good;
- :func:`jobs_to_archive`: finished jobs hidden from ``GET /api/v1/jobs`` (still served by id
  and with ``?all=true``), beyond a count of the newest ones or an age;
- :func:`jobs_to_delete`: archived jobs whose record and progress history the leader drops.
  Their exports on disk are never touched: a model is never lost silently.

A live (PENDING or RUNNING) job is never retired, archived or deleted. Ages count from the
job's end (``finished_at``; ``updated_at`` for a record without one). The job loop applies
the answers (:meth:`silentswarm.leader.orchestrator.Orchestrator.retain`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from silentswarm.settings import Settings
from silentswarm.types.jobs import JobRecord


@dataclass(frozen=True)
class RetentionPolicy:
    """``archive_after_s`` and ``delete_after_s``: 0 never (by age; see the settings)."""

    metrics_retention_s: float = 3600.0
    keep_finished: int = 200
    archive_after_s: float = 7 * 86400.0
    delete_after_s: float = 90 * 86400.0

    @classmethod
    def from_settings(cls, settings: Settings) -> RetentionPolicy:
        return cls(
            metrics_retention_s=settings.job_metrics_retention_s,
            keep_finished=settings.jobs_keep_finished,
            archive_after_s=settings.jobs_archive_after_s,
            delete_after_s=settings.jobs_delete_after_s,
        )


def ended_at(job: JobRecord) -> float:
    """When a terminal job ended (its last change, for a record that does not say)."""
    return job.finished_at if job.finished_at is not None else job.updated_at


def retired_job_ids(jobs: Iterable[JobRecord], *, now: float, retention_s: float) -> set[str]:
    """Jobs whose series are no longer exported at ``now``: archived ones, and those that
    ended ``retention_s`` or more ago."""
    return {
        job.job_id
        for job in jobs
        if job.terminal and (job.archived or now - ended_at(job) >= retention_s)
    }


def jobs_to_archive(jobs: Iterable[JobRecord], *, now: float, policy: RetentionPolicy) -> list[str]:
    """Finished jobs to archive now: all but the ``keep_finished`` that ended last, and any
    that ended ``archive_after_s`` or more ago (when it is not 0). Oldest first."""
    finished = sorted(
        (j for j in jobs if j.terminal and not j.archived),
        key=lambda j: (ended_at(j), j.job_id),
        reverse=True,
    )
    out = []
    for rank, job in enumerate(finished):
        too_many = rank >= policy.keep_finished
        too_old = policy.archive_after_s > 0 and now - ended_at(job) >= policy.archive_after_s
        if too_many or too_old:
            out.append(job.job_id)
    return out[::-1]


def jobs_to_delete(jobs: Iterable[JobRecord], *, now: float, policy: RetentionPolicy) -> list[str]:
    """Archived jobs to delete now: those that ended ``delete_after_s`` or more ago (0:
    never). Only archived ones: a job is hidden before it is gone. Oldest first."""
    if policy.delete_after_s <= 0:
        return []
    due = [
        j for j in jobs if j.terminal and j.archived and now - ended_at(j) >= policy.delete_after_s
    ]
    return [j.job_id for j in sorted(due, key=lambda j: (ended_at(j), j.job_id))]
