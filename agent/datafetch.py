"""Stage 0's agent downloads the uploaded datasets its plan reads into the data cache.

Each goes once: a file already at ``<data cache>/datasets/<sha256>`` was verified when it was
written (it is only ever written by renaming a verified download), so a later job, or a
resumed attempt, on the same fellow reads it from there. A download is streamed to a temporary
file beside it, hashed and counted as it arrives (never more bytes than START announced), and
renamed into place only when its sha256 is the one START named. The token goes in a header,
never in the URL.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

from silentswarm.agent.errors import FetchError
from silentswarm.agent.runtime.data import dataset_path
from silentswarm.agent.shardpush import SHARD_TOKEN_HEADER
from silentswarm.types.signals import DatasetArgs, DatasetFile

CHUNK_BYTES = 1 << 20
TIMEOUT_S = 60.0  # between two pieces of a download, not for all of it


def fetch_datasets(args: DatasetArgs, cache_dir: Path | None = None) -> list[Path]:
    """Each dataset of ``args`` in the data cache (downloaded unless it is there); their
    paths. FetchError naming the dataset when one cannot be had. Runs in a thread."""
    return [_fetch_one(entry, args.token, cache_dir) for entry in args.files]


def _fetch_one(entry: DatasetFile, token: str, cache_dir: Path | None) -> Path:
    import httpx

    path = dataset_path(entry.sha256, cache_dir)
    if path.is_file() and path.stat().st_size == entry.size_bytes:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    what = f"dataset {entry.name!r} ({entry.sha256[:12]}...)"
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".download-")
    try:
        hasher, size = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out:
            try:
                with httpx.stream(
                    "GET", entry.url, headers={SHARD_TOKEN_HEADER: token}, timeout=TIMEOUT_S
                ) as response:
                    if response.status_code != 200:
                        response.read()
                        raise FetchError(
                            f"cannot download {what}: HTTP {response.status_code} "
                            f"{response.text[:200]}"
                        )
                    for chunk in response.iter_bytes(CHUNK_BYTES):
                        size += len(chunk)
                        if size > entry.size_bytes:
                            raise FetchError(
                                f"{what}: the leader sent more than the {entry.size_bytes} "
                                "bytes START announced"
                            )
                        hasher.update(chunk)
                        out.write(chunk)
            except httpx.HTTPError as exc:
                raise FetchError(f"cannot download {what}: {exc}") from None
            out.flush()
            os.fsync(out.fileno())
        if hasher.hexdigest() != entry.sha256:
            raise FetchError(f"{what}: the download's sha256 is {hasher.hexdigest()}")
        os.replace(temp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
    return path
