"""Shared bits of the SSE endpoints."""

from __future__ import annotations

from litestar import Request

from silentswarm.errors import FieldError


def last_event_id(request: Request) -> int | None:
    """The ``Last-Event-ID`` a reconnecting client sends (a stream sequence), if any.

    A browser's EventSource cannot set it on its first request, so ``?after=N`` says the
    same (the header wins: the browser sends it on its own reconnects).
    """
    raw = request.headers.get("last-event-id")
    if raw is None or raw.strip() == "":
        raw = request.query_params.get("after")
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise FieldError(
            f"Last-Event-ID: {raw!r} is not an event id", field="Last-Event-ID"
        ) from None
    if value < 0:
        raise FieldError("Last-Event-ID: must be >= 0", field="Last-Event-ID")
    return value
