"""Step 1 of glue: an export directory's ``run_manifest.json`` and every file it lists, checked.

No TensorFlow here: a missing or corrupt shard is found before TensorFlow is imported. The
manifest's fields and types are the Struct's (:class:`silentswarm.types.manifests.RunManifest`);
this module checks what the types cannot: the spec is valid, the stages are the placement's,
every path stays inside the export directory, every file is there with the recorded sha256,
and each checkpoint's own JSON describes the stage and step the manifest says it does.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from silentswarm.agent.errors import GlueError
from silentswarm.errors import ManifestError
from silentswarm.jobspec import JobSpec, Placement
from silentswarm.types.manifests import (
    RUN_MANIFEST,
    ExportedShard,
    FileEntry,
    RunManifest,
    decode_run_manifest,
)


@dataclass(frozen=True)
class StageFiles:
    """A stage's shard and where its files are on this machine."""

    shard: ExportedShard
    checkpoint: Path  # the JSON
    weights: Path  # the npz

    @property
    def stage(self) -> int:
        return self.shard.stage


@dataclass(frozen=True)
class CheckedExport:
    """An export directory whose manifest and files passed :func:`read_run_manifest`."""

    path: Path  # its run_manifest.json
    manifest: RunManifest
    sha256: str  # of run_manifest.json
    stages: list[StageFiles]

    @property
    def spec(self) -> JobSpec:
        return self.manifest.spec

    @property
    def placement(self) -> Placement:
        return self.manifest.placement

    @property
    def job_id(self) -> str:
        return self.manifest.job_id

    @property
    def attempt(self) -> int:
        return self.manifest.attempt

    @property
    def step(self) -> int:
        return self.manifest.step


def file_entry(path: Path) -> FileEntry:
    """A file's sha256 and size, as a manifest lists them."""
    return FileEntry(sha256=sha256_file(path), bytes=path.stat().st_size)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_run_manifest(export_dir: str | os.PathLike[str]) -> CheckedExport:
    """The checked manifest of ``export_dir``; every file it lists exists and checks out."""
    export_dir = Path(export_dir)
    path = export_dir / RUN_MANIFEST
    if not export_dir.is_dir():
        raise GlueError(f"{export_dir}: not a directory")
    try:
        body = path.read_bytes()
    except FileNotFoundError:
        raise GlueError(f"{path}: missing (not an export directory?)") from None
    except OSError as exc:
        raise GlueError(f"{path}: cannot read it ({exc.strerror})") from None
    try:
        manifest = decode_run_manifest(body)
    except ManifestError as exc:
        raise GlueError(exc.message) from None
    _check_against_spec(manifest)
    stages = [
        _stage_files(export_dir, i, entry, manifest) for i, entry in enumerate(manifest.stages)
    ]
    for files in stages:
        shard, whose = files.shard, f"stage {files.stage}'s"
        _check_file(export_dir, shard.checkpoint, shard.checkpoint_sha256, f"{whose} checkpoint")
        _check_file(export_dir, shard.weights, shard.weights_sha256, f"{whose} weights")
        _check_meta(files, manifest)
    return CheckedExport(
        path=path, manifest=manifest, sha256=hashlib.sha256(body).hexdigest(), stages=stages
    )


def _check_against_spec(manifest: RunManifest) -> None:
    spec, placement = manifest.spec, manifest.placement
    if manifest.compression != spec.compression:
        raise GlueError(
            f"{RUN_MANIFEST}: compression {manifest.compression!r} differs from the spec's "
            f"{spec.compression!r}"
        )
    problems = spec.problems()
    if problems:
        raise GlueError(f"{RUN_MANIFEST}: the job spec is invalid: {'; '.join(problems)}")
    n = len(placement.stages)
    if n < 1 or [s.stage for s in placement.stages] != list(range(n)):
        raise GlueError(f"{RUN_MANIFEST}: the placement's stages are not 0..{n - 1} in order")
    if len(manifest.stages) != n:
        raise GlueError(
            f"{RUN_MANIFEST}: lists {len(manifest.stages)} stage checkpoints, the placement has "
            f"{n} stages"
        )


def _stage_files(
    export_dir: Path, i: int, entry: ExportedShard, manifest: RunManifest
) -> StageFiles:
    where = f"{RUN_MANIFEST}: stages[{i}]"
    if entry.stage != i:
        raise GlueError(f"{where}: stage {entry.stage}, expected {i}")
    placed = manifest.placement.stages[i]
    have = (entry.layer_start, entry.layer_end)
    want = (placed.layer_start, placed.layer_end)
    if have != want:
        raise GlueError(f"{where}: layers {list(have)} differ from the placement's {list(want)}")
    checkpoint = _inside(export_dir, entry.checkpoint, where)
    weights = _inside(export_dir, entry.weights, where)
    if checkpoint.parent.resolve() != weights.parent.resolve():
        raise GlueError(f"{where}: the checkpoint and its weights must share a directory")
    return StageFiles(shard=entry, checkpoint=checkpoint, weights=weights)


def _inside(export_dir: Path, rel: str, where: str) -> Path:
    """``export_dir / rel``, refusing absolute paths and paths that leave the directory."""
    if not rel or Path(rel).is_absolute():
        raise GlueError(f"{where}: {rel!r} must be a path relative to the export directory")
    path = export_dir / rel
    root = export_dir.resolve()
    if root != path.resolve() and root not in path.resolve().parents:
        raise GlueError(f"{where}: {rel!r} leaves the export directory")
    return path


def _check_file(export_dir: Path, rel: str, want: str, what: str) -> None:
    path = export_dir / rel
    if not path.is_file():
        raise GlueError(f"{rel}: missing ({what})")
    got = sha256_file(path)
    if got != want.lower():
        raise GlueError(f"{rel}: sha256 {got} does not match the manifest ({want})")


def _check_meta(files: StageFiles, manifest: RunManifest) -> None:
    """The checkpoint's own JSON agrees with the manifest (it is read again when restoring)."""
    rel = files.shard.checkpoint
    try:
        meta = json.loads(files.checkpoint.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GlueError(f"{rel}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise GlueError(f"{rel}: not a stage checkpoint")
    want = {
        "job_id": manifest.job_id,
        "stage": files.stage,
        "n_stages": len(manifest.stages),
        "layer_start": files.shard.layer_start,
        "layer_end": files.shard.layer_end,
        "steps_done": manifest.step,
        "compression": manifest.spec.compression,
        "model": msgspec.to_builtins(manifest.spec.model),
        "npz": files.weights.name,
    }
    wrong = [f"{k} {meta.get(k)!r} (want {v!r})" for k, v in want.items() if meta.get(k) != v]
    if wrong:
        raise GlueError(f"{rel}: does not fit the manifest: {'; '.join(wrong)}")
