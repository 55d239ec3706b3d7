"""Keeping a fellow's data cache under a size: the least recently used entries go first.

The cache (``SWARM_DATA_CACHE``) holds three kinds of entries: token caches (``<key>.json``,
``<key>.tokens`` and their ``<key>.lock``, one entry), trained tokenizers
(``tokenizers/<key>.json``) and downloaded datasets (``datasets/<sha256>``). Each is marked used
(its access time set to now; its mtime, which says when it was written, is left) whenever a
stage opens it; :func:`prune` removes the entries used
longest ago until the whole is at most ``SWARM_DATA_CACHE_MAX_BYTES`` (unset: no limit),
never one the caller is about to use. Removing a file a running stage has memory-mapped is
safe (the map keeps its pages); a token cache being built lives in temporary files, which are
not entries.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from silentswarm.agent.runtime.cachedirs import byte_limit

log = logging.getLogger(__name__)

MAX_BYTES_ENV = "SWARM_DATA_CACHE_MAX_BYTES"


@dataclass(frozen=True)
class Entry:
    files: tuple[Path, ...]
    used: float  # the newest access time of its files
    size: int


def max_bytes() -> int | None:
    """``SWARM_DATA_CACHE_MAX_BYTES``, or None (no limit; also for a value that is no
    positive integer, with a warning)."""
    return byte_limit(MAX_BYTES_ENV, "the data cache is not limited")


def touch(paths: Iterable[Path]) -> None:
    """Mark entries as used now: their access time (their mtime stays when they were
    written)."""
    now = time.time_ns()
    for path in paths:
        with contextlib.suppress(OSError):
            # In nanoseconds: a dataset's mtime_ns is part of its token cache's key.
            os.utime(path, ns=(now, path.stat().st_mtime_ns))


def entries(directory: Path) -> list[Entry]:
    """Every entry of the cache under ``directory``."""
    groups: dict[str, list[Path]] = {}
    for path in directory.glob("*"):
        if path.is_file() and not path.name.startswith("."):
            groups.setdefault(str(directory / path.name.split(".", 1)[0]), []).append(path)
    for sub in ("tokenizers", "datasets"):
        for path in (directory / sub).glob("*"):
            if path.is_file() and not path.name.startswith("."):
                groups[str(path)] = [path]
    out = []
    for files in groups.values():
        stats = []
        for path in files:
            with contextlib.suppress(OSError):
                stats.append(path.stat())
        if stats:
            used = max(st.st_atime for st in stats)
            out.append(Entry(tuple(files), used, sum(st.st_size for st in stats)))
    return out


def prune(directory: Path, keep: Iterable[Path], limit: int | None = None) -> list[Path]:
    """Remove the least recently used entries until the cache is at most ``limit`` bytes
    (default: :func:`max_bytes`); entries holding a file in ``keep`` stay. The files removed."""
    limit = max_bytes() if limit is None else limit
    if limit is None:
        return []
    kept = {Path(p).resolve() for p in keep}
    found = entries(directory)
    total = sum(e.size for e in found)
    removed: list[Path] = []
    for entry in sorted(found, key=lambda e: e.used):
        if total <= limit:
            break
        if any(f.resolve() in kept for f in entry.files):
            continue
        for path in entry.files:
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
        total -= entry.size
    if removed:
        log.info("data cache over %d bytes: removed %d files", limit, len(removed))
    return removed
