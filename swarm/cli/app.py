"""The ``swarm`` CLI (cyclopts): the app assembled from :mod:`silentswarm.cli.commands`, and the
meta app that parses the shared options given before the command name (``--leader-url``,
``--json``), folds them with those given after it (:mod:`silentswarm.cli.options`) into one
:class:`~swarm.cli.context.CliContext` and hands it to the command.

Every error is one line on stderr, ``swarm: error: <message>``: a usage error (an unknown
command or option, a missing or malformed argument) exits 2, like a bad setting.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any

import cyclopts
from cyclopts import CycloptsError, Parameter, UnknownCommandError

from silentswarm import __version__
from silentswarm.cli.commands import (
    accounts,
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
from silentswarm.cli.options import JSON_HELP, LEADER_URL_HELP, SharedOptions
from silentswarm.entry import fail, run_or_exit
from silentswarm.settings import Settings

PROG = "swarm"
USAGE_EXIT = 2  # as a bad setting (ConfigError): docs/reference/cli.md, "Exit codes"

app = cyclopts.App(
    name=PROG,
    help="SilentSwarm: pipeline-parallel training across heterogeneous machines.\n\n"
    "--leader-url and --json go before or after the command; each command's --help lists "
    "the ones it takes.",
    version=__version__,
    # Help texts are shown as written: a default such as <state>/nats-auth is no markup.
    help_format="plaintext",
    print_error=False,
    exit_on_error=False,
)
for module in (
    cluster,
    fellows,
    jobs,
    data,
    experiments,
    onboarding,
    nats_auth,
    models,
    accounts,
):
    module.register(app)


@app.meta.default
def launcher(
    *tokens: Annotated[str, Parameter(show=False, allow_leading_hyphen=True)],
    leader_url: Annotated[str | None, Parameter(show=False, help=LEADER_URL_HELP)] = None,
    json: Annotated[bool | None, Parameter(show=False, help=JSON_HELP)] = None,
) -> Any:
    """Parse the command, build the context once, and run the command with it (cyclopts'
    meta-app pattern: the context is the command's ``parse=False`` parameter)."""
    command, bound, ignored = app.parse_args(tokens)
    ctx = CliContext(settings=Settings.from_env().replace(leader_url=leader_url), json_flag=json)
    for value in bound.arguments.values():
        if isinstance(value, SharedOptions):
            ctx = ctx.with_options(value)
    given = {name: ctx for name, hint in ignored.items() if hint is CliContext}
    return command(*bound.args, **bound.kwargs, **given)


def usage_message(exc: CycloptsError) -> str:
    """A cyclopts error as one line: an unknown command with the closest command's name."""
    if isinstance(exc, UnknownCommandError) and exc.unused_tokens:
        token = exc.unused_tokens[0]
        commands = command_names(exc.app or app)
        close = difflib.get_close_matches(token, commands, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else f" (see {PROG} --help)"
        return f"unknown command {token!r}{hint}"
    return one_line(str(exc))


def command_names(owner: cyclopts.App) -> list[str]:
    return [name for name in owner if not name.startswith("-")]


def one_line(text: str) -> str:
    return " ".join(text.split()).rstrip(".")


def main() -> None:
    try:
        run_or_exit(PROG, app.meta)
    except CycloptsError as exc:
        fail(PROG, usage_message(exc), USAGE_EXIT)


if __name__ == "__main__":
    main()
