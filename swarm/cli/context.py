"""The CLI's context: what the global options and the environment say, built once per run.

The meta app (:mod:`silentswarm.cli.app`) parses ``--leader-url`` and ``--json``, builds one
:class:`CliContext` and hands it to the command, which declares it as a ``ctx: Ctx``
parameter (cyclopts leaves ``parse=False`` parameters to the caller). Nothing is global.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated, Any

from cyclopts import Parameter

from silentswarm.cli import cluster, render
from silentswarm.cli.client import LeaderClient
from silentswarm.settings import Settings

# How long one HTTP call to the leader may take (LeaderClient's own default).
HTTP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class CliContext:
    settings: Settings
    json: bool = False
    http_timeout_s: float = HTTP_TIMEOUT_S

    @property
    def leader_url(self) -> str:
        """--leader-url or SWARM_LEADER_URL; else the local cluster's leader; else the default.

        Resolved when a command asks (it reads the local cluster's record), so commands that
        never talk to a leader never fail on a stale record."""
        return (
            self.settings.leader_url
            or cluster.running_leader_url(self.settings)
            or self.settings.default_leader_url
        )

    @property
    def token(self) -> str | None:
        """SWARM_API_TOKEN, else the token the local leader stored in the state directory."""
        return self.settings.client_token()

    def client(self) -> LeaderClient:
        return LeaderClient(self.leader_url, token=self.token, timeout=self.http_timeout_s)

    def emit(self, value: Any, human: str) -> None:
        """The command's result: ``value`` as JSON with --json, else the human text."""
        print(render.dumps(value) if self.json else human)

    def progress(self, line: str) -> None:
        """A line about the work under way: stderr with --json (stdout stays one document)."""
        print(line, file=sys.stderr if self.json else sys.stdout)


# How a command asks for the context: ``def info(*, ctx: Ctx) -> None``.
Ctx = Annotated[CliContext, Parameter(parse=False)]
