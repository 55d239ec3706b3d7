"""Remote onboarding: the package a new machine installs, and join sessions.

A join session is created by an operator (operator token) and handed to a remote host as one
command line. Its single-use token is exchanged once (``claim``) for what the host needs (the
NATS URL, its fellow name, the package's sha256) and a session secret it then uses to stream
its install log back; a used or expired token is refused and nothing is installed. The
session is ``created`` -> ``installing`` (claimed) -> ``registered`` (the fellow registered)
or ``failed`` (the script said so, or the session expired unused).

The package is the wheel of exactly the running version: located when the leader starts
(cached, or shipped with the .deb), or built once from the source checkout on the first
request that needs it (in a temporary copy: the checkout is never written to), then cached;
never per request.
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import hmac
import logging
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import msgspec

from silentswarm import __version__
from silentswarm.errors import NotFoundError
from silentswarm.leader.errors import JoinGoneError, JoinRefusedError, PackageUnavailableError
from silentswarm.leader.naming import NameState, settle_fellow_name
from silentswarm.redact import redact
from silentswarm.types.onboarding import JoinSession, JoinSessionRecord, SessionLogLine

log = logging.getLogger(__name__)
LOG_LINES = 5000  # kept per session
# The newest of them the store keeps with the session (its record is written at most once a
# flush while the installer logs): what a leader restart leaves of the log.
STORED_LOG_BYTES = 64 * 1024
LINE_CHARS = 2000  # a line's most characters, kept and stored
REDACT_MARGIN = 256  # what the redaction sees past the cut (a secret is shorter)
# A log-only change (lines, their count) is written at most this often; a change of status
# at the next flush.
LOG_SAVE_S = 2.0
# An ended session stays listed (and stored) this long after it ended: a week, the longest
# a session may be open (services.onboarding.MAX_SESSION_TTL_S).
KEEP_ENDED_S = 7 * 86_400.0
# An installing session whose fellow has not registered this long after the claim failed.
INSTALL_LIMIT_S = 86_400.0


class _Entry:
    def __init__(self, session: JoinSession, token_hash: bytes) -> None:
        self.session = session
        self.token_hash = token_hash
        self.secret_hash: bytes | None = None
        self.lines: list[SessionLogLine] = []
        self.changed = asyncio.Event()

    @classmethod
    def of(cls, record: JoinSessionRecord) -> _Entry:
        entry = cls(record.session, bytes.fromhex(record.token_sha256))
        entry.take(record)
        entry.lines = [line for line in record.lines if line.seq <= record.session.log_lines]
        return entry

    def take(self, record: JoinSessionRecord) -> None:
        """The session and its installer secret as ``record`` has them."""
        self.session = record.session
        secret = record.secret_sha256
        self.secret_hash = None if secret is None else bytes.fromhex(secret)

    def record(self) -> JoinSessionRecord:
        secret = None if self.secret_hash is None else self.secret_hash.hex()
        return JoinSessionRecord(
            session=self.session,
            token_sha256=self.token_hash.hex(),
            secret_sha256=secret,
            lines=self.newest_lines(STORED_LOG_BYTES),
        )

    def newest_lines(self, budget: int) -> list[SessionLogLine]:
        """The newest lines whose JSON (escapes included) fits in ``budget`` bytes."""
        kept: list[SessionLogLine] = []
        for line in reversed(self.lines):
            budget -= len(msgspec.json.encode(line)) + 1
            if budget < 0:
                break
            kept.append(line)
        kept.reverse()
        return kept


def _hash(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


class JoinSessions:
    """The sessions. Each change marks its session ``dirty`` for the leader's store, which
    writes it (:meth:`take_dirty`, :meth:`record`) and restores them when the leader starts
    (:meth:`restore`): a session outlives a leader restart, its token and secret as hashes,
    with the newest of its install log's lines (:data:`STORED_LOG_BYTES`; the lines are
    redacted as they come, since they are shown and stored). A creation and a claim are written
    before the API answers (``OnboardingService``), so a restart can never hand a used token
    out again. An installing session whose fellow never registers fails
    :data:`INSTALL_LIMIT_S` after its claim; an ended session is dropped :data:`KEEP_ENDED_S`
    after it ended."""

    def __init__(self, *, wall: Callable[[], float] = time.time) -> None:
        self._wall = wall
        self._entries: dict[str, _Entry] = {}
        self.dirty: set[str] = set()
        # Sessions whose log alone changed since it was written, and when it last was.
        self._log_dirty: set[str] = set()
        self._log_saved: dict[str, float] = {}

    def restore(self, records: list[JoinSessionRecord]) -> None:
        """The sessions the store kept (a session already here stays as it is)."""
        for record in records:
            if record.session.session_id not in self._entries:
                self._entries[record.session.session_id] = _Entry.of(record)

    def take_dirty(self) -> list[str]:
        """The changed sessions' ids, no longer dirty (:meth:`prune` first); the caller
        writes each one's :meth:`record` (None: dropped, to delete) and puts the id back in
        ``dirty`` when that fails. A session whose log alone changed comes at most every
        :data:`LOG_SAVE_S` (an installer may post lines many times a second)."""
        self.prune()
        now = self._wall()
        for session_id in self._log_dirty:
            if now - self._log_saved.get(session_id, -math.inf) >= LOG_SAVE_S:
                self.dirty.add(session_id)
        for session_id in self.dirty & self._log_dirty:
            self._log_saved[session_id] = now
        self._log_dirty -= self.dirty
        out = sorted(self.dirty)
        self.dirty.clear()
        return out

    def record(self, session_id: str) -> JoinSessionRecord | None:
        """What the store keeps of a session now; None when it was dropped."""
        entry = self._entries.get(session_id)
        return None if entry is None else entry.record()

    def snapshot(self, session_id: str) -> JoinSessionRecord:
        """A copy of a session's state, for :meth:`put_back` when it could not be saved."""
        record = self._entry(session_id).record()
        return msgspec.structs.replace(record, session=msgspec.structs.replace(record.session))

    def put_back(self, before: JoinSessionRecord) -> None:
        """Undo a change the store could not save: the session as it was (not dirty: the
        store holds that, or nothing)."""
        self._entry(before.session.session_id).take(before)
        self.dirty.discard(before.session.session_id)

    def drop(self, session_id: str) -> None:
        """Forget a session the store never saved (not dirty)."""
        self._entries.pop(session_id, None)
        self.dirty.discard(session_id)
        self._forget_log(session_id)

    def _forget_log(self, session_id: str) -> None:
        self._log_dirty.discard(session_id)
        self._log_saved.pop(session_id, None)

    def settle(self, registered_at: Callable[[str], float | None]) -> None:
        """Installing sessions whose fellow registered since the claim (``registered_at``: when
        a fellow last registered, None when unknown) are done; one still waiting
        :data:`INSTALL_LIMIT_S` after its claim failed."""
        now = self._wall()
        for entry in self._entries.values():
            session = entry.session
            if session.status != "installing" or not session.fellow_name:
                continue
            claimed = session.claimed_at or 0.0
            seen = registered_at(session.fellow_name)
            if seen is not None and seen >= claimed:
                self.fellow_registered(session.fellow_name)
            elif now - claimed > INSTALL_LIMIT_S:
                session.status = "failed"
                session.reason = "its fellow never registered"
                self.dirty.add(session.session_id)
                self._wake(entry)

    def prune(self) -> None:
        """Drop the sessions that ended (or expired) over :data:`KEEP_ENDED_S` ago."""
        now = self._wall()
        for session_id, entry in list(self._entries.items()):
            self._expire(entry)
            session = entry.session
            ended = session.expires_at if session.registered_at is None else session.registered_at
            if session.claimed_at is not None and session.registered_at is None:
                ended = max(ended, session.claimed_at + INSTALL_LIMIT_S)
            if session.status in ("registered", "failed") and now - ended > KEEP_ENDED_S:
                del self._entries[session_id]
                self._forget_log(session_id)
                self.dirty.add(session_id)

    def create(self, *, fellow_name: str | None, ttl_s: float) -> tuple[JoinSession, str]:
        """A new session and its single-use token (returned once, stored only as a hash)."""
        now = self._wall()
        session = JoinSession(
            session_id=secrets.token_hex(6),
            fellow_name=fellow_name,
            status="created",
            created_at=now,
            expires_at=now + ttl_s,
        )
        token = secrets.token_urlsafe(24)
        self._entries[session.session_id] = _Entry(session, _hash(token))
        self.dirty.add(session.session_id)
        return session, token

    def get(self, session_id: str) -> JoinSession:
        entry = self._entry(session_id)
        self._expire(entry)
        return entry.session

    def list(self) -> list[JoinSession]:
        for entry in self._entries.values():
            self._expire(entry)
        return sorted((e.session for e in self._entries.values()), key=lambda s: s.created_at)

    def claim(
        self,
        session_id: str,
        token: str,
        proposed_name: str | None = None,
        state_of: Callable[[str], NameState] = lambda _: NameState.FREE,
    ) -> tuple[JoinSession, str]:
        """Exchange the single-use token for the session secret the installer then uses.

        The fellow's name is settled here (leader.naming): the operator's, else the host's
        proposal, else a fresh one; its NATS user is bound to it. ``state_of`` says what the
        leader knows of a name. A refused name leaves the session unclaimed."""
        entry = self._entry(session_id)
        if not hmac.compare_digest(_hash(token), entry.token_hash):
            raise JoinRefusedError("this join token is not the session's; nothing was installed")
        self._expire(entry)
        if entry.session.status == "failed" and entry.session.claimed_at is None:
            raise JoinGoneError("this join session expired; ask the operator for a new one")
        if entry.session.claimed_at is not None:
            raise JoinGoneError("this join token was already used; ask for a new session")

        def known(name: str) -> NameState:
            state = state_of(name)
            if state is NameState.FREE and self.holds(name, other_than=session_id):
                return NameState.RESERVED
            return state

        name = settle_fellow_name(
            operator_name=entry.session.fellow_name,
            proposed_name=proposed_name,
            state_of=known,
            fresh=lambda: f"fellow-{secrets.token_hex(3)}",
        )
        secret = secrets.token_urlsafe(24)
        entry.secret_hash = _hash(secret)
        entry.session.claimed_at = self._wall()
        entry.session.status = "installing"
        entry.session.fellow_name = name
        entry.changed.set()
        self.dirty.add(session_id)
        return entry.session, secret

    def holds(self, name: str, *, other_than: str | None = None) -> bool:
        """Does a session hold ``name``: being installed under it, or named by the operator
        and still open?"""
        for entry in self._entries.values():
            session = entry.session
            if session.session_id == other_than or session.fellow_name != name:
                continue
            self._expire(entry)
            if session.status in ("created", "installing"):
                return True
        return False

    def append_log(self, session_id: str, secret: str, lines: list[str], *, failed: bool) -> int:
        entry = self._entry(session_id)
        if entry.secret_hash is None or not hmac.compare_digest(_hash(secret), entry.secret_hash):
            raise JoinRefusedError("this is not the installer of that join session")
        now = self._wall()
        for line in lines:  # numbered on from the session's count, which a restart keeps
            entry.session.log_lines += 1
            # Shown and stored: redacted (before the cut, so a secret it cuts is still
            # whole to the rules).
            text = redact(line[: LINE_CHARS + REDACT_MARGIN])[:LINE_CHARS]
            entry.lines.append(SessionLogLine(entry.session.log_lines, now, text))
        del entry.lines[:-LOG_LINES]
        self._log_dirty.add(session_id)  # written within LOG_SAVE_S
        if failed and entry.session.status == "installing":
            entry.session.status = "failed"
            last = entry.lines[-1].line if lines else "the installer failed"
            entry.session.reason = last[:500]
            self.dirty.add(session_id)
        self._wake(entry)
        return entry.session.log_lines

    def fellow_registered(self, fellow_id: str) -> None:
        """A fellow registered: the session that installed it is done."""
        for entry in self._entries.values():
            session = entry.session
            if session.status == "installing" and session.fellow_name == fellow_id:
                session.status, session.registered_at = "registered", self._wall()
                self.dirty.add(session.session_id)
                self._wake(entry)

    def lines_after(self, session_id: str, seq: int) -> list[SessionLogLine]:
        return [line for line in self._entry(session_id).lines if line.seq > seq]

    async def wait_change(self, session_id: str, timeout: float) -> None:
        entry = self._entry(session_id)
        try:
            await asyncio.wait_for(entry.changed.wait(), timeout)
        except TimeoutError:
            return
        entry.changed.clear()

    def _wake(self, entry: _Entry) -> None:
        entry.changed.set()

    def _entry(self, session_id: str) -> _Entry:
        entry = self._entries.get(session_id)
        if entry is None:
            raise NotFoundError(f"no join session {session_id!r}")
        return entry

    def _expire(self, entry: _Entry) -> None:
        session = entry.session
        if session.status == "created" and self._wall() > session.expires_at:
            session.status, session.reason = "failed", "expired before it was used"
            self.dirty.add(session.session_id)


