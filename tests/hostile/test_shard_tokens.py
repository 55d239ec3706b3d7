"""A shard download against a real leader: the token travels in a header (never in a URL),
opens one stage's files of the job's current attempt, and no log line holds it."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import httpx
import msgspec
import pytest

from silentswarm.agent.errors import FetchError
from silentswarm.agent.shardpush import SHARD_TOKEN_HEADER, fetch_shard
from silentswarm.leader.exports import ExportService
from silentswarm.leader.jobs import JobManager
from silentswarm.types.signals import ResumeArgs, ShardFile
from tests.integration.test_jobs import agents, tiny, wait_ready

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def signer(leader) -> ExportService:
    """The leader's own token maker: the operator token is its key."""
    return ExportService(
        bus=None,  # type: ignore[arg-type]
        jobs=JobManager(),
        prefix="swarm",
        export_root=Path(".").resolve(),
        secret=leader.token.encode(),
        public_url=leader.url,
    )


def test_a_shard_opens_with_its_stages_header_token_only(
    procs, nats_server, leader, tmp_path, caplog
):
    agents(procs, nats_server, "t1", "t2")
    wait_ready(leader, "t1", "t2")
    spec = tiny(
        name="tokens", steps=20, stages=2, shard_push_to_leader=True, shard_push_interval_steps=10
    )
    job_id = leader.submit(**spec)["job_id"]
    job = leader.wait_job(job_id, "COMPLETED", timeout=150)
    step, attempt = job["pushed_step"], job["attempt"]
    assert step == 20
    tokens = {s: signer(leader).token(job_id, attempt, s) for s in (0, 1)}
    base = f"{leader.url}/api/v1/jobs/{job_id}/shards/{step}"
    on_disk = Path(job["export_dir"]) / "shards" / f"step-{step}"
    anonymous = httpx.Client(timeout=10)  # no operator token: the shard token is enough

    got = anonymous.get(f"{base}/stage-1.npz", headers={SHARD_TOKEN_HEADER: tokens[1]})
    assert got.status_code == 200, got.text
    assert got.content == (on_disk / "stage-1.npz").read_bytes()

    refusals = [
        ({}, {}, "does not open"),
        ({SHARD_TOKEN_HEADER: "0" * 64}, {}, "does not open"),
        ({SHARD_TOKEN_HEADER: tokens[0]}, {}, "stage 0's shard files"),  # the neighbour's
        ({}, {"token": tokens[1]}, "never accepted in the URL"),  # the old way
        ({SHARD_TOKEN_HEADER: tokens[1]}, {"token": tokens[1]}, "never accepted in the URL"),
        # A token of another attempt (the previous one) opens nothing now.
        ({SHARD_TOKEN_HEADER: signer(leader).token(job_id, attempt - 1, 1)}, {}, "does not"),
    ]
    for headers, params, says in refusals:
        refused = anonymous.get(f"{base}/stage-1.npz", headers=headers, params=params)
        assert refused.status_code == 403, (headers, params, refused.text)
        body = refused.json()
        assert body["code"] == "SHARD_TOKEN_INVALID" and says in body["message"], body

    # The agent's download: sha256-checked, and its HTTP client logs a URL without the token.
    resume = ResumeArgs(
        step=step,
        token=tokens[0],
        files=[
            ShardFile(
                name=name,
                sha256=hashlib.sha256((on_disk / name).read_bytes()).hexdigest(),
                url=f"{base}/{name}",
            )
            for name in ("stage-0.npz", "stage-0.json")
        ],
    )
    # Only the download's records: the refusals above put a token in the URL on purpose, and
    # they are recorded too where an earlier test left httpx's logger at INFO.
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="httpx"):
        json_path = fetch_shard(resume, tmp_path / "fetched")
    assert json_path.read_bytes() == (on_disk / "stage-0.json").read_bytes()
    requests = [r.getMessage() for r in caplog.records if r.name == "httpx"]
    assert any(f"{base}/stage-0.npz" in line for line in requests), requests
    assert all(tokens[0] not in line and "token=" not in line for line in requests), requests
    # Stage 0's token does not fetch stage 1's files.
    stolen = msgspec.structs.replace(
        resume, files=[msgspec.structs.replace(resume.files[0], url=f"{base}/stage-1.npz")]
    )
    with pytest.raises(FetchError, match="HTTP 403"):
        fetch_shard(stolen, tmp_path / "stolen")


def test_the_export_a_job_starts_from_opens_to_its_stages_layers_only(procs, nats_server, leader):
    agents(procs, nats_server, "i1", "i2")
    wait_ready(leader, "i1", "i2")
    source = leader.submit(**tiny(name="source", steps=5, stages=2))["job_id"]
    done = leader.wait_job(source, "COMPLETED", timeout=150)
    job_id = leader.submit(**tiny(name="warm", steps=100_000, stages=2, init_from=f"job:{source}"))[
        "job_id"
    ]
    job = leader.wait_job(job_id, "RUNNING", timeout=60)
    tokens = {s: signer(leader).token(job_id, job["attempt"], s) for s in (0, 1)}
    base = f"{leader.url}/api/v1/jobs/{job_id}/init"
    export = Path(done["export_dir"])
    anonymous = httpx.Client(timeout=10)
    try:
        mine = {SHARD_TOKEN_HEADER: tokens[0]}
        got = anonymous.get(f"{base}/run_manifest.json", headers=mine)
        assert got.status_code == 200 and got.content == (export / "run_manifest.json").read_bytes()
        got = anonymous.get(f"{base}/stage-0.npz", headers=mine)
        step = done["pushed_step"] or 5
        assert got.content == (export / "shards" / f"step-{step}" / "stage-0.npz").read_bytes()
        source_token = signer(leader).token(source, done["attempt"], 0)
        refusals = [
            ("stage-1.npz", mine, {}),  # the source stage that holds the other stage's layer
            ("stage-0.npz", {}, {}),
            ("stage-0.npz", {SHARD_TOKEN_HEADER: source_token}, {}),  # another job's token
            ("stage-0.npz", mine, {"token": tokens[0]}),  # a token in the URL
            ("..%2F..%2Frun_manifest.json", mine, {}),
            ("api-token", mine, {}),
        ]
        for name, headers, params in refusals:
            refused = anonymous.get(f"{base}/{name}", headers=headers, params=params)
            assert refused.status_code in (403, 404), (name, refused.status_code, refused.text)
            assert leader.token not in refused.text
        got = anonymous.get(f"{base}/stage-1.npz", headers={SHARD_TOKEN_HEADER: tokens[1]})
        assert got.status_code == 200
    finally:
        anonymous.close()
        leader.request("DELETE", f"/api/v1/jobs/{job_id}")
