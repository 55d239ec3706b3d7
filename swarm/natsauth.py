"""NATS authentication: an operator, an account, and one user per process, as NATS JWTs.

The server trusts the operator (its JWT and the account JWTs go into ``server.conf``). Users
are JWTs signed by the account key, so the leader can mint a user for a new fellow at any time
**without touching the server**: the server checks the signature chain when the fellow
connects. Each fellow's user may publish only its own subjects (see
:func:`fellow_permissions`); the leader's user has full rights.

Revoking a user does touch the server: the account JWT lists revoked user keys
(``revocations``: key -> time; users of that key issued at or before it are refused, and
connected ones disconnected). The server keeps account JWTs in a ``full`` resolver (a
directory, ``jwt/`` here) that takes a newer account JWT at run time from the system account
(``$SYS.REQ.CLAIMS.UPDATE``; :mod:`silentswarm.leader.revocations` sends it with
``system.creds``), and ``server.conf`` preloads the account JWT with the revocations known
here, so a restarted server refuses them too.

Everything lives in one directory (the *authority*), private to its owner (0700/0600):
``operator.nk``, ``account.nk``, ``system.nk`` (seeds), ``server.conf`` (what nats-server
needs), ``leader.creds``, ``system.creds`` (a user of the system account, to push account
JWTs), ``fellows/<name>.creds`` for the users minted here, ``users.json`` (which user keys
each fellow was given, its own and its attempts') and ``revocations.json`` (the revoked keys).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from silentswarm import subjects as topics
from silentswarm.errors import ConfigError, NatsAuthError

ACCOUNT_NAME = "SWARM"
SYSTEM_ACCOUNT_NAME = "SYS"
_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
_UNLIMITED = {"subs": -1, "data": -1, "payload": -1}
_ACCOUNT_LIMITS = {
    **_UNLIMITED,
    "imports": -1,
    "exports": -1,
    "wildcards": True,
    "conn": -1,
    "leaf": -1,
}
# JetStream is enabled for an account by giving it storage (-1: unlimited).
_JETSTREAM_LIMITS = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}


@dataclass(frozen=True)
class Permissions:
    """What a NATS user may publish and subscribe to; empty lists mean no restriction."""

    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    allow_responses: bool = False


def fellow_permissions(prefix: str, fellow_id: str) -> Permissions:
    """A fellow's own, long-lived user: it registers, heartbeats and ships logs on its own
    subjects, hears only its signals and its own inbox, and replies to the signals it gets.
    Nothing of a job: progress, shard pushes and the relay need the attempt's user
    (:func:`attempt_permissions`), which only START hands out."""
    own = {"fellow": fellow_id}
    return Permissions(
        publish=(
            topics.REGISTER.subject(prefix, **own),
            topics.HEARTBEAT.subject(prefix, **own),
            topics.LOG.subject(prefix, **own),
        ),
        subscribe=(
            topics.SIGNAL.subject(prefix, **own),
            f"{topics.inbox_prefix(fellow_id)}.>",
        ),
        allow_responses=True,
    )


def attempt_permissions(
    prefix: str,
    *,
    fellow_id: str,
    job_id: str,
    attempt: int,
    stage: int,
    n_stages: int,
    replica: int = 0,
    n_replicas: int = 1,
    sync_segments: Sequence[int] = (),
) -> Permissions:
    """The user of one placed stage of one attempt: its progress and shard subjects for that
    job, its inbox (the leader's shard acks), and exactly the relay subjects of its own
    boundaries (those of its pipeline ``replica``) and, with replicas, of the rings of the
    segments it may hold (``sync_segments``, their first layers: those of the attempt's
    segments within its layers): its own link to its successor in each, and the link from
    each other replica, any of which may be its predecessor (elastic membership), in the
    direction it sends and the one it hears. Nobody else can read or write them (the
    leader aside), and a new attempt has new subjects."""

    def relay(link: str, direction: str) -> str:
        return topics.RELAY.subject(
            prefix, job=job_id, attempt=attempt, boundary=link, direction=direction
        )

    publish = [
        topics.PROGRESS.subject(prefix, job=job_id, fellow=fellow_id),
        topics.SHARD.subject(prefix, job=job_id, fellow=fellow_id),
    ]
    subscribe = [f"{topics.inbox_prefix(fellow_id)}.>"]
    if stage > 0:  # the upstream boundary: gradients go up, activations come down
        up = topics.relay_link(stage - 1, replica)
        publish.append(relay(up, "bwd"))
        subscribe.append(relay(up, "fwd"))
    if stage + 1 < n_stages:  # the downstream boundary
        down = topics.relay_link(stage, replica)
        publish.append(relay(down, "fwd"))
        subscribe.append(relay(down, "bwd"))
    if n_replicas > 1:
        # Each ring: it connects to its successor (sends "fwd" on its own link) and binds
        # for its predecessor (answers "bwd" on the predecessor's link). Elastic membership
        # may make any other replica its predecessor (a ring without a lost one), so it may
        # bind for each: the links of its segments' rings in this attempt, and no other.
        # Each ring's links have fresh relay tokens, so a member left out of a ring cannot
        # talk to it.
        for segment in sync_segments:
            own = topics.sync_link(segment, replica)
            others = [topics.sync_link(segment, q) for q in range(n_replicas) if q != replica]
            publish += [relay(own, "fwd"), *(relay(link, "bwd") for link in others)]
            subscribe += [relay(own, "bwd"), *(relay(link, "fwd") for link in others)]
    return Permissions(publish=tuple(publish), subscribe=tuple(subscribe))


def attempt_user_name(fellow_id: str, job_id: str, attempt: int) -> str:
    return f"{fellow_id}@{job_id}/{attempt}"


# --- keys and JWTs --------------------------------------------------------------------------


def _nkeys() -> Any:
    try:
        import nkeys
    except ImportError:  # pragma: no cover - a dependency of the package
        raise ConfigError("NATS credentials need the 'nkeys' package: pip install nkeys") from None
    return nkeys


def new_seed(role: str) -> str:
    """A fresh nkey seed for an ``operator``, ``account`` or ``user``."""
    nkeys = _nkeys()
    prefix = {
        "operator": nkeys.PREFIX_BYTE_OPERATOR,
        "account": nkeys.PREFIX_BYTE_ACCOUNT,
        "user": nkeys.PREFIX_BYTE_USER,
    }[role]
    return nkeys.encode_seed(os.urandom(32), prefix).decode()


def public_key(seed: str) -> str:
    return _nkeys().from_seed(seed.encode()).public_key.decode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def encode_jwt(issuer_seed: str, subject: str, name: str, nats: dict[str, Any]) -> str:
    """A NATS v2 JWT: claims about ``subject`` signed by the issuer's nkey."""
    kp = _nkeys().from_seed(issuer_seed.encode())
    claims: dict[str, Any] = {
        "jti": "",
        "iat": int(time.time()),
        "iss": kp.public_key.decode(),
        "name": name,
        "sub": subject,
        "nats": {**nats, "version": 2},
    }
    digest = hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()
    claims["jti"] = base64.b32encode(digest).rstrip(b"=").decode()
    head = _b64(json.dumps(_HEADER, separators=(",", ":")).encode())
    body = _b64(json.dumps(claims, separators=(",", ":")).encode())
    signature = kp.sign(f"{head}.{body}".encode())
    return f"{head}.{body}.{_b64(signature)}"


def decode_jwt_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT (not verified: the server verifies; this reads names)."""
    try:
        body = token.split(".")[1]
        return json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (IndexError, ValueError) as exc:
        raise ConfigError(f"not a NATS user JWT ({exc})") from None


def account_claims(*, jetstream: bool, revocations: Mapping[str, int]) -> dict[str, Any]:
    """The ``nats`` claims of an account: unlimited, JetStream on or off, and the revoked
    user keys (key -> unix time: that key's users issued at or before it are refused)."""
    limits = {**_ACCOUNT_LIMITS, **(_JETSTREAM_LIMITS if jetstream else {})}
    claims: dict[str, Any] = {"type": "account", "limits": limits}
    if revocations:
        claims["revocations"] = dict(sorted(revocations.items()))
    return claims


def merge_revocations(*sources: Mapping[str, int]) -> dict[str, int]:
    """Every key revoked in any source, at the latest time any gives it (a later time
    refuses more of that key's users)."""
    merged: dict[str, int] = {}
    for source in sources:
        for key, at in source.items():
            merged[key] = max(at, merged.get(key, at))
    return merged


def jwt_revocations(token: str) -> dict[str, int]:
    """The revocations an account JWT carries (none: {})."""
    found = decode_jwt_claims(token).get("nats", {}).get("revocations") or {}
    return {str(k): int(v) for k, v in found.items()}


def user_jwt(account_seed: str, user_public: str, name: str, perms: Permissions) -> str:
    nats: dict[str, Any] = {"type": "user", **_UNLIMITED, "pub": {}, "sub": {}}
    if perms.publish:
        nats["pub"] = {"allow": list(perms.publish)}
    if perms.subscribe:
        nats["sub"] = {"allow": list(perms.subscribe)}
    if perms.allow_responses:
        nats["resp"] = {"max": 1, "ttl": 0}
    return encode_jwt(account_seed, user_public, name, nats)


def creds_text(jwt: str, seed: str) -> str:
    """A ``.creds`` file as nats-py, the nats CLI and nsc read it."""
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{jwt}\n"
        "------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{seed}\n"
        "------END USER NKEY SEED------\n\n"
        "*************************************************************\n"
    )


def _creds_jwt(creds: str) -> str:
    lines = creds.splitlines()
    try:
        return lines[lines.index("-----BEGIN NATS USER JWT-----") + 1].strip()
    except (ValueError, IndexError):
        raise ConfigError("not a NATS credentials file (no user JWT)") from None


def creds_user_key(creds: str) -> str:
    """The user's public key (the JWT's subject) in a ``.creds`` file."""
    return str(decode_jwt_claims(_creds_jwt(creds))["sub"])


def creds_user_name(creds: str) -> str:
    """The user name in a ``.creds`` file's JWT (for a fellow: its id)."""
    name = decode_jwt_claims(_creds_jwt(creds)).get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError("the NATS credentials carry no user name")
    return name


def read_creds_user_name(path: Path) -> str:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"SWARM_NATS_CREDS={path}: {exc.strerror}") from None
    try:
        return creds_user_name(text)
    except ConfigError as exc:
        raise ConfigError(f"SWARM_NATS_CREDS={path}: {exc.message}") from None