# --- the package ----------------------------------------------------------------------------


class Package(msgspec.Struct):
    file: str
    sha256: str
    size: int
    path: str


def find_or_build_wheel(
    cache: Path, *, build: bool = True, wheel: Path | None = None
) -> Package | None:
    """The wheel of the running version: cached, shipped beside the install, or built now
    (None when it is not found and ``build`` is False). ``wheel`` (SWARM_BOOTSTRAP_WHEEL)
    names the one to serve instead: a file, or a directory whose newest
    ``silentswarm-*.whl`` is served (drop a new build there and run ``swarm update``).

    Looked for in ``cache`` (the leader's state), then next to the installed package (the
    .deb puts it in ``<prefix>/share/silentswarm/``); else built from the source tree this
    code runs from (an editable or source checkout) with setuptools' backend, in a temporary
    copy of it (:func:`build_wheel`).
    """
    if wheel is not None:
        return package_of(newest_wheel(wheel))
    name = f"silentswarm-{__version__}-py3-none-any.whl"
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / name
    if not target.exists():
        here = Path(__file__).resolve()
        shipped = [p / "share" / "silentswarm" / name for p in here.parents]
        source = next((p for p in here.parents if (p / "pyproject.toml").exists()), None)
        found = next((p for p in shipped if p.exists()), None)
        if found is not None:
            shutil.copyfile(found, target)
        elif source is not None and build:
            build_wheel(source, cache)
        elif not build:
            return None
        if not target.exists():
            raise PackageUnavailableError(
                f"no {name} to serve: install from a .deb or a source checkout, "
                f"or put the wheel in {cache}"
            )
    return package_of(target)


