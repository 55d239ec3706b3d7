"""A CLI older than its leader: the real CLI against a real leader whose answers carry what a
newer version added to a job's spec (a proxy between them adds it to each record, as a
newer leader would write it, and gives the leader a newer version). The CLI shows what it
knows and says once what it left out; ``swarm info`` says the versions differ; an answer
wrong in a field it does know is still an error naming that field."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from silentswarm import __version__
from tests.helpers import Leader, swarm_cli

Rewrite = Callable[[dict[str, Any]], None]
NEWER = "99.0.0"


def newer_spec(record: dict[str, Any]) -> None:
    """What a newer leader's spec might carry: a field at the top, in the model, and in a
    struct inside the spec."""
    spec = record["spec"]
    spec["zero_bubble"] = True
    spec["model"]["rope_scaling"] = {"factor": 2.0}
    spec["artifact_paths"]["mirror"] = "s3://bucket/runs"


def steps_as_words(record: dict[str, Any]) -> None:
    record["spec"]["steps"] = "many"


def job_records(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, list):
        for item in value:
            yield from job_records(item)
    elif isinstance(value, dict) and isinstance(value.get("spec"), dict) and "job_id" in value:
        yield value


class RewritingProxy:
    """Forwards each request to ``upstream`` and hands every job record in a JSON answer to
    ``rewrite`` before passing the answer on."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.rewrite: Rewrite = newer_spec
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                proxy.forward(self)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def forward(self, handler: BaseHTTPRequestHandler) -> None:
        headers = {k: v for k, v in handler.headers.items() if k.lower() in ("authorization",)}
        answer = httpx.get(self.upstream + handler.path, headers=headers, timeout=10)
        body = answer.content
        if answer.headers.get("content-type", "").startswith("application/json"):
            value = answer.json()
            for record in job_records(value):
                self.rewrite(record)
            if handler.path == "/api/v1/info":
                value["version"] = NEWER
            body = json.dumps(value).encode()
        handler.send_response(answer.status_code)
        handler.send_header("content-type", answer.headers.get("content-type", "text/plain"))
        handler.send_header("content-length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def newer_leader(leader: Leader) -> Iterator[tuple[Leader, RewritingProxy]]:
    proxy = RewritingProxy(leader.url)
    proxied = Leader(proxy.url, token=leader.token)
    try:
        yield proxied, proxy
    finally:
        proxied.http.close()
        proxy.close()


WARNING = "swarm: warning: the leader sent fields this CLI"
LEFT_OUT = ("zero_bubble", "model.rope_scaling", "artifact_paths.mirror")


def test_an_older_cli_shows_a_newer_leaders_jobs_and_says_once_what_it_left_out(
    leader, newer_leader
):
    proxied, proxy = newer_leader
    # No fellow: the jobs stay PENDING, records with their specs.
    first = leader.submit(name="skew-a", steps=5, stages=1)["job_id"]
    second = leader.submit(name="skew-b", steps=5, stages=1)["job_id"]

    direct = swarm_cli(leader, "jobs", timeout=30)
    assert direct.returncode == 0 and WARNING not in direct.stderr, direct.stderr
    same = swarm_cli(leader, "info", timeout=30)
    assert same.returncode == 0 and f"cli       version {__version__}\n" in same.stdout
    info = swarm_cli(proxied, "info", timeout=30)
    assert info.returncode == 0, info.stdout + info.stderr
    assert f"(version {NEWER})" in info.stdout
    assert f"cli       version {__version__} (not the leader's: install {NEWER}" in info.stdout

    listed = swarm_cli(proxied, "jobs", timeout=30)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert first in listed.stdout and second in listed.stdout and "PENDING" in listed.stdout
    warnings = [line for line in listed.stderr.splitlines() if line.startswith(WARNING)]
    assert len(warnings) == 1, listed.stderr  # two records, one line
    assert all(f"spec.{name}" in warnings[0] for name in LEFT_OUT), warnings[0]
    assert "Traceback" not in listed.stderr

    shown = swarm_cli(proxied, "--json", "job", first, timeout=30)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    record = json.loads(shown.stdout)  # stdout stays JSON: the warning is on stderr
    assert record["job_id"] == first and record["spec"]["name"] == "skew-a"
    assert "zero_bubble" not in record["spec"]
    assert WARNING in shown.stderr

    # What it does know must still be right: a wrong known field is an error naming it.
    proxy.rewrite = steps_as_words
    wrong = swarm_cli(proxied, "job", first, timeout=30)
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert "not what this client expects" in wrong.stderr and "$.spec.steps" in wrong.stderr
    assert "Traceback" not in wrong.stderr


def suspended(record: dict[str, Any]) -> None:
    """A state a newer leader might add, and a transport."""
    record["state"] = "SUSPENDED"
    record["spec"]["transport"] = "quic"


def test_an_older_cli_shows_states_a_newer_leader_added_as_sent(leader, newer_leader):
    proxied, proxy = newer_leader
    job = leader.submit(name="skew-c", steps=5, stages=1)["job_id"]
    proxy.rewrite = suspended
    listed = swarm_cli(proxied, "jobs", timeout=30)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    row = next(line for line in listed.stdout.splitlines() if job in line)
    assert "SUSPENDED" in row, listed.stdout
    said = [line for line in listed.stderr.splitlines() if "values this CLI" in line]
    assert len(said) == 1 and "state='SUSPENDED'" in said[0], listed.stderr
    shown = swarm_cli(proxied, "--json", "job", job, timeout=30)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    record = json.loads(shown.stdout)
    assert record["state"] == "SUSPENDED" and record["spec"]["transport"] == "quic"
    assert "Traceback" not in listed.stderr + shown.stderr
