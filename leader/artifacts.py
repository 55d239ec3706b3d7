"""Model exports on the leader: the shards fellows push, and ``run_manifest.json``.

A job's export directory is ``artifact_paths.model_export_dir`` from its spec, else
``<state>/model_exports/<job_id>/model_export``::

    run_manifest.json                     the job, its placement, and the newest complete step
    shards/step-<n>/stage-<i>.npz         a stage's checkpoint after n steps (arrays)
    shards/step-<n>/stage-<i>.json        ... and its metadata (written last: it completes it)
    shards/step-<n>/stage-<i>.*.sha256    the verified sha256 of each file
    .incoming/                            files being received

A step is *complete* when every stage's JSON is there; resume and glue use the newest complete
step. Older complete steps are pruned (the newest two are kept).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from swarm import __version__
from swarm.protocol import ShardAck, ShardChunk

SHARD_FILE = re.compile(r"^stage-(\d{1,4})\.(npz|json)$")
MANIFEST = "run_manifest.json"
KEEP_COMPLETE_STEPS = 2
MANIFEST_FORMAT = 1


class ShardReceipt(msgspec.Struct, kw_only=True):
    """A stage's shard arrived whole and verified."""

    fellow_id: str
    stage: int
    step: int
    attempt: int
    size: int  # both files
    sha256: str  # of the arrays (.npz)
    at: float


@dataclass
class _Transfer:
    path: Path
    sha256: str
    size: int
    total: int
    next_seq: int = 0
    hasher: Any = field(default_factory=hashlib.sha256)
    received: int = 0


def _step_of(entry: Path) -> int | None:
    name = entry.name
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


