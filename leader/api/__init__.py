"""Thin HTTP controllers; the logic lives in leader.services and below."""

from leader.api.auth import AuthController
from leader.api.bootstrap import BootstrapController
from leader.api.health import HealthController
from leader.api.info import ClusterController, InfoController
from leader.api.jobs import JobsController
from leader.api.logs import LogsController
from leader.api.metrics import MetricsController
from leader.api.nodes import NodesController
from leader.api.ui import STATIC, OpsController
from leader.api.workers import PurgesController, WorkersController

CONTROLLERS = [
    HealthController,
    InfoController,
    ClusterController,
    WorkersController,
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
