"""Is an address loopback? What the leader's defaults (public reads) and warnings (no TLS
off loopback) turn on; and which host a fellow's ``tcp://host:port`` address names, and
whether another machine could reach it (the leader's link probes)."""

from __future__ import annotations

import ipaddress
import re
import socket
from urllib.parse import urlsplit

LOOPBACK_NAMES = frozenset(
    {
        "localhost",
        "localhost.localdomain",
        "ip6-localhost",
        "ip6-loopback",
        "localhost6",
        "localhost6.localdomain6",
    }
)
# What inet_aton reads as an IPv4 address besides the dotted quad: 127.1, 2130706433, 0x7f...
_IPV4_SHORTHAND = re.compile(r"(0x[0-9a-f]+|[0-9]+)(\.(0x[0-9a-f]+|[0-9]+)){0,3}")


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


def endpoint_host(address: str | None) -> str | None:
    """The host of a ``tcp://host:port`` address, lower case (None for none)."""
    if not address or not address.startswith("tcp://"):
        return None
    host, _, _ = address[len("tcp://") :].rpartition(":")
    return host.lower() or None


def routable_endpoint(address: str | None) -> bool:
    """Whether another machine could reach ``address``: not loopback, link-local or
    unspecified, in any of the forms a resolver takes (``localhost.``, ``127.1``,
    ``0x7f000001``, ``[::ffff:127.0.0.1]``); a stranger that advertises one has its peers
    connect to their own machine."""
    host = endpoint_host(address)
    if host is None:
        return False
    host = host.rstrip(".")
    if not host or is_loopback(host) or host.endswith(".localhost"):
        return False
    ip = _ip_of(host.strip("[]").partition("%")[0])
    if ip is None:
        return True  # a name
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified)


def _ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an address, the shorthand IPv4 forms ``inet_aton`` takes included (None:
    a name)."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if not _IPV4_SHORTHAND.fullmatch(host):
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


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
