"""Datasets uploaded to the leader, end to end: the CLI uploads, a job names the dataset, only
stage 0's agent downloads it (verified, with its stage token), the last stage reads no data."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import leader_process, start_agent
from tests.helpers import child_env, run_swarm, swarm_cli, wait_for
from tests.integration.test_jobs import tiny, wait_ready

pytestmark = pytest.mark.timeout(240)


def corpus(path: Path, n_bytes: int = 300_000) -> Path:
    """Real text: standard library sources, concatenated up to ``n_bytes``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for source in sorted(stdlib.glob("*.py")):
        text = source.read_bytes()
        parts.append(text)
        total += len(text)
        if total >= n_bytes:
            break
    path.write_bytes(b"\n".join(parts)[:n_bytes])
    return path


def stage_token(operator_token: str, job_id: str, attempt: int, stage: int) -> str:
    """What START gives a stage (leader/exports.py: an HMAC under the operator token)."""
    message = f"shards:{job_id}:{attempt}:{stage}".encode()
    return hmac.new(operator_token.encode(), message, hashlib.sha256).hexdigest()


def files_under(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file()] if directory.exists() else []


def test_an_uploaded_file_trains_a_two_stage_llama_with_a_bpe_only_stage_0_reads_it(
    procs, nats_server, leader, tmp_path
):
    source = corpus(tmp_path / "notes.txt")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    up = swarm_cli(leader, "--json", "data", "upload", str(source), "--name", "notes")
    assert up.returncode == 0, up.stderr
    record = json.loads(up.stdout)
    assert (record["name"], record["sha256"]) == ("notes", digest)
    assert record["size_bytes"] == source.stat().st_size and record["source"] == "notes.txt"
    source.unlink()  # from now on only the leader has it
    listed = swarm_cli(leader, "data", "list")
    assert listed.returncode == 0 and "notes" in listed.stdout and digest[:16] in listed.stdout

    caches = {name: tmp_path / f"cache-{name}" for name in ("f1", "f2")}
    for name, cache in caches.items():
        start_agent(procs, nats_server.url, name, SWARM_DATA_CACHE=str(cache))
    wait_ready(leader, "f1", "f2")
    spec = tiny(
        name="uploaded",
        steps=20,
        stages=2,
        data=["dataset:notes"],
        tokenizer={"kind": "bpe"},
        shard_push_to_leader=True,
        shard_push_interval_steps=10,
    )
    spec["model"] = {**spec["model"], "family": "llama", "vocab_size": 512, "n_kv_heads": 1}
    job = leader.submit(**spec)
    assert job["spec"]["data"] == [f"dataset:notes@{digest}"], "pinned at submit"
    done = leader.wait_job(job["job_id"], "COMPLETED", timeout=180)
    assert done["final_val_loss"] is not None
    # A BPE of 512 tokens beats bytes: fewer, richer tokens; the loss is per token.
    assert done["final_val_loss"] < math.log(512)

    by_stage = {s["stage"]: s["fellow_id"] for s in done["placement"]["stages"]}
    first, last = caches[by_stage[0]], caches[by_stage[1]]
    downloaded = first / "datasets" / digest
    assert hashlib.sha256(downloaded.read_bytes()).hexdigest() == digest
    assert files_under(last) == [], "the last stage downloaded or tokenised nothing"
    bpe = [json.loads(p.read_text()) for p in (first / "tokenizers").glob("*.json")]
    assert len(bpe) == 1 and bpe[0]["model"]["type"] == "BPE"

    # The export holds the tokenizer (stage 0's checkpoint); glue, on the leader's machine,
    # reads the validation data from the leader's store and puts the tokenizer beside the
    # model; generate speaks it.
    export = Path(done["export_dir"])
    step = export / "shards" / "step-20"
    assert json.loads(json.loads((step / "stage-0.json").read_text())["tokenizer"]) == bpe[0]
    assert json.loads((step / "stage-1.json").read_text())["tokenizer"] is None
    env = child_env(SWARM_STATE_DIR=str(tmp_path / "leader-state"))
    glued = run_swarm("glue", str(export), env=env, timeout=240)
    assert glued.returncode == 0, glued.stdout + glued.stderr
    inference = json.loads((export / "full_model" / "inference_manifest.json").read_text())
    assert (inference["tokenizer"], inference["tokenizer_file"]) == ("bpe", "tokenizer.json")
    assert inference["val_loss"] == pytest.approx(done["final_val_loss"], rel=0.01)
    model_dir = str(export / "full_model")
    args = ["generate", "--model-dir", model_dir, "--prompt", "def ", "--temperature", "0"]
    text = run_swarm(*args, "--max-new-tokens", "12", env=env, timeout=120)
    # 12 tokens of at least one character each (a young model's may all be blanks)
    assert text.returncode == 0 and len(text.stdout.rstrip("\n")) >= 12, text.stderr

    # The download route: stage 0's token of the current attempt opens the job's dataset only.
    job_id, attempt = done["job_id"], done["attempt"]
    url = f"/api/v1/jobs/{job_id}/datasets/{digest}"
    header = "X-Swarm-Shard-Token"
    own = stage_token(leader.token, job_id, attempt, 0)
    ok = leader.http.get(url, headers={header: own, "authorization": ""})
    assert ok.status_code == 200 and hashlib.sha256(ok.content).hexdigest() == digest
    for headers, params, why in (
        ({}, {}, "current attempt"),
        ({header: stage_token(leader.token, job_id, attempt, 1)}, {}, "only stage 0"),
        ({header: stage_token(leader.token, job_id, attempt - 1 or 9, 0)}, {}, "current"),
        ({}, {"token": own}, "never accepted in the URL"),
    ):
        refused = leader.http.get(url, headers={**headers, "authorization": ""}, params=params)
        assert refused.status_code == 403 and why in refused.json()["message"], refused.text
    other = leader.http.get(
        f"/api/v1/jobs/{job_id}/datasets/{'0' * 64}", headers={header: own, "authorization": ""}
    )
    assert other.status_code == 403 and "reads no dataset" in other.json()["message"]


