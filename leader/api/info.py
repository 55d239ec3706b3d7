from __future__ import annotations

from litestar import Controller, get

from leader.services import LeaderServices
from swarm.types.api import LeaderInfo
from swarm.types.metrics import ClusterView


class InfoController(Controller):
    path = "/api/v1/info"
    tags = ["info"]

    @get("/", summary="Leader version, NATS URL and fellow counts by status")
    async def info(self, services: LeaderServices) -> LeaderInfo:
        return services.info()


class ClusterController(Controller):
    path = "/api/v1/cluster"
    tags = ["info"]

    @get("/", summary="Online capacity (CPU, RAM, VRAM, network) and running jobs' performance")
    async def cluster(self, services: LeaderServices) -> ClusterView:
        return services.cluster()
