"""What the controllers talk to: one object holding the leader's live services."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from leader.artifacts import resolve_export_dir
from leader.bootstrap import (
    JoinSessions,
    Package,
    find_or_build_wheel,
    newest_wheel,
    package_of,
)
from leader.bus import LeaderBus
from leader.errors import EnrollRefusedError, PackageUnavailableError
from leader.exports import ExportService
from leader.jobs import JobManager
from leader.naming import NameState, settle_fellow_name
from leader.observe import Observability
from leader.orchestrator import Orchestrator
from leader.purges import PurgeBook
from leader.registry import WorkerRegistry
from leader.storage import StorageMonitor
from swarm import __version__
from swarm.errors import ErrorCode, FieldError, NatsAuthError, NotFoundError
from swarm.jobspec import JobSpec
from swarm.natsauth import NatsAuthority
from swarm.protocol import PROTOCOL_VERSION, FellowStatus
from swarm.settings import Settings
from swarm.subjects import TOKEN_RE
from swarm.types.api import LeaderInfo, NatsAuthMode
from swarm.types.fleet import FellowRecord, NodeView
from swarm.types.jobs import JobRecord, SignalRecord
from swarm.types.metrics import ClusterView, RunningJob
from swarm.types.onboarding import (
    BootstrapManifest,
    Enrollment,
    JoinClaim,
    JoinSession,
    JoinSessionCreated,
    PackageInfo,
)
from swarm.types.signals import PackageRef, UpdateArgs

log = logging.getLogger(__name__)


@dataclass
class LeaderServices:
    settings: Settings
    nats_url: str
    authority: NatsAuthority | None
    registry: WorkerRegistry
    bus: LeaderBus
    jobs: JobManager
    purges: PurgeBook
    observe: Observability
    orchestrator: Orchestrator
    exports: ExportService
    joins: JoinSessions = field(default_factory=JoinSessions)
    storage: StorageMonitor = field(default_factory=StorageMonitor)
    package: Package | None = None
    _package_build: asyncio.Future[Package | None] | None = None
    started_at: float = field(default_factory=time.time)

    def info(self) -> LeaderInfo:
        return LeaderInfo(
            version=__version__,
            protocol_version=PROTOCOL_VERSION,
            nats_url=self.nats_url,
            nats_connected=self.bus.is_connected,
            nats_auth=self.nats_auth,
            subject_prefix=self.settings.subject_prefix,
            started_at=self.started_at,
            uptime_s=round(time.time() - self.started_at, 3),
            heartbeat_interval_s=self.settings.heartbeat_interval_s,
            offline_after_s=self.settings.offline_after_s,
            state_loaded=self.orchestrator.loaded.is_set(),
            fellows=self.registry.counts(),
            jobs=self.jobs.counts(),
            nodes=self.registry.host_count(),
            storage=self.storage.view(),
        )

    @property
    def nats_auth(self) -> NatsAuthMode:
        """``dev`` (no authentication), ``jwt`` (this leader mints each fellow its own NATS
        user) or ``credentials`` (it has its own user but cannot mint others)."""
        if self.settings.dev:
            return "dev"
        return "jwt" if self.authority is not None else "credentials"

    def worker(self, fellow_id: str) -> FellowRecord:
        record = self.registry.get(fellow_id)
        if record is None:
            raise NotFoundError(f"no fellow {fellow_id!r} is registered")
        return record

    def workers(self) -> list[FellowRecord]:
        return self.registry.list()

    def nodes(self) -> list[NodeView]:
        return self.registry.nodes()

    def job(self, job_id: str) -> JobRecord:
        self.orchestrator.require_loaded()
        return self.jobs.get(job_id)

    def job_list(self) -> list[JobRecord]:
        self.orchestrator.require_loaded()
        return self.jobs.list()

    def cluster(self) -> ClusterView:
        """What the swarm has online (per host, so fellows sharing a host count it once) and
        how its running jobs perform."""
        hosts = [n for n in self.registry.nodes() if n.online]
        gpus = [g for n in hosts for g in n.gpus]
        running = []
        for job in self.jobs.running():
            view = self.observe.metrics(job.job_id)
            running.append(
                RunningJob(
                    job_id=job.job_id,
                    name=job.name,
                    step=view.step,
                    total_steps=view.total_steps,
                    loss=view.loss,
                    step_time_s=view.step_time_s,
                    steps_per_min=view.steps_per_min,
                    tokens_per_s=view.tokens_per_s,
                    boundaries=view.boundaries,
                    placement=job.placement,
                )
            )
        return ClusterView(
            fellows=self.registry.counts(),
            hosts=len(hosts),
            cpu_cores=sum(n.cpu_cores for n in hosts),
            ram_total_bytes=sum(n.ram_total_bytes for n in hosts),
            ram_available_bytes=sum(n.ram_available_bytes for n in hosts),
            gpus=len(gpus),
            vram_total_bytes=sum(g.memory_total_bytes for g in gpus),
            vram_free_bytes=sum(g.memory_free_bytes for g in gpus),
            net_sent_bytes_per_s=round(sum(n.net_sent_bytes_per_s for n in hosts), 1),
            net_recv_bytes_per_s=round(sum(n.net_recv_bytes_per_s for n in hosts), 1),
            running_jobs=running,
        )

    # --- onboarding --------------------------------------------------------------------------

    async def ensure_package(self) -> Package:
        """The package joining hosts install: found at start, else built once, on first need
        (a source checkout has no wheel until then; building takes seconds of CPU that a
        leader which never onboards anyone should not spend). One build, however many ask,
        and it finishes even if the request that started it goes away.

        With SWARM_BOOTSTRAP_WHEEL a directory, its newest wheel is looked up every time."""
        wheels = self.settings.bootstrap_wheel
        if wheels is not None and wheels.is_dir():
            newest = newest_wheel(wheels)
            if self.package is None or Path(self.package.path) != newest:
                self.package = await asyncio.to_thread(package_of, newest)
                log.info("serving %s (sha256 %s)", self.package.file, self.package.sha256)
            return self.package
        if self.package is None:
            build = self._package_build
            if build is None or (build.done() and build.exception() is not None):
                cache = self.settings.state_dir / "bootstrap"
                build = self._package_build = asyncio.ensure_future(
                    asyncio.to_thread(
                        find_or_build_wheel, cache, wheel=self.settings.bootstrap_wheel
                    )
                )
            self.package = await asyncio.shield(build)
        if self.package is None:
            raise PackageUnavailableError("no package to serve (see the leader's log)")
        return self.package

    async def update(self, fellow_id: str | None, request_base: str) -> list[SignalRecord]:
        """UPDATE: fellows that fellow.sh installed reinstall from this leader's package
        (checked against its sha256), then restart; others restart from their install."""
        args = UpdateArgs()
        try:
            package = await self.ensure_package()
        except PackageUnavailableError as exc:
            log.warning("update without a package (fellows restart as installed): %s", exc)
        else:
            base = self._public_url(request_base)
            ref = PackageRef(
                file=package.file, sha256=package.sha256, url=f"{base}/api/v1/bootstrap/source"
            )
            args = UpdateArgs(package=ref)
        return await self.orchestrator.update(fellow_id, args=args)

    def package_or_503(self) -> Package:
        if self.package is None:
            raise PackageUnavailableError("the package is not ready yet; try again")
        return self.package

    def _public_url(self, request_base: str) -> str:
        return (self.settings.public_url or request_base).rstrip("/")

    def bootstrap_manifest(self, request_base: str) -> BootstrapManifest:
        package = self.package_or_503()
        base = self._public_url(request_base)
        return BootstrapManifest(
            leader_version=__version__,
            leader_url=base,
            package=PackageInfo(
                file=package.file,
                sha256=package.sha256,
                size=package.size,
                url=f"{base}/api/v1/bootstrap/source",
            ),
            nats_urls=[self.settings.public_nats_url or self.nats_url],
            transport_default="auto",
            min_python="3.11",
        )

    def create_join_session(
        self, fellow_name: str | None, ttl_s: float, request_base: str
    ) -> JoinSessionCreated:
        if fellow_name is not None:
            _check_fellow_name(fellow_name)
        if not 1 <= ttl_s <= 7 * 86400:
            raise FieldError("ttl_s: between 1 s and 7 days", field="ttl_s")
        if self.nats_auth == "credentials":
            raise NatsAuthError(
                "this leader cannot give a joining fellow its own NATS user: it has no NATS "
                f"authority in {self.settings.authority_dir} (set SWARM_NATS_AUTH_DIR to the "
                "directory 'swarm nats-auth init' made for this NATS server)"
            )
        session, token = self.joins.create(fellow_name=fellow_name, ttl_s=ttl_s)
        base = self._public_url(request_base)
        # The token in sh's environment, not its arguments: `ps` shows arguments to every
        # user of the host, and fellow.sh unsets the variable at once.
        command = (
            f"curl -fsSL {base}/api/v1/bootstrap/fellow.sh | SWARM_JOIN_TOKEN={token} sh -s -- "
            f"--join {base} {session.session_id}"
        )
        fields = msgspec.structs.asdict(session)
        return JoinSessionCreated(**fields, token=token, command=command)

    def join_sessions(self) -> list[JoinSession]:
        self._mark_registered()
        return self.joins.list()

    def join_session(self, session_id: str) -> JoinSession:
        self._mark_registered()
        return self.joins.get(session_id)

    def claim_join_session(
        self, session_id: str, token: str, proposed_name: str | None
    ) -> JoinClaim:
        """The installer's single-use token for what it installs, and (unless in dev mode)
        the fellow's own NATS user, bound to the fellow name settled here."""
        if proposed_name is not None:
            _check_fellow_name(proposed_name)
        package = self.package_or_503()
        session, secret = self.joins.claim(session_id, token, proposed_name, self.name_state)
        assert session.fellow_name is not None
        creds = None
        if self.authority is not None:
            creds = self.authority.fellow_creds(self.settings.subject_prefix, session.fellow_name)
        return JoinClaim(
            session_id=session.session_id,
            secret=secret,
            fellow_name=session.fellow_name,
            leader_url=self.settings.public_url,
            nats_url=self.settings.public_nats_url or self.nats_url,
            nats_creds=creds,
            package_file=package.file,
            package_sha256=package.sha256,
        )

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
        return Enrollment(
            fellow_name=fellow_name,
            nats_url=self.settings.public_nats_url or self.nats_url,
            nats_creds=creds,
        )

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

    # --- jobs ----------------------------------------------------------------------------------

    async def submit(self, spec: JobSpec) -> JobRecord:
        """Accept a job whose export directory (if it names one) is inside the export root:
        FieldError (400, ``artifact_paths.model_export_dir``) otherwise."""
        configured = spec.artifact_paths.model_export_dir
        if configured is not None:
            resolve_export_dir(self.settings.model_export_root, configured)
        return await self.orchestrator.submit(spec)

    def _mark_registered(self) -> None:
        for session in self.joins.list():
            if session.status != "installing" or not session.fellow_name:
                continue
            record = self.registry.get(session.fellow_name)
            if record is not None and (record.last_registered_at or record.registered_at) >= (
                session.claimed_at or 0
            ):
                self.joins.fellow_registered(session.fellow_name)


def _check_fellow_name(name: str) -> None:
    """A fellow name from a request body must be a subject token (400 naming the field)."""
    if not TOKEN_RE.match(name):
        raise FieldError(
            f"fellow_name: {name!r} is not a fellow id (1-64 letters, digits, '-' or '_')",
            field="fellow_name",
        )
