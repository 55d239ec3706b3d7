"""Model exports on the leader: the shards fellows push, and ``run_manifest.json``.

A job's export directory is ``artifact_paths.model_export_dir`` from its spec (taken under the
export root, SWARM_EXPORT_ROOT, default ``<state>/model_exports``, and refused at submit when
it leads out of it), else ``<root>/<job_id>/model_export``::

    run_manifest.json                     the job, its placement, and the newest complete step
    shards/step-<n>/stage-<i>.npz         a stage's checkpoint after n steps (arrays)
    shards/step-<n>/stage-<i>.json        ... and its metadata (written last: it completes it)
    shards/step-<n>/stage-<i>.*.sha256    the verified sha256 of each file
    stage-<i>/weights.npz                 the newest complete step's stage-<i>.npz, hard
                                          linked (the same file: no extra disk)
    .incoming/                            files being received (a failed write removes its
                                          file; the leader empties it at start-up and
                                          when the job or attempt ends)

A step is *complete* when every stage's JSON is there; resume and glue use the newest complete
step. Older complete steps are pruned (the newest two are kept), as are incomplete steps older
than the newest complete one, those that can no longer complete (a stage without them has pushed
a later step) and all but the newest :data:`KEEP_PARTIAL_STEPS` of those that can. A pushing
fellow is a stranger: its files never grow past their announced size, it holds at most
:data:`OPEN_TRANSFERS_PER_FELLOW` open transfers, and a file that would leave the disk less
than its reserve free fails with ENOSPC before a byte is written. A job with replicas exports
replica 0's stages (:func:`exported_placement`): the other replicas push nothing.

Writes never follow symlinks: see :class:`ExportStore`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from silentswarm import __version__
from silentswarm.errors import FieldError
from silentswarm.jobspec import Placement
from silentswarm.leader.errors import ExportPathError
from silentswarm.protocol import ShardAck, ShardChunk
from silentswarm.types.jobs import JobRecord, ShardReceipt
from silentswarm.types.manifests import (
    RUN_MANIFEST,
    BaseRef,
    ExportedShard,
    RunManifest,
    encode_run_manifest,
)
from silentswarm.types.views import job_view

SHARD_FILE = re.compile(r"^stage-(\d{1,4})\.(npz|json)$")
MANIFEST = RUN_MANIFEST
WEIGHTS = "weights.npz"  # stage-<i>/weights.npz: the name earlier exports used
KEEP_COMPLETE_STEPS = 2
# What one placed fellow can make the leader hold (a stranger's pushes): an honest pusher
# sends one file at a time, and its pipeline's stages reach the same checkpoints a few
# steps apart, so a few open transfers and incomplete steps are plenty.
OPEN_TRANSFERS_PER_FELLOW = 4
# Incomplete steps that can still complete, newer than the newest complete one: an honest
# slow stage lags a few checkpoints; one stage pushing far ahead of the others is held here.
KEEP_PARTIAL_STEPS = 16
MAX_PIECE = 1 << 20  # ShardChunk.data's bound
# A file is not taken on when it would leave the export disk less free than this (or than
# a twentieth of a smaller disk).
DISK_RESERVE_BYTES = 256 << 20


def exported_placement(
    placement: Placement, ranges: Sequence[tuple[int, int]] | None = None
) -> Placement:
    """The placement an export describes: the lead replica's stages (the only ones that push
    shards: replica 0's, or the one that took over when it was lost) as one pipeline without
    replicas (:meth:`Placement.alone`; ``ranges``: the pushed shards' layers), so a job with
    replicas exports what a job without them does, whichever replica led."""
    return placement.alone(ranges)


@dataclass
class _Transfer:
    path: Path
    sha256: str
    size: int
    total: int
    next_seq: int = 0
    hasher: Any = field(default_factory=hashlib.sha256)
    received: int = 0


def partial_steps_to_drop(
    held: dict[int, set[int]], complete: set[int], n_stages: int, writing: set[int]
) -> set[int]:
    """Which incomplete steps newer than the newest complete one go (``held``: the stages
    with a file at each step). A step is *dead* when a stage without a file there has
    pushed a later step: pushers go forward (a slow one skips to its newest checkpoint), so
    it never will, and the step can never complete. The live ones are kept, but for the
    oldest beyond :data:`KEEP_PARTIAL_STEPS` (one stage pushing steps far ahead of the
    others, which no honest lag reaches), unless a transfer still ``writing`` into it."""
    newest_complete = max(complete, default=-1)
    newest = {i: max((s for s, st in held.items() if i in st), default=-1) for i in range(n_stages)}
    partial = sorted(s for s in held if s > newest_complete and s not in complete)
    dead = {
        s
        for s in partial
        if any(i not in held[s] and newest[i] > s for i in range(n_stages)) and s not in writing
    }
    live = [s for s in partial if s not in dead]
    return dead | {s for s in live[:-KEEP_PARTIAL_STEPS] if s not in writing}


def piece_problem(chunk: ShardChunk, n_stages: int) -> str | None:
    """What is wrong with a piece on its face (its file, numbering, and on a first piece
    whether its pieces can carry its size); None: nothing."""
    match = SHARD_FILE.match(chunk.name)
    if match is None or int(match.group(1)) != chunk.stage or not 0 <= chunk.stage < n_stages:
        return f"bad shard file {chunk.name!r}"
    if chunk.step < 0 or chunk.total < 1 or not 0 <= chunk.seq < chunk.total:
        return "bad piece numbering"
    if chunk.seq == 0 and not -(-chunk.size // MAX_PIECE) <= chunk.total <= max(1, chunk.size):
        return f"{chunk.total} pieces cannot carry {chunk.size} bytes"
    return None


def _step_of(entry: Path) -> int | None:
    name = entry.name
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


# --- where exports go -------------------------------------------------------------------------

EXPORT_DIR_FIELD = "artifact_paths.model_export_dir"


def export_dir(root: Path, job_id: str, configured: str | None) -> Path:
    """A job's export directory: ``configured`` taken under the export ``root`` (an absolute
    one as it is: :func:`resolve_export_dir` refused those outside the root at submit), else
    ``<root>/<job_id>/model_export``."""
    if configured:
        return Path(os.path.normpath(root / configured))
    return root / job_id / "model_export"


def resolve_export_dir(root: Path, configured: str) -> Path:
    """The directory a spec's ``artifact_paths.model_export_dir`` names, under the export root
    (``root``: absolute, its own symlinks resolved). A relative path is taken under the root.
    FieldError (400, naming the field) for a path outside the root (absolute, with ``..``, or
    through a symlink), the root itself, or a path through an existing symlink or file."""

    def refuse(why: str) -> FieldError:
        return FieldError(
            f"{EXPORT_DIR_FIELD}: {configured!r} {why} (the export root is {root}, "
            "SWARM_EXPORT_ROOT; relative paths are taken under it)",
            field=EXPORT_DIR_FIELD,
        )

    if "\x00" in configured:
        raise refuse("contains a NUL byte")
    if ".." in Path(configured).parts:
        raise refuse("contains '..'")
    candidate = Path(os.path.normpath(root / configured))
    if candidate.is_relative_to(root):
        relative = candidate.relative_to(root)
    else:  # perhaps through another name of the root (a symlink to it)
        real = Path(os.path.realpath(candidate))
        if not real.is_relative_to(root):
            raise refuse("is outside the export root")
        relative = real.relative_to(root)
    if not relative.parts:
        raise refuse("is the export root itself: name a directory in it")
    path = root
    for part in relative.parts:
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            break
        if stat.S_ISLNK(mode):
            raise refuse(f"goes through a symlink ({path})")
        if not stat.S_ISDIR(mode):
            raise refuse(f"goes through something that is not a directory ({path})")
    return root / relative


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class ExportStore:
    """Receives shard pieces into export directories and describes what is there.

    With a ``root`` (the leader's export root) every write checks, as it writes, that its
    directory is inside the root and that no component below the root is a symlink: it walks
    down with ``O_NOFOLLOW`` directory descriptors and creates files ``O_EXCL | O_NOFOLLOW``
    relative to them, so a symlink planted at any point is refused, never followed. Without
    a root, the export directory itself is trusted and everything below it is checked."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = None if root is None else Path(os.path.realpath(root))
        self._transfers: dict[tuple[str, str, int, int, str], _Transfer] = {}

    # --- safe paths -----------------------------------------------------------------------

    def _split(self, directory: Path) -> tuple[Path, tuple[str, ...]]:
        """(the trusted base, the components below it that must be plain directories)."""
        if self.root is None:
            return directory, ()
        path = Path(os.path.normpath(directory))
        if not path.is_relative_to(self.root):
            raise ExportPathError(directory, f"outside the export root {self.root}")
        return self.root, path.relative_to(self.root).parts

    @contextlib.contextmanager
    def _dir(self, directory: Path, *sub: str, create: bool = True) -> Iterator[int]:
        """A descriptor of ``directory/sub...``, walked down without following symlinks."""
        base, parts = self._split(directory)
        if create:
            base.mkdir(parents=True, exist_ok=True)
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            walked = base
            for part in (*parts, *sub):
                walked = walked / part
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise ExportPathError(walked, "a symlink or not a directory") from None
                    raise
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    def _links_below(self, directory: Path, *sub: str) -> bool:
        """For reads: is any existing component below the trusted base a symlink (or is the
        directory outside the root)?"""
        try:
            base, parts = self._split(directory)
        except ExportPathError:
            return True
        path = base
        for part in (*parts, *sub):
            path = path / part
            try:
                if stat.S_ISLNK(os.lstat(path).st_mode):
                    return True
            except FileNotFoundError:
                return False
        return False

    # --- receiving ------------------------------------------------------------------------

    def receive(
        self, directory: Path, chunk: ShardChunk, n_stages: int
    ) -> tuple[ShardAck, ShardReceipt | None]:
        """Take one piece; a receipt when it completed a stage's shard (its JSON)."""
        problem = piece_problem(chunk, n_stages)
        if problem is not None:
            return ShardAck(ok=False, next_seq=chunk.seq, message=problem), None
        key = (chunk.job_id, chunk.fellow_id, chunk.step, chunk.attempt, chunk.name)
        transfer = self._transfers.get(key)
        if chunk.seq == 0:
            transfer = self._open(directory, key, chunk)
        if transfer is None or chunk.seq != transfer.next_seq or chunk.sha256 != transfer.sha256:
            want = 0 if transfer is None or chunk.sha256 != transfer.sha256 else transfer.next_seq
            return ShardAck(ok=False, next_seq=want, message=f"expected piece {want}"), None
        incoming = transfer.path.name
        if transfer.received + len(chunk.data) > transfer.size:
            self._forget_transfer(key)
            message = f"{chunk.name}: more than the {transfer.size} bytes announced"
            return ShardAck(ok=False, next_seq=0, message=message), None
        try:
            with self._dir(directory, ".incoming") as fd:
                flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
                with os.fdopen(os.open(incoming, flags, dir_fd=fd), "ab") as f:
                    f.write(chunk.data)
        except OSError:
            del self._transfers[key]
            self._abandon(directory, incoming)
            raise
        transfer.hasher.update(chunk.data)
        transfer.received += len(chunk.data)
        transfer.next_seq += 1
        if transfer.next_seq < transfer.total:
            return ShardAck(ok=True, next_seq=transfer.next_seq), None
        del self._transfers[key]
        digest = transfer.hasher.hexdigest()
        if digest != transfer.sha256 or transfer.received != transfer.size:
            with self._dir(directory, ".incoming") as fd, contextlib.suppress(FileNotFoundError):
                os.unlink(incoming, dir_fd=fd)
            return (
                ShardAck(
                    ok=False,
                    next_seq=0,
                    message=f"{chunk.name}: sha256 {digest} or size {transfer.received} does "
                    "not match; send it again",
                ),
                None,
            )
        step_parts = ("shards", f"step-{chunk.step}")
        try:
            with (
                self._dir(directory, ".incoming") as src,
                self._dir(directory, *step_parts) as dst,
            ):
                # The sidecar is written first, under a temporary name: a full disk fails
                # here, before anything stored (perhaps a complete step's file) is replaced.
                sidecar = _write_temp(dst, f"{chunk.name}.sha256", digest.encode())
                try:
                    os.replace(incoming, chunk.name, src_dir_fd=src, dst_dir_fd=dst)
                    os.replace(sidecar, f"{chunk.name}.sha256", src_dir_fd=dst, dst_dir_fd=dst)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(sidecar, dir_fd=dst)
                    raise
                npz_size = _plain_size(dst, f"stage-{chunk.stage}.npz")
        except OSError:
            self._abandon(directory, incoming)
            raise
        self._drop_partial(directory, n_stages, chunk.job_id)
        receipt = None
        if chunk.name.endswith(".json"):
            npz = self.step_dir(directory, chunk.step) / f"stage-{chunk.stage}.npz"
            receipt = ShardReceipt(
                fellow_id=chunk.fellow_id,
                stage=chunk.stage,
                step=chunk.step,
                attempt=chunk.attempt,
                size=transfer.size + (npz_size or 0),
                sha256=self.sha256_of(npz) or "",
                at=time.time(),
            )
        return ShardAck(ok=True, next_seq=transfer.total, done=True), receipt

    def _open(
        self, directory: Path, key: tuple[str, str, int, int, str], chunk: ShardChunk
    ) -> _Transfer:
        """A file's first piece: its transfer (a new one: a first piece starts the file
        over). ENOSPC, before a byte is written, for a file that would leave the export disk
        less free than its reserve (a stranger's claimed size must not fill it)."""
        name = f"{chunk.fellow_id}-a{chunk.attempt}-s{chunk.step}-{chunk.name}"
        self._forget_transfer(key)
        self._make_room(chunk.job_id, chunk.fellow_id)
        try:
            with self._dir(directory, ".incoming") as fd:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
                disk = os.fstatvfs(fd)
                free = disk.f_bavail * disk.f_frsize
                reserve = min(DISK_RESERVE_BYTES, disk.f_blocks * disk.f_frsize // 20)
                if chunk.size > free - reserve:
                    raise OSError(
                        errno.ENOSPC,
                        f"No space left on device for its {chunk.size} bytes ({free} free, "
                        f"{reserve} kept in reserve)",
                    )
                os.close(os.open(name, _NEW_FILE, 0o644, dir_fd=fd))
        except OSError:
            self._abandon(directory, name)
            raise
        transfer = _Transfer(
            path=directory / ".incoming" / name,
            sha256=chunk.sha256,
            size=chunk.size,
            total=chunk.total,
        )
        self._transfers[key] = transfer
        return transfer

    def _forget_transfer(self, key: tuple[str, str, int, int, str]) -> None:
        """An open transfer given up: its partial file goes too."""
        transfer = self._transfers.pop(key, None)
        if transfer is not None:
            self._abandon(transfer.path.parent.parent, transfer.path.name)

    def _make_room(self, job_id: str, fellow_id: str) -> None:
        """Before ``fellow_id`` opens another transfer: its oldest open ones given up, down
        to one fewer than :data:`OPEN_TRANSFERS_PER_FELLOW`."""
        mine = [k for k in self._transfers if k[:2] == (job_id, fellow_id)]
        for key in mine[: max(0, len(mine) - OPEN_TRANSFERS_PER_FELLOW + 1)]:
            self._forget_transfer(key)

    def _drop_partial(self, directory: Path, n_stages: int, job_id: str) -> None:
        """Incomplete steps that can no longer complete, and the oldest beyond
        :data:`KEEP_PARTIAL_STEPS` of those that can (:func:`partial_steps_to_drop`); a step
        one of the job's open transfers writes into is kept."""
        held = self.stages_by_step(directory)
        complete = set(self.complete_steps(directory, n_stages))
        writing = {key[2] for key in self._transfers if key[0] == job_id}
        doomed = partial_steps_to_drop(held, complete, n_stages, writing)
        if doomed:
            self._remove_steps(directory, doomed.__contains__)

    def stages_by_step(self, directory: Path) -> dict[int, set[int]]:
        """Every step directory's step and the stages with a stored file there."""
        root = directory / "shards"
        out: dict[int, set[int]] = {}
        for step in self.step_numbers(directory):
            stages = out.setdefault(step, set())
            for entry in (root / f"step-{step}").iterdir():
                match = SHARD_FILE.match(entry.name)
                if match is not None and _is_plain(entry):
                    stages.add(int(match.group(1)))
        return out

    def _abandon(self, directory: Path, incoming: str) -> None:
        """A write failed: the partial file goes (on a full disk, its space comes back)."""
        with contextlib.suppress(OSError), self._dir(directory, ".incoming", create=False) as fd:
            os.unlink(incoming, dir_fd=fd)

    def forget(self, job_id: str) -> None:
        """The job is over: its unfinished transfers will never finish."""
        for key in [k for k in self._transfers if k[0] == job_id]:
            del self._transfers[key]

    def sweep_incoming(self, directory: Path) -> list[str]:
        """Remove what ``.incoming/`` holds, and the folder itself; the names removed.

        Only for a directory no transfer is under way in (at start-up, after the job or
        attempt ended): stored shards and the manifest are never touched, and a symlink
        (planted as ``.incoming`` or in it) is removed, never followed."""
        removed: list[str] = []
        try:
            with self._dir(directory, create=False) as parent:
                try:
                    fd = os.open(".incoming", _DIR_FLAGS, dir_fd=parent)
                except OSError as exc:
                    if exc.errno == errno.ENOENT:
                        return removed
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    os.unlink(".incoming", dir_fd=parent)  # a symlink or file, not ours
                    return [".incoming"]
                try:
                    for name in os.listdir(fd):
                        if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                            shutil.rmtree(name, ignore_errors=True, dir_fd=fd)
                        else:
                            os.unlink(name, dir_fd=fd)
                        removed.append(name)
                finally:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    os.rmdir(".incoming", dir_fd=parent)
        except (FileNotFoundError, ExportPathError):
            pass
        return removed

    # --- what is there --------------------------------------------------------------------

    @staticmethod
    def step_dir(directory: Path, step: int) -> Path:
        return directory / "shards" / f"step-{step}"

    @staticmethod
    def sha256_of(path: Path) -> str | None:
        sidecar = path.with_name(f"{path.name}.sha256")
        try:
            if stat.S_ISLNK(os.lstat(sidecar).st_mode):
                return None
            return sidecar.read_text().strip()
        except OSError:
            return None

    def complete_steps(self, directory: Path, n_stages: int) -> list[int]:
        """Steps for which every stage's shard (both files, plain files) is there, oldest
        first. Symlinks count as missing."""
        return [
            step
            for step in self.step_numbers(directory)
            if all(
                _is_plain(self.step_dir(directory, step) / f"stage-{i}.{suffix}")
                for i in range(n_stages)
                for suffix in ("json", "npz")
            )
        ]

    def step_numbers(self, directory: Path) -> list[int]:
        """Every step directory's step, oldest first (symlinks left out)."""
        root = directory / "shards"
        if not root.is_dir() or self._links_below(directory, "shards"):
            return []
        found = (_step_of(e) for e in root.iterdir() if not e.is_symlink())
        return sorted(s for s in found if s is not None)

    def prune(self, directory: Path, n_stages: int) -> None:
        """Keep the newest complete steps (and anything newer); drop older steps, and the
        incomplete ones older than the newest complete step (every stage has pushed past
        them: a pusher sends its checkpoints in order)."""
        complete = self.complete_steps(directory, n_stages)
        if not complete:
            return
        oldest_kept = complete[-KEEP_COMPLETE_STEPS:][0]
        kept = set(complete)
        self._remove_steps(
            directory,
            lambda step: step < oldest_kept or (step < complete[-1] and step not in kept),
        )

    def drop_after(self, directory: Path, step: int) -> None:
        """A resume from ``step``: the failed attempt's later (partial) shards must not mix
        with the new attempt's."""
        self._remove_steps(directory, lambda found: found > step)

    def _remove_steps(self, directory: Path, doomed: Callable[[int], bool]) -> None:
        """Step directories removed relative to a no-follow descriptor of ``shards/`` (a
        symlink there is refused by rmtree, never followed)."""
        try:
            with self._dir(directory, "shards", create=False) as fd:
                for name in os.listdir(fd):
                    step = _step_of(Path(name))
                    if step is not None and doomed(step):
                        shutil.rmtree(name, ignore_errors=True, dir_fd=fd)
        except (FileNotFoundError, ExportPathError):
            return

    def shard_files(self, directory: Path, step: int, stage: int) -> list[tuple[str, str]]:
        """(file name, sha256) of a stage's shard at ``step``, arrays first."""
        out = []
        for suffix in ("npz", "json"):
            name = f"stage-{stage}.{suffix}"
            digest = self.sha256_of(self.step_dir(directory, step) / name)
            if digest is None:
                raise FileNotFoundError(f"no verified {name} at step {step} in {directory}")
            out.append((name, digest))
        return out

    def file_path(self, directory: Path, step: int, name: str) -> Path | None:
        """A shard file to serve: a plain file reached without any symlink, else None."""
        if SHARD_FILE.match(name) is None or step < 0:
            return None
        if self._links_below(directory, "shards", f"step-{step}", name):
            return None
        path = self.step_dir(directory, step) / name
        return path if _is_plain(path) else None

    # --- the manifest ---------------------------------------------------------------------

    def write_manifest(
        self, directory: Path, job: Any, pushed: tuple[int, Any] | None = None
    ) -> Path | None:
        """``run_manifest.json`` for the newest complete step (None when there is none).
        ``pushed``: the ``(step, layer ranges)`` about to be the job's ``pushed_step`` and
        ``pushed_ranges`` (the manifest is written before the record says so); None: the
        record's."""
        if job.placement is None:
            return None
        n = job.placement.n_stages
        complete = self.complete_steps(directory, n)
        if not complete:
            return None
        step = complete[-1]
        stages = []
        base = f"shards/step-{step}"
        # The shards' own layers: those of the lead that pushed them (a lead that took over
        # since may split the layers otherwise, until it pushes a complete step of its own).
        pushed_step, ranges = pushed or (
            getattr(job, "pushed_step", None),
            getattr(job, "pushed_ranges", None),
        )
        if ranges is None or len(ranges) != n or step != pushed_step:
            ranges = None
        placement = exported_placement(job.placement, ranges)
        ranges = placement.split(0)
        for placed, (layer_start, layer_end) in zip(placement.stages, ranges, strict=True):
            (npz, npz_sha), (meta, meta_sha) = self.shard_files(directory, step, placed.stage)
            stages.append(
                ExportedShard(
                    stage=placed.stage,
                    fellow_id=placed.fellow_id,
                    layer_start=layer_start,
                    layer_end=layer_end,
                    checkpoint=f"{base}/{meta}",
                    checkpoint_sha256=meta_sha,
                    weights=f"{base}/{npz}",
                    weights_sha256=npz_sha,
                    bytes=sum(
                        (self.step_dir(directory, step) / f).stat().st_size for f in (npz, meta)
                    ),
                )
            )
        view = job_view(
            job.progress,
            total_steps=job.spec.steps,
            final_loss=job.final_loss,
            final_val_loss=job.final_val_loss,
        )
        manifest = RunManifest(
            job_id=job.job_id,
            name=job.name,
            attempt=job.attempt,
            state=job.state.value,
            package_version=__version__,
            spec=job.spec,
            placement=placement,
            compression=job.spec.compression,
            step=step,
            total_steps=job.spec.steps,
            loss=view.loss,
            val_loss=view.val_loss,
            stages=stages,
            updated_at=time.time(),
            base=_base_ref(job),
            owner=job.owner,
        )
        with self._dir(directory) as fd:
            _write_atomic(fd, MANIFEST, encode_run_manifest(manifest))
        self.link_weights(directory, step, n)
        return directory / MANIFEST

    def link_weights(self, directory: Path, step: int, n_stages: int) -> None:
        """``stage-<i>/weights.npz`` for every stage: its shard's arrays at ``step``, hard
        linked (where the file system has no hard links, copied), each replaced whole.

        The name operators of earlier exports know (docs/operations/names.md); a link costs
        no disk, and the pruned step's space comes back once every link moved on."""
        with self._dir(directory, "shards", f"step-{step}", create=False) as src:
            for stage in range(n_stages):
                with self._dir(directory, f"stage-{stage}") as dst:
                    tmp = f".{WEIGHTS}.{secrets.token_hex(4)}.tmp"
                    try:
                        _link_or_copy(src, f"stage-{stage}.npz", dst, tmp)
                        os.replace(tmp, WEIGHTS, src_dir_fd=dst, dst_dir_fd=dst)
                    except BaseException:
                        with contextlib.suppress(OSError):
                            os.unlink(tmp, dir_fd=dst)
                        raise


def _base_ref(job: JobRecord) -> BaseRef | None:
    """What an adapter's export names as its base: the export the job started from."""
    source = job.init_source
    if job.spec.adapter is None or source is None:
        return None
    return BaseRef(job_id=source.job_id, step=source.step, manifest_sha256=source.manifest_sha256)


def _write_atomic(dir_fd: int, name: str, data: bytes) -> None:
    """``name`` in the directory ``dir_fd`` replaced whole: a fresh temporary file (O_EXCL,
    O_NOFOLLOW) renamed over it (a rename replaces a symlink, never follows it)."""
    tmp = _write_temp(dir_fd, name, data)
    try:
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _link_or_copy(src_fd: int, name: str, dst_fd: int, new: str) -> None:
    """``new`` in ``dst_fd``: a hard link to the plain file ``name`` in ``src_fd``, else (a
    file system without hard links) a copy. Symlinks are never followed."""
    try:
        os.link(name, new, src_dir_fd=src_fd, dst_dir_fd=dst_fd, follow_symlinks=False)
        return
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
    read_flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    with (
        os.fdopen(os.open(name, read_flags, dir_fd=src_fd), "rb") as source,
        os.fdopen(os.open(new, _NEW_FILE, 0o644, dir_fd=dst_fd), "wb") as target,
    ):
        shutil.copyfileobj(source, target, 1 << 20)


def _write_temp(dir_fd: int, name: str, data: bytes) -> str:
    """``data`` in a fresh temporary file next to ``name`` (O_EXCL, O_NOFOLLOW); its name.
    Nothing is left behind when the write fails."""
    tmp = f".{name}.{secrets.token_hex(4)}.tmp"
    try:
        with os.fdopen(os.open(tmp, _NEW_FILE, 0o644, dir_fd=dir_fd), "wb") as f:
            f.write(data)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    return tmp


def _plain_size(dir_fd: int, name: str) -> int | None:
    """The size of a plain file in ``dir_fd`` (None: missing, or a symlink or not a file)."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def _is_plain(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
