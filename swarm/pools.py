"""Pools and labels: the names and bounds a fellow and a job use to say where a job may run.

A fellow is in exactly one pool (``SWARM_FELLOW_POOL``; unset: :data:`DEFAULT_POOL`) and
carries labels (``SWARM_FELLOW_LABELS``, ``gpu=a100,zone=eu``). A job runs in one pool (its
spec's ``pool``; unset: :data:`DEFAULT_POOL`) on fellows that carry every one of its
``labels`` with the same value. A pool is therefore kept for the jobs that name it: a fleet
that never sets a pool is one pool, ``default``, and behaves as before.

Fellows are strangers: the leader decodes what they claim with these same bounds
(:class:`silentswarm.protocol.FellowIdentity`), so a name outside them is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

import msgspec

from silentswarm.errors import ConfigError
from silentswarm.types.accounts import PoolName

__all__ = [
    "DEFAULT_POOL",
    "LABEL_PATTERN",
    "MAX_LABELS",
    "LabelKey",
    "LabelValue",
    "Labels",
    "PoolName",
    "format_labels",
    "parse_labels",
]

DEFAULT_POOL = "default"
# The same shape for keys and values: 1-63 letters, digits, '_', '.' or '-', starting with a
# letter or digit (Kubernetes label values are alike).
LABEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
MAX_LABELS = 16
LabelKey = Annotated[str, msgspec.Meta(pattern=LABEL_PATTERN)]
LabelValue = Annotated[str, msgspec.Meta(pattern=LABEL_PATTERN)]
Labels = Annotated[dict[LabelKey, LabelValue], msgspec.Meta(max_length=MAX_LABELS)]


def parse_labels(text: str, *, source: str = "SWARM_FELLOW_LABELS") -> dict[str, str]:
    """``"gpu=a100, zone=eu"`` as ``{"gpu": "a100", "zone": "eu"}``; ConfigError naming
    ``source`` and the bad part. Empty text: no labels."""
    labels: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep:
            raise ConfigError(f"{source}: {part!r} is not key=value (e.g. gpu=a100,zone=eu)")
        if key in labels:
            raise ConfigError(f"{source}: label {key!r} is given twice")
        labels[key] = value
    try:
        return msgspec.convert(labels, Labels)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_label_problem(exc, labels)}") from None


def _label_problem(exc: msgspec.ValidationError, labels: Mapping[str, str]) -> str:
    if len(labels) > MAX_LABELS:
        return f"{len(labels)} labels; at most {MAX_LABELS}"
    bad = next((f"{k}={v}" for k, v in labels.items() if not _fits(k) or not _fits(v)), str(exc))
    return (
        f"{bad!r}: keys and values are 1-63 letters, digits, '_', '.' or '-', starting with "
        "a letter or digit"
    )


def _fits(text: str) -> bool:
    try:
        msgspec.convert(text, LabelKey)
    except msgspec.ValidationError:
        return False
    return True


def format_labels(labels: Mapping[str, str]) -> str:
    """``gpu=a100,zone=eu`` (sorted): how labels are shown and written in settings."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
