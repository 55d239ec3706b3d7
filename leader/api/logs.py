from __future__ import annotations

from typing import Annotated

from litestar import Controller, Request, get
from litestar.params import Parameter
from litestar.response import ServerSentEvent

from leader.api.sse import last_event_id
from leader.errors import StorageUnavailableError
from leader.services import LeaderServices
from swarm.errors import FieldError
from swarm.subjects import TOKEN_RE
from swarm.types.fleet import LogEntry


def _check(fellow_id: str) -> None:
    if not TOKEN_RE.match(fellow_id):
        raise FieldError(f"fellow_id: {fellow_id!r} is not a fellow id", field="fellow_id")


class LogsController(Controller):
    path = "/api/v1/workers/{fellow_id:str}/logs"
    tags = ["logs"]

    @get("/", summary="The fellow's latest log records (agent and stage runtime)")
    async def snapshot(
        self,
        fellow_id: str,
        services: LeaderServices,
        limit: Annotated[int, Parameter(ge=1, le=2000)] = 200,
    ) -> list[LogEntry]:
        _check(fellow_id)
        return services.observe.log_snapshot(fellow_id, limit)

    @get("/stream", summary="SSE: the fellow's log batches, resumable with Last-Event-ID")
    async def stream(
        self, fellow_id: str, request: Request, services: LeaderServices
    ) -> ServerSentEvent:
        _check(fellow_id)
        if not services.observe.ready.is_set() and services.storage.create_error:
            raise StorageUnavailableError(
                f"the log stream could not be created: {services.storage.create_error}"
            )
        services.observe.check_stream()
        return ServerSentEvent(services.observe.log_events(fellow_id, last_event_id(request)))
