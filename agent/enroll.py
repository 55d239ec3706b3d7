"""Fleet enrollment: a fellow that has the fleet's enrollment token but no NATS user yet asks
the leader for its own (once; it keeps the file, mode 0600).

For fleets where every machine gets the same configuration (a Nomad system job, one
``/etc/silentswarm/fellow.env`` for many hosts), so nobody mints users by hand.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import httpx
import msgspec

from silentswarm.errors import ConfigError
from silentswarm.natsauth import write_private
from silentswarm.settings import Settings
from silentswarm.types.onboarding import Enroll, Enrollment

log = logging.getLogger(__name__)
RETRY_MAX_S = 10.0
# Answers worth waiting out: the leader is starting, or this fellow's previous instance has
# not gone offline yet (FELLOW_ID_IN_USE).
RETRY_STATUSES = {409, 429, 500, 502, 503, 504}


def creds_path(settings: Settings) -> Path:
    return settings.nats_creds or settings.state_dir / "nats.creds"


def enroll(settings: Settings, fellow_id: str) -> Path | None:
    """This fellow's credentials file, asking the leader for it when it does not exist yet.
    None when the leader runs without NATS authentication (dev mode). Retries while the
    leader is unreachable or busy; a refusal (wrong token, enrollment off) is a ConfigError."""
    path = creds_path(settings)
    if path.exists():
        return path
    if not settings.leader_url:
        raise ConfigError("SWARM_ENROLL_TOKEN needs SWARM_LEADER_URL (where to enroll)")
    url = f"{settings.leader_url.rstrip('/')}/api/v1/bootstrap/enroll"
    headers = {
        "authorization": f"Bearer {settings.enroll_token}",
        "content-type": "application/json",
    }
    body = msgspec.json.encode(Enroll(fellow_name=fellow_id))
    delay, reported = 0.5, ""
    while True:
        try:
            response = httpx.post(url, content=body, headers=headers, timeout=10)
        except httpx.HTTPError as exc:
            reason = f"cannot reach the leader at {url} ({type(exc).__name__})"
        else:
            if response.status_code == 200:
                return _save(path, _enrollment(response, url).nats_creds, fellow_id)
            message = _message(response)
            if response.status_code not in RETRY_STATUSES:
                raise ConfigError(f"the leader refused to enroll {fellow_id!r}: {message}")
            reason = f"enrollment not possible yet ({response.status_code}: {message})"
        if reason != reported:
            log.warning("%s; retrying", reason)
            reported = reason
        time.sleep(delay)
        delay = min(RETRY_MAX_S, delay * 2)


def _enrollment(response: httpx.Response, url: str) -> Enrollment:
    try:
        return msgspec.json.decode(response.content, type=Enrollment)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{url} answered what is not an enrollment: {exc}") from None


def _save(path: Path, creds: str | None, fellow_id: str) -> Path | None:
    if not creds:
        log.warning("the leader runs without NATS authentication (dev mode): no user needed")
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, creds)
    log.info("enrolled as %s: NATS user kept in %s", fellow_id, path)
    return path


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json().get("message", response.text))
    except ValueError:
        return response.text[:300]
