"""The job loop's decisions (leader/decide.py): table tests over plain records."""

from __future__ import annotations

import pytest

from silentswarm.jobspec import JobSpec, PlacedStage, Placement
from silentswarm.leader import decide
from silentswarm.leader.decide import (
    ORPHAN_STOP_EVERY_S,
    PURGE_RETRY_S,
    RELEASED_STOP_EVERY_S,
    START_COOLDOWN_S,
    STOP_MEMORY_S,
    OrphanStop,
    StageEnded,
    StageLost,
)
from silentswarm.leader.jobs import FellowState, JobRecord, SignalRecord
from silentswarm.leader.purges import PendingPurge
from silentswarm.leader.registry import FellowRecord
from silentswarm.plan import ModelConfig
from silentswarm.protocol import FellowStatus, HardwareSnapshot, JobState, StageOutcome, StageResult
from silentswarm.types.views import StageProgress

S = FellowStatus
NOW = 1000.0


def job(
    state: JobState = JobState.RUNNING,
    *,
    job_id: str = "j",
    attempt: int = 2,
    fellows: tuple[str, ...] = ("a", "b"),
    results: dict[str, StageResult] | None = None,
    started_at: float = NOW - 60,
) -> JobRecord:
    results = results or {}
    placement = None
    if fellows:
        placement = Placement(
            stages=[
                PlacedStage(stage=i, fellow_id=f, hostname="h", layer_start=i, layer_end=i + 1)
                for i, f in enumerate(fellows)
            ],
            transport="p2p",
        )
    return JobRecord(
        job_id=job_id,
        name=job_id,
        spec=JobSpec(model=ModelConfig(n_layers=max(2, len(fellows)))),
        state=state,
        created_at=0.0,
        updated_at=started_at,
        started_at=started_at,
        attempt=attempt,
        placement=placement,
        progress=[
            StageProgress(stage=i, fellow_id=f, result=results.get(f))
            for i, f in enumerate(fellows)
        ],
    )


def fellow(
    fid: str = "a",
    status: FellowStatus = S.TRAINING,
    *,
    job_id: str | None = "j",
    attempt: int | None = 2,
    outcome: StageOutcome | None = None,
    heard: float | None = NOW,
    offline_reason: str | None = None,
) -> FellowState:
    return FellowState(
        fellow_id=fid,
        status=status,
        job_id=job_id,
        attempt=attempt,
        outcome=outcome,
        last_heartbeat_at=heard,
        offline_reason=offline_reason,
    )


def ended(job_id: str = "j", attempt: int = 2, result=StageResult.COMPLETED) -> StageOutcome:
    return StageOutcome(job_id=job_id, attempt=attempt, result=result, ended_at=0.0)


def record(fid: str, status: FellowStatus = S.READY) -> FellowRecord:
    return FellowRecord(
        fellow_id=fid,
        instance_id="i",
        hostname="h",
        version="v",
        pid=1,
        data_address="tcp://127.0.0.1:1",
        status=status,
        hardware=HardwareSnapshot(
            hostname="h", cpu_cores=4, ram_total_bytes=8 << 30, ram_available_bytes=8 << 30
        ),
        registered_at=0.0,
    )


# --- orphans --------------------------------------------------------------------------------


ORPHANS = [
    # (what the fellow reports, the job's record, starting, last STOP ago, the STOP or None)
    ("current attempt of a running job", fellow(), job(), False, None, None),
    ("current attempt, job starting", fellow(), job(JobState.PENDING), True, None, None),
    ("current attempt of a failed job", fellow(), job(JobState.FAILED), False, None, "FAILED"),
    ("cancelled job", fellow(), job(JobState.CANCELLED), False, None, "CANCELLED"),
    (
        "an older attempt of a running job",
        fellow(attempt=1),
        job(),
        False,
        None,
        "not its current attempt",
    ),
    ("not placed in the job", fellow("z"), job(), False, None, "not its current attempt"),
    ("checkpointing counts as running", fellow(status=S.CHECKPOINTING), job(JobState.FAILED),
     False, None, "FAILED"),
    ("ready: runs nothing", fellow(status=S.READY), job(JobState.FAILED), False, None, None),
    ("offline: not judged", fellow(status=S.OFFLINE), job(JobState.FAILED), False, None, None),
    ("reports no job", fellow(job_id=None), job(JobState.FAILED), False, None, None),
    ("a job this leader never knew", fellow(job_id="other"), job(), False, None, None),
    ("its outcome says the run ended", fellow(outcome=ended()), job(JobState.FAILED), False,
     None, None),
    ("an outcome of an older run does not count", fellow(outcome=ended(attempt=1)),
     job(JobState.FAILED), False, None, "FAILED"),
    ("its end reached the record first", fellow(),
     job(JobState.FAILED, results={"a": StageResult.STOPPED}), False, None, None),
    ("stopped just now", fellow(), job(JobState.FAILED), False, 0.0, None),
    ("stopped just under the interval ago", fellow(), job(JobState.FAILED), False,
     ORPHAN_STOP_EVERY_S - 0.001, None),
    ("stopped exactly the interval ago", fellow(), job(JobState.FAILED), False,
     ORPHAN_STOP_EVERY_S, "FAILED"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "state", "record", "starting", "stopped_ago", "why"),
    ORPHANS,
    ids=[row[0] for row in ORPHANS],
)
def test_orphan_stops(case, state, record, starting, stopped_ago, why):
    key = (state.fellow_id, state.job_id or "", state.attempt or 0)
    stopped = {} if stopped_ago is None else {key: NOW - stopped_ago}
    stops = decide.orphan_stops(
        [state],
        {record.job_id: record},
        starting={record.job_id} if starting else set(),
        stopped=stopped,
        now=NOW,
    )
    expected = [] if why is None else [OrphanStop(*key, why=why)]
    assert stops == expected


