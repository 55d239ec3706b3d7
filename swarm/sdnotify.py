"""systemd's notify protocol, in a few lines: READY, STATUS and WATCHDOG over NOTIFY_SOCKET.

With ``Type=notify`` systemd waits for READY=1 before it calls a unit started, and with
``WatchdogSec=`` it restarts a unit that stops sending WATCHDOG=1. Outside systemd
(NOTIFY_SOCKET unset) every call does nothing, so the same code runs everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(*lines: str) -> bool:
    """Send ``lines`` (e.g. ``"READY=1"``) to NOTIFY_SOCKET; False when there is none."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall("\n".join(lines).encode())
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", os.environ.get("NOTIFY_SOCKET"), exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """Half the watchdog timeout systemd asked for (WATCHDOG_USEC), or None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(0.05, int(usec) / 2e6)
    except ValueError:
        return None


async def watchdog_forever() -> None:
    """Tell systemd we are alive while the event loop runs; returns at once without one."""
    interval = watchdog_interval()
    if interval is None:
        return
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            notify("WATCHDOG=1")
            await asyncio.sleep(interval)
