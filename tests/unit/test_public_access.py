"""Public access through one address: the NATS URL joining fellows get, what
``join-session create`` prints, and a fellow's trust in a private CA for the leader."""

from __future__ import annotations

import os
from pathlib import Path

import certifi
import pytest
from litestar.testing import TestClient

from silentswarm.agent.leadertrust import BUNDLE_NAME, trust_leader_ca
from silentswarm.cli.commands.onboarding import created_text
from silentswarm.errors import ConfigError
from silentswarm.leader.app import create_app
from silentswarm.leader.services.package import fellow_nats_url
from silentswarm.settings import Settings
from silentswarm.types.onboarding import JoinSessionCreated

OWN = "nats://127.0.0.1:4222"


@pytest.mark.parametrize(
    ("public_url", "public_nats_url", "expected"),
    [
        (None, None, OWN),
        (None, "tls://nats.example.org:4222", "tls://nats.example.org:4222"),
        ("https://swarm.example.org", None, "wss://swarm.example.org/nats"),
        ("https://swarm.example.org/", None, "wss://swarm.example.org/nats"),
        ("https://swarm.example.org:8443", None, "wss://swarm.example.org:8443/nats"),
        ("https://example.org/swarm/", None, "wss://example.org/swarm/nats"),
        ("https://swarm.example.org", "wss://other.example.org/ws", "wss://other.example.org/ws"),
        ("http://10.0.0.5:8080", None, OWN),  # plain HTTP: no TLS origin to share
    ],
)
def test_the_nats_url_a_joining_fellow_gets(public_url, public_nats_url, expected):
    settings = Settings(public_url=public_url, public_nats_url=public_nats_url)
    assert fellow_nats_url(settings, OWN) == expected


@pytest.mark.parametrize(
    ("env", "public"),
    [
        ({}, True),
        ({"SWARM_PUBLIC_URL": "https://swarm.example.org"}, False),  # on loopback, proxied
        ({"SWARM_PUBLIC_URL": "https://swarm.example.org", "SWARM_API_PUBLIC_READS": "1"}, True),
    ],
)
def test_reads_behind_a_public_url_need_the_token(env, public):
    assert Settings.from_env(env).reads_public is public


FORWARDED = {"x-forwarded-for": "203.0.113.7"}


@pytest.mark.parametrize(
    ("env", "headers", "status"),
    [
        ({}, {}, 200),  # on loopback: open to this machine
        ({}, FORWARDED, 401),  # ... not to a reverse proxy's clients
        ({}, {"forwarded": "for=203.0.113.7"}, 401),
        ({}, {"x-real-ip": "203.0.113.7"}, 401),
        # Behind a proxy without SWARM_PUBLIC_URL (only the NATS address set): still closed.
        ({"SWARM_PUBLIC_NATS_URL": "wss://swarm.example.org/nats"}, FORWARDED, 401),
        ({"SWARM_API_PUBLIC_READS": "1"}, FORWARDED, 200),  # asked for: open to all
        ({"SWARM_API_PUBLIC_READS": "0"}, {}, 401),
    ],
)
def test_reads_open_on_loopback_are_never_opened_through_a_proxy(tmp_path, env, headers, status):
    settings = Settings.from_env({**env, "SWARM_STATE_DIR": str(tmp_path)})
    client = TestClient(create_app(settings, nats="nats://127.0.0.1:1"))  # no lifespan
    answer = client.get("/api/v1/metrics", headers=headers)
    assert answer.status_code == status, answer.text


def session(leader_url: str, nats_url: str) -> JoinSessionCreated:
    return JoinSessionCreated(
        session_id="s1",
        fellow_name=None,
        status="created",
        created_at=0.0,
        expires_at=3600.0,
        token="t",
        command=f"curl -fsSL {leader_url}/api/v1/bootstrap/fellow.sh | sh",
        leader_url=leader_url,
        nats_url=nats_url,
    )


def test_join_session_create_prints_the_public_addresses_and_the_command():
    text = created_text(session("https://swarm.example.org", "wss://swarm.example.org/nats"), 60)
    lines = text.splitlines()
    assert lines[0] == "join session s1 (valid 60s, single use)"
    assert "leader at https://swarm.example.org and NATS at wss://swarm.example.org/nats" in text
    assert "loopback" not in text
    assert lines[-2:] == [
        "on the new host run:",
        "  curl -fsSL https://swarm.example.org/api/v1/bootstrap/fellow.sh | sh",
    ]


def test_join_session_create_says_when_only_this_machine_reaches_the_leader():
    text = created_text(session("http://127.0.0.1:8080", "nats://127.0.0.1:4222"), 60)
    assert "http://127.0.0.1:8080, nats://127.0.0.1:4222 is loopback" in text
    assert "SWARM_PUBLIC_URL" in text


@pytest.fixture
def cert_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No SSL_CERT_FILE in the test; as the test found it, afterwards (setenv first: a
    variable delenv finds absent would not be removed again at the end)."""
    monkeypatch.setenv("SSL_CERT_FILE", "")
    monkeypatch.delenv("SSL_CERT_FILE")


PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def test_a_fellow_trusts_the_leader_ca_besides_the_public_ones(tmp_path: Path, cert_env):
    ca = tmp_path / "ca.pem"
    ca.write_text(PEM)
    settings = Settings(leader_ca=ca, state_dir=tmp_path / "state")
    bundle = trust_leader_ca(settings)
    assert bundle == tmp_path / "state" / BUNDLE_NAME
    assert os.environ["SSL_CERT_FILE"] == str(bundle)
    text = bundle.read_text()
    assert text.startswith(Path(certifi.where()).read_text().rstrip()) and text.endswith(PEM)
    assert bundle.stat().st_mode & 0o077 == 0
    # Again (a re-executed agent): the CA once, not appended to its own bundle.
    trust_leader_ca(settings)
    assert bundle.read_text() == text


def test_without_the_setting_nothing_changes(tmp_path: Path, cert_env):
    assert trust_leader_ca(Settings(state_dir=tmp_path)) is None
    assert "SSL_CERT_FILE" not in os.environ


@pytest.mark.parametrize(("content", "why"), [(None, "cannot read it"), ("hello", "not a PEM")])
def test_a_bad_leader_ca_is_a_config_error_naming_the_setting(
    tmp_path: Path, cert_env, content, why
):
    ca = tmp_path / "ca.pem"
    if content is not None:
        ca.write_text(content)
    with pytest.raises(ConfigError, match=f"SWARM_LEADER_CA={ca}: {why}"):
        trust_leader_ca(Settings(leader_ca=ca, state_dir=tmp_path))
    assert "SSL_CERT_FILE" not in os.environ
