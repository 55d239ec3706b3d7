"""The CLI's SSE reading (httpx-sse underneath): the rules of the spec that matter to us."""

import httpx
import pytest

from silentswarm.cli.sse import events

BODY = (
    ": keep-alive\n"
    "\n"
    "id: 7\n"
    "event: metrics\n"
    'data: {"a":\n'
    "data: 1}\n"
    "\n"
    ": keep-alive\n"
    "\n"
    "data: \n"
    "\n"
    "event: end\n"
    "data:x\n"
    "\n"
)


def stream(body: str, content_type: str = "text/event-stream") -> httpx.Response:
    return httpx.Response(200, headers={"content-type": content_type}, content=body.encode())


def test_events_ids_comments_and_keepalives():
    got = [(e.event, e.data, e.id) for e in events(stream(BODY))]
    assert got == [
        ("metrics", '{"a":\n1}', "7"),
        ("end", "x", "7"),  # the last event id carries over, as the spec says
    ]


def test_crlf_line_ends_and_an_unterminated_last_event():
    got = [(e.event, e.data) for e in events(stream("event: logs\r\ndata: [1]\r\n\r\ndata: 2"))]
    assert got == [("logs", "[1]")]  # an event is dispatched by its blank line only


def test_a_response_that_is_not_an_event_stream_is_refused():
    from httpx_sse import SSEError

    with pytest.raises(SSEError):
        list(events(stream("data: 1\n\n", content_type="application/json")))