def export_dir(state_dir: Path, job_id: str, configured: str | None) -> Path:
    if configured:
        return Path(configured)
    return state_dir / "model_exports" / job_id / "model_export"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class ExportStore:
    """Receives shard pieces into export directories and describes what is there."""

    def __init__(self) -> None:
        self._transfers: dict[tuple[str, str, int, int, str], _Transfer] = {}

    # --- receiving ------------------------------------------------------------------------

    def receive(
        self, directory: Path, chunk: ShardChunk, n_stages: int
    ) -> tuple[ShardAck, ShardReceipt | None]:
        """Take one piece; a receipt when it completed a stage's shard (its JSON)."""
        match = SHARD_FILE.match(chunk.name)
        if match is None or int(match.group(1)) != chunk.stage or not 0 <= chunk.stage < n_stages:
            return ShardAck(
                ok=False, next_seq=chunk.seq, message=f"bad shard file {chunk.name!r}"
            ), None
        if chunk.step < 0 or chunk.total < 1 or not 0 <= chunk.seq < chunk.total:
            return ShardAck(ok=False, next_seq=chunk.seq, message="bad piece numbering"), None
        key = (chunk.job_id, chunk.fellow_id, chunk.step, chunk.attempt, chunk.name)
        transfer = self._transfers.get(key)
        if chunk.seq == 0:
            incoming = directory / ".incoming"
            incoming.mkdir(parents=True, exist_ok=True)
            path = incoming / f"{chunk.fellow_id}-a{chunk.attempt}-s{chunk.step}-{chunk.name}"
            path.write_bytes(b"")
            transfer = _Transfer(path=path, sha256=chunk.sha256, size=chunk.size, total=chunk.total)
            self._transfers[key] = transfer
        if transfer is None or chunk.seq != transfer.next_seq or chunk.sha256 != transfer.sha256:
            want = 0 if transfer is None or chunk.sha256 != transfer.sha256 else transfer.next_seq
            return ShardAck(ok=False, next_seq=want, message=f"expected piece {want}"), None
        with transfer.path.open("ab") as f:
            f.write(chunk.data)
        transfer.hasher.update(chunk.data)
        transfer.received += len(chunk.data)
        transfer.next_seq += 1
        if transfer.next_seq < transfer.total:
            return ShardAck(ok=True, next_seq=transfer.next_seq), None
        del self._transfers[key]
        digest = transfer.hasher.hexdigest()
        if digest != transfer.sha256 or transfer.received != transfer.size:
            transfer.path.unlink(missing_ok=True)
            return (
                ShardAck(
                    ok=False,
                    next_seq=0,
                    message=f"{chunk.name}: sha256 {digest} or size {transfer.received} does "
                    "not match; send it again",
                ),
                None,
            )
        target_dir = self.step_dir(directory, chunk.step)
        target_dir.mkdir(parents=True, exist_ok=True)
        os.replace(transfer.path, target_dir / chunk.name)
        _write_atomic(target_dir / f"{chunk.name}.sha256", digest.encode())
        receipt = None
        if chunk.name.endswith(".json"):
            npz = target_dir / f"stage-{chunk.stage}.npz"
            receipt = ShardReceipt(
                fellow_id=chunk.fellow_id,
                stage=chunk.stage,
                step=chunk.step,
                attempt=chunk.attempt,
                size=transfer.size + (npz.stat().st_size if npz.exists() else 0),
                sha256=self.sha256_of(npz) or "",
                at=time.time(),
            )
        return ShardAck(ok=True, next_seq=transfer.total, done=True), receipt

    # --- what is there --------------------------------------------------------------------

    @staticmethod
    def step_dir(directory: Path, step: int) -> Path:
        return directory / "shards" / f"step-{step}"

    @staticmethod
    def sha256_of(path: Path) -> str | None:
        try:
            return path.with_name(f"{path.name}.sha256").read_text().strip()
        except OSError:
            return None

    def complete_steps(self, directory: Path, n_stages: int) -> list[int]:
        """Steps for which every stage's shard (both files) is there, oldest first."""
        root = directory / "shards"
        steps = []
        if root.is_dir():
            for entry in root.iterdir():
                if not entry.name.startswith("step-") or not entry.name[5:].isdigit():
                    continue
                if all(
                    (entry / f"stage-{i}.json").exists() and (entry / f"stage-{i}.npz").exists()
                    for i in range(n_stages)
                ):
                    steps.append(int(entry.name[5:]))
        return sorted(steps)

    def prune(self, directory: Path, n_stages: int) -> None:
        """Keep the newest complete steps (and anything newer); drop older steps."""
        complete = self.complete_steps(directory, n_stages)
        if len(complete) <= KEEP_COMPLETE_STEPS:
            return
        oldest_kept = complete[-KEEP_COMPLETE_STEPS]
        for entry in (directory / "shards").iterdir():
            if _step_of(entry) is not None and _step_of(entry) < oldest_kept:
                shutil.rmtree(entry, ignore_errors=True)

    def drop_after(self, directory: Path, step: int) -> None:
        """A resume from ``step``: the failed attempt's later (partial) shards must not mix
        with the new attempt's."""
        root = directory / "shards"
        if root.is_dir():
            for entry in root.iterdir():
                if _step_of(entry) is not None and _step_of(entry) > step:
                    shutil.rmtree(entry, ignore_errors=True)

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
        if SHARD_FILE.match(name) is None:
            return None
        path = self.step_dir(directory, step) / name
        return path if path.is_file() else None

    # --- the manifest ---------------------------------------------------------------------

    def write_manifest(self, directory: Path, job: Any) -> Path | None:
        """``run_manifest.json`` for the newest complete step (None when there is none)."""
        placement = job.placement
        if placement is None:
            return None
        n = len(placement.stages)
        complete = self.complete_steps(directory, n)
        if not complete:
            return None
        step = complete[-1]
        stages = []
        for placed in placement.stages:
            (npz, npz_sha), (meta, meta_sha) = self.shard_files(directory, step, placed.stage)
            base = f"shards/step-{step}"
            stages.append(
                {
                    "stage": placed.stage,
                    "fellow_id": placed.fellow_id,
                    "layer_start": placed.layer_start,
                    "layer_end": placed.layer_end,
                    "checkpoint": f"{base}/{meta}",
                    "checkpoint_sha256": meta_sha,
                    "weights": f"{base}/{npz}",
                    "weights_sha256": npz_sha,
                    "bytes": sum(
                        (self.step_dir(directory, step) / f).stat().st_size for f in (npz, meta)
                    ),
                }
            )
        last = max(job.progress, key=lambda p: p.stage) if job.progress else None
        manifest = {
            "format": MANIFEST_FORMAT,
            "job_id": job.job_id,
            "name": job.name,
            "attempt": job.attempt,
            "state": job.state.value,
            "package_version": __version__,
            "spec": msgspec.to_builtins(job.spec),
            "placement": msgspec.to_builtins(placement),
            "compression": job.spec.compression,
            "step": step,
            "total_steps": job.spec.steps,
            "loss": job.final_loss if job.final_loss is not None else (last and last.loss),
            "val_loss": (
                job.final_val_loss if job.final_val_loss is not None else (last and last.val_loss)
            ),
            "stages": stages,
            "updated_at": time.time(),
        }
        path = directory / MANIFEST
        _write_atomic(path, json.dumps(manifest, indent=1).encode() + b"\n")
        return path
