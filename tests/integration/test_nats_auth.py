"""NATS authentication for real: a nats-server that trusts only the swarm's authority, a
leader with its own user, fellows each with theirs; the server itself refuses what a
fellow's user may not do."""

from __future__ import annotations

import asyncio
import stat
import subprocess
from pathlib import Path

import httpx
import nats
import pytest

from silentswarm import subjects as topics
from silentswarm.natsauth import NatsAuthority, creds_user_name
from silentswarm.natsd import start_nats_server
from tests.conftest import NatsControl, leader_process, secure_env, start_agent
from tests.helpers import Leader, child_env, until, wait_for
from tests.integration.test_jobs import tiny, wait_ready

pytestmark = pytest.mark.timeout(240)


async def _connect(url: str, creds: Path | None, errors: list[str], inbox: str = "_INBOX"):
    async def error_cb(exc: Exception) -> None:
        errors.append(str(exc))

    options = {"user_credentials": str(creds)} if creds else {}
    return await nats.connect(
        url,
        inbox_prefix=inbox,
        error_cb=error_cb,
        allow_reconnect=False,
        max_reconnect_attempts=0,
        **options,
    )


async def request_until_heard(nc, subject: str, payload: bytes, timeout: float = 10.0):
    """A request, asked again while the server answers "no responders": a subscription just
    flushed on another connection may reach the server's interest a moment later (seen once
    under load, in the full suite)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await nc.request(subject, payload, timeout=5)
        except nats.errors.NoRespondersError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.05)


def test_a_fellow_cannot_pose_as_another_or_read_its_inbox(
    secure_nats: NatsControl, nats_authority: NatsAuthority
):
    f1_creds = nats_authority.write_fellow_creds("swarm", "f1")

    async def main() -> None:
        leader_errors: list[str] = []
        leader = await _connect(secure_nats.url, nats_authority.leader_creds_path, leader_errors)
        heartbeats: list[str] = []
        inbox_f2: list[bytes] = []

        async def on_hb(msg) -> None:
            heartbeats.append(msg.subject)

        async def answer(msg) -> None:
            await msg.respond(b"welcome")

        await leader.subscribe("swarm.hb.*", cb=on_hb)
        await leader.subscribe("swarm.register.*", cb=answer)
        await leader.flush()

        errors: list[str] = []
        f1 = await _connect(secure_nats.url, f1_creds, errors, inbox="_INBOX.f1")
        # What f1 may do: its own heartbeat, a request whose reply comes to its own inbox,
        # and an answer to a signal the leader sends it.
        await f1.publish("swarm.hb.f1", b"mine")
        reply = await f1.request("swarm.register.f1", b"hello", timeout=5)
        assert reply.data == b"welcome"

        async def ack(msg) -> None:
            await msg.respond(b"ack")

        await f1.subscribe("swarm.sig.f1", cb=ack)
        await f1.flush()
        assert (await request_until_heard(leader, "swarm.sig.f1", b"STOP")).data == b"ack"

        # What it may not: another fellow's heartbeat, another's inbox and signals, signals.
        await f1.publish("swarm.hb.f2", b"forged")
        await f1.publish("swarm.sig.f2", b"forged signal")

        async def steal(msg) -> None:
            inbox_f2.append(msg.data)

        await f1.subscribe("_INBOX.f2.>", cb=steal)
        await f1.subscribe("swarm.sig.f2", cb=steal)
        await f1.flush()
        await leader.publish("_INBOX.f2.x", b"secret reply for f2")
        await leader.flush()
        await until(lambda: len(errors) >= 4, timeout=10, what="4 permission errors")
        await f1.publish("swarm.hb.f1", b"still mine")
        await f1.flush()
        await until(
            lambda: heartbeats.count("swarm.hb.f1") == 2,
            timeout=10,
            what="f1's second heartbeat",
        )
        assert heartbeats == ["swarm.hb.f1", "swarm.hb.f1"], "the forged heartbeat never arrived"
        assert inbox_f2 == []
        joined = " ".join(errors).lower()
        assert 'publish to "swarm.hb.f2"' in joined and 'publish to "swarm.sig.f2"' in joined
        assert 'subscription to "_inbox.f2.>"' in joined
        assert 'subscription to "swarm.sig.f2"' in joined
        assert leader_errors == []

        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await _connect(secure_nats.url, None, [])
        await f1.close()
        await leader.close()

    asyncio.run(main())


@pytest.mark.parametrize("inbox", ["_INBOX", topics.LEADER_INBOX], ids=["default", "leader's"])
def test_a_fellow_named_after_the_leader_s_inbox_reads_its_answers_only_under_the_default(
    secure_nats: NatsControl, nats_authority: NatsAuthority, inbox: str
):
    """Every signal shows the leader's reply subject; a fellow enrolled under the nuid in it
    may read ``_INBOX.<nuid>.>``. Under its own prefix the leader's answers stay its own."""

    async def main() -> tuple[list[bytes], list[str]]:
        leader = await _connect(secure_nats.url, nats_authority.leader_creds_path, [], inbox)
        f1 = await _connect(
            secure_nats.url, nats_authority.write_fellow_creds("swarm", "f1"), [], "_INBOX.f1"
        )
        replies: list[str] = []

        async def ack(msg) -> None:
            replies.append(msg.reply)
            await msg.respond(b"ack")

        await f1.subscribe("swarm.sig.f1", cb=ack)
        await f1.flush()
        await request_until_heard(leader, "swarm.sig.f1", b"STOP")
        nuid = replies[0].split(".")[1]
        errors: list[str] = []
        spy = await _connect(
            secure_nats.url, nats_authority.write_fellow_creds("swarm", nuid), errors
        )
        stolen: list[bytes] = []

        async def steal(msg) -> None:
            stolen.append(msg.data)

        await spy.subscribe(f"_INBOX.{nuid}.>", cb=steal)
        await spy.flush()
        assert (await request_until_heard(leader, "swarm.sig.f1", b"STOP")).data == b"ack"
        await spy.flush()
        for nc in (spy, f1, leader):
            await nc.close()
        return stolen, errors

    stolen, errors = asyncio.run(main())
    assert stolen == ([b"ack"] if inbox == "_INBOX" else []), stolen
    assert errors == [], "the spy's subscription is one its permissions allow"


