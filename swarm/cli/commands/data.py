"""Datasets on the leader: ``swarm data upload``, ``list`` and ``delete``. A job reads one as
``"data": ["dataset:NAME"]``; only its stage 0 downloads it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import cyclopts
from cyclopts import Parameter

from silentswarm import datasets
from silentswarm.cli import render
from silentswarm.cli.context import Ctx
from silentswarm.cli.options import LEADER, LeaderOptions
from silentswarm.errors import ConfigError

# What an upload may take at least, and per byte on top (a slow link is 1 MB/s).
UPLOAD_TIMEOUT_S = 60.0
UPLOAD_S_PER_BYTE = 1e-6


def upload(
    path: Annotated[Path, Parameter(help="One text or JSONL file")],
    *,
    name: Annotated[
        str | None,
        Parameter(help="The dataset's name (default: the file's name up to its first dot)"),
    ] = None,
    options: LeaderOptions = LEADER,
    ctx: Ctx,
) -> None:
    """Upload a file to the leader as a dataset (content-addressed: sha256); a job names it as
    data "dataset:NAME". Uploading a name again points it at the new content; jobs already
    accepted keep what they were given."""
    if not path.is_file():
        what = "a directory (pack it into one text or JSONL file)" if path.is_dir() else "missing"
        raise ConfigError(f"{path}: {what}")
    name = name or path.name.split(".", 1)[0]
    problem = datasets.name_problem(name)
    if problem:
        raise ConfigError(f"{problem} (choose one with --name)")
    size = path.stat().st_size
    ctx.progress(f"uploading {path} ({render.size(size)}) as dataset {name!r}")
    started = time.monotonic()
    with ctx.client() as client:
        record = client.upload_dataset(
            name, path, timeout_s=UPLOAD_TIMEOUT_S + size * UPLOAD_S_PER_BYTE
        )
    seconds = max(time.monotonic() - started, 1e-6)
    ctx.emit(
        record,
        f"dataset {record.name}: {render.size(record.size_bytes)}, sha256 {record.sha256} "
        f'({render.size(int(size / seconds))}/s); use it as "data": ["dataset:{record.name}"]',
    )


def list_datasets(*, options: LeaderOptions = LEADER, ctx: Ctx) -> None:
    """Every dataset on the leader."""
    with ctx.client() as client:
        records = client.datasets()
    rows = [
        [r.name, render.size(r.size_bytes), r.sha256[:16], render.since(r.uploaded_at), r.source]
        for r in records
    ]
    headers = ["NAME", "SIZE", "SHA256", "AGE", "SOURCE"]
    ctx.emit(records, render.table(headers, rows) if rows else "no datasets")


def delete(
    name: Annotated[str, Parameter(help="The dataset's name")],
    *,
    options: LeaderOptions = LEADER,
    ctx: Ctx,
) -> None:
    """Forget a dataset's name; its content stays while a job that has not ended reads it."""
    with ctx.client() as client:
        record = client.delete_dataset(name)
    ctx.emit(record, f"deleted dataset {record.name} ({record.sha256[:16]})")


def register(app: cyclopts.App) -> None:
    data = cyclopts.App(name="data", help="Datasets uploaded to the leader.")
    data.command(upload, name="upload")
    data.command(list_datasets, name="list")
    data.command(delete, name="delete")
    app.command(data)
