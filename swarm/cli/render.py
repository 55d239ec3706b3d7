"""Human output: rich tables and readable sizes. ``--json`` bypasses all of this.

On a terminal, tables are rich's (bold headers, a rule under them, states in colour). On a
pipe the same table is plain text: columns separated by two spaces, no box, no colour, no
wrapping and no trailing blanks, so that ``grep``, ``awk`` and tests read one row per line.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import IO, Any

import msgspec
from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from silentswarm.text import terminal_safe

_CELL_BREAKS = str.maketrans({"\n": "\\n", "\t": "\\t"})

# Wide enough that no row of a table on a pipe is ever wrapped.
PIPE_WIDTH = 100_000

# Words in table cells that get a colour on a terminal (fellow and job states, results).
STYLES = {
    "ready": "green",
    "online": "green",
    "ok": "green",
    "delivered": "green",
    "registered": "green",
    "COMPLETED": "green",
    "RUNNING": "cyan",
    "busy": "cyan",
    "installing": "cyan",
    "PENDING": "yellow",
    "pending": "yellow",
    "created": "yellow",
    "offline": "red",
    "failed": "red",
    "FAILED": "red",
    "CANCELLED": "magenta",
}


def console(file: IO[str], *, tty: bool) -> Console:
    """A console writing to ``file``: rich's own on a terminal, plain and unwrapped else."""
    if tty:
        return Console(file=file, highlight=False, emoji=False)
    return Console(
        file=file,
        width=PIPE_WIDTH,
        color_system=None,
        force_terminal=False,
        highlight=False,
        emoji=False,
        soft_wrap=True,
    )


def show(out: Console, item: RenderableType) -> None:
    """Print a string as it is (no markup) or a renderable; on a pipe, without the blanks
    rich pads lines with."""
    if isinstance(item, str):
        out.print(item, markup=False, highlight=False, soft_wrap=True)
        return
    if out.is_terminal:
        out.print(item)
        return
    plain(item)
    with out.capture() as captured:
        out.print(item)
    text = "\n".join(line.rstrip() for line in captured.get().splitlines())
    out.print(text, markup=False, highlight=False, soft_wrap=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    """Rows under headers; ``None`` cells show as ``-``. The box and colours are dropped on
    a pipe (:func:`show`)."""
    grid = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        header_style="bold",
        padding=(0, 2, 0, 0),
    )
    for header in headers:
        grid.add_column(header, no_wrap=True, overflow="ignore")
    for row in rows:
        grid.add_row(*(cell(v) for v in row))
    return grid


def cell(value: Any) -> Text:
    """A table cell; what a terminal would act on shown escaped (a job's name, a dataset's
    source: an account's words), and its line breaks and tabs too: no fake rows."""
    text = "-" if value is None else terminal_safe(str(value)).translate(_CELL_BREAKS)
    return Text(text, style=STYLES.get(text, ""))


def plain(item: RenderableType) -> None:
    """Drop the box of every table in ``item`` (what a pipe gets)."""
    if isinstance(item, Table):
        item.box = None
        item.header_style = ""
    elif isinstance(item, Group):
        for part in item.renderables:
            plain(part)


def clock(epoch: float) -> str:
    """``HH:MM:SS`` local time of ``epoch``; ``??:??:??`` for a time no clock shows."""
    try:
        return time.strftime("%H:%M:%S", time.localtime(epoch))
    except (OverflowError, OSError, ValueError):
        return "??:??:??"


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}G"


def size(n: int) -> str:
    """A byte count the way people read it: 812 B, 4.2 MiB, 1.3 GiB."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def ago(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s ago"


def since(epoch: float | None) -> str:
    return "-" if epoch is None else f"{max(0.0, time.time() - epoch):.0f}s"


def dumps(value: Any) -> str:
    """``--json`` output: Structs (and lists of them) as the JSON the leader sent."""
    return json.dumps(msgspec.to_builtins(value), indent=2, sort_keys=True)
