"""Jobs that start from another job's weights: ``init_from: "job:ID"`` or ``"export:DIR"``.

At submit, :func:`resolve` finds the export (a job of this leader that COMPLETED with its
manifest, or a directory under the export root holding a ``run_manifest.json``) and
:func:`check_fits` checks the new job can take its weights: the same model (every field but
``dropout``, each one that differs named) and the same kind of tokenizer (the new job
encodes with the source's own: a BPE is not trained again on the new data). The job record
keeps what was resolved (:class:`~silentswarm.types.jobs.InitSource`, with the manifest's
sha256), so what the stages download is what was checked.

START tells each stage of the first attempt (:func:`init_args`) which files to fetch: the
manifest and the shards of the source stages that hold any of its layers (the split may
differ from the source's), with the stage's download token; :func:`init_file` serves them
to that stage only. A resumed attempt restores its own checkpoint instead (a job that trains
an adapter gets the export again: its checkpoint holds the adapter only). The weights go in
fresh (the optimizer starts over, the step count at 0): a new job on new data.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from silentswarm.compression import parse_compression
from silentswarm.errors import FieldError, ManifestError, NotFoundError
from silentswarm.jobspec import JobSpec
from silentswarm.leader.errors import ShardAccessError
from silentswarm.leader.jobs import JobManager
from silentswarm.plan import LayerRange, StagePlan, layers_overlap
from silentswarm.protocol import JobState
from silentswarm.types.jobs import InitSource, JobRecord
from silentswarm.types.manifests import RUN_MANIFEST, RunManifest, decode_run_manifest
from silentswarm.types.signals import InitArgs, InitFile

FIELD = "init_from"
# Model fields a job may change from the export it starts from.
FREE_MODEL_FIELDS = {"dropout"}


def resolve(spec: JobSpec, jobs: JobManager, export_root: Path) -> InitSource | None:
    """The export ``spec.init_from`` names, checked (:func:`check_fits`); None for a job that
    starts from random weights or a preset. FieldError (400, ``init_from``) naming why not."""
    if not spec.init_from_export:
        return None
    assert spec.init_from is not None
    kind, _, rest = spec.init_from.partition(":")
    rest = rest.strip()
    directory = _job_export(rest, jobs) if kind == "job" else _export_dir(rest, export_root)
    manifest, digest = read_manifest(directory)
    check_fits(spec, manifest)
    return InitSource(
        directory=str(directory),
        step=manifest.step,
        manifest_sha256=digest,
        job_id=manifest.job_id,
        owner=manifest.owner,
    )


def _job_export(job_id: str, jobs: JobManager) -> Path:
    try:
        source = jobs.get(job_id)
    except NotFoundError:
        raise FieldError(f"{FIELD}: there is no job {job_id!r}", field=FIELD) from None
    if source.state is not JobState.COMPLETED:
        raise FieldError(
            f"{FIELD}: job {job_id} is {source.state}; only a COMPLETED job's final weights "
            "can start another",
            field=FIELD,
        )
    if source.export_dir is None or source.export_error is not None:
        why = source.export_error or "its stages pushed no final shards"
        raise FieldError(f"{FIELD}: job {job_id} has no final export: {why}", field=FIELD)
    return Path(source.export_dir)


def _export_dir(text: str, root: Path) -> Path:
    """``text`` under the export root (relative paths are taken under it)."""

    def refuse(why: str) -> FieldError:
        return FieldError(
            f"{FIELD}: export:{text!r} {why} (the export root is {root}, SWARM_EXPORT_ROOT)",
            field=FIELD,
        )

    if "\x00" in text or ".." in Path(text).parts:
        raise refuse("must be a path without '..' or NUL bytes")
    real = Path(os.path.realpath(root / text))
    if not real.is_relative_to(root) or real == root:
        raise refuse("is outside the export root")
    return real


def read_manifest(directory: Path) -> tuple[RunManifest, str]:
    """The export's manifest and its sha256; FieldError when there is none or it is bad."""
    path = directory / RUN_MANIFEST
    try:
        body = path.read_bytes()
    except OSError as exc:
        raise FieldError(
            f"{FIELD}: {directory} holds no readable {RUN_MANIFEST} ({exc.strerror or exc})",
            field=FIELD,
        ) from None
    try:
        manifest = decode_run_manifest(body, str(path))
    except ManifestError as exc:
        raise FieldError(f"{FIELD}: {exc.message}", field=FIELD) from None
    return manifest, hashlib.sha256(body).hexdigest()


