"""What the leader exposes beyond this machine without TLS: the loud warnings at start."""

from __future__ import annotations

from silentswarm.hosts import is_loopback, url_hosts
from silentswarm.settings import Settings

SECURITY_DOC = "docs/operations/security.md"
PLAIN_NATS = frozenset({"nats", "ws"})


def exposure_warnings(settings: Settings, nats_url: str) -> list[str]:
    """One line per way in that crosses the network in clear text (pure).

    HTTP: uvicorn here serves plain HTTP, so listening off loopback sends the operator token,
    join tokens and NATS credentials in clear. NATS: a ``nats://`` or ``ws://`` server off
    loopback (the one the leader joins, the one fellows are told, or the child the leader
    starts on a non-loopback address)."""
    out = []
    if not is_loopback(settings.leader_host):
        out.append(
            f"HTTP listens on {settings.leader_host}:{settings.leader_port} WITHOUT TLS: "
            "the operator token, join tokens and the NATS credentials handed to joining "
            "fellows cross the network in clear. Put a TLS-terminating proxy in front (and "
            "SWARM_PUBLIC_URL=https://...) and keep this port off the network, or bind "
            f"SWARM_LEADER_HOST=127.0.0.1 (see {SECURITY_DOC})"
        )
    urls = [("SWARM_NATS_URL", nats_url)]
    if settings.public_nats_url:
        urls.append(("SWARM_PUBLIC_NATS_URL", settings.public_nats_url))
    plain = [
        f"{name}={url}"
        for name, url in urls
        if any(s in PLAIN_NATS and not is_loopback(h) for s, h in url_hosts(url))
    ]
    if settings.nats_url is None and not is_loopback(settings.nats_host):
        plain.append(f"the child nats-server on SWARM_NATS_HOST={settings.nats_host}")
    if plain:
        out.append(
            f"NATS is reached off loopback WITHOUT TLS ({', '.join(plain)}): every signal, "
            "log and relayed tensor crosses the network in clear. Give nats-server a TLS "
            "certificate and use tls:// URLs (SWARM_NATS_TLS_CA; see the NATS TLS section of "
            f"{SECURITY_DOC})"
        )
    return out