def test_an_authenticated_swarm_trains_over_the_relay(
    procs, secure_nats: NatsControl, nats_authority: NatsAuthority, secure_leader: Leader
):
    assert secure_leader.get("/api/v1/info")["nats_auth"] == "jwt"
    # One fellow over NATS's WebSocket listener (a host that may only make HTTP(S)
    # connections), one over plain NATS; no data addresses: the stages use the relay.
    urls = {"a1": secure_nats.websocket_url, "a2": secure_nats.url}
    for name, url in urls.items():
        creds = nats_authority.write_fellow_creds("swarm", name)
        start_agent(procs, url, name, SWARM_NATS_CREDS=str(creds), SWARM_DATA_ADDRESS="")
    wait_ready(secure_leader, "a1", "a2")
    job_id = secure_leader.submit(**tiny(name="authenticated", steps=12, stages=2))["job_id"]
    job = secure_leader.wait_job(job_id, "COMPLETED", timeout=150)
    assert job["placement"]["transport"] == "tunnel"
    assert job["final_loss"] is not None


def test_credentials_bind_the_fellow_id_and_a_leader_needs_its_own(
    procs, secure_nats: NatsControl, nats_authority: NatsAuthority, tmp_path: Path
):
    creds = nats_authority.write_fellow_creds("swarm", "real-one")
    imposter = start_agent(procs, secure_nats.url, "imposter", SWARM_NATS_CREDS=str(creds))
    assert imposter.wait(timeout=30) == 2
    assert "are for fellow 'real-one'" in procs.log(imposter)

    leader = procs.python(
        "leader",
        "silentswarm.leader.main",
        env=child_env(
            SWARM_DEV="0",
            SWARM_NATS_URL=secure_nats.url,
            SWARM_LEADER_PORT="0",
            SWARM_STATE_DIR=str(tmp_path / "leader-state"),
        ),
    )
    assert leader.wait(timeout=30) == 2
    log = procs.log(leader)
    assert "SWARM_NATS_CREDS" in log and "--dev" in log and "Traceback" not in log


