from __future__ import annotations

from typing import Any

from litestar import Controller, Response, get

from leader.services import LeaderServices
from swarm import __version__


class HealthController(Controller):
    path = "/health"
    tags = ["health"]

    @get("/", summary="Liveness and NATS connectivity (503 while NATS is unreachable)")
    async def health(self, services: LeaderServices) -> Response[dict[str, Any]]:
        connected = services.bus.is_connected
        body = {
            "status": "ok" if connected else "degraded",
            "nats": "connected" if connected else "disconnected",
            "version": __version__,
        }
        return Response(body, status_code=200 if connected else 503)
