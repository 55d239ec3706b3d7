"""Datasets uploaded to the leader, as a job's ``data`` names them: pure parsing, no I/O.

A job spec writes ``"dataset:NAME"`` (as a text entry, or as a JSONL source's ``jsonl``). When
the leader accepts the job it pins each one to the content it names at that moment,
``"dataset:NAME@SHA256"`` (:func:`pin`), so a later upload under the same name never changes
the data of a running or resumed job. Stage 0's agent downloads a pinned dataset into its data
cache, verified against the digest, before the stage starts; the stage's data loader reads it
from there (:func:`silentswarm.agent.runtime.data.dataset_path`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

PREFIX = "dataset:"
# A dataset's name: what a user types, and safe in a file name and a URL path segment.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class DatasetRef:
    """``dataset:NAME`` (``sha256`` None: not pinned yet) or ``dataset:NAME@SHA256``."""

    name: str
    sha256: str | None = None

    def __str__(self) -> str:
        return f"{PREFIX}{self.name}" + (f"@{self.sha256}" if self.sha256 else "")


def is_dataset(text: str) -> bool:
    return text.startswith(PREFIX)


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a dataset, or None."""
    if NAME_PATTERN.match(name):
        return None
    return (
        f"dataset name {name[:140]!r} must be 1-128 letters, digits, '.', '_' or '-', "
        "starting with a letter or digit"
    )


def parse(text: str) -> DatasetRef:
    """The reference in a ``dataset:`` entry; ValueError (naming what is wrong) otherwise."""
    if not is_dataset(text):
        raise ValueError(f"{text[:140]!r} does not start with {PREFIX!r}")
    name, at, digest = text.removeprefix(PREFIX).partition("@")
    problem = name_problem(name)
    if problem:
        raise ValueError(problem)
    if at and not SHA256_PATTERN.match(digest):
        raise ValueError(f"{text[:140]!r}: after '@' comes a sha256 (64 lowercase hex digits)")
    return DatasetRef(name=name, sha256=digest or None)


def pin(text: str, sha256: str) -> str:
    """``dataset:NAME`` (or an already pinned one) pinned to ``sha256``."""
    return str(DatasetRef(name=parse(text).name, sha256=sha256))


def entry_text(entry: Any) -> str | None:
    """The path text of a ``data`` entry: the string, or a JSONL source's ``jsonl``."""
    text = entry if isinstance(entry, str) else getattr(entry, "jsonl", None)
    return text if isinstance(text, str) else None


def pinned_refs(data: Iterable[Any]) -> list[DatasetRef]:
    """The pinned ``dataset:`` references among a spec's or a plan's ``data`` entries, each
    digest once (a malformed one is skipped: the spec's validation names it)."""
    out: dict[str, DatasetRef] = {}
    for entry in data:
        text = entry_text(entry)
        if text is None or not is_dataset(text):
            continue
        try:
            ref = parse(text)
        except ValueError:
            continue
        if ref.sha256:
            out.setdefault(ref.sha256, ref)
    return list(out.values())
