"""drop_unknown_fields: what a strict struct would refuse is found wherever the type puts
one, and nothing else is touched; the CLI's decode of a newer leader's answer."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
import pytest

from silentswarm.cli import client
from silentswarm.cli.client import decode_answer
from silentswarm.cli.experiments import runner
from silentswarm.errors import ErrorCode, FieldError, LeaderResponseError
from silentswarm.jobspec import JobSpec, decode_job_spec
from silentswarm.protocol import FellowStatus, JobState
from silentswarm.types.accounts import Role
from silentswarm.types.jobs import JobRecord
from silentswarm.unknown_fields import drop_unknown_fields
from tests.fakes import job_record


class Inner(msgspec.Struct, forbid_unknown_fields=True):
    a: int = 0


class Loose(msgspec.Struct):
    inner: Inner = msgspec.field(default_factory=Inner)


class Cat(msgspec.Struct, tag="cat", forbid_unknown_fields=True):
    lives: int = 9


class Dog(msgspec.Struct, tag="dog", forbid_unknown_fields=True):
    good: bool = True


class Outer(msgspec.Struct, forbid_unknown_fields=True, rename={"inner": "in"}):
    inner: Inner = msgspec.field(default_factory=Inner)
    maybe: Inner | None = None
    many: list[Inner] = msgspec.field(default_factory=list)
    by_name: dict[str, Inner] = msgspec.field(default_factory=dict)
    pair: tuple[Inner, int] | None = None
    pet: Cat | Dog | None = None
    only_cat: Cat | None = None
    either: str | Inner | None = None
    loose: Loose = msgspec.field(default_factory=Loose)
    sized: Annotated[Inner, msgspec.Meta(title="x")] = msgspec.field(default_factory=Inner)
    mode: Literal["a", "b"] = "a"


CASES = [
    ({"in": {"a": 1}}, [], {"in": {"a": 1}}, "a value it knows: unchanged"),
    ({"new": 1, "in": {}}, ["new"], {"in": {}}, "at the top"),
    ({"in": {"a": 1, "new": {"x": 1}}}, ["in.new"], {"in": {"a": 1}}, "in a renamed field, once"),
    ({"maybe": {"b": 2}}, ["maybe.b"], {"maybe": {}}, "an optional struct"),
    ({"maybe": None, "new": None}, ["new"], {"maybe": None}, "a null where a struct may be"),
    ({"many": [{"a": 1}, {"x": 1}]}, ["many[1].x"], {"many": [{"a": 1}, {}]}, "a list's items"),
    ({"by_name": {"k": {"x": 1}}}, ["by_name[k].x"], {"by_name": {"k": {}}}, "a mapping's values"),
    ({"pair": [{"x": 1}, 3]}, ["pair[0].x"], {"pair": [{}, 3]}, "in a tuple"),
    (
        {"pet": {"type": "dog", "good": True, "x": 1}},
        ["pet.x"],
        {"pet": {"type": "dog", "good": True}},
        "a tagged union by its tag",
    ),
    ({"pet": {"type": "cat", "lives": 3}}, [], {"pet": {"type": "cat", "lives": 3}}, "a tag"),
    ({"only_cat": {"lives": 1, "x": 1}}, ["only_cat.x"], {"only_cat": {"lives": 1}}, "lone tag"),
    ({"either": {"x": 1}}, ["either.x"], {"either": {}}, "a struct beside a string"),
    ({"either": "text"}, [], {"either": "text"}, "the string beside a struct"),
    (
        {"loose": {"new": 1, "inner": {"x": 1}}},
        ["loose.inner.x"],
        {"loose": {"new": 1, "inner": {}}},
        "a lenient struct keeps its own",
    ),
    ({"sized": {"x": 1}}, ["sized.x"], {"sized": {}}, "through Annotated"),
    (
        {"many": "not a list", "maybe": 5},
        [],
        {"many": "not a list", "maybe": 5},
        "values of the wrong kind: left to decode",
    ),
]


@pytest.mark.parametrize(("value", "dropped", "left", "what"), CASES, ids=[c[3] for c in CASES])
def test_drops_what_a_strict_struct_refuses_and_nothing_else(value, dropped, left, what):
    assert drop_unknown_fields(value, Outer) == dropped, what
    assert value == left
    if not isinstance(value.get("many", []), str):
        msgspec.convert(value, Outer)  # what is left decodes strictly


def test_a_list_of_them_names_each_item():
    value = [{"new": 1}, {"in": {"y": 2}}]
    assert drop_unknown_fields(value, list[Outer]) == ["[0].new", "[1].in.y"]
    assert value == [{}, {"in": {}}]


SPEC = decode_job_spec(json.dumps({"name": "skew", "steps": 5, "stages": 1}).encode())


def newer(spec: JobSpec) -> dict[str, Any]:
    raw = msgspec.to_builtins(spec)
    raw["zero_bubble"] = True
    raw["model"]["rope_scaling"] = {"factor": 2.0}
    return raw


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(client, "_warned", set())


def test_a_newer_leaders_spec_decodes_as_this_version_knows_it_and_is_said_once(capsys):
    body = json.dumps([newer(SPEC), newer(SPEC)])
    assert decode_answer(body, list[JobSpec], "GET /api/v1/jobs") == [SPEC, SPEC]
    assert decode_answer(body, list[JobSpec], "GET /api/v1/jobs") == [SPEC, SPEC]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("swarm: warning: the leader sent fields")
    assert "left out: model.rope_scaling, zero_bubble;" in lines[0], lines[0]


def test_an_answer_that_is_wrong_besides_is_still_refused_naming_the_field(capsys):
    raw = newer(SPEC)
    raw["steps"] = "many"
    with pytest.raises(LeaderResponseError) as caught:
        decode_answer(json.dumps(raw), JobSpec, "GET /api/v1/jobs/x")
    assert caught.value.code == ErrorCode.LEADER_RESPONSE_INVALID
    assert "GET /api/v1/jobs/x" in caught.value.message and "$.steps" in caught.value.message
    assert capsys.readouterr().err == "", "no warning for an answer it refuses"


def test_nesting_too_deep_for_the_lenient_decode_is_refused_not_a_traceback():
    raw = newer(SPEC)
    raw["labels_of_the_future"] = "DEEP"
    body = json.dumps(raw).replace('"DEEP"', "[" * 5000 + "]" * 5000)
    with pytest.raises(LeaderResponseError) as caught:
        decode_answer(body, JobSpec, "GET /api/v1/jobs/x")
    assert caught.value.code == ErrorCode.LEADER_RESPONSE_INVALID


def test_the_warning_names_a_field_once_whatever_list_item_or_mapping_key_holds_it(capsys):
    client.warn_newer_fields(["[0].a.x", "[1].a.x", "a.by[gpu].y", "a.by[cpu].y", "[2].z"])
    client.warn_newer_fields(["[7].a.x"])
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "left out: a.x, a.by[].y, z;" in lines[0], lines


class Tally(msgspec.Struct, forbid_unknown_fields=True):
    state: JobState
    by_status: dict[FellowStatus, int] = msgspec.field(default_factory=dict)
    roles: list[Role] = msgspec.field(default_factory=list)


def test_a_newer_leaders_enum_values_are_shown_as_sent_and_said_once(capsys):
    """A job state, a fellow status as a mapping's key, a role in a list, a transport in a
    spec: values this version lacks decode as members named after them."""
    body = json.dumps(
        [
            {"state": "SUSPENDED", "by_status": {"ready": 1, "draining": 2}, "roles": ["auditor"]},
            {"state": "RUNNING", "roles": ["admin", "auditor"]},
        ]
    )
    first, second = decode_answer(body, list[Tally], "GET /things")
    assert first.state == "SUSPENDED" and isinstance(first.state, JobState)
    assert first.state.name == "SUSPENDED" and first.state.value == "SUSPENDED"
    assert first.by_status == {FellowStatus.READY: 1, "draining": 2}
    assert second.state is JobState.RUNNING and second.roles[0] is Role.ADMIN
    assert second.roles[1] == "auditor"
    raw = newer(SPEC)
    raw["transport"] = "quic"
    spec = decode_answer(json.dumps(raw), JobSpec, "GET /api/v1/jobs/x")
    assert spec.transport == "quic" and spec.name == "skew"
    lines = capsys.readouterr().err.splitlines()
    values = [line for line in lines if "values this CLI" in line]
    assert len(values) == 2, lines
    assert "state='SUSPENDED', by_status[]='draining', roles[]='auditor';" in values[0]
    assert "transport='quic'" in values[1]


def test_only_the_lenient_decode_takes_a_value_an_enum_lacks():
    """The leader checking a fellow's or a user's input stays strict, before and after."""
    decode_answer(json.dumps({"state": "SUSPENDED"}), Tally, "GET /things")
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value 'SUSPENDED'"):
        msgspec.json.decode(b'"SUSPENDED"', type=JobState)
    with pytest.raises(ValueError, match="is not a valid JobState"):
        JobState("SUSPENDED")
    with pytest.raises(FieldError) as caught:
        decode_job_spec(json.dumps({"name": "x", "transport": "quic"}).encode())
    assert caught.value.field == "transport"
    assert list(JobState) == [s for s in JobState.__members__.values()], "no member added"
    assert "SUSPENDED" not in JobState.__members__


def test_a_sweep_waiting_on_a_job_in_a_state_it_does_not_know_stops_and_says_why():
    raw = msgspec.to_builtins(job_record(job_id="j1", state="RUNNING"))
    raw["state"] = "ARCHIVED"
    archived = decode_answer(json.dumps(raw), JobRecord, "GET /api/v1/jobs/j1")

    class Polled:
        def job(self, job_id: str) -> JobRecord:
            return archived

    with pytest.raises(LeaderResponseError) as caught:
        runner.wait_for_end(Polled(), "j1", poll_s=0.0, sleep=lambda s: None)
    assert caught.value.code == ErrorCode.LEADER_RESPONSE_INVALID
    assert "ARCHIVED, a state this CLI does not know" in caught.value.message


def test_the_warnings_show_a_strangers_names_escaped(capsys):
    client.warn_newer_fields(["spec.\x1b]0;pwn\x07"])
    client.warn_newer_values([("by[a]\x1bc]", "new\x1b")])
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err
    assert "\\x1b" in err and "'new\\x1b'" in err
