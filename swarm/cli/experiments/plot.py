"""The sweep's plot: final validation loss against bytes on the wire, one colour per
compression spec, drawn with matplotlib (the ``plots`` extra).

matplotlib is imported inside :func:`scatter_png` only, so ``swarm`` starts without it and
the leader and the agent never load it. Without it, :func:`require_matplotlib` raises
:class:`ExtraMissingError`, which names the extra to install, and a sweep says so once
(:func:`missing_matplotlib`) and runs without its plot.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from silentswarm.errors import ExtraMissingError

PLOT_FILE = "val_loss_vs_bytes.png"
INSTALL_HINT = "pip install 'silentswarm[plots]'"


class PlotPoint(NamedTuple):
    bytes_per_step: float  # per stage boundary, both directions
    val_loss: float
    group: str  # the compression spec


def plot_points(rows: Iterable[Mapping[str, str]]) -> list[PlotPoint]:
    """(bytes per step per boundary, validation loss, compression) of every row that has both."""
    out = []
    for r in rows:
        try:
            x, y = float(r["bytes_per_step_per_boundary"]), float(r["final_val_loss"])
        except (KeyError, TypeError, ValueError):
            continue
        out.append(PlotPoint(x, y, r.get("compression", "")))
    return out


def require_matplotlib() -> None:
    """Raise :class:`ExtraMissingError` unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ExtraMissingError(
            f"plotting needs matplotlib, which is not installed: {INSTALL_HINT}"
        ) from None


def missing_matplotlib() -> str | None:
    """None when the plot can be drawn, else what to say instead (once, by a sweep that then
    runs without it: rerun the same sweep once matplotlib is there to draw it from
    results.csv)."""
    try:
        require_matplotlib()
    except ExtraMissingError as exc:
        return (
            f"no {PLOT_FILE}: {exc.message}; the sweep runs without it (install it and run the"
            " same command again to draw it from results.csv)"
        )
    return None


def scatter_png(
    points: Sequence[tuple[float, float, str]], *, width_px: int = 800, height_px: int = 520
) -> bytes:
    """Validation loss (y) against bytes on the wire per step per boundary (x, log scale) as a
    PNG: one colour and one legend entry per group, in first-seen order.

    ``points`` are ``(x, y, group)``; those with a non-positive or non-finite x or y are left
    out (a single-stage point sends nothing). No usable point: the empty axes, saying so.
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    usable = [(x, y, g) for x, y, g in points if x > 0 and math.isfinite(x) and math.isfinite(y)]
    dpi = 100
    figure = Figure(figsize=(width_px / dpi, height_px / dpi), dpi=dpi, layout="constrained")
    canvas = FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    groups = list(dict.fromkeys(g for _, _, g in usable))
    for group in groups:
        xs = [x for x, _, g in usable if g == group]
        ys = [y for _, y, g in usable if g == group]
        axes.scatter(xs, ys, s=36, label=group or "(none)")
    axes.set_xscale("log")
    axes.set_xlabel("bytes on the wire per step per stage boundary (B, log scale)")
    axes.set_ylabel("final validation loss (nats per byte)")
    axes.set_title("validation loss vs bytes on the wire")
    axes.grid(True, which="major", alpha=0.3)
    if groups:
        axes.legend(title="compression", fontsize="small")
    else:
        axes.text(0.5, 0.5, "no point with both numbers yet", ha="center", transform=axes.transAxes)
    buffer = io.BytesIO()
    canvas.print_png(buffer)
    return buffer.getvalue()
