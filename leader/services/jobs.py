"""The jobs service: what an operator can ask of jobs, and the shard downloads of resumes."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Protocol

from litestar.response import ServerSentEventMessage

from silentswarm.errors import NotFoundError
from silentswarm.jobspec import JobSpec, with_default_transport
from silentswarm.leader import initsource
from silentswarm.leader.artifacts import resolve_export_dir
from silentswarm.leader.errors import (
    AccountForbiddenError,
    PoolForbiddenError,
    SpecFieldForbiddenError,
)
from silentswarm.leader.exports import ExportService
from silentswarm.leader.jobs import JobManager
from silentswarm.leader.observe import Observability
from silentswarm.leader.permissions import (
    OPERATOR,
    Principal,
    export_dir_refusal,
    fellow_path_refusal,
    init_from_refusal,
    pool_refusal,
)
from silentswarm.leader.signals import SignalHub
from silentswarm.plan import Transport
from silentswarm.types.jobs import (
    CheckpointRecord,
    CheckpointStage,
    InitSource,
    JobRecord,
    ServedJob,
)
from silentswarm.types.metrics import HistoryPoint, JobMetrics
from silentswarm.types.signals import CheckpointArgs


class JobLoop(Protocol):
    """What the jobs service asks of the job loop
    (:class:`silentswarm.leader.orchestrator.Orchestrator`)."""

    def require_loaded(self) -> None:
        """NotReadyError (503) until the durable state is loaded."""
        ...

    def signal_hub(self) -> SignalHub:
        """The hub that signals fellows (NotReadyError before NATS is up)."""
        ...

    async def flush(self) -> None:
        """Save every changed record now."""
        ...

    def wake(self) -> None:
        """Run the next tick at once."""
        ...

    def job_ended(self, job: JobRecord) -> None:
        """Write its final manifest; stop the stages still running."""
        ...

    async def final_exports(self) -> None:
        """Return once the final manifests of the jobs that ended are written."""
        ...


class JobsService:
    def __init__(
        self,
        *,
        jobs: JobManager,
        loop: JobLoop,
        observe: Observability,
        exports: ExportService,
        export_root: Path,
        pin_datasets: Callable[[JobSpec, Principal], JobSpec],
        default_transport: Transport | str = Transport.AUTO,
    ) -> None:
        """``export_root``: SWARM_EXPORT_ROOT, which every job's export directory stays under.
        ``pin_datasets``: the spec with its ``dataset:`` entries pinned (FieldError naming an
        unknown one). ``default_transport``: SWARM_PIPELINE_TRANSPORT, the transport of jobs
        whose spec names none (written into the spec the record keeps)."""
        self.jobs = jobs
        self.loop = loop
        self.observe = observe
        self.exports = exports
        self.export_root = export_root
        self.pin_datasets = pin_datasets
        self.default_transport = Transport(default_transport)

    # --- the records -------------------------------------------------------------------------

    async def submit(self, spec: JobSpec, principal: Principal = OPERATOR) -> ServedJob:
        """Accept a job whose export directory (if it names one) is inside the export root:
        FieldError (400, ``artifact_paths.model_export_dir``) otherwise; and whose
        ``init_from`` export (if any) fits it (:mod:`silentswarm.leader.initsource`). It is
        saved before the caller hears of it, as ``principal``'s job: PoolForbiddenError (403,
        ``pool``) for a pool its account may not use, AccountForbiddenError (403) for an
        ``init_from`` export of another account's job."""
        refused = pool_refusal(principal, spec.run_pool)
        if refused:
            raise PoolForbiddenError(refused)
        on_fellows = fellow_path_refusal(principal, spec.data, spec.init_from)
        if on_fellows:
            raise SpecFieldForbiddenError(on_fellows[1], field=on_fellows[0])
        configured = spec.artifact_paths.model_export_dir
        if configured is not None:
            path = resolve_export_dir(self.export_root, configured)
            refused = export_dir_refusal(principal, path.relative_to(self.export_root))
            if refused:
                raise SpecFieldForbiddenError(refused, field="artifact_paths.model_export_dir")
        self.loop.require_loaded()
        if spec.init_from_export:
            await self.loop.final_exports()
        init_source = await asyncio.to_thread(initsource.resolve, spec, self.jobs, self.export_root)
        if init_source is not None:
            self._check_init_owner(principal, init_source)
        spec = with_default_transport(spec, self.default_transport)
        job = self.jobs.submit(self.pin_datasets(spec, principal), init_source)
        job.owner = principal.name  # before any await: the loop never sees it ownerless
        await self.loop.flush()
        self.loop.wake()
        return ServedJob.of(job)

    def list(self, *, archived: bool = False) -> list[ServedJob]:
        """The jobs not archived, oldest first; ``archived``: all of them."""
        self.loop.require_loaded()
        return [ServedJob.of(job) for job in self.jobs.listed(archived=archived)]

    def get(self, job_id: str) -> ServedJob:
        self.loop.require_loaded()
        return ServedJob.of(self.jobs.get(job_id))

    def _check_init_owner(self, principal: Principal, source: InitSource) -> None:
        """The source job's owner, else (its record deleted) the owner its manifest names,
        may start from it; an export that names none (from before accounts): anyone."""
        try:
            owner: str | None = self.jobs.get(source.job_id).owner
        except NotFoundError:
            owner = source.owner
        if owner is None:
            return
        refused = init_from_refusal(principal, source.job_id, owner)
        if refused is not None:
            raise AccountForbiddenError(
                refused.message,
                account=principal.name,
                needed_role=refused.needed_role,
                owner=refused.owner,
            )

    # --- operator actions --------------------------------------------------------------------

    async def cancel(self, job_id: str) -> ServedJob:
        self.loop.require_loaded()
        starting = job_id in self.jobs.starting
        job = self.jobs.cancel(job_id)
        if not starting:
            self.loop.job_ended(job)
        # A job cancelled mid-START is stopped by the loop once the round is over.
        await self.loop.flush()
        self.loop.wake()
        return ServedJob.of(job)

    async def checkpoint(self, job_id: str) -> CheckpointRecord:
        """CHECKPOINT to every stage of a running job, all at the same step (ahead of the
        furthest stage: :meth:`leader.jobs.JobManager.checkpoint_target`)."""
        job, at_step = self.jobs.checkpoint_target(job_id)
        hub = self.loop.signal_hub()
        assert job.placement is not None
        record = CheckpointRecord(
            checkpoint_id=uuid.uuid4().hex[:12],
            requested_at=time.time(),
            attempt=job.attempt,
            at_step=at_step,
            stages=[CheckpointStage(fellow_id=fid) for fid in job.placement.fellow_ids],
        )
        self.jobs.add_checkpoint(job_id, record)
        args = CheckpointArgs(checkpoint_id=record.checkpoint_id, at_step=at_step)
        acks = await asyncio.gather(
            *(
                hub.send(stage.fellow_id, args, job_id=job_id, attempt=job.attempt)
                for stage in record.stages
            )
        )
        for stage, ack in zip(record.stages, acks, strict=True):
            self.jobs.add_signal(job_id, ack)
            stage.acknowledged = ack.ok
            if not ack.ok and stage.ok is None:
                stage.ok, stage.message = False, f"{ack.code}: {ack.message}"
        self.jobs.dirty.add(job_id)
        return record

    # --- metrics -----------------------------------------------------------------------------

    def metrics(self, job_id: str) -> JobMetrics:
        self.loop.require_loaded()
        return self.observe.metrics(job_id)

    async def history(self, job_id: str) -> list[HistoryPoint]:
        self.loop.require_loaded()
        return await self.observe.history(job_id)

    def metrics_stream(
        self, job_id: str, last_event_id: int | None
    ) -> AsyncIterator[ServerSentEventMessage]:
        """The SSE events of the job's metrics; what would not be a 200 raises first."""
        self.loop.require_loaded()
        self.observe.check_stream(job_id)
        return self.observe.metrics_events(job_id, last_event_id)

    # --- shards ------------------------------------------------------------------------------

    def init_file(
        self, job_id: str, name: str, header: str | None, query: Mapping[str, str]
    ) -> Path:
        """A file of the export a job starts from: its token (the ``header``) must be a stage's
        of the job's current attempt, and the file the manifest or one holding that stage's
        layers (:func:`silentswarm.leader.initsource.init_file`)."""
        self.loop.require_loaded()
        job = self.jobs.get(job_id)
        stage = self.exports.download_stage(job, header, query, "export files")
        return initsource.init_file(job, stage, name)

    def shard_file(
        self, job_id: str, step: int, name: str, header: str | None, query: Mapping[str, str]
    ) -> Path:
        """A shard file a resumed stage may download: its token (the ``header``; a ``query``
        token is refused) must be for that job's attempt and that stage's files."""
        self.loop.require_loaded()
        token = self.exports.download_token(header, query)
        return self.exports.shard_file(job_id, step, name, token)
