from __future__ import annotations

from litestar import Controller, Response, get

from leader.services import LeaderServices
from swarm import __version__
from swarm.types.api import Health


def health_body(connected: bool, storage_reasons: list[str]) -> tuple[Health, int]:
    """``ok`` (200) or ``degraded`` (503) with its ``reasons``: NATS unreachable, or the
    JetStream store short of room (leader.storage). Pure."""
    reasons = ([] if connected else ["the leader is not connected to NATS"]) + storage_reasons
    body = Health(
        status="degraded" if reasons else "ok",
        nats="connected" if connected else "disconnected",
        version=__version__,
        reasons=reasons,
    )
    return body, 503 if reasons else 200


class HealthController(Controller):
    path = "/health"
    tags = ["health"]

    @get(
        "/",
        summary="Liveness, NATS connectivity and JetStream storage (503, with the reasons, "
        "while NATS is unreachable or the store is short of room)",
    )
    async def health(self, services: LeaderServices) -> Response[Health]:
        body, status = health_body(services.bus.is_connected, services.storage.reasons)
        return Response(body, status_code=status)
