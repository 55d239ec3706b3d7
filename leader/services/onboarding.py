"""The onboarding service: how a new host joins (the bootstrap manifest, join sessions and
their install logs) and how a fleet fellow enrolls, with the fellow names they settle."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from litestar.response import ServerSentEventMessage

from silentswarm import __version__
from silentswarm.errors import ErrorCode, FieldError, NatsAuthError
from silentswarm.leader.bootstrap import JoinSessions, Package
from silentswarm.leader.errors import EnrollRefusedError, StorageUnavailableError
from silentswarm.leader.naming import NameState, settle_fellow_name
from silentswarm.leader.registry import FellowRegistry
from silentswarm.leader.services.fleet import UserRevocation
from silentswarm.leader.services.package import BootstrapPackage, fellow_nats_url
from silentswarm.natsauth import NatsAuthority
from silentswarm.protocol import FellowStatus
from silentswarm.settings import Settings
from silentswarm.subjects import TOKEN_RE
from silentswarm.types.api import NatsAuthMode
from silentswarm.types.onboarding import (
    BootstrapManifest,
    Enrollment,
    JoinClaim,
    JoinSession,
    JoinSessionCreated,
    PackageInfo,
)

log = logging.getLogger(__name__)
MAX_SESSION_TTL_S = 7 * 86400


class OnboardingService:
    def __init__(
        self,
        *,
        settings: Settings,
        nats_url: str,
        nats_auth: NatsAuthMode,
        authority: NatsAuthority | None,
        registry: FellowRegistry,
        joins: JoinSessions,
        package: BootstrapPackage,
        stopping: asyncio.Event,
        require_loaded: Callable[[], None],
        save_join: Callable[[str], Awaitable[bool | None]],
        revoker: UserRevocation | None = None,
    ) -> None:
        """``authority``: mints each joining fellow its own NATS user (None: it cannot).
        ``stopping``: set at shutdown; the install-log streams end then. ``require_loaded``:
        NotReadyError (503) until the fellows the leader knows are loaded: before that every
        known name reads as free, and a claim or an enrollment would take one. ``save_join``:
        writes one join session to the store now (False: it could not; None: the store is
        not open yet). ``revoker``: revokes the earlier NATS users of a known name a join
        session hands out again."""
        self.settings = settings
        self.nats_url = nats_url
        self.nats_auth = nats_auth
        self.authority = authority
        self.registry = registry
        self.joins = joins
        self.package = package
        self.stopping = stopping
        self.require_loaded = require_loaded
        self.save_join = save_join
        self.revoker = revoker

    @property
    def fellow_nats_url(self) -> str:
        return fellow_nats_url(self.settings, self.nats_url)

    # --- the package ---------------------------------------------------------------------------

    async def source(self) -> Package:
        """The wheel a joining host installs (built on first need)."""
        return await self.package.ensure()

    async def manifest(self, request_base: str) -> BootstrapManifest:
        package = await self.package.ensure()
        return BootstrapManifest(
            leader_version=__version__,
            leader_url=self.package.public_url(request_base),
            package=PackageInfo(
                file=package.file,
                sha256=package.sha256,
                size=package.size,
                url=self.package.source_url(request_base),
            ),
            nats_urls=[self.fellow_nats_url],
            transport_default="auto",
            min_python="3.11",
        )

    # --- join sessions -------------------------------------------------------------------------

    async def create_session(
        self, fellow_name: str | None, ttl_s: float, request_base: str
    ) -> JoinSessionCreated:
        """A join session, its single-use token and the command that joins a host with it."""
        if fellow_name is not None:
            _check_fellow_name(fellow_name)
        if not 1 <= ttl_s <= MAX_SESSION_TTL_S:
            raise FieldError("ttl_s: between 1 s and 7 days", field="ttl_s")
        if self.nats_auth == "credentials":
            raise NatsAuthError(
                "this leader cannot give a joining fellow its own NATS user: it has no NATS "
                f"authority in {self.settings.authority_dir} (set SWARM_NATS_AUTH_DIR to the "
                "directory 'swarm nats-auth init' made for this NATS server)"
            )
        session, token = self.joins.create(fellow_name=fellow_name, ttl_s=ttl_s)
        # The command must outlive a restart; before the store opens (None) the first flush
        # after it writes the session, and a leader that never opened it kept nothing else.
        if await self.save_join(session.session_id) is False:
            self.joins.drop(session.session_id)
            raise StorageUnavailableError(
                "the leader could not save the join session in its store; try again"
            )
        base = self.package.public_url(request_base)
        # The token in sh's environment, not its arguments: `ps` shows arguments to every
        # user of the host, and fellow.sh unsets the variable at once.
        command = (
            f"curl -fsSL {base}/api/v1/bootstrap/fellow.sh | SWARM_JOIN_TOKEN={token} sh -s -- "
            f"--join {base} {session.session_id}"
        )
        fields = msgspec.structs.asdict(session)
        return JoinSessionCreated(
            **fields, token=token, command=command, leader_url=base, nats_url=self.fellow_nats_url
        )

    def sessions(self) -> list[JoinSession]:
        self._mark_registered()
        return self.joins.list()

    def session(self, session_id: str) -> JoinSession:
        self._mark_registered()
        return self.joins.get(session_id)

    async def claim(self, session_id: str, token: str, proposed_name: str | None) -> JoinClaim:
        """The installer's single-use token for what it installs, and (unless in dev mode)
        the fellow's own NATS user, bound to the fellow name settled here."""
        await self.package.ensure()
        if proposed_name is not None:
            _check_fellow_name(proposed_name)
        package = self.package.ready()
        self.require_loaded()
        before = self.joins.snapshot(session_id)
        session, secret = self.joins.claim(session_id, token, proposed_name, self.name_state)
        assert session.fellow_name is not None
        # Saved before the answer: a restart must never hand the used token out again.
        if await self.save_join(session_id) is not True:  # loaded, so never None here
            self.joins.put_back(before)
            raise StorageUnavailableError(
                "the leader could not save the claim in its store; nothing was installed, try again"
            )
        if self.revoker is not None:
            # A name handed out again (the operator gave a known fellow's to a new host, or an
            # earlier claim of it never registered): whoever holds its earlier users (an old
            # install, a lost disk) hears nothing meant for the new host. A new name has none
            # (nothing to push); an online fellow's name never gets here.
            await self.revoker.revoke_fellow(session.fellow_name)
        creds = None
        if self.authority is not None:
            creds = self.authority.fellow_creds(self.settings.subject_prefix, session.fellow_name)
        return JoinClaim(
            session_id=session.session_id,
            secret=secret,
            fellow_name=session.fellow_name,
            leader_url=self.settings.public_url,
            nats_url=self.fellow_nats_url,
            nats_creds=creds,
            package_file=package.file,
            package_sha256=package.sha256,
        )

    def append_log(self, session_id: str, secret: str, lines: list[str], *, failed: bool) -> int:
        """The installer's log lines (its session secret authorizes them); how many are kept."""
        return self.joins.append_log(session_id, secret, lines, failed=failed)

    def log_stream(self, session_id: str) -> AsyncIterator[ServerSentEventMessage]:
        """The SSE events of a session's install log, then an ``end`` event with the session
        once it is registered or failed. An unknown session raises here (404 before the 200)."""
        self.session(session_id)
        return self._log_events(session_id)

    async def _log_events(self, session_id: str) -> AsyncIterator[ServerSentEventMessage]:
        seq = 0
        while True:
            for line in self.joins.lines_after(session_id, seq):
                seq = line.seq
                yield ServerSentEventMessage(
                    data=msgspec.json.encode(line).decode(), event="log", id=line.seq
                )
            session = self.session(session_id)
            if session.status in ("registered", "failed") and not self.joins.lines_after(
                session_id, seq
            ):
                yield ServerSentEventMessage(
                    data=msgspec.json.encode(session).decode(), event="end"
                )
                return
            if self.stopping.is_set():
                return
            await self.joins.wait_change(session_id, 1.0)

    def _mark_registered(self) -> None:
        self.joins.settle(self.registry.registered_at)

    # --- enrollment ----------------------------------------------------------------------------

    def enroll(self, fellow_name: str, token: str) -> Enrollment:
        """A NATS user for a fleet fellow that shows the enrollment token (SWARM_ENROLL_TOKEN).
        Refused (leader.naming) for a name that is online, known (offline) or held by a join
        session: the token cannot take over a fellow; the operator names known fellows."""
        expected = self.settings.enroll_token
        if not expected:
            raise EnrollRefusedError(
                "enrollment is off on this leader (set SWARM_ENROLL_TOKEN to turn it on)",
                code=ErrorCode.ENROLL_DISABLED,
            )
        if not hmac.compare_digest(token.encode(), expected.encode()):
            raise EnrollRefusedError("wrong enrollment token (SWARM_ENROLL_TOKEN)")
        _check_fellow_name(fellow_name)
        self.require_loaded()
        settle_fellow_name(
            operator_name=None,
            proposed_name=fellow_name,
            state_of=self._enroll_state,
            what="an enrollment",
        )
        if self.authority is None and self.nats_auth != "dev":
            raise NatsAuthError(
                "this leader cannot mint NATS users: it has no NATS authority "
                f"(SWARM_NATS_AUTH_DIR, default {self.settings.authority_dir})"
            )
        creds = None
        if self.authority is not None:
            creds = self.authority.fellow_creds(self.settings.subject_prefix, fellow_name)
        log.info("enrolled fellow %s", fellow_name)
        return Enrollment(fellow_name=fellow_name, nats_url=self.fellow_nats_url, nats_creds=creds)

    # --- names ---------------------------------------------------------------------------------

    def name_state(self, name: str) -> NameState:
        """What the registry knows of a fellow name now (for leader.naming)."""
        record = self.registry.get(name)
        if record is None:
            return NameState.FREE
        return NameState.OFFLINE if record.status is FellowStatus.OFFLINE else NameState.ONLINE

    def _enroll_state(self, name: str) -> NameState:
        state = self.name_state(name)
        if state is NameState.FREE and self.joins.holds(name):
            return NameState.RESERVED
        return state


def _check_fellow_name(name: str) -> None:
    """A fellow name from a request body must be a subject token (400 naming the field)."""
    if not TOKEN_RE.match(name):
        raise FieldError(
            f"fellow_name: {name!r} is not a fellow id (1-64 letters, digits, '-' or '_')",
            field="fellow_name",
        )
