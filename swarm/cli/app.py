"""The ``swarm`` CLI (cyclopts): the app assembled from :mod:`silentswarm.cli.commands`, and the
meta app that parses the global options (``--leader-url``, ``--json``) into one
:class:`~swarm.cli.context.CliContext` and hands it to the command."""

from __future__ import annotations

from typing import Annotated, Any

import cyclopts
from cyclopts import Parameter

from silentswarm import __version__
from silentswarm.cli.commands import (
    cluster,
    data,
    experiments,
    fellows,
    jobs,
    models,
    nats_auth,
    onboarding,
)
from silentswarm.cli.context import CliContext
from silentswarm.entry import run_or_exit
from silentswarm.settings import Settings

app = cyclopts.App(
    name="swarm",
    help="SilentSwarm: pipeline-parallel training across heterogeneous machines.",
    version=__version__,
)
for module in (cluster, fellows, jobs, data, experiments, onboarding, nats_auth, models):
    module.register(app)


@app.meta.default
def launcher(
    *tokens: Annotated[str, Parameter(show=False, allow_leading_hyphen=True)],
    leader_url: Annotated[
        str | None,
        Parameter(
            help="Leader URL [env SWARM_LEADER_URL; default: the leader of the cluster that "
            "start-cluster runs from SWARM_STATE_DIR, else http://127.0.0.1:8080]"
        ),
    ] = None,
    json: Annotated[bool, Parameter(help="Machine-readable JSON output")] = False,
) -> Any:
    """Parse the command, build the context once, and run the command with it (cyclopts'
    meta-app pattern: the context is the command's ``parse=False`` parameter)."""
    ctx = CliContext(settings=Settings.from_env().replace(leader_url=leader_url), json=json)
    command, bound, ignored = app.parse_args(tokens)
    given = {name: ctx for name, hint in ignored.items() if hint is CliContext}
    return command(*bound.args, **bound.kwargs, **given)


def main() -> None:
    run_or_exit("swarm", app.meta)


if __name__ == "__main__":
    main()
