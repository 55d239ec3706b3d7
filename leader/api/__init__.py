"""Thin HTTP controllers; each calls the one domain service it needs (leader.services)."""

from silentswarm.leader.api.accounts import AccountsController
from silentswarm.leader.api.auth import AuthController, WhoAmIController
from silentswarm.leader.api.bootstrap import BootstrapController
from silentswarm.leader.api.datasets import DatasetsController
from silentswarm.leader.api.fellows import FellowsController, PurgesController
from silentswarm.leader.api.health import HealthController
from silentswarm.leader.api.info import ClusterController, InfoController
from silentswarm.leader.api.jobs import JobsController
from silentswarm.leader.api.logs import LogsController
from silentswarm.leader.api.metrics import MetricsController
from silentswarm.leader.api.nodes import NodesController
from silentswarm.leader.api.ui import STATIC, OpsController

CONTROLLERS = [
    HealthController,
    InfoController,
    ClusterController,
    FellowsController,
    PurgesController,
    NodesController,
    JobsController,
    DatasetsController,
    LogsController,
    BootstrapController,
    AuthController,
    WhoAmIController,
    AccountsController,
    MetricsController,
    OpsController,
    STATIC,
]
