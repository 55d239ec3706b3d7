"""Experiment sweeps: a grid of job specs, run one after another, one CSV row per point.

A sweep config is ``{"name", "base": <job spec fields>, "grid": {axis: [values...]}}``. Any
job spec field may be an axis, nested ones by a dotted name (``model.d_model``). The grid
expands to the cartesian product of its axes; every point is a full job spec, validated here
exactly as the leader validates it, so a bad point fails before anything is submitted.

Each point has a stable id, a short hash of its grid values: the same values always give the
same id, whatever the axis order in the file. That is what makes a sweep resumable: a rerun
reads ``results.csv`` and skips the point ids already there.

The top of this module is pure (expansion, ids, the GPU check, bookkeeping, the numbers of a
row, the PNG encoder); only :func:`run_sweep` and the small file helpers at the bottom do I/O,
and they take the leader client as an argument so tests can drive them with a fake.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import hashlib
import io
import itertools
import json
import math
import os
import re
import signal
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec

from swarm.compression import parse_compression
from swarm.errors import (
    ConfigError,
    FieldError,
    LeaderResponseError,
    LeaderUnreachableError,
)
from swarm.jobspec import JobSpec, decode_job_spec
from swarm.types.fleet import NodeView
from swarm.types.jobs import JobRecord

T = TypeVar("T")

TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED"})
FP32_BYTES = 4

# Columns of results.csv around the grid values (which sit between point_id and job_id).
HEAD_COLUMNS = ["point_id"]
TAIL_COLUMNS = [
    "job_id",
    "state",
    "final_loss",
    "final_val_loss",
    "tokens_per_s",
    "step_time_s",
    "bytes_per_step_per_boundary",
    "compression_ratio_vs_fp32",
    "reason",
]
# The numbers a finished job gives a row (empty for a point that never got a job).
NUMBER_COLUMNS = TAIL_COLUMNS[2:-1]


class JobsClient(Protocol):
    """What sweeps ask of the leader (:class:`swarm.cli.client.LeaderClient`; tests fake it)."""

    def submit(self, spec_json: bytes) -> JobRecord: ...

    def job(self, job_id: str) -> JobRecord: ...

    def jobs(self) -> list[JobRecord]: ...

    def cancel(self, job_id: str) -> JobRecord: ...


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


def decode_config(data: bytes, kind: type[T], *, source: str, what: str) -> T:
    """A JSON config file as ``kind``; ConfigError naming the file, the field and the reason."""
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid JSON ({exc})") from None


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
        spec_json = json.dumps(doc, sort_keys=True).encode()
        try:
            spec = decode_job_spec(spec_json)
        except FieldError as exc:
            raise ConfigError(
                f"{source}: point {pid} {canonical(values)}: {exc.field}: "
                f"{exc.message.removeprefix(exc.field + ': ')}"
            ) from None
        except ConfigError as exc:
            raise ConfigError(f"{source}: point {pid} {canonical(values)}: {exc.message}") from None
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


# --- numbers of a finished job (pure) -------------------------------------------------------


def n_boundaries(job: JobRecord) -> int:
    placed = len(job.placement.stages) if job.placement is not None else 0
    return max((placed or len(job.progress)) - 1, 0)


def steps_done(job: JobRecord) -> int:
    """Steps every stage finished (the pipeline's step)."""
    return job.current_view().step or 0


def bytes_per_step_per_boundary(job: JobRecord) -> float | None:
    """Bytes on the wire per optimizer step per stage boundary, both directions (activations
    forward, gradients back): every stage's ``bytes_sent`` summed, over steps and boundaries.
    None for a single stage (no wire) or before a step."""
    boundaries, steps = n_boundaries(job), steps_done(job)
    if boundaries == 0 or steps == 0:
        return None
    return job.current_view().bytes_sent / steps / boundaries


def fp32_bytes_per_step_per_boundary(spec: JobSpec) -> float:
    """What an uncompressed boundary carries per step: the float32 activations of the whole
    batch forward and their gradients back (``2 * batch * seq_len * d_model * 4``)."""
    return 2.0 * spec.batch_size * spec.model.seq_len * spec.model.d_model * FP32_BYTES


def nominal_compression_ratio(compression: str, d_model: int) -> float:
    """fp32 bytes over the codec's payload bytes per value, ignoring headers and scales: what
    the spec promises (the measured ratio also pays for frames, scales and validation)."""
    return parse_compression(compression, d_model=d_model).ratio(d_model)


def compression_ratio(job: JobRecord) -> float | None:
    """Measured: fp32 bytes per step per boundary over the bytes actually sent."""
    measured = bytes_per_step_per_boundary(job)
    if not measured:
        return None
    return fp32_bytes_per_step_per_boundary(job.spec) / measured


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


# --- PNG (pure) -----------------------------------------------------------------------------

PALETTE = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
]

