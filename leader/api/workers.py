from __future__ import annotations

from litestar import Controller, get

from leader.registry import FellowRecord
from leader.services import LeaderServices


class WorkersController(Controller):
    path = "/api/v1/workers"
    tags = ["workers"]

    @get("/", summary="Every fellow the leader knows, online or not")
    async def list_workers(self, services: LeaderServices) -> list[FellowRecord]:
        return services.workers()

    @get("/{fellow_id:str}", summary="One fellow, with its recent status transitions")
    async def get_worker(self, fellow_id: str, services: LeaderServices) -> FellowRecord:
        return services.worker(fellow_id)
