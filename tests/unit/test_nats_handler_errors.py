"""A message handler that raises is a bug, not an outage: on a real nats-server its
exception is counted for every message, and logged as an error with its traceback, once
per type in a while; the connection's own errors stay outages."""

from __future__ import annotations

import asyncio
import logging

import nats

from silentswarm.natsconn import ErrorReport, NatsAccess, connect_forever


def test_a_handler_s_exception_is_counted_and_logged_with_its_traceback(nats_server, caplog):
    failed: list[Exception] = []

    async def run() -> None:
        nc = await connect_forever(nats_server.url, name="t", on_handler_error=failed.append)

        async def broken(msg) -> None:
            raise ValueError(f"cannot handle {msg.data!r}")

        await nc.subscribe("t.broken", cb=broken)
        for n in range(3):
            await nc.publish("t.broken", str(n).encode())
        await nc.flush()
        deadline = asyncio.get_running_loop().time() + 10
        while len(failed) < 3 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        await nc.close()

    with caplog.at_level(logging.DEBUG, logger="silentswarm.natsconn"):
        asyncio.run(run())
    assert [str(e) for e in failed] == [f"cannot handle b'{n}'" for n in range(3)]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "handler failed" in errors[0].getMessage()
    assert errors[0].exc_info is not None and errors[0].exc_info[0] is ValueError


def test_the_connection_s_own_errors_are_an_outage_not_a_handler_s(caplog):
    counted: list[Exception] = []
    report = ErrorReport(NatsAccess(url="nats://127.0.0.1:1"), counted.append)
    with caplog.at_level(logging.DEBUG, logger="silentswarm.natsconn"):
        for exc in (
            ConnectionRefusedError(111, "refused"),
            nats.errors.UnexpectedEOF(),
            TimeoutError(),
        ):
            asyncio.run(report.report(exc))
    assert counted == []
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "retrying every" in warned[0].getMessage()
