"""The history streams fitted to the store, and the store's health: pure decisions."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from nats.js.errors import APIError, BadRequestError, ServerError, ServiceUnavailableError

from silentswarm.leader.services.info import health_body
from silentswarm.leader.storage import storage_reasons
from silentswarm.leader.store import StateStore
from silentswarm.leader.streams import (
    GIB,
    LOG_PER_SUBJECT,
    MIB,
    PROBE_STEP,
    PROGRESS_PER_SUBJECT,
    RECORD_OVERHEAD,
    SUBJECT_SHARE,
    StoreCapacity,
    StreamLimits,
    fit_limits,
    is_storage_error,
    limits_for,
    log_stream,
    progress_stream,
    settle,
)
from silentswarm.throttle import Throttle
from silentswarm.types.api import StreamUsage
from tests.fakes import Clock

PROGRESS, LOGS = progress_stream("swarm"), log_stream("swarm")
SPECS = [PROGRESS, LOGS]


def _round(n: float) -> int:
    n = int(n)
    return n - n % PROBE_STEP


@pytest.mark.parametrize(
    ("available", "progress_bytes", "logs_bytes", "too_small"),
    [
        # A 64 MiB tmpfs: nats-server's max_store is 48 MiB; 35% each.
        (48 * MIB, _round(0.35 * 48 * MIB), _round(0.35 * 48 * MIB), False),
        # An 8 MiB tmpfs (6 MiB): the streams exist but are too small to be useful.
        (6 * MIB, _round(0.35 * 6 * MIB), _round(0.35 * 6 * MIB), True),
        # Exactly the useful minimum.
        (_round(4 * MIB / 0.35) + PROBE_STEP, 4 * MIB, 4 * MIB, False),
        # A large disk: the ceilings (4 GiB of progress, 2 GiB of logs).
        (100 * GIB, 4 * GIB, 2 * GIB, False),
        (12 * GIB, 4 * GIB, 2 * GIB, False),
        # Nothing, or less than one record: cannot be created at all.
        (0, 0, 0, True),
        (64 * 1024, 0, 0, True),
        (-1, 0, 0, True),
    ],
)
def test_fit_limits_gives_each_stream_its_share_of_the_store(
    available, progress_bytes, logs_bytes, too_small
):
    progress, logs = fit_limits(available, SPECS)
    assert (progress.name, logs.name) == ("swarm_progress", "swarm_logs")
    assert (progress.max_bytes, logs.max_bytes) == (progress_bytes, logs_bytes)
    assert progress.too_small is logs.too_small is too_small
    total = progress.max_bytes + logs.max_bytes
    assert total <= 0.7 * max(available, 0), "the KV buckets keep 30% of the store"
    for limits in (progress, logs):
        assert limits.max_bytes % PROBE_STEP == 0


@pytest.mark.parametrize(
    ("available", "progress_per_subject", "logs_per_subject"),
    [
        (48 * MIB, 1008, 132),  # what a 64 MiB tmpfs gives (measured, tests/faults)
        (100 * GIB, PROGRESS_PER_SUBJECT, LOG_PER_SUBJECT),  # the defaults fit the ceilings
        (6 * MIB, 124, 16),
    ],
)
def test_one_subject_fills_at_most_a_quarter_of_its_stream(
    available, progress_per_subject, logs_per_subject
):
    progress, logs = fit_limits(available, SPECS)
    assert progress.max_msgs_per_subject == progress_per_subject
    assert logs.max_msgs_per_subject == logs_per_subject
    for limits, spec in ((progress, PROGRESS), (logs, LOGS)):
        worst = limits.max_msgs_per_subject * (spec.max_msg_size + RECORD_OVERHEAD)
        assert worst <= SUBJECT_SHARE * limits.max_bytes


def test_an_accounts_stream_limit_caps_every_stream():
    progress, logs = fit_limits(100 * GIB, SPECS, max_stream_bytes=8 * MIB)
    assert progress.max_bytes == logs.max_bytes == 8 * MIB
    assert fit_limits(100 * GIB, SPECS, max_stream_bytes=-1)[0].max_bytes == 4 * GIB


def test_limits_for_one_record_at_least():
    assert limits_for(LOGS, LOGS.max_msg_size + RECORD_OVERHEAD - 1) == StreamLimits(
        "swarm_logs", 0, 0, too_small=True
    )
    one = limits_for(LOGS, LOGS.max_msg_size + RECORD_OVERHEAD)
    assert one.max_bytes > 0 and one.max_msgs_per_subject == 1 and one.too_small


@pytest.mark.parametrize(
    ("target", "current", "kept"),
    [
        (17 * MIB, 17 * MIB + PROBE_STEP, True),  # the probe's jitter: no resize
        (17 * MIB, int(17 * MIB * 1.02), True),
        (17 * MIB, 18 * MIB, False),  # a real change of the store
        (17 * MIB, 0, False),  # no stream yet (or one without a limit)
        (0, 17 * MIB, False),  # nothing fits any more: say so
    ],
)
def test_settle_keeps_a_stream_whose_size_barely_changed(target, current, kept):
    limits = limits_for(PROGRESS, target)
    settled = settle(limits, PROGRESS, current)
    assert settled == (limits_for(PROGRESS, current) if kept else limits)


@pytest.mark.parametrize(
    ("error", "storage"),
    [
        (
            ServerError(
                code=500, err_code=10047, description="insufficient storage resources available"
            ),
            True,
        ),
        (
            ServiceUnavailableError(code=503, err_code=10023, description="insufficient resources"),
            True,
        ),
        (
            BadRequestError(
                code=400, err_code=10002, description="resource limits exceeded for account"
            ),
            True,
        ),
        (APIError(code=503, description="maximum bytes exceeded"), True),
        (
            BadRequestError(code=400, err_code=10058, description="stream name already in use"),
            False,
        ),
        (APIError(code=408, description="request timeout"), False),
        (TimeoutError(), False),
        (OSError("insufficient storage"), False),  # not JetStream's word
    ],
)
def test_is_storage_error(error, storage):
    assert is_storage_error(error) is storage


def usage(name="swarm_progress", max_bytes=17 * MIB, min_bytes=4 * MIB) -> StreamUsage:
    return StreamUsage(name, max_bytes, 0, 1000, min_bytes)


CAPACITY = StoreCapacity(free_bytes=14 * MIB, reserved_bytes=34 * MIB)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, []),
        # Starting: the streams are not there yet, nothing failed.
        ({"usage": [usage(max_bytes=0)]}, []),
        (
            {"usage": [usage(max_bytes=0)], "create_error": "insufficient resources (10023)"},
            ["history streams (swarm_progress) could not be created: insufficient resources"],
        ),
        # Created meanwhile: the old failure no longer matters.
        ({"create_error": "insufficient resources (10023)"}, []),
        ({"usage": [usage(max_bytes=2 * MIB)]}, ["too small: the stream swarm_progress gets 2.0"]),
        ({"usage": [usage(max_bytes=-1)]}, []),  # made by an older leader: no limit, no reason
        ({"used_bytes": 44 * MIB}, ["store is full: 44.0 MiB used of 48.0 MiB (92%)"]),
        ({"used_bytes": 43 * MIB}, []),
        # A store larger than the probe went: never "full" by a lower bound.
        ({"used_bytes": 44 * MIB, "capacity": StoreCapacity(48 * MIB, 0, at_least=True)}, []),
        ({"used_bytes": 44 * MIB, "capacity": None}, []),
        ({"write_error": "insufficient resources (10023)"}, ["cannot save its state"]),
        ({"check_error": "insufficient resources (10023)"}, ["JetStream refuses the leader"]),
        (
            {"usage": [usage(max_bytes=2 * MIB)], "write_error": "x", "used_bytes": 47 * MIB},
            ["too small", "store is full", "cannot save its state"],
        ),
    ],
)
def test_storage_reasons(kwargs, expected):
    arguments = {
        "usage": [usage()],
        "used_bytes": 1 * MIB,
        "capacity": CAPACITY,
        "create_error": None,
        "write_error": None,
        "check_error": None,
        **kwargs,
    }
    reasons = storage_reasons(**arguments)
    assert len(reasons) == len(expected), reasons
    for reason, words in zip(reasons, expected, strict=True):
        assert words in reason


@pytest.mark.parametrize(
    ("connected", "storage", "status", "reasons"),
    [
        (True, [], 200, None),
        (False, [], 503, ["the leader is not connected to NATS"]),
        (True, ["the JetStream store is full"], 503, ["the JetStream store is full"]),
        (False, ["x"], 503, ["the leader is not connected to NATS", "x"]),
    ],
)
def test_health_is_degraded_with_its_reasons(connected, storage, status, reasons):
    health, code = health_body(connected, storage)
    body = msgspec.to_builtins(health)  # the JSON /health answers
    assert code == status
    assert body["status"] == ("ok" if status == 200 else "degraded")
    assert body["nats"] == ("connected" if connected else "disconnected")
    assert body.get("reasons") == reasons
    if status == 200:
        assert set(body) == {"status", "nats", "version"}  # unchanged while healthy


def test_throttle_lets_one_line_a_minute_through_and_counts_the_rest():
    clock = Clock(0.0)
    throttle = Throttle(every_s=60, clock=clock)
    assert throttle.allow("streams") == 0
    for t in (1, 2, 59):
        clock.now = t
        assert throttle.allow("streams") is None
    assert throttle.allow("other") == 0
    clock.now = 60
    assert throttle.allow("streams") == 3
    clock.now = 61
    assert throttle.allow("streams") is None


class FakeBucket:
    def __init__(self) -> None:
        self.refuse: Exception | None = None
        self.values: dict[str, bytes] = {}

    async def put(self, key: str, value: bytes) -> int:
        if self.refuse is not None:
            raise self.refuse
        self.values[key] = value
        return 1

    async def delete(self, key: str) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.values.pop(key, None)


def test_the_state_store_remembers_a_write_refused_for_want_of_storage_until_one_succeeds():
    bucket = FakeBucket()
    store = StateStore(None, "swarm", bucket, bucket, bucket, bucket, bucket)  # type: ignore[arg-type]

    async def scenario() -> list[str | None]:
        seen = []
        bucket.refuse = ServiceUnavailableError(
            code=503, err_code=10023, description="insufficient resources"
        )
        with pytest.raises(ServiceUnavailableError):
            await store.put(store.jobs, "j1", {"a": 1})
        seen.append(store.write_error)
        bucket.refuse = TimeoutError()  # not about storage: what was known stays
        with pytest.raises(TimeoutError):
            await store.delete(store.jobs, "j1")
        seen.append(store.write_error)
        bucket.refuse = None
        await store.put(store.jobs, "j1", {"a": 2})
        seen.append(store.write_error)
        return seen

    assert asyncio.run(scenario()) == [
        "insufficient resources (10023)",
        "insufficient resources (10023)",
        None,
    ]
    assert bucket.values == {"j1": b'{"a":2}'}
