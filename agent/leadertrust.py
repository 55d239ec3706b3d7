"""A private CA for the leader's HTTPS (SWARM_LEADER_CA), trusted by the whole fellow.

A fellow reaches the leader over HTTPS from several places (enrollment, dataset and shard
downloads, UPDATE's package: httpx and urllib) and NATS over ``wss://`` (aiohttp, through the
default SSL context), and so do its stage processes. All of them honour ``SSL_CERT_FILE``, so
the agent writes one bundle, the public CAs (certifi's, or an ``SSL_CERT_FILE`` the operator
set) plus the leader's, and points ``SSL_CERT_FILE`` at it for itself and its children: one
place instead of a CA threaded through every call, and the public CAs stay trusted (pip, model
downloads).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import certifi

from silentswarm.errors import ConfigError
from silentswarm.natsauth import write_private
from silentswarm.settings import Settings, env_name

log = logging.getLogger(__name__)
BUNDLE_NAME = "leader-trust.pem"
PEM_CERTIFICATE = "-----BEGIN CERTIFICATE-----"


def trust_leader_ca(settings: Settings) -> Path | None:
    """Trust SWARM_LEADER_CA in this process and its children; the bundle written (None
    without the setting). ConfigError naming the setting for a missing or non-PEM file."""
    ca = settings.leader_ca
    if ca is None:
        return None
    setting = f"{env_name('leader_ca')}={ca}"
    try:
        extra = ca.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{setting}: cannot read it ({exc})") from None
    if PEM_CERTIFICATE not in extra:
        raise ConfigError(f"{setting}: not a PEM certificate")
    bundle = settings.state_dir / BUNDLE_NAME
    base = Path(os.environ.get("SSL_CERT_FILE") or certifi.where())
    if base.resolve() == bundle.resolve():  # a re-executed agent (UPDATE): written already
        base = Path(certifi.where())
    bundle.parent.mkdir(parents=True, exist_ok=True)
    write_private(bundle, f"{base.read_text().rstrip()}\n{extra.strip()}\n")
    os.environ["SSL_CERT_FILE"] = str(bundle)
    log.info("trusting the leader's CA %s (bundle %s)", ca, bundle)
    return bundle
