"""Server-Sent Events from the leader (httpx-sse), resuming with ``Last-Event-ID``."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
from httpx_sse import EventSource, ServerSentEvent, SSEError

from silentswarm.errors import ErrorCode, LeaderResponseError, LeaderUnreachableError

RETRY_S = 1.0

Event = ServerSentEvent


def events(response: httpx.Response) -> Iterator[ServerSentEvent]:
    """The events of one streamed response. An event with no data dispatches nothing (the
    SSE spec; httpx-sse yields one for a keep-alive once an id was seen)."""
    for event in EventSource(response).iter_sse():
        if event.data:
            yield event


def follow(
    base_url: str,
    path: str,
    *,
    give_up_after_s: float = 60.0,
    last_event_id: str | None = None,
    token: str | None = None,
) -> Iterator[ServerSentEvent]:
    """Events from ``path``, reconnecting (from the last id seen) when the stream drops.

    Stops when the server ends the stream after an ``end`` event; raises
    LeaderUnreachableError after ``give_up_after_s`` without a connection.
    """
    down_since: float | None = None
    timeout = httpx.Timeout(10.0, read=60.0)
    with httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout) as http:
        while True:
            headers = {"accept": "text/event-stream"}
            if token:
                headers["authorization"] = f"Bearer {token}"
            if last_event_id is not None:
                headers["last-event-id"] = last_event_id
            try:
                with http.stream("GET", path, headers=headers) as response:
                    if response.status_code != 200:
                        _raise_for(response, path)
                    down_since = None
                    for event in events(response):
                        if event.id:
                            last_event_id = event.id
                        yield event
                        if event.event == "end":
                            return
            except SSEError as exc:
                raise LeaderResponseError(
                    f"{base_url}{path} is not an event stream ({exc})",
                    code=ErrorCode.LEADER_RESPONSE_INVALID,
                ) from None
            except (httpx.TransportError, LeaderResponseError) as exc:
                if isinstance(exc, LeaderResponseError) and exc.code != ErrorCode.LEADER_NOT_READY:
                    raise
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since > give_up_after_s:
                    raise LeaderUnreachableError(
                        f"lost the stream {base_url}{path} for {give_up_after_s:.0f}s ({exc})"
                    ) from None
            time.sleep(RETRY_S)


def _raise_for(response: httpx.Response, path: str) -> None:
    response.read()
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "code" in body:
        raise LeaderResponseError(str(body.get("message", "")), code=str(body["code"]))
    raise LeaderResponseError(
        f"leader answered {response.status_code} for GET {path}",
        code=ErrorCode.HTTP_ERROR,
    )
