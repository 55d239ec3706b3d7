"""LeaderClient decodes every answer into its Struct: an answer that does not decode is a
LeaderResponseError with its own code, an error body keeps the leader's code, and what the
CLI prints with --json is the JSON the leader sent."""

from __future__ import annotations

import json

import httpx
import msgspec
import pytest

from silentswarm.cli import render
from silentswarm.cli.client import LeaderClient
from silentswarm.errors import ErrorCode, LeaderResponseError
from silentswarm.types.api import Health
from silentswarm.types.fleet import ReleaseResult
from tests.fakes import fellow_record, gpu, job_record, placed_stage


def client_answering(status: int, body: bytes, seen: list[httpx.Request] | None = None):
    def answer(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        return httpx.Response(status, content=body)

    client = LeaderClient("http://leader")
    client._http = httpx.Client(base_url="http://leader", transport=httpx.MockTransport(answer))
    return client


def test_an_answer_that_does_not_decode_names_the_route_and_the_field():
    body = json.dumps({"job_id": "j", "name": "j", "spec": {}, "state": 5}).encode()
    with pytest.raises(LeaderResponseError) as err:
        client_answering(200, body).job("j")
    assert err.value.code == ErrorCode.LEADER_RESPONSE_INVALID
    assert "GET /api/v1/jobs/j" in err.value.message and "$.state" in err.value.message
    with pytest.raises(LeaderResponseError) as err:
        client_answering(200, b"<html>").fellows()
    assert err.value.code == ErrorCode.LEADER_RESPONSE_INVALID


def test_an_error_body_keeps_the_leaders_code_and_anything_else_its_status():
    error = json.dumps({"code": "NOT_FOUND", "message": "no job 'x'"}).encode()
    with pytest.raises(LeaderResponseError) as err:
        client_answering(404, error).job("x")
    assert (err.value.code, err.value.message) == ("NOT_FOUND", "no job 'x'")
    with pytest.raises(LeaderResponseError) as err:
        client_answering(502, b"bad gateway").job("x")
    assert err.value.code == ErrorCode.HTTP_ERROR and "502" in err.value.message


def test_a_degraded_health_is_an_answer_not_an_error():
    body = msgspec.json.encode(
        Health(status="degraded", nats="disconnected", version="1", reasons=["x"])
    )
    assert client_answering(503, body).health().reasons == ["x"]


def test_request_bodies_are_the_request_structs_as_json():
    seen: list[httpx.Request] = []
    answer = msgspec.json.encode(ReleaseResult(fellow_id="f", released=True, purge=None))
    client_answering(200, answer, seen).release("f", purge_install=True)
    assert json.loads(seen[0].content) == {"purge_install": True}
    assert seen[0].headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    "leader_sent",
    [
        job_record(
            state="COMPLETED",
            spec={"steps": 7, "model": {"d_model": 64}},
            placement={"stages": [placed_stage(0), placed_stage(1)], "transport": "p2p"},
            progress=[{"stage": 0, "fellow_id": "f0", "step": 7, "loss": 1.25}],
            layer_ranges=[[0, 1], [1, 2]],
            final_loss=1.25,
        ),
        fellow_record("f1", gpus=[gpu(0, free_bytes=2**30)], outcome=None),
        ReleaseResult(fellow_id="f", released=True, purge="pending"),
        ReleaseResult(fellow_id="f", released=True, purge=None, agent_stopped=False),
        Health(status="ok", nats="connected", version="1"),
    ],
)
def test_json_output_is_the_json_the_leader_sent(leader_sent):
    body = msgspec.json.encode(leader_sent)  # as Litestar encodes a route's Struct
    decoded = msgspec.json.decode(body, type=type(leader_sent))
    assert render.dumps(decoded) == json.dumps(json.loads(body), indent=2, sort_keys=True)
