"""Test plumbing: real processes that never outlive a test, and waiting on conditions."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "exp" / "bench"


def bench_module(name: str) -> Any:
    """A module of ``exp/bench``, imported the way the benchmarks import each other (by bare
    name, with ``exp/bench`` on ``sys.path``)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


@functools.cache
def shaped_paths_unavailable() -> str | None:
    """Why the link emulator cannot build a path here (None: it can); asked once per run."""
    return bench_module("linkemu").unavailable_reason()


def wait_for(predicate: Callable[[], T], *, timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy; fail loudly after ``timeout``.

    An AssertionError raised by the predicate fails at once (the awaited thing cannot happen).
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = predicate()
        except AssertionError:
            raise
        except Exception as exc:  # a not-yet-ready server answers with errors
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


async def until(
    predicate: Callable[[], T], *, timeout: float, what: str, interval: float = 0.02
) -> T:
    """:func:`wait_for` inside an event loop: poll ``predicate`` (a plain callable, checked
    between the loop's other work) and fail loudly after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (last := predicate()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
        await asyncio.sleep(interval)
    return last


@contextlib.contextmanager
def busy_port() -> Iterator[int]:
    """A loopback port with something listening on it, for the duration of the block."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def child_env(**overrides: str) -> dict[str, str]:
    # The test's own token cache and default state directory stay, and the suite's compile
    # cache and stage fork server setting (tests/conftest.py).
    kept = ("SWARM_DATA_CACHE", "SWARM_STATE_DIR", "SWARM_COMPILE_CACHE", "SWARM_STAGE_FORKSERVER")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_") or k in kept}
    env["PYTHONUNBUFFERED"] = "1"
    # Most tests run NATS without authentication; the auth tests (and start-cluster's)
    # pass SWARM_DEV="0" and real credentials.
    env["SWARM_DEV"] = "1"
    env.update(overrides)
    return env


def run_swarm(
    *args: str, env: dict[str, str] | None = None, timeout: float = 90.0
) -> subprocess.CompletedProcess[str]:
    """The ``swarm`` CLI as a user runs it, in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "silentswarm.cli.app", *args],
        env=env or child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def swarm_cli(
    leader: Leader, *args: str, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """The CLI pointed at ``leader``, sending its operator token."""
    env = child_env(SWARM_API_TOKEN=leader.token or "")
    return run_swarm("--leader-url", leader.url, *args, env=env, timeout=timeout)


class Processes:
    """Starts real processes and guarantees they (and their children) die with the test."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[subprocess.Popen[bytes]] = []
        self.logs: dict[int, Path] = {}

    def start(
        self, name: str, argv: list[str], env: dict[str, str], cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        log = self.log_dir / f"{name}-{len(self.started)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd or REPO
            )
        self.started.append(proc)
        self.logs[proc.pid] = log
        return proc

    def python(
        self, name: str, module: str, *args: str, env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        return self.start(name, [sys.executable, "-m", module, *args], env)

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        return self.logs[proc.pid].read_text(errors="replace")

    def cleanup(self) -> None:
        for proc in self.started:
            kill_tree(proc.pid)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def kill_tree(pid: int) -> None:
    try:
        parent = psutil.Process(pid)
        family = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for proc in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)


class Leader:
    """HTTP access to a running leader."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url
        self.token = token
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=url, timeout=5.0, headers=headers)

    def get(self, path: str) -> Any:
        response = self.http.get(path)
        response.raise_for_status()
        return response.json()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self.http.request(method, path, **kwargs)

    def submit(self, **spec: Any) -> dict[str, Any]:
        response = self.http.post("/api/v1/jobs", json=spec)
        assert response.status_code == 201, response.text
        return response.json()

    def job(self, job_id: str) -> dict[str, Any]:
        return self.get(f"/api/v1/jobs/{job_id}")

    def wait_job(
        self, job_id: str, *states: str, timeout: float = 60.0, what: str = ""
    ) -> dict[str, Any]:
        """Wait until the job is in one of ``states``; fail at once if it ends otherwise."""

        def check() -> dict[str, Any] | None:
            job = self.job(job_id)
            if job["state"] in states:
                return job
            if job["state"] in {"COMPLETED", "FAILED", "CANCELLED"}:
                raise AssertionError(f"job ended {job['state']}: {job['reason']}")
            return None

        return wait_for(
            check, timeout=timeout, what=what or f"job {job_id} to be {'/'.join(states)}"
        )

    def workers(self) -> dict[str, dict[str, Any]]:
        return {w["fellow_id"]: w for w in self.get("/api/v1/workers")}

    def status(self, fellow_id: str) -> str | None:
        worker = self.workers().get(fellow_id)
        return None if worker is None else worker["status"]

    def wait_status(self, fellow_id: str, status: str, timeout: float = 10.0) -> dict[str, Any]:
        return wait_for(
            lambda: (w := self.workers().get(fellow_id)) and w["status"] == status and w,
            timeout=timeout,
            what=f"{fellow_id} to be {status}",
        )

    def close(self) -> None:
        self.http.close()


def stage_processes(job_id: str | None = None) -> list[psutil.Process]:
    """Live stage runtimes (``silentswarm.agent.runtime.main``), of one job or of any."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if (
            proc.info["status"] == psutil.STATUS_ZOMBIE
            or "silentswarm.agent.runtime.main" not in cmdline
        ):
            continue
        if job_id is None or any(job_id in part for part in cmdline):
            found.append(proc)
    return found


def dropped_messages(http: httpx.Client, reason: str | None = None) -> float:
    """The leader's ``swarm_leader_dropped_messages_total`` from its metrics page: all of
    it, or only ``reason``'s."""
    text = http.get("/api/v1/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "swarm_leader_dropped_messages"
        for sample in family.samples
        if sample.name.endswith("_total")
        and (reason is None or sample.labels.get("reason") == reason)
    )


def fellow_gauges(http: httpx.Client, family: str) -> dict[str, float]:
    """A per-fellow gauge of the leader's metrics page, by fellow id."""
    text = http.get("/api/v1/metrics").text
    return {
        sample.labels["fellow"]: sample.value
        for found in text_string_to_metric_families(text)
        if found.name == family
        for sample in found.samples
    }
