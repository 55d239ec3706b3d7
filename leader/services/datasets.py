"""The datasets service: uploads, the names, pinning a job's ``dataset:`` entries at submit,
and the downloads of the stages that read them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

import msgspec

from silentswarm import datasets
from silentswarm.errors import FieldError, NotFoundError
from silentswarm.jobspec import JobSpec
from silentswarm.leader.datasets import DatasetStore
from silentswarm.leader.errors import ShardAccessError
from silentswarm.leader.exports import ExportService
from silentswarm.leader.jobs import JobManager
from silentswarm.leader.permissions import OPERATOR, Principal
from silentswarm.leader.services.jobs import JobLoop
from silentswarm.plan import JsonlSource
from silentswarm.types.accounts import Role
from silentswarm.types.datasets import DatasetRecord


def pin_datasets(
    spec: JobSpec, lookup: Callable[[str], DatasetRecord], has_content: Callable[[str], bool]
) -> JobSpec:
    """``spec`` with each ``dataset:NAME`` entry pinned to the content ``lookup(NAME)`` has now;
    an entry already pinned (``dataset:NAME@SHA256``, say from an earlier job's record) stays
    as it is if the leader still has that content. FieldError naming the entry (``data[i]``)
    otherwise."""
    entries = spec.dataset_entries()
    if not entries:
        return spec
    data = list(spec.data)
    for i, text in entries:
        ref = datasets.parse(text)
        field = f"data[{i}]"
        if ref.sha256 is not None:
            if not has_content(ref.sha256):
                raise FieldError(
                    f"{field}: the leader has no dataset content {ref.sha256[:12]}... (any "
                    f"more); name it as 'dataset:{ref.name}' to use what that name holds now",
                    field=field,
                )
            continue
        try:
            record = lookup(ref.name)
        except NotFoundError as exc:
            raise FieldError(f"{field}: {exc.message}", field=field) from None
        pinned = datasets.pin(text, record.sha256)
        entry = data[i]
        if isinstance(entry, JsonlSource):
            data[i] = msgspec.structs.replace(entry, jsonl=pinned)
        else:
            data[i] = pinned
    return msgspec.structs.replace(spec, data=data)


class DatasetsService:
    # The header a stage sends its download token in (the shard downloads' header).
    TOKEN_HEADER = ExportService.TOKEN_HEADER

    def __init__(
        self,
        *,
        store: DatasetStore,
        jobs: JobManager,
        loop: JobLoop,
        exports: ExportService,
    ) -> None:
        self.store = store
        self.jobs = jobs
        self.loop = loop
        self.exports = exports

    def in_use(self) -> set[str]:
        """The digests pinned by jobs that have not ended (only known once the leader's state
        is loaded: callers that remove content require that first)."""
        self.loop.require_loaded()
        return {
            ref.sha256
            for job in self.jobs.list()
            if not job.terminal
            for ref in datasets.pinned_refs(job.spec.data)
            if ref.sha256
        }

    # --- the operator's ----------------------------------------------------------------------

    async def upload(
        self,
        name: str,
        body: AsyncIterator[bytes],
        *,
        source: str,
        declared_bytes: int | None,
        replace: bool = True,
    ) -> DatasetRecord:
        """``replace`` False: FileExistsError when ``name`` exists once the body is in."""
        self.loop.require_loaded()
        try:
            return await self.store.put(
                name, body, source=source, declared_bytes=declared_bytes, replace=replace
            )
        finally:  # the content the name pointed at before, or the one it could not take
            self.store.collect(self.in_use())

    def list(self) -> list[DatasetRecord]:
        return self.store.list()

    def get(self, name: str) -> DatasetRecord:
        return self.store.get(name)

    def delete(self, name: str) -> DatasetRecord:
        return self.store.delete(name, self.in_use())

    def pin(self, spec: JobSpec, principal: Principal = OPERATOR) -> JobSpec:
        """``spec`` pinned (:func:`pin_datasets`). An entry pinned already names content an
        admin may reuse while the leader has it; an account of another role only while a
        name still points at it: content an admin deleted, kept only for the jobs reading it,
        is not kept alive by new jobs of whoever read its digest in a job record."""

        def reusable(digest: str) -> bool:
            if self.store.blob(digest) is None:
                return False
            if principal.role is Role.ADMIN:
                return True
            return any(record.sha256 == digest for record in self.store.list())

        return pin_datasets(spec, self.store.get, reusable)

    # --- the stages' ---------------------------------------------------------------------

    def dataset_file(
        self, job_id: str, sha256: str, header: str | None, query: Mapping[str, str]
    ) -> Path:
        """The content a stage downloads: its token (the ``header``; a ``query`` token is
        refused) must be one of the job's current attempt, and the job must be pinned to
        ``sha256``."""
        job = self.jobs.get(job_id)
        stage = self.exports.download_stage(job, header, query, "datasets")
        if stage != 0:
            raise ShardAccessError(f"only stage 0 reads data; this token is stage {stage}'s")
        if sha256 not in {ref.sha256 for ref in datasets.pinned_refs(job.spec.data)}:
            raise ShardAccessError(f"job {job_id} reads no dataset {sha256[:12]}...")
        path = self.store.blob(sha256)
        if path is None:
            raise NotFoundError(f"the leader no longer has dataset {sha256[:12]}...")
        return path
