"""Experiment sweeps: a grid of job specs, run one after another, one CSV row per point.

A sweep config is ``{"name", "base": <job spec fields>, "grid": {axis: [values...]}}``. Any
job spec field may be an axis, nested ones by a dotted name (``model.d_model``). The grid
expands to the cartesian product of its axes; every point is a full job spec, validated here
exactly as the leader validates it, so a bad point fails before anything is submitted.

Each point has a stable id, a short hash of its grid values: the same values always give the
same id, whatever the axis order in the file. That is what makes a sweep resumable: a rerun
reads ``results.csv`` and skips the point ids already there.

Everything here is pure (expansion, ids, the GPU check, bookkeeping, a point's CSV row); the
run loop and the files are :mod:`.runner`, the plot :mod:`.plot`.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from silentswarm.cli.experiments.config import decode_config, spec_of
from silentswarm.cli.experiments.job_numbers import (
    RESULT_FIELDS,
    bytes_per_step_per_boundary,
    compression_ratio,
)
from silentswarm.errors import ConfigError
from silentswarm.jobspec import JobSpec
from silentswarm.types.fleet import NodeView
from silentswarm.types.jobs import JobRecord

# Columns of results.csv around the grid values (which sit between point_id and job_id).
HEAD_COLUMNS = ["point_id"]
TAIL_COLUMNS = ["job_id", "state", *RESULT_FIELDS, "reason"]
# The numbers a finished job gives a row (empty for a point that never got a job).
NUMBER_COLUMNS = TAIL_COLUMNS[2:-1]


class SweepConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    base: dict[str, Any] = msgspec.field(default_factory=dict)
    grid: dict[str, list[Any]] = msgspec.field(default_factory=dict)
    description: str = ""


class SweepPoint(msgspec.Struct, frozen=True, kw_only=True):
    point_id: str
    values: dict[str, Any]  # axis -> value, in the grid's axis order
    spec: JobSpec
    spec_json: bytes  # what is submitted (the leader checks it again)


class Sweep(msgspec.Struct, frozen=True, kw_only=True):
    sweep_id: str
    config: SweepConfig
    axes: list[str]
    points: list[SweepPoint]
    # Grid axes a command-line override narrowed to its one value: axis -> the grid's values.
    overridden: dict[str, list[Any]] = msgspec.field(default_factory=dict)

    @property
    def columns(self) -> list[str]:
        return [*HEAD_COLUMNS, *self.axes, *TAIL_COLUMNS]


# --- expansion (pure) -----------------------------------------------------------------------


def decode_sweep_config(data: bytes, *, source: str) -> SweepConfig:
    """The config from JSON; ConfigError naming the file, the field and the reason."""
    config = decode_config(data, SweepConfig, source=source, what="sweep config")
    if not config.name.strip():
        raise ConfigError(f"{source}: name: must not be empty")
    for axis, values in config.grid.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", axis):
            raise ConfigError(f"{source}: grid.{axis}: not a job spec field name")
        if not values:
            raise ConfigError(f"{source}: grid.{axis}: needs at least one value")
        if len({canonical(v) for v in values}) != len(values):
            raise ConfigError(f"{source}: grid.{axis}: has a value twice")
    return config


def canonical(value: Any) -> str:
    """JSON with sorted keys and no spaces: the same value always gives the same text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def point_id(values: Mapping[str, Any]) -> str:
    """A stable id for a point: 10 hex of the sha256 of its grid values (order-free)."""
    return hashlib.sha256(canonical(dict(values)).encode()).hexdigest()[:10]


