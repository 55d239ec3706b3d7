"""``GET /api/v1/metrics``: the Prometheus scrape endpoint (the logic is in leader.metrics)."""

from __future__ import annotations

from litestar import Controller, Request, Response, get

from silentswarm.leader.metrics import MEDIA_TYPE, LeaderMetrics


class MetricsController(Controller):
    path = "/api/v1/metrics"
    tags = ["metrics"]

    @get("/", summary="Prometheus metrics (text format 0.0.4)", media_type=MEDIA_TYPE)
    async def metrics(self, request: Request) -> Response[bytes]:
        # Rendered on the event loop, where the state it reads changes: a consistent view.
        metrics: LeaderMetrics = request.app.state["metrics"]
        return Response(metrics.render(), media_type=MEDIA_TYPE)
