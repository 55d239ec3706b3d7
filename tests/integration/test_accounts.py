"""Accounts on a real leader (with NATS): roles, ownership of jobs, revocation, the CLI.

Jobs need no fellows here: they stay PENDING, which is enough to be cancelled, refused a
checkpoint (409 once ownership is through) and asked for their files.
"""

from __future__ import annotations

import subprocess
import threading
from typing import Any

import httpx
import pytest

from tests.conftest import leader_process
from tests.helpers import Leader, child_env, run_swarm

pytestmark = pytest.mark.integration

SPEC = {"stages": 1, "steps": 5}
SHA = "0" * 64


def _create(leader: Leader, name: str, role: str, **extra: Any) -> Leader:
    answer = leader.request("POST", "/api/v1/accounts", json={"name": name, "role": role, **extra})
    assert answer.status_code == 201, answer.text
    body = answer.json()
    assert body["account"]["name"] == name and body["account"]["role"] == role
    assert "token_sha256" not in body["account"]
    return Leader(leader.url, token=body["token"])


def _job_routes(job_id: str) -> list[tuple[str, str]]:
    """Every route that acts on one job or reads its files (not a plain read)."""
    return [
        ("DELETE", f"/api/v1/jobs/{job_id}"),
        ("POST", f"/api/v1/jobs/{job_id}/checkpoint"),
        ("GET", f"/api/v1/jobs/{job_id}/shards/5/stage0.weights.h5"),
        ("GET", f"/api/v1/jobs/{job_id}/init/run_manifest.json"),
        ("GET", f"/api/v1/jobs/{job_id}/datasets/{SHA}"),
    ]


