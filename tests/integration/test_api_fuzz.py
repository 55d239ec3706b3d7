"""Hostile REST input: schemathesis generates requests from the leader's own OpenAPI schema
(valid and invalid, bounded examples per operation, the text/event-stream routes left
out) against a real
leader. No request may cause a 5xx, and every error is a JSON body with a code and a
message."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.conftest import NatsControl, leader_process
from tests.helpers import Leader, Processes

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def fuzzed_leader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Leader]:
    """One leader for every generated request (one per operation would take minutes)."""
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "proc-logs").mkdir()
    procs = Processes(tmp / "proc-logs")
    nats = NatsControl(tmp)
    started = leader_process(procs, nats, tmp)
    try:
        yield next(started)
    finally:
        started.close()
        procs.cleanup()
        nats.stop()


def test_no_request_fails_the_leader_and_every_error_says_what(fuzzed_leader: Leader):
    schema = schemathesis.openapi.from_url(f"{fuzzed_leader.url}/schema/openapi.json")
    auth = {"authorization": f"Bearer {fuzzed_leader.token}"}
    operations = [
        result.ok()
        for result in schema.get_all_operations()
        if not result.ok().path.endswith("/stream")  # text/event-stream: they never end
    ]
    assert len(operations) >= 25
    failures: dict[str, str] = {}
    statuses: dict[str, set[int]] = {}
    for operation, mode in itertools.product(operations, GenerationMode):

        @settings(
            max_examples=12,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(mode))
        def probe(case) -> None:
            response = case.call(headers=auth)
            statuses.setdefault(f"{case.method} {case.path}", set()).add(response.status_code)
            text = response.content[:300].decode(errors="replace")
            where = f"{case.formatted_path} -> {response.status_code}: {text}"
            assert response.status_code < 500, where
            if response.status_code >= 400:
                body = response.json()
                assert isinstance(body, dict) and body.get("code") and body.get("message"), where

        try:
            probe()
        except Unsatisfiable:  # no invalid form exists (no parameters, no body)
            assert mode is GenerationMode.NEGATIVE
        except AssertionError as exc:
            failures[f"{operation.method.upper()} {operation.path} ({mode.value})"] = str(exc)[:500]
    assert failures == {}
    # It really exercised the API: every operation answered, and most with more than one
    # kind of answer (the generated junk meets validation).
    assert len(statuses) == len(operations)
    print({label: sorted(codes) for label, codes in statuses.items()})
