"""The NATS authority: keys, JWTs, creds files and each fellow's permissions (no server here;
tests/integration/test_nats_auth.py shows a real nats-server enforcing them)."""

from __future__ import annotations

import stat

import nkeys
import pytest

from silentswarm.errors import ConfigError, NatsAuthError
from silentswarm.natsauth import (
    NatsAuthority,
    Permissions,
    attempt_permissions,
    creds_user_name,
    decode_jwt_claims,
    encode_jwt,
    fellow_permissions,
    new_seed,
    public_key,
)


def test_a_fellow_may_publish_only_its_own_subjects_and_hear_only_its_own():
    perms = fellow_permissions("swarm", "gpu-7")
    # Nothing of a job: progress, shards and the relay need an attempt's user.
    assert set(perms.publish) == {"swarm.register.gpu-7", "swarm.hb.gpu-7", "swarm.log.gpu-7"}
    assert set(perms.subscribe) == {"swarm.sig.gpu-7", "_INBOX.gpu-7.>"}
    assert perms.allow_responses  # it answers the signals it gets
    assert not any("gpu-8" in s or s == ">" for s in perms.publish + perms.subscribe)


@pytest.mark.parametrize(
    ("stage", "n_stages", "relay_pub", "relay_sub"),
    [
        (0, 1, set(), set()),
        (0, 3, {"swarm.relay.j1.2.0.fwd"}, {"swarm.relay.j1.2.0.bwd"}),
        (
            1,
            3,
            {"swarm.relay.j1.2.0.bwd", "swarm.relay.j1.2.1.fwd"},
            {"swarm.relay.j1.2.0.fwd", "swarm.relay.j1.2.1.bwd"},
        ),
        (2, 3, {"swarm.relay.j1.2.1.bwd"}, {"swarm.relay.j1.2.1.fwd"}),
    ],
)
def test_an_attempt_user_reaches_exactly_its_stage_of_that_attempt(
    stage, n_stages, relay_pub, relay_sub
):
    perms = attempt_permissions(
        "swarm", fellow_id="gpu-7", job_id="j1", attempt=2, stage=stage, n_stages=n_stages
    )
    own = {"swarm.progress.j1.gpu-7", "swarm.shard.j1.gpu-7"}
    assert set(perms.publish) == own | relay_pub
    assert set(perms.subscribe) == {"_INBOX.gpu-7.>"} | relay_sub
    assert not perms.allow_responses
    assert not any("*" in s or ">" in s for s in perms.publish)


@pytest.mark.parametrize(
    ("stage", "n_stages", "replica", "n_replicas", "relay_pub", "relay_sub"),
    [
        # Replica 0 of a replicated job keeps the plain boundary subjects.
        (
            0,
            2,
            0,
            2,
            {"r.0.fwd", "r.g0-0.fwd", "r.g0-1.bwd"},
            {"r.0.bwd", "r.g0-0.bwd", "r.g0-1.fwd"},
        ),
        # Replica 1's boundaries are its own; its ring links are the mirror of replica 0's.
        (
            1,
            2,
            1,
            2,
            {"r.r1-0.bwd", "r.g1-1.fwd", "r.g1-0.bwd"},
            {"r.r1-0.fwd", "r.g1-1.bwd", "r.g1-0.fwd"},
        ),
        # A ring of three: replica 0 sends to 1 and hears from 2, or (elastic membership:
        # a ring without 2) from 1; never another stage's ring.
        (
            0,
            1,
            0,
            3,
            {"r.g0-0.fwd", "r.g0-1.bwd", "r.g0-2.bwd"},
            {"r.g0-0.bwd", "r.g0-1.fwd", "r.g0-2.fwd"},
        ),
        (
            1,
            3,
            2,
            3,
            {"r.r2-0.bwd", "r.r2-1.fwd", "r.g1-2.fwd", "r.g1-0.bwd", "r.g1-1.bwd"},
            {"r.r2-0.fwd", "r.r2-1.bwd", "r.g1-2.bwd", "r.g1-0.fwd", "r.g1-1.fwd"},
        ),
        # No replicas: no ring subjects at all.
        (0, 1, 0, 1, set(), set()),
    ],
)
def test_an_attempt_user_of_a_replica_reaches_its_pipeline_and_its_ring_links(
    stage, n_stages, replica, n_replicas, relay_pub, relay_sub
):
    perms = attempt_permissions(
        "swarm",
        fellow_id="gpu-7",
        job_id="j1",
        attempt=2,
        stage=stage,
        n_stages=n_stages,
        replica=replica,
        n_replicas=n_replicas,
        sync_segments=[stage],  # one split: stage s holds one segment, named s here
    )

    def full(short: set[str]) -> set[str]:
        return {s.replace("r.", "swarm.relay.j1.2.", 1) for s in short}

    own = {"swarm.progress.j1.gpu-7", "swarm.shard.j1.gpu-7"}
    assert set(perms.publish) == own | full(relay_pub)
    assert set(perms.subscribe) == {"_INBOX.gpu-7.>"} | full(relay_sub)


