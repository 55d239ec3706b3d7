from __future__ import annotations

from litestar import Controller, get

from leader.registry import NodeView
from leader.services import LeaderServices


class NodesController(Controller):
    path = "/api/v1/nodes"
    tags = ["nodes"]

    @get("/", summary="Hosts: CPU cores, RAM and GPUs (total/free VRAM), from live telemetry")
    async def list_nodes(self, services: LeaderServices) -> list[NodeView]:
        return services.nodes()
