import re

import msgspec
import pytest

from silentswarm import protocol as p
from silentswarm import subjects as topics
from silentswarm.errors import ProtocolError


def snapshot() -> p.HardwareSnapshot:
    return p.HardwareSnapshot(
        hostname="h", cpu_cores=4, ram_total_bytes=8 << 30, ram_available_bytes=4 << 30
    )


def identity() -> p.FellowIdentity:
    return p.FellowIdentity(fellow_id="f1", instance_id="i", hostname="h", version="1", pid=9)


MESSAGES = [
    (topics.REGISTER, p.RegisterRequest(fellow=identity(), hardware=snapshot())),
    (topics.REGISTER, p.DeregisterRequest(fellow_id="f1", instance_id="i")),
    (
        topics.HEARTBEAT,
        p.Heartbeat(
            fellow=identity(),
            seq=3,
            status=p.FellowStatus.TRAINING,
            job_id="j",
            step=5,
            loss=1.25,
            bytes_sent=10,
            bytes_received=20,
            hardware=snapshot(),
        ),
    ),
    (topics.SIGNAL, p.StopSignal(signal_id="s1", job_id="j", attempt=2)),
    (
        topics.LOG,
        p.LogBatch(
            fellow_id="f1", records=[p.LogRecord(ts=1.0, level="INFO", logger="x", message="m")]
        ),
    ),
    (topics.PROGRESS, p.Progress(job_id="j", fellow_id="f1", attempt=1, step=2, loss=3.0)),
    (
        topics.SHARD,
        p.ShardChunk(
            job_id="j",
            fellow_id="f1",
            attempt=1,
            stage=0,
            step=10,
            name="stage-0.npz",
            size=2,
            sha256="ab" * 32,
            seq=0,
            total=1,
            data=b"xy",
        ),
    ),
]


@pytest.mark.parametrize(("topic", "message"), MESSAGES)
def test_every_message_round_trips_through_its_subject(topic, message):
    decoded = topic.decode(topics.encode(message))
    assert decoded == message
    assert decoded.v == p.PROTOCOL_VERSION


def test_replies_round_trip():
    reply = p.RegisterReply(accepted=False, code="X", message="m")
    assert topics.REGISTER.decode_reply(topics.encode(reply)) == reply
    ack = p.SignalAck(signal_id="s", fellow_id="f", ok=True)
    assert topics.SIGNAL.decode_reply(topics.encode(ack)) == ack


def test_peers_fields_unknown_to_us_are_ignored():
    """A newer peer may add fields; an older reader must still decode the message."""
    raw = msgspec.to_builtins(p.StopSignal(signal_id="s1"))
    raw["added_in_v2"] = {"anything": [1, 2]}
    raw["v"] = 2
    decoded = topics.SIGNAL.decode(msgspec.msgpack.encode(raw))
    assert decoded.signal_id == "s1" and decoded.v == 2


def test_register_subject_carries_a_tagged_union():
    data = topics.encode(p.DeregisterRequest(fellow_id="f1", instance_id="i"))
    assert msgspec.msgpack.decode(data)["kind"] == "deregister"
    assert isinstance(topics.REGISTER.decode(data), p.DeregisterRequest)


@pytest.mark.parametrize(
    "data",
    [
        b"\x00\xffgarbage",
        msgspec.msgpack.encode({"kind": "no-such-kind"}),
        topics.encode(p.StopSignal(signal_id="s")),  # wrong Struct
        msgspec.msgpack.encode({"kind": "register", "fellow": "not a struct"}),
    ],
)
def test_malformed_payloads_raise_protocol_error(data):
    with pytest.raises(ProtocolError) as err:
        topics.REGISTER.decode(data)
    assert err.value.code == "PROTOCOL_ERROR"


def _hardware(**overrides):
    fields = {"hostname": "h", "cpu_cores": 4, "ram_total_bytes": 8, "ram_available_bytes": 4}
    return {**fields, **overrides}


def _gpu(index=0, **overrides):
    return {
        "index": index,
        "uuid": "GPU-1",
        "name": "A100",
        "memory_total_bytes": 80 << 30,
        "memory_free_bytes": 80 << 30,
        "memory_used_bytes": 0,
        **overrides,
    }


@pytest.mark.parametrize(
    ("hardware", "where"),
    [
        (_hardware(gpus=[_gpu(i % 60) for i in range(7000)]), "$.hardware.gpus"),
        (_hardware(gpus=[_gpu(index=64)]), "$.hardware.gpus[0].index"),
        (_hardware(gpus=[_gpu(memory_total_bytes=2**62)]), "memory_total_bytes"),
        (_hardware(gpus=[_gpu(utilization_pct=250.0)]), "utilization_pct"),
        (_hardware(hostname="h" * 300), "$.hardware.hostname"),
        (_hardware(cpu_cores=-1), "$.hardware.cpu_cores"),
        (_hardware(ram_total_bytes=2**63), "$.hardware.ram_total_bytes"),
        (_hardware(nvml_error="x" * 5000), "$.hardware.nvml_error"),
    ],
)
def test_a_heartbeat_claiming_too_much_is_refused_naming_the_field(hardware, where):
    hb = {
        "v": 1,
        "fellow": msgspec.to_builtins(identity()),
        "seq": 1,
        "status": "ready",
        "hardware": hardware,
    }
    with pytest.raises(ProtocolError, match=re.escape(where)):
        topics.HEARTBEAT.decode(msgspec.msgpack.encode(hb))


def test_a_fellow_with_64_gpus_is_still_a_fellow():
    hb = {
        "v": 1,
        "fellow": msgspec.to_builtins(identity()),
        "seq": 1,
        "status": "ready",
        "hardware": _hardware(gpus=[_gpu(i) for i in range(64)]),
    }
    assert len(topics.HEARTBEAT.decode(msgspec.msgpack.encode(hb)).hardware.gpus) == 64


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("message", "x" * 2000),
        ("step", -1),
        ("job_id", "j" * 65),
        ("checkpoint_path", "p" * 2000),
        # the leader divides by step times and sums rates: NaN, inf and negatives are refused
        ("step_time_s", float("nan")),
        ("step_time_s", float("inf")),
        ("step_time_s", -1.0),
        ("tokens_per_s", float("inf")),
        ("lr", float("nan")),
    ],
)
def test_progress_out_of_bounds_is_refused(field, value):
    record = {"v": 1, "job_id": "j", "fellow_id": "f1", "attempt": 1, "step": 1, field: value}
    with pytest.raises(ProtocolError, match=field):
        topics.PROGRESS.decode(msgspec.msgpack.encode(record))
