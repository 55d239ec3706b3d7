from __future__ import annotations

from typing import Annotated

from litestar import Controller, Request, get
from litestar.di import NamedDependency
from litestar.params import FromPath, QueryParameter
from litestar.response import ServerSentEvent

from silentswarm.leader.api.sse import for_reader, last_event_id
from silentswarm.leader.services.accounts import AccountsService
from silentswarm.leader.services.fleet import FleetService
from silentswarm.types.fleet import LogEntry


class LogsController(Controller):
    path = "/api/v1/workers/{fellow_id:str}/logs"
    tags = ["logs"]

    @get("/", summary="The fellow's latest log records (agent and stage runtime)")
    async def snapshot(
        self,
        fellow_id: FromPath[str],
        fleet: NamedDependency[FleetService],
        limit: Annotated[int, QueryParameter(ge=1, le=2000)] = 200,
    ) -> list[LogEntry]:
        return fleet.log_snapshot(fellow_id, limit)

    @get("/stream", summary="SSE: the fellow's log batches, resumable with Last-Event-ID")
    async def stream(
        self,
        fellow_id: FromPath[str],
        request: Request,
        fleet: NamedDependency[FleetService],
        accounts: NamedDependency[AccountsService],
    ) -> ServerSentEvent:
        events = fleet.log_stream(fellow_id, last_event_id(request))
        return ServerSentEvent(for_reader(request, accounts, events))
