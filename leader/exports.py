"""The leader's side of exports and resume: shard pushes in over NATS, the manifest, and the
shards a resumed attempt downloads.

Pushes arrive on ``<prefix>.shard.<job>.<fellow>`` (request/reply, see agent/shardpush.py)
from the fellow placed for that stage in the job's current attempt; anything else is refused
in the reply and counted as dropped. A resumed attempt's fellows fetch their stage's shard
over HTTP with a token only START gives them, in the ``X-Swarm-Shard-Token`` header (never
in the URL): an HMAC of the job, attempt and stage under the operator token, so nothing is
stored, a leader restart changes nothing, a stage's token opens only that stage's files, and
a new attempt's tokens void the old ones.

A job with replicas exports its lead replica's pipeline (replica 0's, or when replica 0 was
lost the one that took over its checkpoints, ``Placement.lead``): only the lead's fellows
push (the others' plans write no checkpoints for the leader), and a push from another
replica's fellow is refused, counted (``refused_replica_shards``, and as a dropped bus
message of kind ``shard_replica``) and logged, so it can never overwrite the lead's
``stage-<i>`` files; the manifest names the lead's stages only.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from silentswarm import subjects as topics
from silentswarm.errors import NotFoundError
from silentswarm.jobspec import Placement
from silentswarm.leader.artifacts import ExportStore, export_dir, exported_placement
from silentswarm.leader.bus import LeaderBus
from silentswarm.leader.errors import ShardAccessError
from silentswarm.leader.jobs import JobManager
from silentswarm.protocol import JobState, ShardAck
from silentswarm.types.jobs import JobRecord, ShardReceipt
from silentswarm.types.signals import ResumeArgs, ShardFile

log = logging.getLogger(__name__)
# The bus's dropped-message kind of a shard push from a replica other than the lead.
REPLICA_DROP = "shard_replica"


def pipeline_length(placement: Placement) -> int:
    """The stages of one pipeline (what an export holds): the lead replica's."""
    return len(exported_placement(placement).stages)


