"""The CLI's SSE parser: the rules of the spec that matter to us."""

from silentswarm.cli.sse import parse


def test_events_ids_comments_and_keepalives():
    lines = [
        ": keep-alive",
        "",
        "id: 7",
        "event: metrics",
        'data: {"a":',
        "data: 1}",
        "",
        ": keep-alive",
        "data: ",
        "",
        "event: end",
        "data:x",
        "",
    ]
    events = list(parse(iter(lines)))
    assert [(e.event, e.data, e.id) for e in events] == [
        ("metrics", '{"a":\n1}', "7"),
        ("end", "x", "7"),  # the last event id carries over, as the spec says
    ]
