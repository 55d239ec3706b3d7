"""What a fellow may advertise as its data and sync addresses: a TCP endpoint, nothing else.

A fellow's addresses are a stranger's word: its placed neighbours and ring peers connect to
them. ZeroMQ takes many schemes (``ipc://``, ``inproc://``, ``udp://`` ...) and refuses a
malformed one with an error of its own inside the peer, so the leader accepts only
``tcp://host:port`` (a sync address may name a port range, ``tcp://host:7000-7003``): a name
or an IPv4 address, or an IPv6 address in brackets. Loopback stays allowed: a local cluster's
fellows share a host.
"""

from __future__ import annotations

import re

# A name (letters, digits, '-', '_', dots; a final dot allowed), an IPv4 address, or an IPv6
# address in brackets, perhaps with a zone (``[fe80::1%eth0]``). \Z, not $: no final newline.
_HOST = (
    r"(?:\[[0-9A-Fa-f:.]{2,45}(?:%[A-Za-z0-9_.-]{1,32})?\]"
    r"|[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,251}[A-Za-z0-9_])?\.?)"
)
DATA_ENDPOINT = rf"^tcp://{_HOST}:[0-9]{{1,5}}\Z"
SYNC_ENDPOINT = rf"^tcp://{_HOST}:[0-9]{{1,5}}(?:-[0-9]{{1,5}})?\Z"
_DATA = re.compile(DATA_ENDPOINT)
_SYNC = re.compile(SYNC_ENDPOINT)


def endpoint_problem(address: str, *, ports: bool = False) -> str | None:
    """Why ``address`` is no advertisable endpoint (None: it is); ``ports``: a range of
    ports is allowed (a sync address)."""
    if (_SYNC if ports else _DATA).match(address):
        return None
    form = "tcp://host:port or tcp://host:first-last" if ports else "tcp://host:port"
    return f"{address!r} is not {form}"


__all__ = ["DATA_ENDPOINT", "SYNC_ENDPOINT", "endpoint_problem"]
