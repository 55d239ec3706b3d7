"""Thin HTTP controllers; each calls the one domain service it needs (leader.services)."""

from leader.api.auth import AuthController
from leader.api.bootstrap import BootstrapController
from leader.api.fellows import FellowsController, PurgesController
from leader.api.health import HealthController
from leader.api.info import ClusterController, InfoController
from leader.api.jobs import JobsController
from leader.api.logs import LogsController
from leader.api.metrics import MetricsController
from leader.api.nodes import NodesController
from leader.api.ui import STATIC, OpsController

CONTROLLERS = [
    HealthController,
    InfoController,
    ClusterController,
    FellowsController,
    PurgesController,
    NodesController,
    JobsController,
    LogsController,
    BootstrapController,
    AuthController,
    MetricsController,
    OpsController,
    STATIC,
]
