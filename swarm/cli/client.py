"""LeaderClient: the typed HTTP client every CLI command goes through.

Each call decodes the leader's answer into its Struct (:mod:`silentswarm.types`), the same types
the leader encodes; an answer that does not decode is a :class:`LeaderResponseError` with
code ``LEADER_RESPONSE_INVALID`` that names the route and the field, not a traceback.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from silentswarm import __version__
from silentswarm.cli.render import terminal_safe
from silentswarm.errors import ErrorCode, LeaderResponseError, LeaderUnreachableError
from silentswarm.types.account_api import AccountCreated, AccountView, CreateAccount, WhoAmI
from silentswarm.types.api import Health, LeaderInfo
from silentswarm.types.datasets import DatasetRecord
from silentswarm.types.fleet import (
    FellowRecord,
    LogEntry,
    NodeView,
    PendingPurge,
    PurgeDelivery,
    ReleaseRequest,
    ReleaseResult,
    RetryPurgeRequest,
    UpdateRequest,
)
from silentswarm.types.jobs import CheckpointRecord, JobRecord, ServedJob, SignalRecord
from silentswarm.types.metrics import ClusterView, HistoryPoint, JobMetrics
from silentswarm.types.onboarding import CreateSession, JoinSession, JoinSessionCreated
from silentswarm.unknown_fields import decode_leniently

UPLOAD_CHUNK_BYTES = 1 << 20
# Calls that wait for fellows to answer signals (8 s per signal, retries included).
SIGNAL_TIMEOUT_S = 30.0

T = TypeVar("T")


class _ErrorBody(msgspec.Struct):
    """What the leader's error handlers answer (leader/api/error_handlers.py)."""

    code: str
    message: str = ""