def test_two_accounts_cannot_touch_each_others_jobs(leader, procs):
    alice = _create(leader, "alice", "submitter")
    bob = _create(leader, "bob", "submitter")
    viewer = _create(leader, "vera", "viewer")
    assert alice.get("/api/v1/auth/whoami") == {
        "name": "alice",
        "role": "submitter",
        "pools": None,
        "operator": False,
    }
    a_job = alice.submit(**SPEC)
    b_job = bob.submit(**SPEC)
    op_job = leader.submit(**SPEC)
    assert (a_job["owner"], b_job["owner"], op_job["owner"]) == ("alice", "bob", "operator")

    # Every account reads every job; ?owner= filters.
    for reader in (alice, bob, viewer):
        assert {j["job_id"] for j in reader.get("/api/v1/jobs")} >= {a_job["job_id"]}
        assert reader.get(f"/api/v1/jobs/{b_job['job_id']}")["owner"] == "bob"
    mine = alice.get("/api/v1/jobs?owner=alice")
    assert [j["job_id"] for j in mine] == [a_job["job_id"]]

    # Each route on the other's job (and the operator's): 403 naming the owner and the role.
    for me, other_job in ((alice, b_job), (bob, a_job), (alice, op_job)):
        for method, path in _job_routes(other_job["job_id"]):
            answer = me.request(method, path)
            assert answer.status_code == 403, (method, path, answer.text)
            body = answer.json()
            assert body["code"] == "ACCOUNT_FORBIDDEN", (method, path, body)
            assert body["owner"] == other_job["owner"] and body["needed_role"] == "admin"
            assert f"account {other_job['owner']!r}" in body["message"]
    assert bob.job(b_job["job_id"])["state"] == "PENDING"

    # Starting from another account's export is reading it: refused at submit.
    refused = alice.request(
        "POST", "/api/v1/jobs", json={**SPEC, "init_from": f"job:{b_job['job_id']}"}
    )
    assert refused.status_code in (400, 403), refused.text  # 400: not COMPLETED, checked first

    # Nor may its job write into the export directory of another account's job.
    for where in (f"{b_job['job_id']}/model_export", "bob/run", "elsewhere"):
        paths = {"model_export_dir": where}
        hijack = alice.request("POST", "/api/v1/jobs", json={**SPEC, "artifact_paths": paths})
        assert hijack.status_code == 403, (where, hijack.text)
        assert hijack.json()["field"] == "artifact_paths.model_export_dir", hijack.text
    # Nor have fellows read their own files for it (their credentials, /proc): only an admin
    # names paths on the fellows' disks.
    for extra, field in (
        ({"data": ["stdlib", "/proc/self/environ"]}, "data[1]"),
        ({"data": [{"jsonl": "/var/lib/silentswarm/fellow/*"}]}, "data[0].jsonl"),
        ({"init_from": "preset:/home/someone/model"}, "init_from"),
    ):
        snoop = alice.request("POST", "/api/v1/jobs", json={**SPEC, **extra})
        assert snoop.status_code == 403, (extra, snoop.text)
        assert snoop.json()["field"] == field and "admin role" in snoop.json()["message"]
    assert leader.request("POST", "/api/v1/jobs", json={**SPEC, "data": ["/srv/*"]}).is_success
    paths = {"model_export_dir": "alice/run-1"}
    own_dir = alice.request("POST", "/api/v1/jobs", json={**SPEC, "artifact_paths": paths})
    assert own_dir.status_code == 201, own_dir.text
    assert alice.request("DELETE", f"/api/v1/jobs/{own_dir.json()['job_id']}").status_code == 200

    # Its own job: past the ownership check (the stage files need a stage's token).
    assert alice.request("POST", f"/api/v1/jobs/{a_job['job_id']}/checkpoint").status_code == 409
    own_shard = alice.request("GET", f"/api/v1/jobs/{a_job['job_id']}/init/run_manifest.json")
    assert own_shard.status_code == 403 and own_shard.json()["code"] == "SHARD_TOKEN_INVALID"
    cancelled = alice.request("DELETE", f"/api/v1/jobs/{a_job['job_id']}")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "CANCELLED"

    # A viewer mutates nothing, not even its own reads' tickets are more than reads.
    for method, path in [
        ("POST", "/api/v1/jobs"),
        *_job_routes(b_job["job_id"]),
        ("PUT", "/api/v1/datasets/corpus"),
        ("DELETE", "/api/v1/datasets/corpus"),
        ("POST", "/api/v1/accounts"),
        ("POST", "/api/v1/accounts/alice/revoke"),
        ("POST", "/api/v1/workers/update"),
        ("POST", "/api/v1/bootstrap/join-sessions"),
    ]:
        answer = viewer.request(method, path, json={})
        assert answer.status_code == 403, (method, path, answer.text)
        assert answer.json()["code"] == "ACCOUNT_FORBIDDEN", (method, path)
    assert viewer.request("GET", "/api/v1/accounts").status_code == 403

    # A submitter uploads datasets under new names; replacing one is an admin's.
    text = b"some words to train on\n" * 50
    assert alice.request("PUT", "/api/v1/datasets/alices", content=text).status_code == 201
    replaced = bob.request("PUT", "/api/v1/datasets/alices", content=text)
    assert replaced.status_code == 403 and replaced.json()["code"] == "ACCOUNT_FORBIDDEN"
    assert leader.request("PUT", "/api/v1/datasets/alices", content=text).status_code == 201

    # A submitter administers nothing either.
    for method, path in [
        ("GET", "/api/v1/accounts"),
        ("POST", "/api/v1/accounts/bob/revoke"),
        ("DELETE", "/api/v1/datasets/corpus"),
        ("POST", "/api/v1/workers/update"),
    ]:
        assert alice.request(method, path, json={}).status_code == 403, (method, path)

    # A read ticket reads as its account: a submitter's ticket does not open another's files.
    ticket = alice.request("POST", "/api/v1/auth/read-ticket").json()["ticket"]
    with httpx.Client(base_url=leader.url, timeout=5.0) as anonymous:
        assert anonymous.get(f"/api/v1/auth/whoami?ticket={ticket}").json()["name"] == "alice"
        listed = anonymous.get(f"/api/v1/accounts?ticket={ticket}")
        assert listed.status_code == 403 and listed.json()["account"] == "alice"

    # The operator token works as before, on everything.
    assert leader.get("/api/v1/auth/whoami")["operator"] is True
    assert leader.request("DELETE", f"/api/v1/jobs/{b_job['job_id']}").status_code == 200
    for client in (alice, bob, viewer):
        client.close()


def follow_stream(leader: Leader, path: str, token: str) -> threading.Event:
    """Open an SSE stream with ``token`` and read it in a thread; set once it has ended."""
    opened, ended = threading.Event(), threading.Event()

    def follow() -> None:
        headers = {"authorization": f"Bearer {token}"}
        with httpx.stream("GET", leader.url + path, headers=headers, timeout=60) as stream:
            assert stream.status_code == 200
            opened.set()
            for _ in stream.iter_bytes():
                pass
        ended.set()

    threading.Thread(target=follow, daemon=True).start()
    assert opened.wait(10), "the stream opened"
    return ended


def test_revoking_a_name_and_creating_it_again_ends_the_old_tokens_streams(leader):
    bob = _create(leader, "bob", "submitter")
    job = bob.submit(**SPEC)
    ended = follow_stream(leader, f"/api/v1/jobs/{job['job_id']}/metrics/stream", bob.token)
    assert leader.request("POST", "/api/v1/accounts/bob/revoke").status_code == 200
    again = _create(leader, "bob", "submitter")  # at once: before the stream's next check
    assert ended.wait(10), "the old token's stream ended"
    again.close()
    bob.close()


