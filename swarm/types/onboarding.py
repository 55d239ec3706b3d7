"""Remote onboarding over REST: join sessions, the installer's claim and log lines, fleet
enrollment and the bootstrap manifest. The leader's :mod:`silentswarm.leader.bootstrap` and
:mod:`silentswarm.leader.services` own the logic; ``fellow.sh``, the agent's enrollment and the CLI
read these bodies."""

from __future__ import annotations

import msgspec


class JoinSession(msgspec.Struct, kw_only=True):
    session_id: str
    fellow_name: str | None
    status: str  # created | installing | registered | failed
    created_at: float
    expires_at: float
    claimed_at: float | None = None
    registered_at: float | None = None
    reason: str = ""
    log_lines: int = 0  # lines the installer sent (the newest LOG_LINES are kept)


class JoinSessionRecord(msgspec.Struct, kw_only=True):
    """A join session as the leader's store keeps it (KV bucket ``joins``), so a session
    outlives a leader restart: its token and installer secret as SHA-256 hashes only (hex),
    never themselves; the install log's newest lines, as many as fit in
    ``leader.bootstrap.STORED_LOG_BYTES`` (already redacted when they came)."""

    session: JoinSession
    token_sha256: str
    secret_sha256: str | None = None
    lines: list[SessionLogLine] = []


class JoinSessionCreated(JoinSession, kw_only=True):
    """A new session with its single-use token and the command the remote host runs; the
    only answer that ever shows the token."""

    token: str
    command: str
    # What the new host will reach: the leader (SWARM_PUBLIC_URL, else the request's URL) and
    # NATS (see leader.services.package.fellow_nats_url).
    leader_url: str = ""
    nats_url: str = ""


class SessionLogLine(msgspec.Struct):
    seq: int
    ts: float
    line: str


class CreateSession(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    fellow_name: str | None = None
    ttl_s: float = 3600.0


class Claim(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    token: str
    fellow_name: str | None = None  # the host's proposal; the operator's name wins


class JoinClaim(msgspec.Struct, kw_only=True):
    """What a claimed session gives the installer: its session secret (for the log), the
    settled fellow name, where NATS is, the fellow's own NATS user (None in dev mode) and the
    package it must install."""

    session_id: str
    secret: str
    fellow_name: str
    leader_url: str | None
    nats_url: str
    nats_creds: str | None
    package_file: str
    package_sha256: str


class Enroll(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    fellow_name: str


class Enrollment(msgspec.Struct, kw_only=True):
    """A fleet fellow's NATS user (None in dev mode) and where NATS is."""

    fellow_name: str
    nats_url: str
    nats_creds: str | None


class LogLines(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    lines: list[str]
    failed: bool = False


class LogLinesTaken(msgspec.Struct, kw_only=True):
    lines: int  # how many lines the session's log has taken: its last line's number


class PackageInfo(msgspec.Struct, kw_only=True):
    file: str
    sha256: str
    size: int
    url: str


class BootstrapManifest(msgspec.Struct, kw_only=True):
    """What a joining host installs: ``GET /api/v1/bootstrap/manifest``."""

    leader_version: str
    leader_url: str
    package: PackageInfo
    nats_urls: list[str]
    transport_default: str
    min_python: str
