"""The options that many commands share: ``--leader-url`` and ``--json``.

Each command declares the ones that apply to it (``options: LeaderOptions`` or ``options:
JsonOptions``), so that its ``--help`` lists exactly those; a command that talks to no leader
lists no ``--leader-url``. Given after the command name, cyclopts parses them into that
parameter; given before it (``swarm --json fellows``), the meta app
(:mod:`silentswarm.cli.app`) parses them. The meta app folds both into the one
:class:`~silentswarm.cli.context.CliContext` the command gets; the command never reads its
``options`` parameter itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated
from urllib.parse import urlsplit

from cyclopts import Group, Parameter

GLOBAL = Group("Global options", sort_key=100)

LEADER_URL_HELP = (
    "Leader URL, http(s)://HOST[:PORT] [env SWARM_LEADER_URL; default: the leader of the "
    "cluster that start-cluster runs from SWARM_STATE_DIR, else http://127.0.0.1:8080]"
)
JSON_HELP = "Machine-readable JSON output"


@Parameter(name="*", group=GLOBAL)
@dataclass(frozen=True)
class JsonOptions:
    """``--json``: for commands that print a result but talk to no leader."""

    json: Annotated[bool | None, Parameter(help=JSON_HELP, show_default=False)] = None


@Parameter(name="*", group=GLOBAL)
@dataclass(frozen=True)
class LeaderOptions:
    """``--leader-url`` and ``--json``: for commands that ask the leader."""

    leader_url: Annotated[str | None, Parameter(help=LEADER_URL_HELP, show_default=False)] = None
    json: Annotated[bool | None, Parameter(help=JSON_HELP, show_default=False)] = None


@Parameter(name="*", group=GLOBAL)
@dataclass(frozen=True)
class JsonByDefaultOptions:
    """``swarm job``: JSON unless ``--no-json`` asks for the readable summary."""

    leader_url: Annotated[str | None, Parameter(help=LEADER_URL_HELP, show_default=False)] = None
    json: Annotated[
        bool | None,
        Parameter(
            help="JSON (the default for this command); --no-json: a readable summary",
            show_default=False,
        ),
    ] = None


SharedOptions = JsonOptions | LeaderOptions | JsonByDefaultOptions


def leader_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a leader's base URL (None when it can): it needs the scheme
    http or https and a host."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (a port that is not a number raises here)
    except ValueError as exc:
        return f"{url!r} is not a URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return f"{url!r} is not an http:// or https:// URL"
    if not parts.hostname:
        return f"{url!r} has no host"
    if parts.query or parts.fragment:
        return f"{url!r}: a leader URL has no query or fragment"
    return None


# The defaults a command's ``options`` parameter declares (module-level: one frozen instance).
LEADER = LeaderOptions()
JSON = JsonOptions()
JSON_BY_DEFAULT = JsonByDefaultOptions()