class LeaderClient:
    def __init__(self, base_url: str, *, timeout: float = 10.0, token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)

    def __enter__(self) -> LeaderClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def health(self) -> Health:
        return self._call("GET", "/health", Health, ok_statuses=(200, 503))

    def info(self) -> LeaderInfo:
        return self._call("GET", "/api/v1/info", LeaderInfo)

    def cluster(self) -> ClusterView:
        return self._call("GET", "/api/v1/cluster", ClusterView)

    def fellows(self) -> list[FellowRecord]:
        return self._call("GET", "/api/v1/workers", list[FellowRecord])

    def fellow(self, fellow_id: str) -> FellowRecord:
        return self._call("GET", f"/api/v1/workers/{_id(fellow_id)}", FellowRecord)

    def nodes(self) -> list[NodeView]:
        return self._call("GET", "/api/v1/nodes", list[NodeView])

    def jobs(self, *, all: bool = False, owner: str | None = None) -> list[JobRecord]:
        """Every job; ``all``: archived ones too (a leader without archival ignores it);
        ``owner``: one account's only."""
        params = {"all": "true"} if all else {}
        if owner is not None:
            params["owner"] = owner
        return self._call("GET", "/api/v1/jobs", list[JobRecord], params=params)

    def job(self, job_id: str) -> ServedJob:
        return self._call("GET", f"/api/v1/jobs/{_id(job_id)}", ServedJob)

    def logs(self, fellow_id: str, *, limit: int) -> list[LogEntry]:
        path = f"/api/v1/workers/{_id(fellow_id)}/logs"
        return self._call("GET", path, list[LogEntry], params={"limit": limit})

    def metrics(self, job_id: str) -> JobMetrics:
        return self._call("GET", f"/api/v1/jobs/{_id(job_id)}/metrics", JobMetrics)

    def history(self, job_id: str) -> list[HistoryPoint]:
        return self._call("GET", f"/api/v1/jobs/{_id(job_id)}/metrics/history", list[HistoryPoint])

    def submit(self, spec_json: bytes) -> JobRecord:
        return self._call("POST", "/api/v1/jobs", JobRecord, content=spec_json, ok_statuses=(201,))

    def cancel(self, job_id: str) -> JobRecord:
        return self._call("DELETE", f"/api/v1/jobs/{_id(job_id)}", JobRecord)

    def checkpoint(self, job_id: str) -> CheckpointRecord:
        return self._call(
            "POST",
            f"/api/v1/jobs/{_id(job_id)}/checkpoint",
            CheckpointRecord,
            ok_statuses=(202,),
            timeout=SIGNAL_TIMEOUT_S,
        )

    def update(self, fellow_id: str | None) -> list[SignalRecord]:
        return self._call(
            "POST",
            "/api/v1/workers/update",
            list[SignalRecord],
            body=UpdateRequest(fellow_id=fellow_id),
            timeout=SIGNAL_TIMEOUT_S,
        )

    def release(self, fellow_id: str, *, purge_install: bool) -> ReleaseResult:
        return self._call(
            "POST",
            f"/api/v1/workers/{_id(fellow_id)}/release",
            ReleaseResult,
            body=ReleaseRequest(purge_install=purge_install),
            timeout=SIGNAL_TIMEOUT_S,
        )

    def create_join_session(self, fellow_name: str | None, ttl_s: float) -> JoinSessionCreated:
        return self._call(
            "POST",
            "/api/v1/bootstrap/join-sessions",
            JoinSessionCreated,
            body=CreateSession(fellow_name=fellow_name, ttl_s=ttl_s),
            ok_statuses=(201,),
        )

    def join_sessions(self) -> list[JoinSession]:
        return self._call("GET", "/api/v1/bootstrap/join-sessions", list[JoinSession])

    def upload_dataset(self, name: str, path: Path, *, timeout_s: float) -> DatasetRecord:
        """Stream the file at ``path`` to the leader as dataset ``name``."""
        size = path.stat().st_size

        def chunks() -> Iterator[bytes]:
            with open(path, "rb") as source:
                while chunk := source.read(UPLOAD_CHUNK_BYTES):
                    yield chunk

        return self._call(
            "PUT",
            f"/api/v1/datasets/{quote(name, safe='')}",
            DatasetRecord,
            ok_statuses=(201,),
            content=chunks(),
            headers={"content-length": str(size), "content-type": "application/octet-stream"},
            params={"source": path.name},
            timeout=httpx.Timeout(timeout_s, connect=10.0),
        )

    def datasets(self) -> list[DatasetRecord]:
        return self._call("GET", "/api/v1/datasets", list[DatasetRecord])

    def delete_dataset(self, name: str) -> DatasetRecord:
        return self._call("DELETE", f"/api/v1/datasets/{quote(name, safe='')}", DatasetRecord)

    def pending_purges(self) -> list[PendingPurge]:
        return self._call("GET", "/api/v1/purges", list[PendingPurge])

    def retry_purges(self, fellow_id: str | None) -> list[PurgeDelivery]:
        return self._call(
            "POST",
            "/api/v1/purges/retry",
            list[PurgeDelivery],
            body=RetryPurgeRequest(fellow_id=fellow_id),
            timeout=SIGNAL_TIMEOUT_S,
        )

    def whoami(self) -> WhoAmI:
        return self._call("GET", "/api/v1/auth/whoami", WhoAmI)

    def create_account(self, request: CreateAccount) -> AccountCreated:
        return self._call(
            "POST", "/api/v1/accounts", AccountCreated, ok_statuses=(201,), body=request
        )

    def accounts(self) -> list[AccountView]:
        return self._call("GET", "/api/v1/accounts", list[AccountView])

    def rotate_account(self, name: str) -> AccountCreated:
        return self._call("POST", f"/api/v1/accounts/{_id(name)}/rotate", AccountCreated)

    def revoke_account(self, name: str) -> AccountView:
        return self._call("POST", f"/api/v1/accounts/{_id(name)}/revoke", AccountView)

    def _call(
        self,
        method: str,
        path: str,
        answer: type[T],
        *,
        ok_statuses: tuple[int, ...] = (200,),
        body: msgspec.Struct | None = None,
        **kwargs: Any,  # httpx's request options, passed through
    ) -> T:
        if body is not None:
            kwargs["content"] = msgspec.json.encode(body)
            kwargs["headers"] = {"content-type": "application/json"}
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise LeaderUnreachableError(
                f"cannot reach the leader at {self.base_url} ({type(exc).__name__}: {exc}); "
                "is it running? (swarm start-cluster, or set SWARM_LEADER_URL / --leader-url)"
            ) from None
        if response.status_code in ok_statuses:
            return decode_answer(response.content, answer, f"{method} {path}")
        try:
            error = msgspec.json.decode(response.content, type=_ErrorBody)
        except msgspec.DecodeError:
            raise LeaderResponseError(
                f"leader answered {response.status_code} for {method} {path}",
                code=ErrorCode.HTTP_ERROR,
            ) from None
        raise LeaderResponseError(error.message, code=error.code)


