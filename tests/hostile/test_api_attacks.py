"""Attacks on the leader's HTTP API and onboarding (issue 17, untrusted fellows). Each test
mounts one against a real leader process and asserts that it failed: a join or an enrollment
taking a live or known fellow's name, the operator token in a URL, a read ticket used for
what it does not open or after it expired, anonymous reads of a leader that listens off
loopback, export directories that lead out of the export root (at submit and at write time),
and absurd job spec numbers."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from silentswarm.leader.auth import ReadTickets
from silentswarm.natsauth import creds_user_name
from silentswarm.procs import free_port
from tests.conftest import leader_process, secure_env, start_agent
from tests.helpers import Leader, child_env, run_swarm, wait_for
from tests.integration.test_jobs import tiny, wait_ready
from tests.integration.test_nats_revocation import refused as nats_refuses

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
FLEET_TOKEN = "fleet-secret"


# --- 1. names are the operator's ----------------------------------------------------------------


@pytest.fixture
def onboarding_leader(procs, secure_nats, nats_authority, tmp_path):
    """An authenticated leader that mints NATS users for joins and enrollments. It serves a
    stand-in package (a claim needs one; what it contains does not matter here)."""
    wheel = tmp_path / "wheels" / "silentswarm-0.0.0-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"a stand-in package")
    yield from leader_process(
        procs,
        secure_nats,
        tmp_path,
        **secure_env(nats_authority),
        SWARM_ENROLL_TOKEN=FLEET_TOKEN,
        SWARM_BOOTSTRAP_WHEEL=str(wheel),
    )


def create_session(leader: Leader, **body) -> dict:
    response = leader.request("POST", "/api/v1/bootstrap/join-sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def claim(leader: Leader, session: dict, proposed: str | None) -> httpx.Response:
    return httpx.post(
        f"{leader.url}/api/v1/bootstrap/join-sessions/{session['session_id']}/claim",
        json={"token": session["token"], "fellow_name": proposed},
        timeout=10,
    )


def enroll(leader: Leader, name: str, timeout: float = 10) -> httpx.Response:
    return httpx.post(
        f"{leader.url}/api/v1/bootstrap/enroll",
        json={"fellow_name": name},
        headers={"authorization": f"Bearer {FLEET_TOKEN}"},
        timeout=timeout,
    )


def refused(response: httpx.Response, code: str) -> None:
    assert response.status_code == 409, response.text
    body = response.json()
    assert body["code"] == code and body["field"] == "fellow_name", body
    assert body["message"].startswith("fellow_name: ")
    assert "nats_creds" not in body and "secret" not in body


def test_a_claim_or_enrollment_cannot_take_a_live_or_known_fellows_name(
    procs, secure_nats, nats_authority, onboarding_leader, tmp_path
):
    leader = onboarding_leader
    creds = nats_authority.write_fellow_creds("swarm", "victim")
    victim = start_agent(procs, secure_nats.url, "victim", SWARM_NATS_CREDS=str(creds))
    wait_ready(leader, "victim")

    # A host with an unnamed session proposes the live fellow's name: refused, and the
    # session stays unused (nothing was handed out). Enrollment cannot take it either.
    session = create_session(leader)
    refused(claim(leader, session, "victim"), "FELLOW_ID_IN_USE")
    path = f"/api/v1/bootstrap/join-sessions/{session['session_id']}"
    assert leader.get(path)["status"] == "created"
    refused(enroll(leader, "victim"), "FELLOW_ID_IN_USE")
    # Not even an operator's session hands out a live fellow's name.
    named = create_session(leader, fellow_name="victim")
    refused(claim(leader, named, None), "FELLOW_ID_IN_USE")

    # Offline now, but known: a host's proposal and an enrollment are still refused.
    victim.send_signal(signal.SIGTERM)
    assert victim.wait(timeout=30) == 0
    leader.wait_status("victim", "offline", timeout=15)
    refused(claim(leader, session, "victim"), "FELLOW_NAME_KNOWN")
    refused(enroll(leader, "victim"), "FELLOW_NAME_KNOWN")

    # The operator's session may give a known name, and its name wins over the host's.
    old_keys = nats_authority.fellow_user_keys("victim")
    kept = tmp_path / "old-install.creds"  # the old install's copy (the authority drops its own)
    kept.write_bytes(creds.read_bytes())
    assert old_keys and not asyncio.run(nats_refuses(secure_nats.url, kept))
    given = claim(leader, named, "something-else")
    assert given.status_code == 200, given.text
    assert given.json()["fellow_name"] == "victim"
    assert creds_user_name(given.json()["nats_creds"]) == "victim"
    # Whoever held the name's users before (an old install's disk) is cut off: only the
    # new host's user stays.
    assert asyncio.run(nats_refuses(secure_nats.url, kept))
    assert not set(old_keys) & set(nats_authority.fellow_user_keys("victim"))
    # That session holds the name while it installs: no other host or enrollment gets it.
    refused(enroll(leader, "victim"), "FELLOW_NAME_KNOWN")

    # The refused session still works for a name nobody has.
    fresh = claim(leader, session, "newcomer")
    assert fresh.status_code == 200, fresh.text
    assert creds_user_name(fresh.json()["nats_creds"]) == "newcomer"
    refused(enroll(leader, "newcomer"), "FELLOW_NAME_RESERVED")


def test_no_name_is_handed_out_before_the_leader_knows_its_fellows(procs, nats_authority, tmp_path):
    """Until the leader has loaded the fellows it knows (from NATS), every known name would
    read as free: a claim or an enrollment then is a 503, and the session stays unused."""
    wheel = tmp_path / "silentswarm-0.0.0-py3-none-any.whl"
    wheel.write_bytes(b"a stand-in package")
    port = free_port()
    leader = Leader(f"http://127.0.0.1:{port}", token="op-token")
    env = child_env(
        SWARM_NATS_URL=f"nats://127.0.0.1:{free_port()}",  # nobody there: it never loads
        SWARM_LEADER_PORT=str(port),
        SWARM_STATE_DIR=str(tmp_path / "leader-state"),
        SWARM_API_TOKEN="op-token",
        SWARM_ENROLL_TOKEN=FLEET_TOKEN,
        SWARM_BOOTSTRAP_WHEEL=str(wheel),
        **secure_env(nats_authority),
    )
    proc = procs.python("leader", "silentswarm.leader.main", env=env)
    wait_for(
        lambda: proc.poll() is None and leader.get("/api/v1/info")["state_loaded"] is False,
        timeout=20,
        what="the leader to serve before its state is loaded",
    )
    session = create_session(leader)  # unnamed: the host proposes a name
    # (The enrollment token is no account's: the guard gives the accounts 10 s to load first.)
    for response in (enroll(leader, "victim", timeout=30), claim(leader, session, "victim")):
        assert response.status_code == 503, response.text
        assert response.json()["code"] == "LEADER_NOT_READY", response.text
        assert "nats_creds" not in response.text
    path = f"/api/v1/bootstrap/join-sessions/{session['session_id']}"
    assert leader.get(path)["status"] == "created"


# --- 2. the operator token only in the Authorization header -------------------------------------


def test_the_operator_token_in_a_url_is_refused_for_posts_and_gets(leader):
    token = leader.token
    with httpx.Client(base_url=leader.url, timeout=5) as anonymous:
        for method, path in (
            ("POST", "/api/v1/bootstrap/join-sessions"),
            ("POST", "/api/v1/jobs"),
            ("POST", "/api/v1/auth/read-ticket"),
            ("GET", "/api/v1/jobs"),  # reads are public here (loopback): still refused
            ("GET", "/api/v1/workers"),
        ):
            response = anonymous.request(method, f"{path}?access_token={token}", json={})
            assert response.status_code == 401, (method, path, response.text)
            body = response.json()
            assert body["code"] == "UNAUTHORIZED"
            assert "Authorization: Bearer" in body["message"] and "ticket" in body["message"]
            assert token not in response.text
    # Not even next to the right header.
    both = leader.request("POST", f"/api/v1/jobs?access_token={token}", json={})
    assert both.status_code == 401
    assert leader.get("/api/v1/bootstrap/join-sessions") == []
    assert leader.get("/api/v1/jobs") == []


# --- 2b. read tickets -----------------------------------------------------------------------------


def test_a_read_ticket_opens_a_stream_expires_and_opens_nothing_else(procs, nats_server, tmp_path):
    started = leader_process(procs, nats_server, tmp_path, SWARM_API_PUBLIC_READS="0")
    leader = next(started)
    start_agent(procs, nats_server.url, "t1")
    wait_ready(leader, "t1")
    wait_for(lambda: leader.get("/api/v1/workers/t1/logs"), timeout=20, what="t1's first logs")
    stream = "/api/v1/workers/t1/logs/stream?after=0"
    with httpx.Client(base_url=leader.url, timeout=20) as anonymous:
        assert anonymous.get(stream).status_code == 401
        assert anonymous.post("/api/v1/auth/read-ticket").status_code == 401

        answer = leader.request("POST", "/api/v1/auth/read-ticket")
        assert answer.status_code == 200, answer.text
        issued = answer.json()
        assert issued["ttl_s"] == 60 and 55 <= issued["expires_at"] - time.time() <= 61
        ticket = issued["ticket"]
        assert leader.token not in ticket

        # The SSE stream, as a browser's EventSource opens it: events arrive.
        with anonymous.stream("GET", f"{stream}&ticket={ticket}") as response:
            assert response.status_code == 200, response.read()
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("event: logs"):
                    break
        assert anonymous.get(f"/api/v1/jobs?ticket={ticket}").status_code == 200

        # A ticket opens reads only, and cannot mint tickets.
        for path in ("/api/v1/jobs", "/api/v1/auth/read-ticket", "/api/v1/bootstrap/join-sessions"):
            response = anonymous.post(f"{path}?ticket={ticket}", json={})
            assert response.status_code == 401, (path, response.text)
        # A longer life cannot be written in; one signed for another token is refused.
        stamp, _, mac = ticket.partition(".")
        forged = anonymous.get(f"{stream}&ticket={int(stamp) + 3600}.{mac}")
        assert forged.status_code == 403 and forged.json()["code"] == "FORBIDDEN"
        other, _ = ReadTickets("another-token").issue()
        assert anonymous.get(f"{stream}&ticket={other}").status_code == 403
        # A genuine ticket whose minute is over: 401 saying to get a new one.
        expired, _ = ReadTickets(leader.token, wall=lambda: time.time() - 61).issue()
        response = anonymous.get(f"{stream}&ticket={expired}")
        assert response.status_code == 401 and response.json()["code"] == "TICKET_EXPIRED"
        assert "read-ticket" in response.json()["message"]
    assert leader.get("/api/v1/jobs") == []
    started.close()


# --- 3. reads are private off loopback ------------------------------------------------------------

PRIVATE_READS = (
    "/api/v1/info",
    "/api/v1/workers",
    "/api/v1/workers/x1/logs",
    "/api/v1/nodes",
    "/api/v1/cluster",
    "/api/v1/jobs",
    "/api/v1/metrics",
    "/api/v1/purges",
    "/api/v1/bootstrap/join-sessions",
)
OPEN_READS = ("/health", "/ops/join-v2", "/schema/openapi.json", "/api/v1/bootstrap/fellow.sh")


def test_reads_are_private_when_the_leader_listens_off_loopback(procs, nats_server, tmp_path):
    started = leader_process(
        procs,
        nats_server,
        tmp_path,
        SWARM_LEADER_HOST="0.0.0.0",
        SWARM_PUBLIC_NATS_URL="nats://203.0.113.7:4222",
    )
    leader = next(started)  # reached through 127.0.0.1
    proc = procs.started[-1]
    start_agent(procs, nats_server.url, "x1")
    wait_ready(leader, "x1")
    with httpx.Client(base_url=leader.url, timeout=5) as anonymous:
        for path in PRIVATE_READS:
            response = anonymous.get(path)
            assert response.status_code == 401, (path, response.text)
            assert response.json()["code"] == "UNAUTHORIZED"
            assert "x1" not in response.text
        for path in OPEN_READS:
            assert anonymous.get(path).status_code == 200, path
    assert "x1" in leader.workers()  # with the token, as ever
    log = procs.log(proc)
    assert "NO TLS: HTTP listens on 0.0.0.0" in log and "TLS-terminating proxy" in log
    assert "NATS is reached off loopback WITHOUT TLS" in log and "SWARM_PUBLIC_NATS_URL" in log
    assert "every read (GET) needs the operator token" in log
    started.close()

    # The operator may open them on purpose.
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=20)
    opened = leader_process(
        procs,
        nats_server,
        tmp_path / "opted-in",
        SWARM_LEADER_HOST="0.0.0.0",
        SWARM_API_PUBLIC_READS="1",
    )
    leader = next(opened)
    with httpx.Client(base_url=leader.url, timeout=5) as anonymous:
        assert anonymous.get("/api/v1/workers").status_code == 200
        assert anonymous.post("/api/v1/jobs", json={}).status_code == 401
    opened.close()


# --- 4. export directories stay under the export root ---------------------------------------------

EXPORT_FIELD = "artifact_paths.model_export_dir"


def test_an_export_dir_that_leads_out_of_the_root_is_400_at_submit(leader, tmp_path):
    root = tmp_path / "leader-state" / "model_exports"  # the default root
    root.mkdir(parents=True, exist_ok=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "planted").symlink_to(outside)
    for configured in (
        str(outside / "run"),
        "/etc/cron.d",
        "../../outside/run",
        f"{root}/../../outside",
        "planted/run",
        str(root),
    ):
        response = leader.request(
            "POST", "/api/v1/jobs", json={"artifact_paths": {"model_export_dir": configured}}
        )
        assert response.status_code == 400, (configured, response.text)
        body = response.json()
        assert body["code"] == "INVALID_FIELD" and body["field"] == EXPORT_FIELD, body
        assert body["message"].startswith(EXPORT_FIELD)
    assert leader.get("/api/v1/jobs") == []
    assert list(outside.iterdir()) == []
    # Inside the root, relative or absolute, it is taken.
    assert leader.submit(artifact_paths={"model_export_dir": "team/run-1"})["job_id"]
    assert leader.submit(artifact_paths={"model_export_dir": str(root / "run-2")})["job_id"]


def test_a_symlink_planted_in_the_export_root_after_submit_is_not_followed(
    procs, nats_server, leader, tmp_path
):
    start_agent(procs, nats_server.url, "p1")
    wait_ready(leader, "p1")
    root = tmp_path / "leader-state" / "model_exports"
    outside = tmp_path / "outside"
    outside.mkdir()
    spec = tiny(
        name="planted",
        steps=20,
        stages=1,
        shard_push_to_leader=True,
        shard_push_interval_steps=5,
        artifact_paths={"model_export_dir": "victim-run"},
    )
    job_id = leader.submit(**spec)["job_id"]
    # Planted before the first shard arrives (the stage has not even started TensorFlow).
    root.mkdir(parents=True, exist_ok=True)
    (root / "victim-run").symlink_to(outside)
    job = wait_for(
        lambda: (job := leader.job(job_id))["export_error"] and job,
        timeout=120,
        what="the refused write to show on the job",
    )
    assert "never follow symlinks" in job["export_error"], job["export_error"]
    leader.wait_job(job_id, "COMPLETED", timeout=120)
    assert list(outside.iterdir()) == [], "nothing was written through the planted symlink"


# --- 5. bounds on job specs -----------------------------------------------------------------------

ABSURD = [
    ({"steps": 10**23}, "steps"),
    ({"model": {"d_model": 10**9}}, "model.d_model"),
    ({"model": {"n_heads": 10**7}}, "model.n_heads"),
    ({"model": {"vocab_size": 2**40}}, "model.vocab_size"),
    ({"batch_size": 2**40}, "batch_size"),
    ({"micro_batches": 2**30}, "micro_batches"),
    ({"learning_rate": 1e300}, "learning_rate"),
    ({"val_every": 10**15}, "val_every"),
    ({"shard_push_interval_steps": 10**15}, "shard_push_interval_steps"),
    ({"resume_wait_s": 1e18}, "resume_wait_s"),
    ({"max_resumes": 10**9}, "max_resumes"),
    ({"name": "n" * 100_000}, "name"),
]


@pytest.mark.parametrize(("spec", "field"), ABSURD)
def test_absurd_spec_numbers_are_400_naming_the_field(leader, spec, field):
    response = leader.request("POST", "/api/v1/jobs", json=spec)
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["code"] == "INVALID_FIELD" and body["field"] == field, body
    assert leader.get("/api/v1/jobs") == []


def test_swarm_submit_refuses_absurd_numbers_before_it_sends_anything(leader, tmp_path):
    config = tmp_path / "absurd.json"
    config.write_text(json.dumps({"steps": 10**23}))
    done = run_swarm(
        "--leader-url",
        leader.url,
        "submit",
        str(config),
        env=child_env(SWARM_API_TOKEN=leader.token or ""),
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "steps" in done.stderr and str(config) in done.stderr
    assert leader.get("/api/v1/jobs") == []
