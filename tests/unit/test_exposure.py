"""Loopback or not: what opens reads by default and what the leader warns about (pure)."""

from __future__ import annotations

import pytest

from silentswarm.hosts import is_loopback
from silentswarm.leader.exposure import exposure_warnings
from silentswarm.settings import Settings


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("127.255.0.9", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.5", False),
        ("192.168.1.10", False),
        ("leader.example.org", False),
        ("128.0.0.1", False),
    ],
)
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    ("env", "public"),
    [
        ({}, True),
        ({"SWARM_LEADER_HOST": "127.0.0.2"}, True),
        ({"SWARM_LEADER_HOST": "0.0.0.0"}, False),
        ({"SWARM_LEADER_HOST": "10.1.2.3"}, False),
        ({"SWARM_LEADER_HOST": "0.0.0.0", "SWARM_API_PUBLIC_READS": "1"}, True),
        ({"SWARM_API_PUBLIC_READS": "0"}, False),
    ],
)
def test_reads_are_public_by_default_only_on_loopback(env, public):
    assert Settings.from_env(env).reads_public is public


def warnings(url: str = "nats://127.0.0.1:4222", **env: str) -> str:
    return "\n".join(exposure_warnings(Settings.from_env(env), url))


def test_a_loopback_leader_and_nats_warn_of_nothing():
    assert warnings() == ""
    assert (
        warnings("tls://nats.example.org:4222", SWARM_NATS_URL="tls://nats.example.org:4222") == ""
    )


def test_http_off_loopback_says_tls_is_the_way():
    text = warnings(SWARM_LEADER_HOST="0.0.0.0")
    assert "WITHOUT TLS" in text and "TLS-terminating proxy" in text and "security.md" in text


@pytest.mark.parametrize(
    ("url", "env", "named"),
    [
        ("nats://10.0.0.2:4222", {"SWARM_NATS_URL": "nats://10.0.0.2:4222"}, "SWARM_NATS_URL"),
        ("nats://127.0.0.1:1,nats://10.0.0.3:1", {"SWARM_NATS_URL": "x"}, "10.0.0.3"),
        ("ws://nats.example.org:80", {"SWARM_NATS_URL": "x"}, "ws://"),
        ("nats://127.0.0.1:4222", {"SWARM_PUBLIC_NATS_URL": "nats://203.0.113.7:4222"}, "PUBLIC"),
        ("nats://127.0.0.1:4222", {"SWARM_NATS_HOST": "0.0.0.0"}, "SWARM_NATS_HOST=0.0.0.0"),
    ],
)
def test_nats_off_loopback_without_tls_says_tls_is_the_way(url, env, named):
    text = warnings(url, **env)
    assert "NATS is reached off loopback WITHOUT TLS" in text and named in text
    assert "tls://" in text