def newest_wheel(spec: Path) -> Path:
    """``spec`` itself, or the newest silentswarm wheel in that directory."""
    if spec.is_dir():
        found = sorted(spec.glob("silentswarm-*.whl"), key=lambda p: p.stat().st_mtime_ns)
        if not found:
            raise PackageUnavailableError(f"SWARM_BOOTSTRAP_WHEEL={spec}: no silentswarm wheel")
        return found[-1]
    if not spec.is_file() or spec.suffix != ".whl":
        raise PackageUnavailableError(f"SWARM_BOOTSTRAP_WHEEL={spec}: not a wheel file")
    return spec


def package_of(path: Path) -> Package:
    data = path.read_bytes()
    return Package(
        file=path.name, sha256=hashlib.sha256(data).hexdigest(), size=len(data), path=str(path)
    )


# What a wheel is built from: the project's top-level files (metadata, readme, licence) and
# its packages (top-level directories with an ``__init__.py``), without build leftovers.
_PROJECT_FILES = ("pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in")
_PROJECT_FILE_PREFIXES = ("README", "LICENSE", "LICENCE", "COPYING", "NOTICE")
_NOT_IN_A_WHEEL = shutil.ignore_patterns(
    "__pycache__", "*.pyc", "*.pyo", "build", "dist", "*.egg-info", ".*"
)