def test_without_credentials_a_fellow_is_refused_and_says_why(
    procs, secure_nats: NatsControl, secure_leader: Leader
):
    agent = start_agent(procs, secure_nats.url, "anonymous")
    wait_for(
        lambda: "refused our credentials" in procs.log(agent),
        timeout=30,
        what="the agent to report the refusal",
    )
    assert "anonymous" not in secure_leader.workers()


def _certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 it signed (openssl)."""
    ca_key, ca, key, csr, cert = (
        directory / n for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem")
    )
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")

    def openssl(*args: str) -> None:
        done = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
        "-days",
        "1",
        "-subj",
        "/CN=swarm-test-ca",
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(csr),
        "-subj",
        "/CN=127.0.0.1",
    )
    openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-out",
        str(cert),
        "-days",
        "1",
        "-extfile",
        str(ext),
    )
    return ca, cert, key


def test_the_leader_and_a_fellow_reach_nats_over_tls_with_their_users(
    procs, nats_authority: NatsAuthority, tmp_path: Path
):
    ca, cert, key = _certificates(tmp_path)
    config = tmp_path / "tls.conf"
    config.write_text(
        f'include "{nats_authority.server_config_path.name}"\n'
        f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n}}\n'
    )
    # nats-server resolves include paths from the including file's folder.
    (tmp_path / nats_authority.server_config_path.name).write_text(
        nats_authority.server_config_path.read_text()
    )
    server = start_nats_server(
        host="127.0.0.1",
        port=0,
        store_dir=tmp_path / "tls-store",
        log_path=tmp_path / "tls-nats.log",
        config=config,
        tie_to_parent=True,
    )
    try:
        url = server.url.replace("nats://", "tls://")
        started = leader_process(
            procs,
            _Url(url),
            tmp_path,
            SWARM_NATS_TLS_CA=str(ca),
            **secure_env(nats_authority),
        )
        leader = next(started)
        creds = nats_authority.write_fellow_creds("swarm", "tls-1")
        start_agent(procs, url, "tls-1", SWARM_NATS_CREDS=str(creds), SWARM_NATS_TLS_CA=str(ca))
        wait_ready(leader, "tls-1")
        assert leader.get("/api/v1/info")["nats_connected"]
        started.close()
    finally:
        server.stop()


class _Url:
    """Enough of a NatsControl for leader_process: the URL it joins."""

    def __init__(self, url: str) -> None:
        self.url = url


def test_a_fleet_fellow_enrolls_with_the_shared_token_and_gets_its_own_user(
    procs, secure_nats: NatsControl, nats_authority: NatsAuthority, tmp_path: Path
):
    env = {**secure_env(nats_authority), "SWARM_ENROLL_TOKEN": "fleet-secret"}
    started = leader_process(procs, secure_nats, tmp_path, **env)
    leader = next(started)
    state = tmp_path / "fleet-1-state"
    start_agent(
        procs,
        secure_nats.url,
        "fleet-1",
        SWARM_ENROLL_TOKEN="fleet-secret",
        SWARM_LEADER_URL=leader.url,
        SWARM_STATE_DIR=str(state),
    )
    wait_ready(leader, "fleet-1")
    creds = state / "nats.creds"
    assert stat.S_IMODE(creds.stat().st_mode) == 0o600
    assert creds_user_name(creds.read_text()) == "fleet-1"

    # A live fellow's name cannot be taken; a wrong token is refused, and the agent says so.
    taken = httpx.post(
        f"{leader.url}/api/v1/bootstrap/enroll",
        json={"fellow_name": "fleet-1"},
        headers={"authorization": "Bearer fleet-secret"},
        timeout=10,
    )
    assert taken.status_code == 409 and taken.json()["code"] == "FELLOW_ID_IN_USE"
    wrong = start_agent(
        procs,
        secure_nats.url,
        "fleet-2",
        SWARM_ENROLL_TOKEN="guessed",
        SWARM_LEADER_URL=leader.url,
        SWARM_STATE_DIR=str(tmp_path / "fleet-2-state"),
    )
    assert wrong.wait(timeout=30) == 2
    assert "wrong enrollment token" in procs.log(wrong)
    assert not (tmp_path / "fleet-2-state" / "nats.creds").exists()
    started.close()
