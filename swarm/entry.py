"""Shared start-up for every console script: logging, and errors as one line + exit code."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

from silentswarm.errors import SwarmError
from silentswarm.retrying import log_retries_at_debug

T = TypeVar("T")
LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
# HTTP clients that log every request's URL at INFO (query string and all: a shard download
# token, an access_token, ...): only their warnings get through.
QUIET_HTTP_LOGGERS = ("httpx", "httpcore")


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)
    # nats-py logs every failed reconnect attempt at ERROR; our own callbacks say it once.
    logging.getLogger("nats.aio.client").setLevel(logging.CRITICAL)
    quiet_http_clients()
    # stamina logs every scheduled retry at WARNING; each of our loops warns once per reason.
    log_retries_at_debug()


def quiet_http_clients() -> None:
    """Request URLs are never logged, whatever the level: httpx and httpcore at WARNING."""
    for name in QUIET_HTTP_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def fail(prog: str, message: str, exit_code: int) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(exit_code)


def run_or_exit(prog: str, fn: Callable[[], T]) -> T:
    """Run ``fn``; a SwarmError becomes one line on stderr and its exit code, not a traceback."""
    try:
        return fn()
    except SwarmError as exc:
        fail(prog, exc.message, exc.exit_code)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