@pytest.fixture
def small_leader(procs, nats_server, tmp_path):
    """A leader that takes datasets of at most 100 kB."""
    yield from leader_process(procs, nats_server, tmp_path, SWARM_MAX_DATASET_BYTES="100000")


def test_uploads_are_checked_and_bounded_and_jobs_name_only_what_exists(small_leader, tmp_path):
    leader = small_leader
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"text": "hello"}) + "\n")
    big = corpus(tmp_path / "big.txt", 150_000)

    bad_name = swarm_cli(leader, "data", "upload", str(small), "--name", "../etc")
    assert bad_name.returncode == 2 and "dataset name" in bad_name.stderr
    too_big = swarm_cli(leader, "data", "upload", str(big))
    assert too_big.returncode != 0 and "at most 100000 bytes" in too_big.stderr, too_big.stderr
    # Streamed without a declared length, it is stopped at the limit just the same.
    chunks = (big.read_bytes()[i : i + 8192] for i in range(0, 150_000, 8192))
    streamed = leader.request("PUT", "/api/v1/datasets/big", content=chunks)
    assert streamed.status_code == 413 and streamed.json()["code"] == "PAYLOAD_TOO_LARGE"
    state = tmp_path / "leader-state" / "datasets"
    assert files_under(state) == [], "nothing of a refused upload is kept"
    anonymous = leader.http.put(
        "/api/v1/datasets/small", content=b"x", headers={"authorization": ""}
    )
    assert anonymous.status_code == 401

    up = swarm_cli(leader, "--json", "data", "upload", str(small))
    assert up.returncode == 0, up.stderr
    digest = json.loads(up.stdout)["sha256"]
    spec = tiny(name="jsonl", steps=5, data=[{"jsonl": "dataset:small", "field": "text"}])
    job = leader.submit(**spec)
    assert job["spec"]["data"] == [{"jsonl": f"dataset:small@{digest}", "field": "text"}]

    unknown = leader.request("POST", "/api/v1/jobs", json=tiny(data=["a.txt", "dataset:nope"]))
    assert unknown.status_code == 400, unknown.text
    assert unknown.json()["field"] == "data[1]" and "no dataset called 'nope'" in unknown.text
    malformed = leader.request("POST", "/api/v1/jobs", json=tiny(data=["dataset:bad name"]))
    assert malformed.status_code == 400 and "data[0]" in malformed.text

    # A new upload under the name points it at new content; the job keeps its pin, and the old
    # content stays (the job has not ended) until the job no longer needs it.
    small.write_text(json.dumps({"text": "hello again"}) + "\n")
    again = swarm_cli(leader, "--json", "data", "upload", str(small))
    assert again.returncode == 0 and json.loads(again.stdout)["sha256"] != digest
    assert leader.job(job["job_id"])["spec"]["data"][0]["jsonl"].endswith(digest)
    assert (state / "blobs" / digest).is_file()
    leader.request("DELETE", f"/api/v1/jobs/{job['job_id']}")
    leader.wait_job(job["job_id"], "CANCELLED", timeout=20)
    deleted = swarm_cli(leader, "data", "delete", "small")
    assert deleted.returncode == 0, deleted.stderr
    wait_for(lambda: files_under(state / "blobs") == [], timeout=5, what="the content removed")
    gone = swarm_cli(leader, "data", "delete", "small")
    assert gone.returncode != 0 and "no dataset called 'small'" in gone.stderr