def test_the_two_ends_of_every_ring_link_send_what_the_other_hears():
    k = 3
    perms = [
        attempt_permissions(
            "swarm",
            fellow_id=f"f{r}",
            job_id="j1",
            attempt=1,
            stage=0,
            n_stages=1,
            replica=r,
            n_replicas=k,
            sync_segments=[0],
        )
        for r in range(k)
    ]
    for r in range(k):
        nxt = (r + 1) % k
        link = f"swarm.relay.j1.1.g0-{r}"
        assert f"{link}.fwd" in perms[r].publish and f"{link}.fwd" in perms[nxt].subscribe
        assert f"{link}.bwd" in perms[nxt].publish and f"{link}.bwd" in perms[r].subscribe


def test_a_jwt_is_signed_by_its_issuer_and_names_its_subject():
    account = new_seed("account")
    user = new_seed("user")
    token = encode_jwt(account, public_key(user), "f1", {"type": "user"})
    head, body, signature = token.split(".")
    claims = decode_jwt_claims(token)
    assert claims["iss"] == public_key(account) and claims["sub"] == public_key(user)
    assert claims["name"] == "f1" and claims["nats"] == {"type": "user", "version": 2}
    assert public_key(account).startswith("A") and public_key(user).startswith("U")
    # The signature verifies with the issuer's public key.
    import base64

    import nacl.signing

    raw = nkeys.from_seed(account.encode())
    verify = nacl.signing.VerifyKey(bytes(raw._keys.verify_key))
    sig = base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4))
    verify.verify(f"{head}.{body}".encode(), sig)


def test_the_authority_is_created_once_privately_and_reloaded(tmp_path):
    directory = tmp_path / "auth"
    first = NatsAuthority.load_or_create(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for name in (
        "operator.nk",
        "account.nk",
        "system.nk",
        "leader.creds",
        "system.creds",
        "server.conf",
    ):
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600, name
    again = NatsAuthority.load_or_create(directory)
    assert again.account_public == first.account_public  # users minted before stay valid
    conf = first.server_config_path.read_text()
    assert "operator:" in conf and "type: full" in conf and first.account_public in conf


def test_fellow_creds_carry_the_fellow_name_and_a_seed(tmp_path):
    authority = NatsAuthority.load_or_create(tmp_path / "auth")
    text = authority.fellow_creds("swarm", "joined-3")
    assert creds_user_name(text) == "joined-3"
    assert "BEGIN USER NKEY SEED" in text
    path = authority.write_fellow_creds("swarm", "joined-3")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    leader = authority.leader_creds_path.read_text()
    jwt = leader.splitlines()[1]
    nats = decode_jwt_claims(jwt)["nats"]
    assert nats["pub"] == {} and nats["sub"] == {}  # the leader has full rights


def test_a_missing_authority_and_bad_creds_say_what_to_do(tmp_path):
    with pytest.raises(NatsAuthError, match="swarm nats-auth init"):
        NatsAuthority.load(tmp_path / "none")
    with pytest.raises(ConfigError, match="no user JWT"):
        creds_user_name("not a creds file")


def test_permissions_default_to_full_rights():
    assert Permissions() == Permissions(publish=(), subscribe=(), allow_responses=False)
