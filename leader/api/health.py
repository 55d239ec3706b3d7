from __future__ import annotations

from litestar import Controller, Response, get
from litestar.di import NamedDependency

from silentswarm.leader.services.info import InfoService
from silentswarm.types.api import Health


class HealthController(Controller):
    path = "/health"
    tags = ["health"]

    @get(
        "/",
        summary="Liveness, NATS connectivity and JetStream storage (503, with the reasons, "
        "while NATS is unreachable or the store is short of room)",
    )
    async def health(self, info: NamedDependency[InfoService]) -> Response[Health]:
        body, status = info.health()
        return Response(body, status_code=status)
