from __future__ import annotations

from litestar import Controller, get
from litestar.di import NamedDependency

from silentswarm.leader.services.fleet import FleetService
from silentswarm.leader.services.info import InfoService
from silentswarm.types.api import LeaderInfo
from silentswarm.types.metrics import ClusterView


class InfoController(Controller):
    path = "/api/v1/info"
    tags = ["info"]

    @get("/", summary="Leader version, NATS URL and fellow counts by status")
    async def info(self, info: NamedDependency[InfoService]) -> LeaderInfo:
        return info.info()


class ClusterController(Controller):
    path = "/api/v1/cluster"
    tags = ["info"]

    @get("/", summary="Online capacity (CPU, RAM, VRAM, network) and running jobs' performance")
    async def cluster(self, fleet: NamedDependency[FleetService]) -> ClusterView:
        return fleet.cluster()
