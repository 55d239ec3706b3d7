"""Fleet enrollment: a fellow that has the fleet's enrollment token but no NATS user yet asks
the leader for its own (once; it keeps the file, mode 0600).

For fleets where every machine gets the same configuration (a Nomad system job, one
``/etc/silentswarm/fellow.env`` for many hosts), so nobody mints users by hand.
"""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import msgspec

from silentswarm.errors import ConfigError
from silentswarm.natsauth import write_private
from silentswarm.retrying import Backoff, WarnOnNewReason
from silentswarm.settings import Settings
from silentswarm.types.onboarding import Enroll, Enrollment

log = logging.getLogger(__name__)
# Answers worth waiting out: the leader is starting, or this fellow's previous instance has
# not gone offline yet (FELLOW_ID_IN_USE).
RETRY_STATUSES = {409, 429, 500, 502, 503, 504}
# Asked again until it answers, after 0.5 s doubling up to 10 s, with up to 1 s of jitter (a
# fleet's fellows all start together).
RETRIES = Backoff(wait_initial=0.5, wait_max=10.0, wait_jitter=1.0)


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
    worth_retrying = WarnOnNewReason(
        log, "%s; retrying", should_retry, lambda exc: why_not_yet(exc, url)
    )
    try:
        for attempt in RETRIES.context(on=worth_retrying):
            with attempt:
                response = httpx.post(url, content=body, headers=headers, timeout=10)
                response.raise_for_status()
    except httpx.HTTPStatusError as exc:
        message = _message(exc.response)
        raise ConfigError(f"the leader refused to enroll {fellow_id!r}: {message}") from None
    return _save(path, _enrollment(response, url).nats_creds, fellow_id)


def should_retry(exc: Exception) -> bool:
    """A leader that cannot be reached, or answers one of RETRY_STATUSES, is asked again;
    any other answer (a 4xx: wrong token, enrollment off) is final."""
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code in RETRY_STATUSES
    return isinstance(exc, httpx.HTTPError)


def why_not_yet(exc: Exception, url: str) -> str:
    """A retried failure in words (warned once per new one)."""
    if isinstance(exc, httpx.HTTPStatusError):
        code = exc.response.status_code
        return f"enrollment not possible yet ({code}: {_message(exc.response)})"
    return f"cannot reach the leader at {url} ({type(exc).__name__})"


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
