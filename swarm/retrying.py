"""Retries with backoff, on stamina: each loop's policy as one :class:`Backoff` constant, and
how a scheduled retry is logged.

stamina retries what its ``on`` names (exception types, or a function of the exception that
says yes or no), waits ``wait_initial * 2**(n-1)`` capped at ``wait_max`` plus up to
``wait_jitter`` at random, and stops after ``attempts`` tries or ``timeout`` seconds (None: no
such limit); a cancelled task stops at once. Its default instrumentation logs every scheduled
retry at WARNING, a line a second through a leader outage: :func:`log_retries_at_debug` has
them logged at DEBUG instead, and each loop warns the way an operator reads it (once per new
reason).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import stamina
from stamina.instrumentation import RetryDetails, set_on_retry_hooks

log = logging.getLogger(__name__)

RetryOn = type[Exception] | tuple[type[Exception], ...] | Callable[[Exception], bool]


class RetryContext(Protocol):
    """What :func:`stamina.retry_context` gives: its tries, each a context manager."""

    def __iter__(self) -> Iterator[stamina.Attempt]: ...

    def __aiter__(self) -> AsyncIterator[stamina.Attempt]: ...


@dataclass(frozen=True)
class Backoff:
    """When to try again: after ``wait_initial`` s doubling up to ``wait_max`` s (plus up to
    ``wait_jitter`` s at random), at most ``attempts`` tries and ``timeout`` s (None: no
    limit; a loop with neither retries until it succeeds or is cancelled)."""

    wait_initial: float
    wait_max: float
    wait_jitter: float = 0.0
    attempts: int | None = None
    timeout: float | None = None

    def context(self, on: RetryOn) -> RetryContext:
        """``for attempt in policy.context(on=...): with attempt: ...`` (``async for`` too)."""
        return stamina.retry_context(
            on=on,
            attempts=self.attempts,
            timeout=self.timeout,
            wait_initial=self.wait_initial,
            wait_max=self.wait_max,
            wait_jitter=self.wait_jitter,
        )


def _log_retry(details: RetryDetails) -> None:
    log.debug(
        "retrying %s in %.2f s (try %d: %r)",
        details.name,
        details.wait_for,
        details.retry_num,
        details.caused_by,
    )


def log_retries_at_debug() -> None:
    """Every scheduled retry at DEBUG (not stamina's WARNING, nor its Prometheus counter in
    the process-wide registry, which nothing here serves)."""
    set_on_retry_hooks([_log_retry])


class WarnOnNewReason:
    """stamina's ``on`` for a loop that retries until it succeeds: retries what ``retry_on``
    names (exception types, or a function of the exception) and warns (``template % reason``)
    when ``describe(exc)`` is not the reason warned last: an outage is one line, not one a
    try."""

    def __init__(
        self,
        logger: logging.Logger,
        template: str,
        retry_on: RetryOn,
        describe: Callable[[Exception], str] = str,
    ) -> None:
        self.logger = logger
        self.template = template
        self.retry_on = retry_on
        self.describe = describe
        self.reported = ""

    def __call__(self, exc: Exception) -> bool:
        if isinstance(self.retry_on, type | tuple):
            retry = isinstance(exc, self.retry_on)
        else:
            retry = self.retry_on(exc)
        if not retry:
            return False
        reason = self.describe(exc)
        if reason != self.reported:
            self.logger.warning(self.template, reason)
            self.reported = reason
        return True
