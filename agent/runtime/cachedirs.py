"""Where a fellow's caches live by default, and the byte limits their settings give."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)


def user_cache_dir(leaf: str, environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/silentswarm/<leaf>`` (an absolute XDG_CACHE_HOME only), else
    ``~/.cache/silentswarm/<leaf>``."""
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "silentswarm" / leaf


def byte_limit(name: str, otherwise: str, environ: Mapping[str, str] | None = None) -> int | None:
    """The positive integer the variable ``name`` holds; None when it is unset, and (with a
    warning that ends in ``otherwise``: what happens instead) when it holds anything else."""
    env = os.environ if environ is None else environ
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        log.warning("%s=%r is not a positive integer: %s", name, raw, otherwise)
        return None
    return value
