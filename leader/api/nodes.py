from __future__ import annotations

from litestar import Controller, get
from litestar.di import NamedDependency

from silentswarm.leader.services.fleet import FleetService
from silentswarm.types.fleet import NodeView


class NodesController(Controller):
    path = "/api/v1/nodes"
    tags = ["nodes"]

    @get("/", summary="Hosts: CPU cores, RAM and GPUs (total/free VRAM), merged over their fellows")
    async def list_nodes(self, fleet: NamedDependency[FleetService]) -> list[NodeView]:
        return fleet.nodes()