def copy_project(source: Path, dest: Path) -> None:
    """Copy what building ``source``'s wheel reads into ``dest`` (which must not exist).

    setuptools writes ``build/`` and ``*.egg-info`` into the directory it builds in, so the
    leader builds in a copy and the source checkout stays as it was."""
    dest.mkdir()
    for entry in sorted(source.iterdir()):
        if entry.name.startswith(".") or entry.is_symlink():
            continue
        if entry.is_file() and (
            entry.name in _PROJECT_FILES or entry.name.startswith(_PROJECT_FILE_PREFIXES)
        ):
            shutil.copy2(entry, dest / entry.name)
    for folder in _package_folders(source):
        target = dest / folder.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(folder, target, ignore=_NOT_IN_A_WHEEL)


def _package_folders(source: Path) -> list[Path]:
    """The folders setuptools builds packages from: the ``[tool.setuptools] package-dir``
    values when the project maps its folders (this one maps swarm/, leader/ and agent/ into
    ``silentswarm``), else the top-level package folders ``packages.find include`` names
    (every one when it says nothing). Never a folder outside ``source`` or behind a link."""
    try:
        config = tomllib.loads((source / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        config = {}  # the build will say what is wrong
    setuptools_config = config.get("tool", {}).get("setuptools", {})
    mapped = setuptools_config.get("package-dir")
    if isinstance(mapped, dict) and mapped:
        folders = [source / str(rel) for rel in mapped.values()]
        root = source.resolve()
        return [
            f
            for f in folders
            if f.is_dir() and not f.is_symlink() and f.resolve().is_relative_to(root)
        ]
    find = setuptools_config.get("packages", {})
    patterns = find.get("find", {}).get("include") if isinstance(find, dict) else None
    included = [p.split(".")[0] for p in patterns] if patterns else ["*"]
    return [
        entry
        for entry in sorted(source.iterdir())
        if entry.is_dir()
        and not entry.is_symlink()
        and not entry.name.startswith(".")
        and (entry / "__init__.py").is_file()
        and any(fnmatch.fnmatchcase(entry.name, pattern) for pattern in included)
    ]


def build_wheel(source: Path, out: Path) -> Path | None:
    """Build ``source``'s wheel into ``out`` with setuptools' backend, in a temporary copy of
    the project (nothing is written into ``source``). None, logged, when the build fails."""
    code = (
        "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    )
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="swarm-wheel-") as scratch:
        project = Path(scratch) / "project"
        copy_project(source, project)
        tmp = Path(scratch) / "tmp"
        tmp.mkdir()
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": str(tmp)}
        done = subprocess.run(
            [sys.executable, "-c", code, str(out.resolve())],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    if done.returncode != 0:
        log.error("building the bootstrap wheel failed: %s", done.stderr[-2000:])
        return None
    return out / done.stdout.strip().splitlines()[-1]