def check_fits(spec: JobSpec, manifest: RunManifest) -> None:
    """FieldError naming every model field that differs from the export's, or a tokenizer of
    another kind. Pure."""
    theirs, ours = manifest.spec.model, spec.model
    wrong = [
        f"model.{name} is {getattr(ours, name)!r}, the export's {getattr(theirs, name)!r}"
        for name in ours.__struct_fields__
        if name not in FREE_MODEL_FIELDS and getattr(ours, name) != getattr(theirs, name)
    ]
    if manifest.spec.adapter is not None:
        wrong.append(
            f"it holds an adapter, not a model (start from its base, job "
            f"{manifest.base.job_id if manifest.base else '?'})"
        )
    if spec.adapter is not None:
        wrong.extend(_adapter_problems(spec, manifest))
    if spec.tokenizer.kind != manifest.spec.tokenizer.kind:
        wrong.append(
            f"tokenizer.kind is {spec.tokenizer.kind!r}, the export's "
            f"{manifest.spec.tokenizer.kind!r} (the job encodes with the export's tokenizer)"
        )
    if wrong:
        raise FieldError(
            f"{FIELD}: job {manifest.job_id}'s export does not fit this job: " + "; ".join(wrong),
            field=FIELD,
        )


def _adapter_problems(spec: JobSpec, manifest: RunManifest) -> list[str]:
    """Why an adapter cannot be trained on this export: a glued base applies its own
    boundaries' codec, and a learned bottleneck's projections would be frozen where the
    split differs, so the adapter trains through the base's compression, which must be a
    wire codec."""
    theirs = manifest.spec.compression
    out = []
    if spec.compression != theirs:
        out.append(
            f"compression is {spec.compression!r}, the export's {theirs!r} (an adapter trains "
            "through its base's)"
        )
    elif parse_compression(theirs, d_model=spec.model.d_model).bottleneck_dim is not None:
        out.append(f"an adapter cannot train through a learned bottleneck ({theirs!r})")
    return out


def source_stages(manifest: RunManifest, stage: LayerRange) -> list[int]:
    """The export's stages that hold any of ``stage``'s layers (the first and last always
    hold the embedding and the head, which are stage 0's and the last stage's). Pure."""
    return [shard.stage for shard in manifest.stages if layers_overlap(shard, stage)]


def init_args(job: JobRecord, plan: StagePlan, *, token: str, public_url: str) -> InitArgs | None:
    """What START tells ``plan``'s stage of a job that starts from an export (None for any
    other job, and for a resumed attempt: it restores its own checkpoint)."""
    source = job.init_source
    if source is None or (job.resume_step and job.spec.adapter is None):
        return None
    manifest = _pinned_manifest(source)
    base = f"{public_url.rstrip('/')}/api/v1/jobs/{job.job_id}/init"
    files = [
        InitFile(name=RUN_MANIFEST, sha256=source.manifest_sha256, url=f"{base}/{RUN_MANIFEST}")
    ]
    wanted = set(source_stages(manifest, plan))
    for shard in manifest.stages:
        if shard.stage in wanted:
            for relative, digest in (
                (shard.checkpoint, shard.checkpoint_sha256),
                (shard.weights, shard.weights_sha256),
            ):
                name = Path(relative).name
                files.append(InitFile(name=name, sha256=digest, url=f"{base}/{name}"))
    return InitArgs(step=source.step, files=files, token=token)


def init_file(job: JobRecord, stage: int, name: str) -> Path:
    """The export file ``name`` for ``stage`` of ``job``: its manifest, or a file of a source
    stage that holds some of that stage's layers. ShardAccessError for any other."""
    source = job.init_source
    if source is None or job.placement is None:
        raise NotFoundError(f"job {job.job_id} does not start from an export")
    manifest = _pinned_manifest(source)
    directory = Path(source.directory)
    if name == RUN_MANIFEST:
        return directory / RUN_MANIFEST
    placed = next((p for p in job.placement.stages if p.stage == stage), None)
    if placed is None:
        raise ShardAccessError(f"job {job.job_id} has no stage {stage}")
    wanted = set(source_stages(manifest, placed))
    for shard in manifest.stages:
        if shard.stage in wanted:
            for relative in (shard.checkpoint, shard.weights):
                if Path(relative).name == name:
                    return directory / relative
    raise ShardAccessError(f"stage {stage}'s token does not open the export's {name!r}")


def _pinned_manifest(source: InitSource) -> RunManifest:
    """The source's manifest, as it was when the job was submitted."""
    try:
        manifest, digest = read_manifest(Path(source.directory))
    except FieldError as exc:
        raise NotFoundError(f"the export this job starts from is gone: {exc.message}") from None
    if digest != source.manifest_sha256:
        raise NotFoundError(
            f"the export in {source.directory} changed since the job was submitted "
            "(its run_manifest.json is not the one checked then)"
        )
    return manifest