def _id(value: str) -> str:
    """A fellow or job id as one path segment ("a/b" stays one id, which the leader refuses
    by name instead of answering 404 for a route it does not have)."""
    return quote(value, safe="")


def decode_answer(body: bytes | str, answer: type[T], what: str) -> T:
    """``body`` (JSON) as ``answer``; LeaderResponseError (``LEADER_RESPONSE_INVALID``) naming
    ``what`` and msgspec's reason (with the field's path) when it does not decode.

    A newer leader's answer may carry fields this version's strict types (a job's spec)
    refuse: they are left out, and said once on stderr (:func:`warn_newer_fields`); and
    values this version's enums lack (a job state it added): they are shown as sent, and
    said once too (:func:`warn_newer_values`)."""
    try:
        return msgspec.json.decode(body, type=answer)
    except msgspec.DecodeError:
        pass
    try:
        lenient = decode_leniently(body, answer)
    except msgspec.DecodeError as exc:  # what is wrong besides what it does not know
        raise LeaderResponseError(
            f"the leader's answer to {what} is not what this client expects: {exc} (a "
            f"leader of another version than this CLI's {__version__} may send what it does "
            "not know: swarm info shows both)",
            code=ErrorCode.LEADER_RESPONSE_INVALID,
        ) from None
    warn_newer_fields(lenient.dropped)
    warn_newer_values(lenient.newer_values)
    return lenient.value


_warned: set[str] = set()


def warn_newer_fields(paths: list[str]) -> None:
    """One line on stderr per field this CLI does not know (a list's items, a mapping's
    values, count once)."""
    new = _not_yet_said([_collapsed(p) for p in paths])
    if new:
        _warn(f"fields this CLI ({__version__}) does not know, left out: {', '.join(new)}")


def warn_newer_values(found: list[tuple[str, str]]) -> None:
    """One line on stderr per value of a field this CLI's enums lack (``state='PAUSED'``;
    a list's items, a mapping's values, count once), shown as sent."""
    new = _not_yet_said([f"{_collapsed(path)}={value!r}" for path, value in found])
    if new:
        _warn(f"values this CLI ({__version__}) does not know, shown as sent: {', '.join(new)}")


def _collapsed(path: str) -> str:
    """A field's path with a list's index or a mapping's key as ``[]``."""
    return re.sub(r"\[[^]]*\]", "[]", path).removeprefix("[].")


def _not_yet_said(said: list[str]) -> list[str]:
    new = [f for f in dict.fromkeys(said) if f not in _warned]
    _warned.update(new)
    return new


def _warn(what: str) -> None:
    """A warning about what the leader sent: its names are a stranger's text, made safe."""
    print(
        f"swarm: warning: the leader sent {terminal_safe(what)}; install the leader's "
        "version (swarm info shows it)",
        file=sys.stderr,
    )
