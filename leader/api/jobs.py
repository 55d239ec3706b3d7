from __future__ import annotations

from typing import Annotated

from litestar import Controller, Request, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, QueryParameter
from litestar.response import File, ServerSentEvent
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED, HTTP_202_ACCEPTED

from silentswarm.jobspec import decode_job_spec
from silentswarm.leader.api.sse import for_reader, last_event_id
from silentswarm.leader.auth import principal_of
from silentswarm.leader.exports import ExportService
from silentswarm.leader.services.accounts import AccountsService
from silentswarm.leader.services.jobs import JobsService
from silentswarm.types.jobs import CheckpointRecord, ServedJob
from silentswarm.types.metrics import HistoryPoint, JobMetrics


class JobsController(Controller):
    path = "/api/v1/jobs"
    tags = ["jobs"]

    @post(
        "/",
        status_code=HTTP_201_CREATED,
        summary="Submit a job (the job spec as JSON); 400 names a wrong or unknown field",
    )
    async def submit(self, request: Request, jobs: NamedDependency[JobsService]) -> ServedJob:
        # Decoded here, strictly, so that the error names the field the way the CLI shows it.
        spec = decode_job_spec(await request.body())
        return await jobs.submit(spec, principal_of(request))

    @get(
        "/",
        summary=(
            "Every job, oldest first; archived ones (finished long ago, or beyond the newest "
            "SWARM_JOBS_KEEP_FINISHED finished jobs) only with ?all=true; ?owner=NAME: one "
            "account's jobs"
        ),
    )
    async def list_jobs(
        self,
        jobs: NamedDependency[JobsService],
        # Named as the query parameter is, so that a bad value's 400 names ``all``.
        all: Annotated[bool, QueryParameter(description="also list archived jobs")] = False,
        owner: Annotated[
            str | None, QueryParameter(description="only the jobs of this account")
        ] = None,
    ) -> list[ServedJob]:
        listed = jobs.list(archived=all)
        return listed if owner is None else [job for job in listed if job.owner == owner]

    @get(
        "/{job_id:str}",
        summary="One job (archived ones too): state, placement, per-fellow progress, reason",
    )
    async def get_job(self, job_id: FromPath[str], jobs: NamedDependency[JobsService]) -> ServedJob:
        return jobs.get(job_id)

    @delete("/{job_id:str}", status_code=HTTP_200_OK, summary="Cancel a PENDING or RUNNING job")
    async def cancel(self, job_id: FromPath[str], jobs: NamedDependency[JobsService]) -> ServedJob:
        return await jobs.cancel(job_id)

    @post(
        "/{job_id:str}/checkpoint",
        status_code=HTTP_202_ACCEPTED,
        summary="Ask every fellow of a running job to write a checkpoint at the same step",
    )
    async def checkpoint(
        self, job_id: FromPath[str], jobs: NamedDependency[JobsService]
    ) -> CheckpointRecord:
        return await jobs.checkpoint(job_id)

    @get("/{job_id:str}/metrics", summary="The job's merged live metrics")
    async def metrics(
        self, job_id: FromPath[str], jobs: NamedDependency[JobsService]
    ) -> JobMetrics:
        return jobs.metrics(job_id)

    @get(
        "/{job_id:str}/metrics/history",
        summary="Every finished step of the job's latest attempt (durable: JetStream)",
    )
    async def history(
        self, job_id: FromPath[str], jobs: NamedDependency[JobsService]
    ) -> list[HistoryPoint]:
        return await jobs.history(job_id)

    @get(
        "/{job_id:str}/metrics/stream",
        summary="SSE: merged metrics per record (ids: stream sequence), then an 'end' event",
    )
    async def stream(
        self,
        job_id: FromPath[str],
        request: Request,
        jobs: NamedDependency[JobsService],
        accounts: NamedDependency[AccountsService],
    ) -> ServerSentEvent:
        events = jobs.metrics_stream(job_id, last_event_id(request))
        return ServerSentEvent(for_reader(request, accounts, events))

    @get(
        "/{job_id:str}/init/{name:str}",
        summary=(
            "A file of the export the job starts from (init_from), for a stage of its current "
            "attempt (the X-Swarm-Shard-Token header from its START: the manifest and the "
            "shards holding that stage's layers only; never ?token=)"
        ),
        media_type="application/octet-stream",
    )
    async def init_file(
        self,
        job_id: FromPath[str],
        name: FromPath[str],
        request: Request,
        jobs: NamedDependency[JobsService],
    ) -> File:
        header = request.headers.get(ExportService.TOKEN_HEADER)
        path = jobs.init_file(job_id, name, header, request.query_params)
        return File(path, filename=name, media_type="application/octet-stream")

    @get(
        "/{job_id:str}/shards/{step:int}/{name:str}",
        summary=(
            "A shard file for a resumed attempt's stage (the X-Swarm-Shard-Token header from "
            "its START: that stage's files only; never ?token=)"
        ),
        media_type="application/octet-stream",
    )
    async def shard(
        self,
        job_id: FromPath[str],
        step: FromPath[int],
        name: FromPath[str],
        request: Request,
        jobs: NamedDependency[JobsService],
    ) -> File:
        header = request.headers.get(ExportService.TOKEN_HEADER)
        path = jobs.shard_file(job_id, step, name, header, request.query_params)
        return File(path, filename=name, media_type="application/octet-stream")
