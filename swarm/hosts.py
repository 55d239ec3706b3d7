"""Is an address loopback? What the leader's defaults (public reads) and warnings (no TLS
off loopback) turn on."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and ``localhost``; anything else (0.0.0.0, a name, an interface's
    address) reaches, or may reach, beyond this machine."""
    host = host.strip().strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_hosts(url: str) -> list[tuple[str, str]]:
    """(scheme, host) of each server in a URL or a comma-separated list of them."""
    out = []
    for part in url.split(","):
        part = part.strip()
        if not part:
            continue
        split = urlsplit(part if "://" in part else f"nats://{part}")
        out.append((split.scheme.lower(), split.hostname or ""))
    return out
