"""START, decided: who may start, and every way a START is refused (agent/decide.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from silentswarm.agent.decide import AgentState, Refusal, Start, decide, malformed
from silentswarm.natsconn import NatsAccess
from silentswarm.plan import ModelConfig, Peer, StagePlan, TrainConfig, single_process_plan
from silentswarm.protocol import FellowStatus, SignalHead, StartSignal
from silentswarm.types.signals import (
    DatasetArgs,
    DatasetFile,
    InitArgs,
    InitFile,
    ResumeArgs,
    ShardFile,
    StartArgs,
)

HOME = Path("/var/lib/swarm/fellows/f1")
PLAIN = NatsAccess(url="nats://127.0.0.1:4222")
WITH_USERS = NatsAccess(url="nats://127.0.0.1:4222", creds="/etc/swarm/f1.creds")
RESUME = ResumeArgs(
    step=40,
    files=[ShardFile(name="stage-0.json", sha256="ab" * 32, url="http://leader/shards/40")],
    token="cd" * 32,
)


def plan(**changes) -> StagePlan:
    base = single_process_plan(
        job_id="j1",
        model=ModelConfig(vocab_size=256, seq_len=16, n_layers=2, d_model=32, n_heads=2),
        train=TrainConfig(steps=10, batch_size=4, micro_batches=2),
    )
    return msgspec.structs.replace(base, **{"fellow_id": "f1", "attempt": 2, **changes})


def start(*, job="j1", attempt=2, creds=None, resume=None, **plan_changes) -> StartSignal:
    return StartSignal(
        signal_id="s1",
        job_id=job,
        attempt=attempt,
        args=StartArgs(plan=plan(**plan_changes), nats_creds=creds, resume=resume),
    )


def state(**changes) -> AgentState:
    fields = {
        "fellow_id": "f1",
        "status": FellowStatus.READY,
        "nats": PLAIN,
        "subject_prefix": "swarm",
        "fellow_dir": HOME,
    }
    return AgentState(**{**fields, **changes})


REFUSALS = [
    # (what the agent is doing, the START, the code, words the message holds)
    (state(stopping=True), start(), "AGENT_STOPPING", "shutting down"),
    (state(status=FellowStatus.TRAINING, running_job="j0"), start(), "FELLOW_BUSY", "(job j0)"),
    (state(status=FellowStatus.CHECKPOINTING), start(), "FELLOW_BUSY", "checkpointing"),
    (state(status=FellowStatus.FAILED), start(), "FELLOW_BUSY", "failed"),
    (state(status=FellowStatus.REGISTERING), start(), "FELLOW_BUSY", "registering"),
    (state(running_job="j0"), start(), "FELLOW_BUSY", "(job j0)"),  # ready, run not reaped
    (state(updating=True), start(), "FELLOW_BUSY", "installing an update"),
    # Stopping wins over busy, busy over a bad plan: the cheapest answer first.
    (state(stopping=True, running_job="j0"), start(stage=5), "AGENT_STOPPING", "shutting down"),
    (state(running_job="j0"), start(stage=5), "FELLOW_BUSY", "(job j0)"),
    (state(), start(stage=5), "PLAN_INVALID", "stage 5 is outside 0..0"),
    (state(), start(fellow_id="f2"), "PLAN_INVALID", "the plan is for 'f2', not 'f1'"),
    (state(), start(job="j2"), "PLAN_INVALID", "do not match the plan's"),
    (state(), start(attempt=3), "PLAN_INVALID", "do not match the plan's"),
    (state(), start(attempt=None), "PLAN_INVALID", "do not match the plan's"),
    (state(), start(job_id="bad.id", job="bad.id"), "PLAN_INVALID", "job_id 'bad.id'"),
    # A stale attempt: that attempt (or a later one) of the job already ran here.
    (state(last_run=("j1", 2)), start(), "START_STALE", "not newer than attempt 2"),
    (state(last_run=("j1", 5)), start(), "START_STALE", "not newer than attempt 5"),
    # A swarm with NATS users: START must bring the attempt's own.
    (state(nats=WITH_USERS), start(), "START_INVALID", "brought no NATS user"),
    (state(nats=WITH_USERS), start(creds=""), "START_INVALID", "brought no NATS user"),
]


@pytest.mark.parametrize(("agent", "signal", "code", "says"), REFUSALS)
def test_a_start_is_refused(agent, signal, code, says):
    decision = decide(agent, signal)
    assert isinstance(decision, Refusal)
    assert decision.code == code
    assert says in decision.message


@pytest.mark.parametrize(
    ("agent", "signal"),
    [
        (state(), start()),
        (state(last_run=("j1", 1)), start()),  # the next attempt of the job that ran here
        (state(last_run=("j0", 9)), start()),  # another job ran here
        (state(nats=WITH_USERS), start(creds="-----BEGIN NATS USER JWT-----")),
        (state(), start(creds="creds of a swarm this agent joined without")),
    ],
)
def test_a_ready_fellow_takes_a_valid_start(agent, signal):
    decision = decide(agent, signal)
    assert isinstance(decision, Start), decision
    assert decision.workdir == HOME / "jobs" / "j1-a2"
    assert decision.nats_creds == signal.args.nats_creds
    assert decision.resume is None and decision.resume_dir is None
    assert decision.plan.resume_from is None
    assert decision.message == "stage 0 started"


def test_the_plan_is_made_this_fellows_own():
    decision = decide(state(data_bind="tcp://0.0.0.0:7000"), start(data_address="tcp://h:7000"))
    assert isinstance(decision, Start)
    got = decision.plan
    assert got.nats == PLAIN and got.subject_prefix == "swarm"
    assert got.checkpoint_dir == str(HOME / "checkpoints")
    assert got.data_address == "tcp://0.0.0.0:7000", "SWARM_DATA_BIND replaces the address"
    # Without an address to bind (a first stage), SWARM_DATA_BIND changes nothing.
    unbound = decide(state(data_bind="tcp://0.0.0.0:7000"), start())
    assert isinstance(unbound, Start) and unbound.plan.data_address is None


@pytest.mark.parametrize(
    ("advertised", "bind", "binds"),
    [
        (["tcp://h:7001"], "tcp://0.0.0.0:7001", ["tcp://0.0.0.0:7001"]),
        # port j of the advertised range binds port j of the bind range
        (
            ["tcp://h:7001", "tcp://h:7002"],
            "tcp://0.0.0.0:9001-9002",
            ["tcp://0.0.0.0:9001", "tcp://0.0.0.0:9002"],
        ),
    ],
)
def test_a_replicas_ring_ports_bind_where_sync_bind_says(advertised, bind, binds):
    plan = start(sync_ports=advertised).args.plan
    assert plan.sync_ports == advertised
    decision = decide(state(sync_bind=bind), start(sync_ports=advertised))
    assert isinstance(decision, Start) and decision.plan.sync_ports == binds
    # The data port keeps its own address; a stage with no ring port binds none.
    assert decision.plan.data_address is None
    unbound = decide(state(sync_bind=bind), start())
    assert isinstance(unbound, Start) and unbound.plan.sync_ports == []


def test_a_resumed_attempt_fetches_its_shard_first_and_resumes_from_it():
    decision = decide(state(), start(resume=RESUME))
    assert isinstance(decision, Start)
    assert decision.resume == RESUME
    assert decision.resume_dir == HOME / "resume" / "j1-a2"
    assert decision.plan.resume_from == str(HOME / "resume" / "j1-a2" / "stage-0.json")
    assert decision.message == "stage 0 resuming from step 40"


def head_of(kind: str) -> SignalHead:
    return SignalHead(signal_id="s1", kind=kind)


@pytest.mark.parametrize(
    ("head", "error", "code"),
    [
        (None, "cannot decode: not msgpack", "PROTOCOL_ERROR"),
        (head_of(""), "no kind", "PROTOCOL_ERROR"),
        (head_of("REBOOT"), "unknown kind", "PROTOCOL_ERROR"),
        (head_of("START"), "... - at `$.args.plan.n_stages`", "PLAN_INVALID"),
        (head_of("START"), "... - at `$.args.nats_creds`", "START_INVALID"),
        (head_of("START"), "Object missing required field `args`", "START_INVALID"),
        (head_of("UPDATE"), "... - at `$.args.package.sha256`", "UPDATE_INVALID"),
        (head_of("CHECKPOINT"), "... - at `$.args.checkpoint_id`", "CHECKPOINT_INVALID"),
        (head_of("STOP"), "... - at `$.args.reason`", "STOP_INVALID"),
    ],
)
def test_a_signal_that_does_not_decode_is_refused_with_what_was_wrong(head, error, code):
    refusal = malformed(head, error)
    assert refusal == Refusal(code, error)


DATA = DatasetArgs(
    files=[DatasetFile(name="notes", sha256="ef" * 32, size_bytes=10, url="http://leader/d/ef")],
    token="cd" * 32,
)


def test_stage_0_fetches_its_uploaded_datasets_and_a_later_stage_never_does():
    signal = start(creds=None)
    first = msgspec.structs.replace(
        signal, args=msgspec.structs.replace(signal.args, datasets=DATA)
    )
    decision = decide(state(), first)
    assert isinstance(decision, Start) and decision.datasets == DATA and decision.fetches
    later = plan(stage=1, n_stages=2, data_address="tcp://h:7000", prev=Peer(fellow_id="f0"))
    second = msgspec.structs.replace(first, args=msgspec.structs.replace(first.args, plan=later))
    decided = decide(state(), second)
    assert isinstance(decided, Start) and decided.datasets is None and not decided.fetches


INIT = InitArgs(
    step=80,
    files=[InitFile(name="run_manifest.json", sha256="a" * 64, url="http://l/x")],
    token="t",
)


def test_a_job_from_an_export_fetches_it_first_and_so_does_a_resumed_adapter():
    signal = start()
    with_init = msgspec.structs.replace(
        signal, args=msgspec.structs.replace(signal.args, init=INIT)
    )
    decision = decide(state(), with_init)
    assert isinstance(decision, Start) and decision.init == INIT and decision.fetches
    assert decision.init_dir == HOME / "init" / "j1-a2"
    assert decision.plan.init_dir == str(decision.init_dir)
    resumed = msgspec.structs.replace(
        with_init, args=msgspec.structs.replace(with_init.args, resume=RESUME)
    )
    # The leader sends both to an adapter's resumed attempt: the export, the adapter on it.
    decided = decide(state(), resumed)
    assert isinstance(decided, Start) and decided.init == INIT and decided.resume == RESUME
    assert decided.plan.init_dir is not None and decided.plan.resume_from is not None
