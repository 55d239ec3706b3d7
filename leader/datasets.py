"""Datasets uploaded to the leader: content-addressed files and the names that point at them.

Under the dataset root (SWARM_DATASET_ROOT, default ``<state>/datasets``)::

    blobs/<sha256>        a dataset's bytes, named by their sha256 (written once, never changed)
    names/<name>.json     a DatasetRecord: the content the name points at now
    .incoming/            uploads being received (emptied at start-up)

An upload streams into ``.incoming`` while it is hashed and counted (never whole in memory; over
the limit or the disk's room it is stopped and removed), then moves to ``blobs/`` and its name
is (re)written, each step an atomic rename: a reader never sees half a dataset or half a name.
Re-uploading a name points it at the new content; the old content stays while a job that has
not ended is pinned to it (:mod:`silentswarm.datasets`), and :meth:`DatasetStore.collect`
removes content no name and no such job refers to.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Collection
from pathlib import Path

import msgspec

from silentswarm import datasets
from silentswarm.errors import FieldError, NotFoundError
from silentswarm.leader.errors import DatasetTooLargeError
from silentswarm.plan import StagePlan
from silentswarm.types.datasets import DatasetRecord
from silentswarm.types.signals import DatasetArgs, DatasetFile

WRITE_BYTES = 1 << 20  # gathered before each write to disk (in a thread)
# What an upload leaves free on the leader's disk: twice the most the exports keep in
# reserve (leader/artifacts.py, 256 MiB at most), so uploads run out of room before shard
# pushes and exports do.
DISK_MARGIN_BYTES = 512 << 20


class DatasetStore:
    def __init__(self, root: Path, *, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.blobs = root / "blobs"
        self.names = root / "names"
        self.incoming = root / ".incoming"

    def open(self) -> None:
        """Create the directories and drop what an interrupted upload left behind (content
        is only removed by :meth:`collect`, once the jobs that may pin it are known)."""
        for directory in (self.blobs, self.names):
            directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.incoming, ignore_errors=True)
        self.incoming.mkdir(parents=True, exist_ok=True)

    # --- reading --------------------------------------------------------------------------

    def list(self) -> list[DatasetRecord]:
        """Every named dataset, by name."""
        out = []
        for path in sorted(self.names.glob("*.json")) if self.names.is_dir() else []:
            with contextlib.suppress(OSError, msgspec.DecodeError):
                out.append(msgspec.json.decode(path.read_bytes(), type=DatasetRecord))
        return out

    def get(self, name: str) -> DatasetRecord:
        """The dataset called ``name``: NotFoundError when there is none."""
        if datasets.name_problem(name) is None:
            with contextlib.suppress(FileNotFoundError):
                data = (self.names / f"{name}.json").read_bytes()
                return msgspec.json.decode(data, type=DatasetRecord)
        raise NotFoundError(f"no dataset called {name[:140]!r} (swarm data list shows them)")

    def blob(self, sha256: str) -> Path | None:
        """The file holding the content with this digest, if the leader has it."""
        if not datasets.SHA256_PATTERN.match(sha256):
            return None
        path = self.blobs / sha256
        return path if path.is_file() else None

    # --- writing --------------------------------------------------------------------------

    async def put(
        self,
        name: str,
        body: AsyncIterator[bytes],
        *,
        source: str = "",
        declared_bytes: int | None = None,
        replace: bool = True,
    ) -> DatasetRecord:
        """Store the streamed ``body`` under ``name`` (replacing what the name pointed at;
        without ``replace``, FileExistsError when the name exists by the time the body is in,
        the content then left for :meth:`collect`). FieldError (``name``) for a bad name;
        DatasetTooLargeError when the body is over the limit or the disk's room, before it is
        read when the client declared its length."""
        problem = datasets.name_problem(name)
        if problem:
            raise FieldError(problem, field="name")
        room = self._room()
        if declared_bytes is not None:
            self._check_size(declared_bytes, room)
        temp = self.incoming / f"{secrets.token_hex(8)}.part"
        hasher, size = hashlib.sha256(), 0
        try:
            with open(temp, "xb") as out:
                pending: list[bytes] = []
                pending_bytes = 0
                async for chunk in body:
                    size += len(chunk)
                    self._check_size(size, room)
                    hasher.update(chunk)
                    pending.append(chunk)
                    pending_bytes += len(chunk)
                    if pending_bytes >= WRITE_BYTES:
                        # The room again, as it is now: uploads running side by side each
                        # saw the same free space at their start.
                        room = min(room, size - pending_bytes + self._room())
                        self._check_size(size, room)
                        await asyncio.to_thread(out.writelines, pending)
                        pending, pending_bytes = [], 0
                await asyncio.to_thread(out.writelines, pending)
                await asyncio.to_thread(os.fsync, out.fileno())
            digest = hasher.hexdigest()
            record = DatasetRecord(
                name=name, sha256=digest, size_bytes=size, uploaded_at=time.time(), source=source
            )
            # The content lands and its name points at it with no await in between: a
            # collect() run by another request (an upload or a delete finishing meanwhile)
            # can never see the content without its name and remove it.
            os.replace(temp, self.blobs / digest)
            self._write_name(record, replace=replace)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DatasetTooLargeError(
                    f"the leader's disk filled up after {size} bytes of dataset {name!r}"
                ) from None
            raise
        finally:
            temp.unlink(missing_ok=True)
        return record

    def delete(self, name: str, in_use: Collection[str]) -> DatasetRecord:
        """Forget ``name``; its content goes too unless another name or a job in ``in_use``
        (digests pinned by jobs that have not ended) still needs it."""
        record = self.get(name)
        (self.names / f"{name}.json").unlink(missing_ok=True)
        self.collect(in_use)
        return record

    def collect(self, in_use: Collection[str]) -> list[str]:
        """Remove the content no name and no digest in ``in_use`` refers to; the digests
        removed."""
        kept = {record.sha256 for record in self.list()} | set(in_use)
        removed = []
        for path in self.blobs.iterdir() if self.blobs.is_dir() else []:
            if path.name not in kept:
                path.unlink(missing_ok=True)
                removed.append(path.name)
        return removed

    def _write_name(self, record: DatasetRecord, *, replace: bool) -> None:
        """Point ``record.name`` at its content; without ``replace`` only if the name is new,
        checked and taken in one step (a link fails where the name exists), so two uploads
        of a new name cannot both think it theirs."""
        temp = self.incoming / f"{secrets.token_hex(8)}.json"
        temp.write_bytes(msgspec.json.encode(record))
        target = self.names / f"{record.name}.json"
        if replace:
            os.replace(temp, target)
            return
        try:
            os.link(temp, target)
        finally:
            temp.unlink(missing_ok=True)

    def _room(self) -> int:
        """The bytes an upload may take now: the limit, or the disk's free space less a
        margin, whichever is smaller."""
        free = shutil.disk_usage(self.incoming).free
        return max(0, min(self.max_bytes, free - DISK_MARGIN_BYTES))

    def _check_size(self, size: int, room: int) -> None:
        if size > self.max_bytes:
            raise DatasetTooLargeError(
                f"a dataset is at most {self.max_bytes} bytes (SWARM_MAX_DATASET_BYTES); "
                f"this one is {size} or more"
            )
        if size > room:
            raise DatasetTooLargeError(
                f"the leader's disk has room for {room} more bytes of datasets; "
                f"this one is {size} or more"
            )


def start_args(
    store: DatasetStore, plan: StagePlan, *, job_id: str, token: str, public_url: str
) -> DatasetArgs | None:
    """What START tells a stage whose plan reads uploaded datasets (stage 0 only: the others
    read no data): where each is and the token that opens them (the stage's download token
    for this attempt)."""
    refs = datasets.pinned_refs(plan.train.data)
    if not refs or not plan.is_first:
        return None
    files = []
    for ref in refs:
        assert ref.sha256 is not None
        path = store.blob(ref.sha256)
        size = path.stat().st_size if path is not None else 0
        url = f"{public_url.rstrip('/')}/api/v1/jobs/{job_id}/datasets/{ref.sha256}"
        files.append(DatasetFile(name=ref.name, sha256=ref.sha256, size_bytes=size, url=url))
    return DatasetArgs(files=files, token=token)