# --- the authority --------------------------------------------------------------------------


class _Seeds(msgspec.Struct):
    operator: str
    account: str
    system: str


# Attempt users kept per fellow for revocation: a started attempt's user is revoked with its
# fellow while it may still matter; one of an attempt long over publishes only on subjects
# nobody reads (the leader drops a stale attempt's messages). Keeping the newest few bounds
# users.json and the account JWT's revocations (nats-server's 1 MB message limit).
KEPT_ATTEMPT_KEYS = 4


class _Users(msgspec.Struct):
    """``users.json``: the user keys minted for each fellow: its own (``fellows``, every
    one) and its newest attempts' (``attempts``), so that releasing a fellow revokes them;
    ``attempt_names``: each kept attempt key's user name (:func:`attempt_user_name`), so that
    a fellow dropped from one job's attempt loses that user alone."""

    fellows: dict[str, list[str]] = msgspec.field(default_factory=dict)
    attempts: dict[str, list[str]] = msgspec.field(default_factory=dict)
    attempt_names: dict[str, str] = msgspec.field(default_factory=dict)


def write_private(path: Path, text: str) -> None:
    """Write a secret atomically, readable by its owner only (0600) from the first byte."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


class NatsAuthority:
    """The keys that make a swarm's NATS users, kept in one private directory."""

    def __init__(self, directory: Path, seeds: _Seeds) -> None:
        self.dir = directory
        self._seeds = seeds

    @classmethod
    def load(cls, directory: Path) -> NatsAuthority:
        try:
            seeds = _Seeds(
                operator=(directory / "operator.nk").read_text().strip(),
                account=(directory / "account.nk").read_text().strip(),
                system=(directory / "system.nk").read_text().strip(),
            )
        except OSError as exc:
            raise NatsAuthError(
                f"no NATS authority in {directory} ({exc.strerror}); create one with "
                f"'swarm nats-auth init --dir {directory}'"
            ) from None
        return cls(directory, seeds)

    @classmethod
    def load_or_create(cls, directory: Path) -> NatsAuthority:
        """The authority in ``directory``; a new one (keys, server.conf, leader.creds) if
        there is none yet. Existing keys are never replaced: users minted before stay valid."""
        if (directory / "account.nk").exists():
            authority = cls.load(directory)
        else:
            directory.mkdir(parents=True, exist_ok=True)
            directory.chmod(0o700)
            seeds = _Seeds(new_seed("operator"), new_seed("account"), new_seed("account"))
            for name, seed in msgspec.structs.asdict(seeds).items():
                write_private(directory / f"{name}.nk", seed + "\n")
            authority = cls(directory, seeds)
        authority.write_server_config()
        if not authority.leader_creds_path.exists():
            authority.write_creds(authority.leader_creds_path, "swarm-leader", Permissions())
        authority.ensure_system_creds()
        return authority

    @property
    def account_public(self) -> str:
        return public_key(self._seeds.account)

    @property
    def resolver_dir(self) -> Path:
        """Where nats-server keeps the account JWTs it was sent (its ``full`` resolver)."""
        return self.dir / "jwt"

    @property
    def system_creds_path(self) -> Path:
        return self.dir / "system.creds"

    @property
    def _users_path(self) -> Path:
        return self.dir / "users.json"

    @property
    def _revocations_path(self) -> Path:
        return self.dir / "revocations.json"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One writer of users.json / revocations.json at a time (the leader, and
        ``swarm nats-auth fellow`` in another process)."""
        fd = os.open(self.dir / ".users.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read_users(self) -> _Users:
        try:
            return msgspec.json.decode(self._users_path.read_bytes(), type=_Users)
        except FileNotFoundError:
            return _Users()
        except msgspec.DecodeError as exc:
            raise NatsAuthError(f"{self._users_path} is damaged ({exc})") from None

    def _record_user(self, fellow_id: str, creds: str, *, attempt_name: str | None = None) -> None:
        """Keep the user's key as the fellow's own, or (``attempt_name``) as one of its newest
        attempts', with that name."""
        key = creds_user_key(creds)
        with self._locked():
            users = self._read_users()
            if attempt_name is not None:
                held = [*users.attempts.get(fellow_id, []), key]
                users.attempts[fellow_id] = held[-KEPT_ATTEMPT_KEYS:]
                for old in held[:-KEPT_ATTEMPT_KEYS]:
                    users.attempt_names.pop(old, None)
                users.attempt_names[key] = attempt_name
            else:
                users.fellows.setdefault(fellow_id, []).append(key)
            write_private(self._users_path, msgspec.json.encode(users).decode())

    def fellow_user_keys(self, fellow_id: str) -> list[str]:
        """The public keys of the users minted here for ``fellow_id`` that a release revokes:
        its own, and its newest attempts' (:data:`KEPT_ATTEMPT_KEYS`)."""
        users = self._read_users()
        return [*users.fellows.get(fellow_id, []), *users.attempts.get(fellow_id, [])]

    def revocations(self) -> dict[str, int]:
        """The revoked user keys: key -> unix time (users of it issued until then)."""
        try:
            data = self._revocations_path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            return msgspec.json.decode(data, type=dict[str, int])
        except msgspec.DecodeError as exc:
            raise NatsAuthError(f"{self._revocations_path} is damaged ({exc})") from None

    def revoke(self, keys: Mapping[str, int]) -> dict[str, int]:
        """Add revocations (key -> time), forget those keys as fellows' users, and rewrite
        server.conf when there is one (its preload then carries them). Returns them all."""
        with self._locked():
            revoked = merge_revocations(self.revocations(), keys)
            write_private(self._revocations_path, msgspec.json.encode(revoked).decode())
            users = self._read_users()
            for table in (users.fellows, users.attempts):
                for fellow_id, held in list(table.items()):
                    left = [k for k in held if k not in revoked]
                    if left:
                        table[fellow_id] = left
                    else:
                        del table[fellow_id]
            for key in [k for k in users.attempt_names if k in revoked]:
                del users.attempt_names[key]
            write_private(self._users_path, msgspec.json.encode(users).decode())
            # Under the lock too: concurrent revokes (the leader revokes in threads) would
            # share server.conf's temporary file, and a slower one preload fewer revocations.
            if self.server_config_path.exists():
                self.write_server_config()
        return revoked

    def revoke_fellow(self, fellow_id: str, *, at: int | None = None) -> list[str]:
        """Revoke every user minted here for ``fellow_id`` (as of ``at``, default now) and
        remove its dead ``fellows/<id>.creds``; the keys revoked (the server learns of them
        from the account JWT, :meth:`account_jwt`)."""
        keys = self.fellow_user_keys(fellow_id)
        if keys:
            when = int(time.time()) if at is None else at
            self.revoke(dict.fromkeys(keys, when))
            self.fellow_creds_path(fellow_id).unlink(missing_ok=True)
        return keys

    def revoke_attempt(
        self, fellow_id: str, job_id: str, attempt: int, *, at: int | None = None
    ) -> list[str]:
        """Revoke the users minted for ``fellow_id``'s stages of one job's attempt (a fellow
        whose replica was dropped while the job goes on), leaving its own user and its other
        jobs' alone; the keys revoked."""
        name = attempt_user_name(fellow_id, job_id, attempt)
        users = self._read_users()
        keys = [k for k in users.attempts.get(fellow_id, []) if users.attempt_names.get(k) == name]
        if keys:
            self.revoke(dict.fromkeys(keys, int(time.time()) if at is None else at))
        return keys

    def account_jwt(self, extra_revocations: Mapping[str, int] | None = None) -> str:
        """The swarm account's JWT, signed by the operator, with every revocation known here
        (and ``extra_revocations``)."""
        revoked = merge_revocations(self.revocations(), extra_revocations or {})
        return encode_jwt(
            self._seeds.operator,
            self.account_public,
            ACCOUNT_NAME,
            account_claims(jetstream=True, revocations=revoked),
        )

    def ensure_system_creds(self) -> Path:
        """``system.creds``: a user of the system account (what may push account JWTs)."""
        if not self.system_creds_path.exists():
            seed = new_seed("user")
            jwt = user_jwt(self._seeds.system, public_key(seed), "swarm-system", Permissions())
            write_private(self.system_creds_path, creds_text(jwt, seed))
        return self.system_creds_path

    @property
    def server_config_path(self) -> Path:
        return self.dir / "server.conf"

    @property
    def leader_creds_path(self) -> Path:
        return self.dir / "leader.creds"

    def fellow_creds_path(self, fellow_id: str) -> Path:
        return self.dir / "fellows" / f"{fellow_id}.creds"

    def server_config(self) -> str:
        """What nats-server needs to trust this authority (``-c`` it, or ``include`` it)."""
        operator_public = public_key(self._seeds.operator)
        system_public = public_key(self._seeds.system)
        account_public = self.account_public
        operator = encode_jwt(
            self._seeds.operator,
            operator_public,
            "silentswarm",
            {"type": "operator", "system_account": system_public},
        )
        system = encode_jwt(
            self._seeds.operator,
            system_public,
            SYSTEM_ACCOUNT_NAME,
            account_claims(jetstream=False, revocations={}),
        )
        account = self.account_jwt()
        return (
            "# SilentSwarm NATS authority: written by swarm; users are JWTs signed by the\n"
            f"# account {ACCOUNT_NAME} ({account_public}).\n"
            f'operator: "{operator}"\n'
            f"system_account: {system_public}\n"
            "# A resolver that takes newer account JWTs (revocations) from the system account\n"
            "# at run time and keeps them in dir; the preload carries those known when written.\n"
            "resolver: {\n"
            "  type: full\n"
            f"  dir: {json.dumps(str(self.resolver_dir.resolve()))}\n"
            "  allow_delete: false\n"
            "}\n"
            "resolver_preload: {\n"
            f'  {system_public}: "{system}"\n'
            f'  {account_public}: "{account}"\n'
            "}\n"
        )

    def write_server_config(self) -> Path:
        write_private(self.server_config_path, self.server_config())
        return self.server_config_path

    def user_creds(self, name: str, perms: Permissions) -> str:
        seed = new_seed("user")
        jwt = user_jwt(self._seeds.account, public_key(seed), name, perms)
        return creds_text(jwt, seed)

    def fellow_creds(self, prefix: str, fellow_id: str) -> str:
        """A fresh user of the fellow's own (recorded in users.json, to revoke it later)."""
        creds = self.user_creds(fellow_id, fellow_permissions(prefix, fellow_id))
        self._record_user(fellow_id, creds)
        return creds

    def attempt_creds(
        self,
        prefix: str,
        *,
        fellow_id: str,
        job_id: str,
        attempt: int,
        stage: int,
        n_stages: int,
        replica: int = 0,
        n_replicas: int = 1,
        sync_segments: Sequence[int] = (),
    ) -> str:
        """A fresh user for one placed stage of one attempt (never stored here; its key is
        recorded as the fellow's, so that releasing the fellow revokes it too)."""
        perms = attempt_permissions(
            prefix,
            fellow_id=fellow_id,
            job_id=job_id,
            attempt=attempt,
            stage=stage,
            n_stages=n_stages,
            replica=replica,
            n_replicas=n_replicas,
            sync_segments=sync_segments,
        )
        name = attempt_user_name(fellow_id, job_id, attempt)
        creds = self.user_creds(name, perms)
        self._record_user(fellow_id, creds, attempt_name=name)
        return creds

    def write_creds(self, path: Path, name: str, perms: Permissions) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, self.user_creds(name, perms))
        return path

    def write_fellow_creds(self, prefix: str, fellow_id: str, path: Path | None = None) -> Path:
        """A fresh user of the fellow's own, written to ``path`` (default: in the authority)."""
        path = path or self.fellow_creds_path(fellow_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, self.fellow_creds(prefix, fellow_id))
        return path
