"""Signals on the wire: one Struct per kind with typed, bounded arguments, in the same shape
as the untyped ``args`` map they replaced (swarm/types/signals.py, swarm/protocol.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from silentswarm import protocol as p
from silentswarm import subjects as topics
from silentswarm.errors import ProtocolError
from silentswarm.plan import ModelConfig, TrainConfig, single_process_plan
from silentswarm.types.signals import (
    MAX_CREDS_CHARS,
    CheckpointArgs,
    PackageRef,
    PurgeArgs,
    ResumeArgs,
    ShardFile,
    StartArgs,
    StopArgs,
    UpdateArgs,
)

PLAN = single_process_plan(
    job_id="j1",
    model=ModelConfig(vocab_size=256, seq_len=16, n_layers=2, d_model=32, n_heads=2),
    train=TrainConfig(steps=10, batch_size=4, micro_batches=2),
)
PACKAGE = PackageRef(file="silentswarm-1.0-py3-none-any.whl", sha256="ab" * 32, url="http://l/src")
RESUME = ResumeArgs(
    step=40,
    files=[ShardFile(name="stage-0.json", sha256="cd" * 32, url="http://l/jobs/j1/shards/40")],
    token="ef" * 32,
)


class OldSignal(msgspec.Struct, kw_only=True):
    """How a fellow of the version before typed signals decoded every signal."""

    v: int = 1
    signal_id: str
    kind: str
    job_id: str | None = None
    attempt: int | None = None
    args: dict[str, Any] = msgspec.field(default_factory=dict)


SIGNALS = [
    (StartArgs(plan=PLAN), p.StartSignal, "START"),
    (StartArgs(plan=PLAN, nats_creds="creds", resume=RESUME), p.StartSignal, "START"),
    (StopArgs(reason="cancelled"), p.StopSignal, "STOP"),
    (StopArgs(release=True, reason="released"), p.StopSignal, "STOP"),
    (CheckpointArgs(checkpoint_id="c1", at_step=20), p.CheckpointSignal, "CHECKPOINT"),
    (UpdateArgs(package=PACKAGE), p.UpdateSignal, "UPDATE"),
    (UpdateArgs(), p.UpdateSignal, "UPDATE"),
    (PurgeArgs(reason="released with --purge-install"), p.PurgeSignal, "PURGE"),
]


@pytest.mark.parametrize(("args", "cls", "kind"), SIGNALS)
def test_each_kind_round_trips_and_its_kind_follows_from_its_args(args, cls, kind):
    sig = p.make_signal(args, signal_id="s1", job_id="j1", attempt=1)
    assert type(sig) is cls and sig.kind == kind
    decoded = topics.SIGNAL.decode(topics.encode(sig))
    assert decoded == sig and decoded.args == args


@pytest.mark.parametrize(("args", "cls", "kind"), SIGNALS)
def test_the_wire_is_the_untyped_map_it_was(args, cls, kind):
    """A fellow of the previous version reads every typed signal, with the same keys."""
    old = msgspec.msgpack.decode(topics.encode(p.make_signal(args, signal_id="s1")), type=OldSignal)
    assert old.kind == kind and old.signal_id == "s1"
    assert old.args == msgspec.to_builtins(args)
    assert None not in old.args.values(), "None is left out, as the old leader did"


def test_an_older_fellow_takes_an_update_to_the_new_version():
    old = msgspec.msgpack.decode(
        topics.encode(p.make_signal(UpdateArgs(package=PACKAGE), signal_id="u1")), type=OldSignal
    )
    # What the old agent did with it (agent/runner.py before typed signals).
    assert old.args["package"] == {
        "file": PACKAGE.file,
        "sha256": PACKAGE.sha256,
        "url": "http://l/src",
    }


def test_signals_as_the_untyped_leader_wrote_them_decode():
    old = OldSignal(
        signal_id="s1",
        kind="START",
        job_id="j1",
        attempt=1,
        args={
            "plan": msgspec.to_builtins(PLAN),
            "nats_creds": "creds",
            "resume": msgspec.to_builtins(RESUME),
        },
    )
    sig = topics.SIGNAL.decode(msgspec.msgpack.encode(old))
    assert isinstance(sig, p.StartSignal)
    assert sig.args == StartArgs(plan=PLAN, nats_creds="creds", resume=RESUME)
    stop = topics.SIGNAL.decode(msgspec.msgpack.encode(OldSignal(signal_id="s2", kind="STOP")))
    assert isinstance(stop, p.StopSignal) and stop.args == StopArgs()


def _start(**args: Any) -> dict[str, Any]:
    return {"v": 1, "signal_id": "s1", "kind": "START", "args": {"plan": PLAN, **args}}


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (_start(nats_creds="x" * (MAX_CREDS_CHARS + 1)), "$.args.nats_creds"),
        (_start(nats_creds=7), "$.args.nats_creds"),
        (_start(plan={"job_id": "j"}), "$.args.plan"),
        (_start(resume={**msgspec.to_builtins(RESUME), "step": 0}), "$.args.resume.step"),
        (
            _start(resume={**msgspec.to_builtins(RESUME), "files": [{"name": "../x"}]}),
            "$.args.resume.files[0]",
        ),
        (
            _start(resume={**msgspec.to_builtins(RESUME), "files": [{}] * 65}),
            "$.args.resume.files",
        ),
        ({"v": 1, "signal_id": "s" * 65, "kind": "STOP"}, "$.signal_id"),
        ({"v": 1, "signal_id": "s", "kind": "STOP", "attempt": -1}, "$.attempt"),
        ({"v": 1, "signal_id": "s", "kind": "STOP", "args": {"reason": "r" * 5000}}, "reason"),
        ({"v": 1, "signal_id": "s", "kind": "CHECKPOINT", "args": {}}, "checkpoint_id"),
        (
            {"v": 1, "signal_id": "s", "kind": "CHECKPOINT", "args": {"checkpoint_id": ""}},
            "$.args.checkpoint_id",
        ),
        (
            {"v": 1, "signal_id": "s", "kind": "UPDATE", "args": {"package": {"file": "a.whl"}}},
            "$.args.package",
        ),
        ({"v": 1, "signal_id": "s", "kind": "REBOOT"}, "kind"),
    ],
)
def test_a_signal_out_of_bounds_is_refused_naming_the_field(raw, where):
    with pytest.raises(ProtocolError) as err:
        topics.SIGNAL.decode(msgspec.msgpack.encode(raw))
    assert where in str(err.value)


def test_what_a_malformed_signal_still_says():
    """A fellow answers a signal it cannot decode by its id (agent/decide.py's malformed)."""
    data = msgspec.msgpack.encode(_start(nats_creds=7))
    head = msgspec.msgpack.decode(data, type=p.SignalHead)
    assert (head.signal_id, head.kind) == ("s1", "START")
