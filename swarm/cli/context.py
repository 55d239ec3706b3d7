"""The CLI's context: what the shared options and the environment say, built once per run.

The meta app (:mod:`silentswarm.cli.app`) folds ``--leader-url`` and ``--json`` (given
before or after the command name, :mod:`silentswarm.cli.options`) into one
:class:`CliContext` and hands it to the command, which declares it as a ``ctx: Ctx``
parameter (cyclopts leaves ``parse=False`` parameters to the caller). Nothing is global.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

from cyclopts import Parameter
from rich.console import Console, RenderableType

from silentswarm.cli import cluster, render
from silentswarm.cli.client import LeaderClient
from silentswarm.cli.options import SharedOptions, leader_url_problem
from silentswarm.errors import ConfigError
from silentswarm.settings import Settings

# How long one HTTP call to the leader may take (LeaderClient's own default).
HTTP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class CliContext:
    settings: Settings
    # --json / --no-json; None: not given (the command's own default: human text, but for
    # `swarm job`, JSON).
    json_flag: bool | None = None
    http_timeout_s: float = HTTP_TIMEOUT_S
    tty: bool = field(default_factory=lambda: sys.stdout.isatty())

    @property
    def json(self) -> bool:
        return bool(self.json_flag)

    def with_options(self, options: SharedOptions) -> CliContext:
        """This context with the options given after the command name (they win)."""
        ctx = self
        if options.json is not None:
            ctx = replace(ctx, json_flag=options.json)
        leader_url = getattr(options, "leader_url", None)
        if leader_url is not None:
            ctx = replace(ctx, settings=ctx.settings.replace(leader_url=leader_url))
        return ctx

    @property
    def leader_url(self) -> str:
        """--leader-url or SWARM_LEADER_URL; else the local cluster's leader; else the default.

        Resolved when a command asks (it reads the local cluster's record), so commands that
        never talk to a leader never fail on a stale record."""
        given = self.settings.leader_url
        if given is not None:
            problem = leader_url_problem(given)
            if problem:
                raise ConfigError(f"--leader-url / SWARM_LEADER_URL: {problem}")
            return given
        return cluster.running_leader_url(self.settings) or self.settings.default_leader_url

    @property
    def token(self) -> str | None:
        """SWARM_API_TOKEN, else the token the local leader stored in the state directory."""
        return self.settings.client_token()

    def client(self) -> LeaderClient:
        return LeaderClient(self.leader_url, token=self.token, timeout=self.http_timeout_s)

    def console(self) -> Console:
        """Rich output on stdout: styled on a terminal; plain, unwrapped text on a pipe."""
        return render.console(sys.stdout, tty=self.tty)

    def emit(self, value: Any, human: RenderableType) -> None:
        """The command's result: ``value`` as JSON with --json, else the human text (a string
        or a rich renderable such as :func:`render.table`'s)."""
        if self.json:
            print(render.dumps(value), flush=True)
        else:
            render.show(self.console(), human)

    def progress(self, line: str) -> None:
        """A line about the work under way: stderr with --json (stdout stays one document)."""
        print(line, file=sys.stderr if self.json else sys.stdout, flush=True)


# How a command asks for the context: ``def info(*, ctx: Ctx) -> None``.
Ctx = Annotated[CliContext, Parameter(parse=False)]