# A 3x5 bitmap font for the axis labels: digits and the few characters numbers need.
_FONT = {
    "0": "111101101101111",
    "1": "010110010010111",
    "2": "111001111100111",
    "3": "111001111001111",
    "4": "101101111001001",
    "5": "111100111001111",
    "6": "111100111101111",
    "7": "111001001001001",
    "8": "111101111101111",
    "9": "111101111001111",
    ".": "000000000000010",
    "e": "000111101110011",
    "-": "000000111000000",
    "+": "000010111010000",
    "K": "101110100110101",
    "M": "101111111101101",
    "G": "111100101101111",
    "B": "110101110101110",
}


def png_bytes(width: int, height: int, pixels: bytearray) -> bytes:
    """An 8-bit RGB PNG of ``pixels`` (``width * height * 3`` bytes, rows top to bottom)."""
    if len(pixels) != width * height * 3:
        raise ValueError("pixels must hold width * height * 3 bytes")
    stride = width * 3
    raw = b"".join(b"\x00" + bytes(pixels[y * stride : (y + 1) * stride]) for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def set(self, x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i : i + 3] = bytes(rgb)

    def rect(self, x0: int, y0: int, x1: int, y1: int, rgb: tuple[int, int, int]) -> None:
        for y in range(y0, y1 + 1):
            for x in range(x0, x1 + 1):
                self.set(x, y, rgb)

    def text(self, x: int, y: int, text: str, rgb: tuple[int, int, int], scale: int = 2) -> None:
        for ch in text:
            bits = _FONT.get(ch)
            if bits:
                for i, bit in enumerate(bits):
                    if bit == "1":
                        cx, cy = x + (i % 3) * scale, y + (i // 3) * scale
                        self.rect(cx, cy, cx + scale - 1, cy + scale - 1, rgb)
            x += 4 * scale


def _short(value: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}"


def scatter_png(
    points: Sequence[tuple[float, float, str]], *, width: int = 640, height: int = 420
) -> bytes:
    """Validation loss (y) against bytes on the wire per step per boundary (x, log10) as a
    PNG: one colour per group (the compression spec), axis ranges printed at the ends.

    Hand-rolled so the CLI needs no plotting library; ``points`` are ``(x, y, group)`` and
    those with a non-positive or non-finite x or y are left out.
    """
    usable = [(x, y, g) for x, y, g in points if x > 0 and math.isfinite(x) and math.isfinite(y)]
    canvas = _Canvas(width, height)
    left, right, top, bottom = 60, width - 20, 20, height - 50
    black, grey = (0, 0, 0), (225, 225, 225)
    canvas.rect(left, bottom, right, bottom, black)
    canvas.rect(left, top, left, bottom, black)
    if not usable:
        return png_bytes(width, height, canvas.pixels)
    lx = [math.log10(x) for x, _, _ in usable]
    ys = [y for _, y, _ in usable]
    x_lo, x_hi = min(lx), max(lx)
    y_lo, y_hi = min(ys), max(ys)
    if x_hi - x_lo < 1e-9:
        x_lo, x_hi = x_lo - 0.5, x_hi + 0.5
    if y_hi - y_lo < 1e-9:
        y_lo, y_hi = y_lo - 0.05, y_hi + 0.05
    pad_x, pad_y = 0.05 * (x_hi - x_lo), 0.05 * (y_hi - y_lo)
    x_lo, x_hi, y_lo, y_hi = x_lo - pad_x, x_hi + pad_x, y_lo - pad_y, y_hi + pad_y

    def px(v: float) -> int:
        return round(left + (v - x_lo) / (x_hi - x_lo) * (right - left))

    def py(v: float) -> int:
        return round(bottom - (v - y_lo) / (y_hi - y_lo) * (bottom - top))

    for decade in range(math.ceil(x_lo), math.floor(x_hi) + 1):  # a grid line per decade
        canvas.rect(px(decade), top, px(decade), bottom - 1, grey)
    groups = list(dict.fromkeys(g for _, _, g in usable))
    for (_x, y, g), lxv in zip(usable, lx, strict=True):
        colour = PALETTE[groups.index(g) % len(PALETTE)]
        cx, cy = px(lxv), py(y)
        canvas.rect(cx - 3, cy - 3, cx + 3, cy + 3, colour)
    canvas.text(left, bottom + 8, _short(10**x_lo) + "B", black)
    hi_label = _short(10**x_hi) + "B"
    canvas.text(right - 8 * len(hi_label), bottom + 8, hi_label, black)
    canvas.text(4, top, f"{y_hi:.3g}", black)
    canvas.text(4, bottom - 10, f"{y_lo:.3g}", black)
    for i, _ in enumerate(groups):  # the legend: one swatch per group, in first-seen order
        colour = PALETTE[i % len(PALETTE)]
        canvas.rect(left + 10 + i * 24, height - 18, left + 24 + i * 24, height - 8, colour)
    return png_bytes(width, height, canvas.pixels)


def plot_points(rows: Iterable[Mapping[str, str]]) -> list[tuple[float, float, str]]:
    """(bytes per step per boundary, validation loss, compression) of every row that has both."""
    out = []
    for r in rows:
        try:
            x, y = float(r["bytes_per_step_per_boundary"]), float(r["final_val_loss"])
        except (KeyError, TypeError, ValueError):
            continue
        out.append((x, y, r.get("compression", "")))
    return out


# --- files and the run loop (I/O) -----------------------------------------------------------


def read_rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def write_rows(path: Path, columns: Sequence[str], rows: Sequence[Mapping[str, str]]) -> None:
    """The whole CSV, replaced atomically: an interrupted sweep never leaves half a file."""
    known = list(columns)
    for r in rows:  # keep columns of rows from an earlier grid (e.g. --sweep-id reused)
        known += [k for k in r if k not in known]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=known, restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    _atomic_write(path, buf.getvalue().encode())


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def wait_for_end(
    client: JobsClient,
    job_id: str,
    *,
    poll_s: float = 2.0,
    timeout_s: float | None = None,
    on_poll: Callable[[JobRecord], None] | None = None,
    unreachable_grace_s: float = 60.0,
    sleep: Callable[[float], None] = time.sleep,
) -> JobRecord | None:
    """Poll ``GET /api/v1/jobs/{id}`` until the job ends; None after ``timeout_s``.

    A leader that is briefly unreachable (a restart) is waited out for
    ``unreachable_grace_s``; longer, and the error propagates.
    """
    started = time.monotonic()
    down_since: float | None = None
    while True:
        try:
            job = client.job(job_id)
            down_since = None
        except LeaderUnreachableError:
            now = time.monotonic()
            down_since = down_since or now
            if now - down_since > unreachable_grace_s:
                raise
            sleep(poll_s)
            continue
        if on_poll:
            on_poll(job)
        if job.state in TERMINAL_STATES:
            return job
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            return None
        sleep(poll_s)


def _changes_only(
    progress: Callable[[str], None], index: int, total: int, point: SweepPoint
) -> Callable[[JobRecord], None]:
    """A poll callback that prints the point's progress line only when it changed."""
    last = [""]

    def on_poll(job: JobRecord) -> None:
        line = progress_line(index, total, point, job)
        if line != last[0]:
            last[0] = line
            progress(line)

    return on_poll


class _Started:
    """The job a point started, once the leader has said its id."""

    job_id: str | None = None


@contextlib.contextmanager
def cancelled_on_interrupt(
    client: JobsClient, point: SweepPoint, progress: Callable[[str], None], label: str
) -> Iterator[_Started]:
    """On Ctrl-C (KeyboardInterrupt) inside the block, cancel the job the point started, then
    let the interrupt go on. Interrupted inside the submit, before its id came back, the job
    is found by its name (``<sweep name>-<point id>``) among the jobs not ended. A second
    Ctrl-C while cancelling is ignored: leaving the job running is what this prevents.

    The point gets no row, so a resumed sweep runs it again."""
    started = _Started()
    try:
        yield started
    except KeyboardInterrupt:
        with _sigint_ignored():
            for job_id in _jobs_to_cancel(client, point, started.job_id):
                try:
                    client.cancel(job_id)
                except (LeaderResponseError, LeaderUnreachableError) as exc:
                    progress(f"{label} interrupted; could not cancel {job_id}: {exc.message}")
                else:
                    progress(f"{label} interrupted: cancelled {job_id} (it runs again on resume)")
        raise


def _jobs_to_cancel(client: JobsClient, point: SweepPoint, job_id: str | None) -> list[str]:
    if job_id is not None:
        return [job_id]
    try:
        jobs = client.jobs()
    except (LeaderResponseError, LeaderUnreachableError):
        return []
    return [j.job_id for j in jobs if j.name == point.spec.name and j.state not in TERMINAL_STATES]


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored for the block (only the main thread may change signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_sweep(
    client: JobsClient,
    sweep: Sweep,
    out_dir: Path,
    *,
    progress: Callable[[str], None] = print,
    poll_s: float = 2.0,
    point_timeout_s: float | None = None,
    retry_failed: bool = False,
) -> list[dict[str, str]]:
    """Run the pending points one after another, recording each as it ends.

    A point the leader refuses, or that fails or times out (it is cancelled), gets a row with
    its state and reason and the sweep goes on. After every point ``results.csv`` and
    ``val_loss_vs_bytes.png`` are rewritten, so an interrupted sweep keeps what it has; Ctrl-C
    cancels the running point's job (:func:`cancelled_on_interrupt`).
    """
    csv_path = out_dir / "results.csv"
    rows = read_rows(csv_path)
    todo = pending_points(sweep, rows, retry_failed=retry_failed)
    total = len(sweep.points)
    skipped = total - len(todo)
    progress(
        f"sweep {sweep.sweep_id}: {total} point(s), {skipped} already in {csv_path}, "
        f"{len(todo)} to run"
    )
    _atomic_write(out_dir / "sweep.json", msgspec.json.format(msgspec.json.encode(sweep.config)))
    for point in todo:
        index = sweep.points.index(point) + 1
        job: JobRecord | None = None
        reason = ""
        label = f"[{index}/{total}] {point.point_id}"
        with cancelled_on_interrupt(client, point, progress, label) as started:
            try:
                record = client.submit(point.spec_json)
            except LeaderResponseError as exc:
                reason = f"submit refused: {exc.code}: {exc.message}"
                progress(f"{label} FAILED ({reason})")
            else:
                job_id = started.job_id = record.job_id
                progress(f"{label} submitted {job_id}")
                job = wait_for_end(
                    client,
                    job_id,
                    poll_s=poll_s,
                    timeout_s=point_timeout_s,
                    on_poll=_changes_only(progress, index, total, point),
                )
                if job is None:
                    reason = f"timed out after {point_timeout_s:.0f}s; cancelled"
                    try:
                        job = client.cancel(job_id)
                    except LeaderResponseError:
                        job = client.job(job_id)
        row = result_row(sweep, point, job, reason=reason)
        rows = merge_row(rows, row)
        write_rows(csv_path, sweep.columns, rows)
        _atomic_write(out_dir / "val_loss_vs_bytes.png", scatter_png(plot_points(rows)))
        progress(
            f"[{index}/{total}] {point.point_id} {row['state']}: loss {row['final_loss'] or '-'}"
            f" val {row['final_val_loss'] or '-'}, {row['bytes_per_step_per_boundary'] or '-'}"
            f" B/step/boundary" + (f" ({row['reason']})" if row["reason"] else "")
        )
    _atomic_write(out_dir / "val_loss_vs_bytes.png", scatter_png(plot_points(rows)))
    if not csv_path.exists():
        write_rows(csv_path, sweep.columns, rows)
    return rows
