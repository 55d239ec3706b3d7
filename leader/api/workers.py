from __future__ import annotations

from litestar import Controller, Request, get, post
from litestar.status_codes import HTTP_200_OK

from leader.services import LeaderServices
from swarm.jobspec import decode_strict
from swarm.types.fleet import (
    FellowRecord,
    PendingPurge,
    PurgeDelivery,
    ReleaseRequest,
    ReleaseResult,
    RetryPurgeRequest,
    UpdateRequest,
)
from swarm.types.jobs import SignalRecord


class WorkersController(Controller):
    path = "/api/v1/workers"
    tags = ["workers"]

    @get("/", summary="Every fellow the leader knows, online or not")
    async def list_workers(self, services: LeaderServices) -> list[FellowRecord]:
        return services.workers()

    @get("/{fellow_id:str}", summary="One fellow, with its recent status transitions")
    async def get_worker(self, fellow_id: str, services: LeaderServices) -> FellowRecord:
        return services.worker(fellow_id)

    @post(
        "/{fellow_id:str}/release",
        status_code=HTTP_200_OK,
        summary="Remove a fellow from the registry; purge_install also wipes its install",
    )
    async def release(
        self, fellow_id: str, request: Request, services: LeaderServices
    ) -> ReleaseResult:
        body = decode_strict(await request.body(), ReleaseRequest)
        return await services.orchestrator.release(fellow_id, purge_install=body.purge_install)

    @post(
        "/update",
        status_code=HTTP_200_OK,
        summary="Update idle fellows: joined ones reinstall the leader's package, then restart",
    )
    async def update(self, request: Request, services: LeaderServices) -> list[SignalRecord]:
        body = decode_strict(await request.body(), UpdateRequest)
        return await services.update(body.fellow_id, str(request.base_url))


class PurgesController(Controller):
    path = "/api/v1/purges"
    tags = ["workers"]

    @get("/", summary="Purges waiting for their fellow to come back")
    async def pending(self, services: LeaderServices) -> list[PendingPurge]:
        return services.orchestrator.pending_purges()

    @post("/retry", status_code=HTTP_200_OK, summary="Try to deliver pending purges now")
    async def retry(self, request: Request, services: LeaderServices) -> list[PurgeDelivery]:
        body = decode_strict(await request.body(), RetryPurgeRequest)
        return await services.orchestrator.retry_purges(body.fellow_id)
