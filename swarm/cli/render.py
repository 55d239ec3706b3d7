"""Human output: aligned tables and readable sizes. ``--json`` bypasses all of this."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import msgspec


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["-" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


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