def sweep_id(config: SweepConfig, overrides: Mapping[str, Any] | None = None) -> str:
    """``<name slug>-<8 hex of the config's content and the CLI overrides>``: a changed grid
    or base is a new sweep (a new directory), the same one resumes."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", config.name).strip("-").lower()[:48] or "sweep"
    content = canonical({"config": msgspec.to_builtins(config), "overrides": overrides or {}})
    return f"{slug}-{hashlib.sha256(content.encode()).hexdigest()[:8]}"


def set_dotted(doc: dict[str, Any], dotted: str, value: Any) -> None:
    """``doc["model"]["d_model"] = value`` for ``model.d_model`` (missing levels made)."""
    *parents, leaf = dotted.split(".")
    node = doc
    for key in parents:
        child = node.get(key)
        if not isinstance(child, dict):
            child = {}
            node[key] = child
        node = child
    node[leaf] = value


def expand(
    config: SweepConfig,
    *,
    source: str,
    overrides: Mapping[str, Any] | None = None,
    sweep_id_override: str | None = None,
) -> Sweep:
    """Every point of the grid as a validated job spec (the base with the point's values and
    ``overrides`` applied; each job named ``<sweep name>-<point id>``).

    ``overrides`` are top-level fields forced on every point (the CLI's ``--partition``). One
    that is also a grid axis narrows the axis to its value (recorded in ``overridden``), so
    the points keep the ids and CSV columns they have in the full grid; one that would
    collapse a nested axis (``model`` over ``model.d_model``) is an error.
    """
    overrides = dict(overrides or {})
    grid, overridden = narrow_grid(config.grid, overrides, source=source)
    axes = list(grid)
    points = []
    for combo in itertools.product(*(grid[a] for a in axes)):
        values = dict(zip(axes, combo, strict=True))
        pid = point_id(values)
        doc = copy.deepcopy(config.base)
        doc.update(copy.deepcopy(overrides))
        for axis, value in values.items():
            set_dotted(doc, axis, copy.deepcopy(value))
        doc["name"] = f"{config.name}-{pid}"[:128]
        spec, spec_json = spec_of(doc, where=f"{source}: point {pid} {canonical(values)}")
        points.append(SweepPoint(point_id=pid, values=values, spec=spec, spec_json=spec_json))
    return Sweep(
        sweep_id=sweep_id_override or sweep_id(config, overrides),
        config=config,
        axes=axes,
        points=points,
        overridden=overridden,
    )


def narrow_grid(
    grid: Mapping[str, list[Any]], overrides: Mapping[str, Any], *, source: str
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """The grid with every axis an override names narrowed to the override's value, and
    those axes' grid values; ConfigError for an override over a nested axis."""
    nested = sorted(a for a in grid if "." in a and a.split(".")[0] in overrides)
    if nested:
        raise ConfigError(
            f"{source}: grid.{nested[0]}: is a grid axis inside "
            f"{nested[0].split('.')[0]!r}, which is overridden"
        )
    narrowed = {a: [overrides[a]] if a in overrides else list(v) for a, v in grid.items()}
    return narrowed, {a: list(grid[a]) for a in grid if a in overrides}


def override_notes(sweep: Sweep, full_points: int, flags: Mapping[str, str]) -> list[str]:
    """What each override did to the grid, for the operator: ``--partition weighted overrides
    the grid's partition axis (equal, weighted): 36 of 72 points``."""
    notes = []
    for axis, values in sweep.overridden.items():
        flag = flags.get(axis, axis)
        shown = ", ".join(v if isinstance(v, str) else canonical(v) for v in values)
        value = sweep.points[0].values[axis] if sweep.points else "?"
        notes.append(
            f"{flag} {value} overrides the grid's {axis} axis ({shown}): "
            f"{len(sweep.points)} of {full_points} points"
        )
    return notes


def grid_size(config: SweepConfig) -> int:
    return math.prod(len(v) for v in config.grid.values())


# --- what the swarm must offer (pure) -------------------------------------------------------


def gpu_only_points(sweep: Sweep) -> list[SweepPoint]:
    """The points that may not run on CPU-only fellows (``allow_cpu: false``)."""
    return [p for p in sweep.points if not p.spec.allow_cpu]


def gpu_refusal(sweep: Sweep, nodes: Sequence[NodeView]) -> str | None:
    """Why the sweep cannot run on this swarm now, or None.

    A point with ``allow_cpu: false`` on a swarm where no online host has a GPU TensorFlow
    can use would wait in PENDING forever (the leader waits for fellows to come), so such a
    sweep is refused before anything is submitted. ``nodes`` is ``GET /api/v1/nodes``.
    """
    gpu_only = gpu_only_points(sweep)
    if not gpu_only:
        return None
    online = [n for n in nodes if n.online]
    usable = sum(n.tf_gpu_count or 0 for n in online)
    if usable:
        return None
    seen = sum(len(n.gpus) for n in online)
    fellows = sum(len(n.fellows) for n in online)
    gpus = f"{seen} GPU(s), none that TensorFlow can use" if seen else "no GPU"
    why = [f"{n.hostname}: {n.gpu_warning}" for n in online if n.gpu_warning]
    return (
        f"sweep {sweep.sweep_id} needs GPUs ({len(gpu_only)} of {len(sweep.points)} point(s) "
        f"have allow_cpu: false) but the swarm has {len(online)} online host(s) with "
        f"{fellows} fellow(s) and {gpus}"
        + (f" ({'; '.join(why)})" if why else "")
        + "; run it where GPU fellows are connected, or set allow_cpu: true in the config's "
        "base to let CPU fellows run it"
    )


def plan_report(
    sweep: Sweep,
    rows: Sequence[Mapping[str, str]],
    out_dir: Path,
    refusal: str | None,
    *,
    retry_failed: bool = False,
) -> tuple[dict[str, Any], str]:
    """What ``swarm sweep --dry-run`` prints (JSON value, text): the points still to run and
    whether the swarm can run them."""
    todo = pending_points(sweep, rows, retry_failed=retry_failed)
    value = {
        "sweep_id": sweep.sweep_id,
        "out_dir": str(out_dir),
        "points": len(sweep.points),
        "to_run": [{"point_id": p.point_id, "values": p.values} for p in todo],
        "overridden": sweep.overridden,
        "refusal": refusal,
    }
    lines = [
        f"sweep {sweep.sweep_id}: {len(sweep.points)} point(s), {len(todo)} to run; "
        f"results in {out_dir}",
        *(f"  {p.point_id} " + " ".join(f"{k}={v}" for k, v in p.values.items()) for p in todo),
        f"refused: {refusal}" if refusal else "the swarm can run it",
    ]
    return value, "\n".join(lines)


# --- resumability bookkeeping (pure) --------------------------------------------------------


def pending_points(
    sweep: Sweep, rows: Iterable[Mapping[str, str]], *, retry_failed: bool = False
) -> list[SweepPoint]:
    """The points still to run: those without a row (any row, unless ``retry_failed``: then
    only a COMPLETED row counts as done)."""
    done = {r.get("point_id") for r in rows if not retry_failed or r.get("state") == "COMPLETED"}
    return [p for p in sweep.points if p.point_id not in done]


def merge_row(rows: Sequence[Mapping[str, str]], row: Mapping[str, str]) -> list[dict[str, str]]:
    """The rows with ``row`` in its point's place (replacing a failed earlier try) or last."""
    out = [dict(r) for r in rows if r.get("point_id") != row["point_id"]]
    at = next((i for i, r in enumerate(rows) if r.get("point_id") == row["point_id"]), len(out))
    out.insert(at, dict(row))
    return out


def result_row(
    sweep: Sweep, point: SweepPoint, job: JobRecord | None, *, reason: str = ""
) -> dict[str, str]:
    """The CSV row of a point: its grid values and, from the job record (None: the point
    never got a job), the numbers."""
    row = {"point_id": point.point_id}
    for axis in sweep.axes:
        value = point.values[axis]
        row[axis] = value if isinstance(value, str) else canonical(value)
    numbers: dict[str, float | None] = dict.fromkeys(NUMBER_COLUMNS)
    if job is not None:
        view = job.current_view()
        numbers = {
            "final_loss": job.final_loss,
            "final_val_loss": job.final_val_loss,
            "tokens_per_s": view.tokens_per_s,
            "step_time_s": view.step_time_s,
            "bytes_per_step_per_boundary": bytes_per_step_per_boundary(job),
            "compression_ratio_vs_fp32": compression_ratio(job),
        }
    row["job_id"] = "" if job is None else job.job_id
    row["state"] = "FAILED" if job is None else str(job.state)
    for key, value in numbers.items():
        row[key] = "" if value is None else f"{value:.6g}"
    job_reason = "" if job is None else job.reason
    row["reason"] = reason or ("" if row["state"] == "COMPLETED" else job_reason)
    return row


def progress_line(index: int, total: int, point: SweepPoint, job: JobRecord) -> str:
    """``[2/8] 1a2b3c4d5e compression=fp16 ... RUNNING step 40/200 loss 2.1``."""
    values = " ".join(f"{k}={v}" for k, v in point.values.items())
    view = job.current_view()
    loss = view.loss
    step = f"step {view.step or 0}/{point.spec.steps}"
    return f"[{index}/{total}] {point.point_id} {values} {job.state} {step}" + (
        "" if loss is None else f" loss {loss:.4f}"
    )