def test_a_stage_without_an_attempt_is_keyed_as_attempt_0():
    stops = decide.orphan_stops(
        [fellow(attempt=None)], {"j": job()}, starting=(), stopped={}, now=NOW
    )
    assert stops == [OrphanStop("a", "j", 0, why="not its current attempt")]


@pytest.mark.parametrize(
    ("ago", "kept"),
    [(0.0, True), (STOP_MEMORY_S, True), (STOP_MEMORY_S + 0.001, False)],
)
def test_stops_are_remembered_for_a_while(ago, kept):
    key = ("a", "j", 1)
    assert decide.forget_old_stops({key: NOW - ago}, now=NOW) == ({key: NOW - ago} if kept else {})


# --- running jobs ---------------------------------------------------------------------------


RUNNING = [
    # (case, the job, fellows by id, findings)
    ("both stages running", job(), {"a": fellow("a"), "b": fellow("b")}, []),
    (
        "an outcome in a heartbeat ends the stage",
        job(),
        {"a": fellow("a", outcome=ended()), "b": fellow("b")},
        [StageEnded("a", ended())],
    ),
    (
        "an outcome of an older attempt is not this one's",
        job(),
        {"a": fellow("a", S.READY, job_id=None, attempt=None, outcome=ended(attempt=1)),
         "b": fellow("b")},
        [StageLost("a", "fellow a (stage 0) is no longer running the job "
                   "(reports ready, no job)")],
    ),
    (
        "an offline fellow loses its stage, with the registry's reason",
        job(),
        {"a": fellow("a"), "b": fellow("b", S.OFFLINE, offline_reason="no heartbeat for 3.1s")},
        [StageLost("b", "fellow b (stage 1) went offline (no heartbeat for 3.1s)")],
    ),
    (
        "a fellow gone from the registry",
        job(),
        {"a": fellow("a")},
        [StageLost("b", "fellow b (stage 1) was removed from the registry")],
    ),
    (
        "another job, heard after the start grace",
        job(),
        {"a": fellow("a", job_id="k", attempt=1), "b": fellow("b")},
        [StageLost("a", "fellow a (stage 0) is no longer running the job "
                   "(reports training, job k)")],
    ),
    (
        "another job, heard exactly at the end of the start grace: not judged yet",
        job(started_at=NOW - 3.0),
        {"a": fellow("a", job_id="k", attempt=1), "b": fellow("b")},
        [],
    ),
    (
        "a stage whose result is recorded is not judged",
        job(results={"a": StageResult.COMPLETED}),
        {"b": fellow("b")},
        [],
    ),
    ("a job that is not running", job(JobState.PENDING), {}, []),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "record", "fellows", "findings"), RUNNING, ids=[r[0] for r in RUNNING]
)
def test_judge_running(case, record, fellows, findings):
    assert decide.judge_running(record, fellows, now=NOW) == findings


@pytest.mark.parametrize(
    ("state", "results", "stop"),
    [
        (JobState.COMPLETED, {}, []),
        (JobState.FAILED, {"a": StageResult.FAILED}, ["b"]),
        (JobState.CANCELLED, {}, ["a", "b"]),
        (JobState.CANCELLED, {"a": StageResult.STOPPED, "b": StageResult.STOPPED}, []),
    ],
)
def test_stages_to_stop_after_the_end(state, results, stop):
    assert decide.stages_to_stop(job(state, results=results)) == stop


def test_an_ended_job_never_placed_stops_nothing():
    assert decide.stages_to_stop(job(JobState.CANCELLED, fellows=())) == []


def test_abandoned_starts_are_pending_jobs_with_a_placement():
    jobs = [
        job(JobState.PENDING, job_id="placed"),
        job(JobState.PENDING, job_id="waiting", fellows=()),
        job(JobState.RUNNING, job_id="running"),
    ]
    assert [j.job_id for j in decide.abandoned_starts(jobs)] == ["placed"]


# --- placing and starting -------------------------------------------------------------------


IDLE = [
    # (case, status, busy, reserved, cooling until, purging, placeable)
    ("ready and free", S.READY, False, False, None, False, True),
    ("training", S.TRAINING, False, False, None, False, False),
    ("offline", S.OFFLINE, False, False, None, False, False),
    ("registering", S.REGISTERING, False, False, None, False, False),
    ("placed in a job", S.READY, True, False, None, False, False),
    ("an operator action signals it", S.READY, False, True, None, False, False),
    ("cooling down", S.READY, False, False, NOW + 0.001, False, False),
    ("cooldown ends exactly now", S.READY, False, False, NOW, False, True),
    ("a purge is pending", S.READY, False, False, None, True, False),
]


