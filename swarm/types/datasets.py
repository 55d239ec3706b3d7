"""Datasets uploaded to the leader (``/api/v1/datasets``, ``swarm data``)."""

from __future__ import annotations

import msgspec


class DatasetRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One named dataset: the content it names now (a later upload under the same name
    replaces it; jobs already accepted keep the content they were pinned to)."""

    name: str
    sha256: str
    size_bytes: int
    uploaded_at: float
    # The file name it was uploaded from (informational).
    source: str = ""