class ExportService:
    def __init__(
        self,
        *,
        bus: LeaderBus,
        jobs: JobManager,
        prefix: str,
        export_root: Path,
        secret: bytes,
        public_url: str,
        on_push: Callable[[], None] | None = None,
    ) -> None:
        """``on_push``: called when a stored shard arrived (the job loop's wake-up)."""
        self.bus = bus
        self.jobs = jobs
        self.prefix = prefix
        # Absolute, resolved once (settings.model_export_root): every export stays under it.
        self.export_root = export_root
        self.secret = secret
        self.public_url = public_url.rstrip("/")
        self.store = ExportStore(root=export_root)
        self.on_push = on_push
        # Pieces of shard pushes refused because their fellow is not of replica 0.
        self.refused_replica_shards = 0

    async def start(self, nc: Client) -> None:
        """Take pushes. The jobs are loaded by now: first, every job's ``.incoming/`` is
        emptied (a transfer does not survive a leader restart; its fellow starts it over)."""
        await asyncio.to_thread(self._sweep_all)
        await nc.subscribe(topics.SHARD.wildcard(self.prefix), cb=self._on_shard)

    def _sweep_all(self) -> None:
        for job in self.jobs.list():
            if job.export_dir is not None:
                self._sweep(job)

    def _sweep(self, job: JobRecord) -> None:
        assert job.export_dir is not None
        try:
            removed = self.store.sweep_incoming(Path(job.export_dir))
        except OSError as exc:
            log.warning("job %s: cannot empty %s/.incoming: %s", job.job_id, job.export_dir, exc)
            return
        if removed:
            log.info(
                "job %s: removed %d partial upload(s) from .incoming: %s",
                job.job_id,
                len(removed),
                ", ".join(removed[:5]) + (", ..." if len(removed) > 5 else ""),
            )

    def directory(self, job: JobRecord) -> Path:
        """The job's export directory (recorded on the job the first time)."""
        if job.export_dir is None:
            configured = job.spec.artifact_paths.model_export_dir
            # Not resolve()d: a symlink planted on the way must not become the recorded
            # directory (the writes under the root refuse it, naming the path).
            job.export_dir = str(export_dir(self.export_root, job.job_id, configured))
            self.jobs.dirty.add(job.job_id)
        return Path(job.export_dir)

    # --- pushes ---------------------------------------------------------------------------

    async def _on_shard(self, msg: Msg) -> None:
        chunk = self.bus.decode_job_message(msg, topics.SHARD)
        if chunk is None:
            return
        if not msg.reply or not topics.reply_allowed(msg.reply, chunk.fellow_id):
            # A piece is request/reply: one whose answer would go elsewhere is not taken.
            self.bus.drop(
                msg, f"reply subject {msg.reply[:120]!r} is not the sender's inbox", kind="reply"
            )
            return
        refusal, kind = self._refusal(chunk)
        if refusal is not None:
            if kind == REPLICA_DROP:
                self.refused_replica_shards += 1
            self.bus.drop(msg, refusal, kind=kind)
            await self._reply(msg, chunk, ShardAck(ok=False, next_seq=chunk.seq, message=refusal))
            return
        job = self.jobs.get(chunk.job_id)
        assert job.placement is not None
        directory = self.directory(job)
        try:
            ack, receipt = self.store.receive(directory, chunk, pipeline_length(job.placement))
        except OSError as exc:
            error = (
                f"cannot store {chunk.name} (stage {chunk.stage}, step {chunk.step}) in "
                f"{directory}: {exc.strerror or exc}"
            )
            log.error("job %s: %s", job.job_id, error)
            self._export_failed(job, error)
            ack, receipt = ShardAck(ok=False, next_seq=chunk.seq, message=error), None
        if receipt is not None:
            # Recorded (and the manifest written) before the fellow hears the shard is
            # stored: it reports its stage's end only after that, so a job that completes
            # has its final push on the record (leader.jobs.final_export_error).
            await self._stored(job, directory, receipt)
        await self._reply(msg, chunk, ack)
        if receipt is not None and self.on_push is not None:
            self.on_push()

    async def _stored(self, job: JobRecord, directory: Path, receipt: ShardReceipt) -> None:
        assert job.placement is not None
        n = pipeline_length(job.placement)
        complete = self.store.complete_steps(directory, n)
        newest = complete[-1] if complete else None
        became = newest is not None and newest == receipt.step
        if became:
            # The manifest first: a client that sees the step on the record finds its files.
            try:
                await asyncio.to_thread(self._refresh, directory, job, newest)
            except OSError as exc:
                self._export_failed(job, f"cannot write {directory}/run_manifest.json: {exc}")
            else:
                if job.export_error is not None:
                    job.export_error = None
                    self.jobs.dirty.add(job.job_id)
        self.jobs.record_push(job.job_id, receipt, newest)
        log.info(
            "job %s: stage %d pushed step %d (%d bytes)%s",
            job.job_id,
            receipt.stage,
            receipt.step,
            receipt.size,
            "; every stage has it" if became else "",
        )

    def _refusal(self, chunk: Any) -> tuple[str | None, str | None]:
        """Why a piece is not taken (None: it is), and the kind it is dropped as (None:
        the subject's)."""
        try:
            job = self.jobs.get(chunk.job_id)
        except NotFoundError:
            return f"no job {chunk.job_id!r}", None
        placement = job.placement
        if job.terminal:
            # Its export is final (and described on the record): nothing changes it now.
            return f"job {job.job_id} is {job.state.value}: its export takes no more pushes", None
        if placement is None or chunk.attempt != job.attempt:
            return f"attempt {chunk.attempt} is not the job's current attempt", None
        if chunk.step > job.spec.steps:
            return f"step {chunk.step} is past the job's last ({job.spec.steps})", None
        placed = placement.stage_of(chunk.fellow_id)
        if placed is None or placed.stage != chunk.stage:
            return (
                f"fellow {chunk.fellow_id} does not run stage {chunk.stage} of this attempt",
                None,
            )
        if placed.replica != placement.lead:
            # The lead replica's shards are the export: another's would overwrite them.
            return (
                f"fellow {chunk.fellow_id} runs replica {placed.replica} of stage "
                f"{chunk.stage}: only replica {placement.lead} pushes shards",
                REPLICA_DROP,
            )
        return None, None

    async def _reply(self, msg: Msg, chunk: Any, ack: ShardAck) -> None:
        # decode_job_message checked that the piece's fellow is its subject's.
        await self.bus.respond(msg, chunk.fellow_id, topics.encode(ack))

    def _export_failed(self, job: JobRecord, error: str) -> None:
        job.export_error = error
        self.jobs.dirty.add(job.job_id)

    def _refresh(self, directory: Path, job: JobRecord, step: int) -> None:
        """The manifest of ``step``, complete now, with the lead's layer ranges; the steps
        before it pruned."""
        assert job.placement is not None
        ranges = job.placement.split(job.placement.lead)
        self.store.write_manifest(directory, job, pushed=(step, ranges))
        self.store.prune(directory, pipeline_length(job.placement))

    async def job_ended(self, job: JobRecord) -> None:
        """The final manifest (with the final loss) once a job is over; its partial uploads
        removed (it takes no more pushes)."""
        self.store.forget(job.job_id)
        if job.placement is None:
            return
        directory = self.directory(job)
        await asyncio.to_thread(self._sweep, job)
        try:
            written = await asyncio.to_thread(self.store.write_manifest, directory, job)
        except OSError as exc:
            log.error("cannot write the manifest of job %s: %s", job.job_id, exc)
            error = f"cannot write {directory}/run_manifest.json: {exc}"
            # Added to what the record says already (why the final model is missing).
            self._export_failed(job, f"{job.export_error}; {error}" if job.export_error else error)
            return
        if written is not None:
            log.info("job %s: model export in %s (step %s)", job.job_id, directory, job.pushed_step)
        elif job.state is JobState.COMPLETED:
            log.warning("job %s completed without a complete export", job.job_id)

    # --- resume ---------------------------------------------------------------------------

    def resumed(self, job: JobRecord, step: int) -> None:
        """A resume from ``step``: drop the failed attempt's later, partial shards."""
        if job.export_dir is not None:
            self.store.drop_after(Path(job.export_dir), step)
            # The failed attempt's pushes are refused from now on: theirs can never finish.
            self.store.forget(job.job_id)
            self._sweep(job)

    # The header a resumed stage sends its download token in (agent/shardpush.py's too).
    TOKEN_HEADER = "X-Swarm-Shard-Token"

    @classmethod
    def download_token(cls, header: str | None, query: Any) -> str:
        """A shard download's token: from the header only. One in the URL (``?token=``) is
        refused, and the download with it: URLs end up in access and client logs."""
        if "token" in query:
            raise ShardAccessError(
                "a shard token is never accepted in the URL (?token=): send it in the "
                f"{cls.TOKEN_HEADER} header"
            )
        return (header or "").strip()

    def token(self, job_id: str, attempt: int, stage: int) -> str:
        """The download token of one stage of one attempt: an HMAC of job, attempt and stage
        under the operator token (nothing stored; a new attempt's tokens are new ones)."""
        message = f"shards:{job_id}:{attempt}:{stage}".encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def token_stage(self, job: JobRecord, token: str) -> int | None:
        """The stage of the job's current attempt that ``token`` was made for, if any."""
        if not token or job.placement is None:
            return None
        given, found = token.encode(), None
        for placed in job.placement.stages:  # every one compared: constant time per stage
            expected = self.token(job.job_id, job.attempt, placed.stage).encode()
            if hmac.compare_digest(given, expected):
                found = placed.stage
        return found

    def download_stage(
        self, job: JobRecord, header: str | None, query: Any, what: str = "files"
    ) -> int:
        """The stage of the job's current attempt whose download token the request carries
        (in the ``header``; one in the ``query`` is refused): ShardAccessError naming
        ``what`` it does not open otherwise."""
        stage = self.token_stage(job, self.download_token(header, query))
        if stage is None:
            raise ShardAccessError(
                f"this token does not open the {what} of job {job.job_id}'s current attempt "
                f"(send the one from START in the {self.TOKEN_HEADER} header)"
            )
        return stage

    def resume_args(self, job: JobRecord, stage: int) -> ResumeArgs | None:
        """What START tells a resumed attempt's stage: the step and where its shard is."""
        step = job.resume_step
        if not step:
            return None
        directory = self.directory(job)
        files = [
            ShardFile(
                name=name,
                sha256=digest,
                url=f"{self.public_url}/api/v1/jobs/{job.job_id}/shards/{step}/{name}",
            )
            for name, digest in self.store.shard_files(directory, step, stage)
        ]
        # The token goes in the TOKEN_HEADER of each download, never in the URL.
        token = self.token(job.job_id, job.attempt, stage)
        return ResumeArgs(step=step, files=files, token=token)

    def shard_file(self, job_id: str, step: int, name: str, token: str) -> Path:
        """The file a resumed stage downloads; ShardAccessError unless ``token`` is the one
        START gave the stage that file belongs to, in the job's current attempt."""
        job = self.jobs.get(job_id)
        stage = self.token_stage(job, token)
        if stage is None:
            raise ShardAccessError(
                f"this token does not open the shards of job {job_id}'s current attempt "
                f"(send the one from START in the {self.TOKEN_HEADER} header)"
            )
        if _stage_of(name) != stage:
            raise ShardAccessError(f"this token opens stage {stage}'s shard files, not {name!r}")
        if job.export_dir is None:
            raise NotFoundError(f"job {job_id} has no shards")
        path = self.store.file_path(Path(job.export_dir), step, name)
        if path is None:
            raise NotFoundError(f"job {job_id} has no shard file {name} at step {step}")
        return path


def _stage_of(name: str) -> int | None:
    """The stage a shard file name (``stage-<n>.npz|json``) belongs to."""
    stem, _, suffix = name.partition(".")
    number = stem.removeprefix("stage-")
    if (
        stem == number
        or not (number.isascii() and number.isdigit())
        or suffix not in ("npz", "json")
    ):
        return None
    return int(number)
