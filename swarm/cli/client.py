"""LeaderClient: the typed HTTP client every CLI command goes through."""

from __future__ import annotations

from typing import Any

import httpx

from swarm.errors import ErrorCode, LeaderResponseError, LeaderUnreachableError

# Calls that wait for fellows to answer signals (8 s per signal, retries included).
SIGNAL_TIMEOUT_S = 30.0


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

    def health(self) -> dict[str, Any]:
        return self._get("/health", ok_statuses=(200, 503))

    def info(self) -> dict[str, Any]:
        return self._get("/api/v1/info")

    def workers(self) -> list[dict[str, Any]]:
        return self._get("/api/v1/workers")

    def worker(self, fellow_id: str) -> dict[str, Any]:
        return self._get(f"/api/v1/workers/{fellow_id}")

    def nodes(self) -> list[dict[str, Any]]:
        return self._get("/api/v1/nodes")

    def jobs(self) -> list[dict[str, Any]]:
        return self._get("/api/v1/jobs")

    def job(self, job_id: str) -> dict[str, Any]:
        return self._get(f"/api/v1/jobs/{job_id}")

    def logs(self, fellow_id: str, *, limit: int) -> list[dict[str, Any]]:
        return self._call("GET", f"/api/v1/workers/{fellow_id}/logs", params={"limit": limit})

    def history(self, job_id: str) -> list[dict[str, Any]]:
        return self._get(f"/api/v1/jobs/{job_id}/metrics/history")

    def submit(self, spec_json: bytes) -> dict[str, Any]:
        return self._call("POST", "/api/v1/jobs", content=spec_json, ok_statuses=(201,))

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/api/v1/jobs/{job_id}")

    def checkpoint(self, job_id: str) -> dict[str, Any]:
        return self._call(
            "POST",
            f"/api/v1/jobs/{job_id}/checkpoint",
            ok_statuses=(202,),
            timeout=SIGNAL_TIMEOUT_S,
        )

    def update(self, fellow_id: str | None) -> list[dict[str, Any]]:
        return self._call(
            "POST",
            "/api/v1/workers/update",
            json={"fellow_id": fellow_id},
            timeout=SIGNAL_TIMEOUT_S,
        )

    def release(self, fellow_id: str, *, purge_install: bool) -> dict[str, Any]:
        return self._call(
            "POST",
            f"/api/v1/workers/{fellow_id}/release",
            json={"purge_install": purge_install},
            timeout=SIGNAL_TIMEOUT_S,
        )

    def create_join_session(self, fellow_name: str | None, ttl_s: float) -> dict[str, Any]:
        return self._call(
            "POST",
            "/api/v1/bootstrap/join-sessions",
            json={"fellow_name": fellow_name, "ttl_s": ttl_s},
            ok_statuses=(201,),
        )

    def join_sessions(self) -> list[dict[str, Any]]:
        return self._get("/api/v1/bootstrap/join-sessions")

    def pending_purges(self) -> list[dict[str, Any]]:
        return self._get("/api/v1/purges")

    def retry_purges(self, fellow_id: str | None) -> list[dict[str, Any]]:
        return self._call(
            "POST", "/api/v1/purges/retry", json={"fellow_id": fellow_id}, timeout=SIGNAL_TIMEOUT_S
        )

    def _get(self, path: str, *, ok_statuses: tuple[int, ...] = (200,)) -> Any:
        return self._call("GET", path, ok_statuses=ok_statuses)

    def _call(
        self, method: str, path: str, *, ok_statuses: tuple[int, ...] = (200,), **kwargs: Any
    ) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise LeaderUnreachableError(
                f"cannot reach the leader at {self.base_url} ({type(exc).__name__}: {exc}); "
                "is it running? (swarm start-cluster, or set SWARM_LEADER_URL / --leader-url)"
            ) from None
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code in ok_statuses:
            return body
        if isinstance(body, dict) and "code" in body:
            raise LeaderResponseError(str(body.get("message", "")), code=str(body["code"]))
        raise LeaderResponseError(
            f"leader answered {response.status_code} for {method} {path}",
            code=ErrorCode.HTTP_ERROR,
        )
