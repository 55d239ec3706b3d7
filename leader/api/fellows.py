"""Fellows (under the public route ``/api/v1/workers``, kept) and their pending purges."""

from __future__ import annotations

from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.status_codes import HTTP_200_OK

from silentswarm.jobspec import decode_strict
from silentswarm.leader.services.fleet import FleetService
from silentswarm.types.fleet import (
    FellowRecord,
    PendingPurge,
    PurgeDelivery,
    ReleaseRequest,
    ReleaseResult,
    RetryPurgeRequest,
    UpdateRequest,
)
from silentswarm.types.jobs import SignalRecord


class FellowsController(Controller):
    path = "/api/v1/workers"
    tags = ["workers"]

    @get("/", summary="Every fellow the leader knows, online or not")
    async def list_fellows(self, fleet: NamedDependency[FleetService]) -> list[FellowRecord]:
        return fleet.fellows()

    @get("/{fellow_id:str}", summary="One fellow, with its recent status transitions")
    async def get_fellow(
        self, fellow_id: FromPath[str], fleet: NamedDependency[FleetService]
    ) -> FellowRecord:
        return fleet.fellow(fellow_id)

    @post(
        "/{fellow_id:str}/release",
        status_code=HTTP_200_OK,
        summary="Remove a fellow from the registry; purge_install also wipes its install",
    )
    async def release(
        self, fellow_id: FromPath[str], request: Request, fleet: NamedDependency[FleetService]
    ) -> ReleaseResult:
        body = decode_strict(await request.body(), ReleaseRequest)
        return await fleet.release(fellow_id, purge_install=body.purge_install)

    @post(
        "/update",
        status_code=HTTP_200_OK,
        summary="Update idle fellows: joined ones reinstall the leader's package, then restart",
    )
    async def update(
        self, request: Request, fleet: NamedDependency[FleetService]
    ) -> list[SignalRecord]:
        body = decode_strict(await request.body(), UpdateRequest)
        return await fleet.update(body.fellow_id, str(request.base_url))


class PurgesController(Controller):
    path = "/api/v1/purges"
    tags = ["workers"]

    @get("/", summary="Purges waiting for their fellow to come back")
    async def pending(self, fleet: NamedDependency[FleetService]) -> list[PendingPurge]:
        return fleet.pending_purges()

    @post("/retry", status_code=HTTP_200_OK, summary="Try to deliver pending purges now")
    async def retry(
        self, request: Request, fleet: NamedDependency[FleetService]
    ) -> list[PurgeDelivery]:
        body = decode_strict(await request.body(), RetryPurgeRequest)
        return await fleet.retry_purges(body.fellow_id)