@pytest.mark.parametrize(
    ("case", "status", "busy", "reserved", "until", "purging", "placeable"),
    IDLE,
    ids=[r[0] for r in IDLE],
)
def test_idle_candidates(case, status, busy, reserved, until, purging, placeable):
    idle = decide.idle_candidates(
        [record("a", status)],
        busy={"a": "j"} if busy else {},
        reserved={"a"} if reserved else set(),
        cooldown={} if until is None else {"a": until},
        purging={"a"} if purging else set(),
        now=NOW,
    )
    assert [c.fellow_id for c in idle] == (["a"] if placeable else [])


def test_a_candidate_offers_what_its_snapshot_allows():
    [c] = decide.idle_candidates(
        [record("a")], busy={}, reserved=set(), cooldown={}, purging=set(), now=NOW
    )
    assert (c.cpu_cores, c.ram_available_bytes, c.gpus) == (4, 8 << 30, ())


def ack(fid: str, ok: bool, code: str | None = None, message: str = "") -> SignalRecord:
    return SignalRecord(
        signal_id="s",
        fellow_id=fid,
        ok=ok,
        code=code,
        message=message,
        kind="start",
        sent_at=0.0,
        attempts=1,
    )


def test_a_start_round_every_fellow_acknowledged_starts():
    assert decide.judge_start([ack("a", True), ack("b", True)], now=NOW) == decide.StartVerdict(
        ok=True
    )


def test_a_start_round_with_a_refusal_fails_and_cools_the_refusing_fellows_down():
    verdict = decide.judge_start(
        [ack("a", True), ack("b", False, "FELLOW_BUSY", "runs k"), ack("c", False, "NO_ANSWER")],
        now=NOW,
    )
    assert not verdict.ok
    assert verdict.reason == "b: FELLOW_BUSY: runs k; c: NO_ANSWER: "
    assert verdict.cooldown == {"b": NOW + START_COOLDOWN_S, "c": NOW + START_COOLDOWN_S}


# --- purges ---------------------------------------------------------------------------------


PURGES = [
    # (case, tries failed, last try ago, online, busy, in flight, due)
    ("never tried", 0, None, False, False, False, True),
    ("tried just now, fellow away", 1, 0.0, False, False, False, False),
    ("just under the retry interval", 1, PURGE_RETRY_S - 0.001, False, False, False, False),
    ("exactly the retry interval", 1, PURGE_RETRY_S, False, False, False, True),
    ("failed many times: still every interval", 50, PURGE_RETRY_S, False, False, False, True),
    ("failed many times, tried just now", 50, 1.0, False, False, False, False),
    ("the fellow is back: at once", 3, 0.0, True, False, False, True),
    ("back, but a delivery is in flight", 3, 0.0, True, False, True, False),
    ("due, but a delivery is in flight", 1, PURGE_RETRY_S, False, False, True, False),
    ("back, but placed in a job", 0, None, True, True, False, False),
]


@pytest.mark.parametrize(
    ("case", "tries", "ago", "online", "busy", "in_flight", "due"),
    PURGES,
    ids=[r[0] for r in PURGES],
)
def test_purges_due(case, tries, ago, online, busy, in_flight, due):
    purge = PendingPurge(
        fellow_id="a",
        requested_at=0.0,
        attempts=tries,
        last_attempt_at=None if ago is None else NOW - ago,
    )
    found = decide.purges_due(
        [purge],
        online={"a"} if online else set(),
        busy={"a": "j"} if busy else {},
        in_flight={"a"} if in_flight else set(),
        now=NOW,
    )
    assert found == (["a"] if due else [])


RELEASED = [
    # (case, heard, purge pending, last told ago (None: never), to stop)
    ("heard, never told", True, False, None, True),
    ("not heard", False, False, None, False),
    ("told just now", True, False, 0.0, False),
    ("just under the interval", True, False, RELEASED_STOP_EVERY_S - 0.001, False),
    ("exactly the interval", True, False, RELEASED_STOP_EVERY_S, True),
    ("a purge is pending: it waits for its PURGE", True, True, None, False),
]


@pytest.mark.parametrize(
    ("case", "heard", "pending", "ago", "stop"), RELEASED, ids=[r[0] for r in RELEASED]
)
def test_released_to_stop(case, heard, pending, ago, stop):
    found = decide.released_to_stop(
        {"a"} if heard else set(),
        purge_pending={"a"} if pending else set(),
        told={} if ago is None else {"a": NOW - ago},
        now=NOW,
    )
    assert found == (["a"] if stop else [])


def test_purges_due_keep_the_books_order():
    book = [PendingPurge(fellow_id=f, requested_at=0.0) for f in ("c", "a", "b")]
    found = decide.purges_due(book, online=set(), busy={}, in_flight=set(), now=NOW)
    assert found == ["c", "a", "b"]