def test_a_rotated_token_stops_at_once_and_its_streams_end(leader):
    erin = _create(leader, "erin", "submitter")
    job = erin.submit(**SPEC)
    ended = follow_stream(leader, f"/api/v1/jobs/{job['job_id']}/metrics/stream", erin.token)
    ticket = erin.request("POST", "/api/v1/auth/read-ticket").json()["ticket"]
    rotated = leader.request("POST", "/api/v1/accounts/erin/rotate")
    assert rotated.status_code == 200, rotated.text
    token = rotated.json()["token"]
    assert token.startswith("swa_") and token != erin.token
    assert ended.wait(10), "the old token's stream ended"
    assert erin.request("GET", "/api/v1/auth/whoami").status_code == 403  # unknown now
    with httpx.Client(base_url=leader.url, timeout=5.0) as anonymous:
        assert anonymous.get(f"/api/v1/jobs?ticket={ticket}").status_code == 403, "its ticket"
    erin.token = token
    erin.http.headers["authorization"] = f"Bearer {token}"
    assert erin.get("/api/v1/auth/whoami")["name"] == "erin"
    assert erin.job(job["job_id"])["owner"] == "erin", "its jobs stay its own"
    erin.close()


def test_a_revoked_token_stops_at_once_and_tokens_are_never_shown_again(leader, procs):
    carol = _create(leader, "carol", "submitter", pools=["gpu"])
    token = carol.token
    assert token
    job = carol.submit(**SPEC, pool="gpu")
    for pool in ("cpu", None):
        answer = carol.request("POST", "/api/v1/jobs", json={**SPEC, "pool": pool})
        assert answer.status_code == 403, answer.text
        assert answer.json()["code"] == "POOL_FORBIDDEN" and answer.json()["field"] == "pool"
    ticket = carol.request("POST", "/api/v1/auth/read-ticket").json()["ticket"]
    # A stream carol opened before: it ends once she is revoked (checked every 5 s).
    ended = follow_stream(leader, f"/api/v1/jobs/{job['job_id']}/metrics/stream", token)
    assert not ended.wait(1), "the stream flows while carol may read"
    revoked = leader.request("POST", "/api/v1/accounts/carol/revoke")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert ended.wait(10), "the revoked account's open stream ended"
    # The very next request: refused, the read ticket too.
    answer = carol.request("GET", "/api/v1/auth/whoami")
    assert answer.status_code == 401 and answer.json()["code"] == "TOKEN_REVOKED"
    assert carol.request("POST", "/api/v1/jobs", json=SPEC).status_code == 401
    with httpx.Client(base_url=leader.url, timeout=5.0) as anonymous:
        assert anonymous.get(f"/api/v1/jobs?ticket={ticket}").status_code == 401
    assert leader.job(job["job_id"])["owner"] == "carol"

    accounts = leader.request("GET", "/api/v1/accounts")
    assert accounts.status_code == 200
    assert token not in accounts.text and "sha256" not in accounts.text
    assert [a["name"] for a in accounts.json()] == ["carol"]
    assert leader.get("/api/v1/accounts/carol")["pools"] == ["gpu"]
    assert token not in procs.log(procs.started[-1]), "a token is never logged"

    # Bad input: 400 naming the field; a live name again: 409; unknown: 404.
    for body, field in [
        ({"name": "Bad Name", "role": "viewer"}, "name"),
        ({"name": "dora", "role": "root"}, "role"),
        ({"name": "dora"}, "role"),
        ({"name": "operator", "role": "viewer"}, "name"),
        ({"name": "dora", "role": "viewer", "extra": 1}, "extra"),
    ]:
        answer = leader.request("POST", "/api/v1/accounts", json=body)
        assert answer.status_code == 400, (body, answer.text)
        assert answer.json()["field"] == field, (body, answer.json())
    _create(leader, "dora", "viewer").close()
    limits = {"pools": ["gpu"], "pool_limits": {"gpu": {"max_jobs": 2}}}
    patched = leader.request("PATCH", "/api/v1/accounts/dora", json=limits)
    assert patched.status_code == 200 and patched.json()["pool_limits"]["gpu"]["max_jobs"] == 2
    outside = leader.request("PATCH", "/api/v1/accounts/dora", json={"pools": ["cpu"]})
    assert outside.status_code == 400 and outside.json()["field"] == "pool_limits"
    again = leader.request("POST", "/api/v1/accounts", json={"name": "dora", "role": "viewer"})
    assert again.status_code == 409 and again.json()["code"] == "ACCOUNT_EXISTS"
    assert leader.request("POST", "/api/v1/accounts/nobody/revoke").status_code == 404
    # Revoked, then created again: a new token for the same name.
    fresh = _create(leader, "carol", "viewer")
    assert fresh.token != token and fresh.get("/api/v1/auth/whoami")["role"] == "viewer"
    assert carol.request("GET", "/api/v1/auth/whoami").status_code == 403  # unknown now
    fresh.close()
    carol.close()


def test_accounts_survive_a_restart(procs, nats_server, tmp_path):
    first = leader_process(procs, nats_server, tmp_path)
    leader = next(first)
    dave = _create(leader, "dave", "submitter")
    job = dave.submit(**SPEC)
    _create(leader, "eric", "viewer").close()
    assert leader.request("POST", "/api/v1/accounts/eric/revoke").status_code == 200
    process = procs.started[-1]
    process.terminate()
    process.wait(timeout=20)
    first.close()
    second = leader_process(procs, nats_server, tmp_path)
    leader = next(second)
    dave.http.base_url = leader.url
    assert dave.get("/api/v1/auth/whoami")["name"] == "dave"
    assert dave.job(job["job_id"])["owner"] == "dave"
    names = {a["name"]: a["revoked_at"] for a in leader.get("/api/v1/accounts")}
    assert names["dave"] is None and names["eric"] is not None
    dave.close()
    second.close()


def test_the_account_commands(leader):
    def swarm(*args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
        env = child_env(SWARM_LEADER_URL=leader.url, SWARM_API_TOKEN=token or leader.token)
        return run_swarm(*args, env=env, timeout=60)

    created = swarm("account", "create", "fran", "--role", "submitter", "--pool", "gpu")
    assert created.returncode == 0, created.stderr
    token = next(w for w in created.stdout.split() if w.startswith("swa_"))
    assert "shown once" in created.stdout
    listed = swarm("account", "list")
    assert listed.returncode == 0 and "fran" in listed.stdout and "submitter" in listed.stdout
    assert token not in listed.stdout
    as_json = swarm("account", "list", "--json")
    assert '"name": "fran"' in as_json.stdout.replace('":"', '": "')
    # Errors: one line, exit 1 (the leader's refusal) or 2 (usage).
    again = swarm("account", "create", "fran", "--role", "viewer")
    assert again.returncode == 1 and again.stderr.count("\n") == 1, again.stderr
    assert "ACCOUNT_EXISTS" in again.stderr or "exists" in again.stderr
    bad_role = swarm("account", "create", "gil", "--role", "root")
    assert bad_role.returncode == 2 and bad_role.stderr.count("\n") == 1, bad_role.stderr
    # A new token: printed once; the old one stops at once, the account (its pools) stays.
    rotated = swarm("account", "rotate", "fran")
    assert rotated.returncode == 0 and "shown once" in rotated.stdout, rotated.stderr
    old, token = token, next(w for w in rotated.stdout.split() if w.startswith("swa_"))
    assert token != old
    assert swarm("jobs", token=old).returncode == 1
    assert swarm("jobs", token=token).returncode == 0
    assert leader.get("/api/v1/accounts/fran")["pools"] == ["gpu"]
    denied = swarm("account", "list", token=token)
    assert denied.returncode == 1 and "admin" in denied.stderr, denied.stderr
    revoked = swarm("account", "revoke", "fran")
    assert revoked.returncode == 0 and "revoked" in revoked.stdout
    after = swarm("jobs", token=token)
    assert after.returncode == 1 and "revoked" in after.stderr, after.stderr
    unknown = swarm("account", "revoke", "nobody")
    assert unknown.returncode == 1 and unknown.stderr.count("\n") == 1
    for name in ("fran", "nobody"):  # revoked: create it again; unknown: 404
        refused = swarm("account", "rotate", name)
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr


def test_a_deleted_datasets_digest_starts_no_account_job(leader):
    """Content an admin deleted stays only for the jobs that read it: an account cannot keep
    it alive with new jobs naming its digest (visible in every job's record); an admin can."""
    alice = _create(leader, "alice", "submitter")
    uploaded = leader.request("PUT", "/api/v1/datasets/notes", content=b"some notes\n" * 50)
    assert uploaded.status_code == 201, uploaded.text
    digest = uploaded.json()["sha256"]
    reading = alice.submit(**SPEC, data=["dataset:notes"])  # PENDING: it keeps the content
    assert reading["spec"]["data"] == [f"dataset:notes@{digest}"]
    again = alice.request("POST", "/api/v1/jobs", json={**SPEC, "data": [f"dataset:x@{digest}"]})
    assert again.status_code == 201, "while a name points at it, a digest is anyone's to reuse"
    assert leader.request("DELETE", "/api/v1/datasets/notes").status_code == 200
    revived = alice.request("POST", "/api/v1/jobs", json={**SPEC, "data": [f"dataset:x@{digest}"]})
    assert revived.status_code == 400 and revived.json()["field"] == "data[0]", revived.text
    admins = leader.request("POST", "/api/v1/jobs", json={**SPEC, "data": [f"dataset:x@{digest}"]})
    assert admins.status_code == 201, admins.text
    alice.close()
