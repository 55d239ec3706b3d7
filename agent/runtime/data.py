"""Byte-level text data: sources to one token file, memory-mapped, deterministic training
windows, a held-out validation split, and a position that can be reported and restored.

A token is one byte of the UTF-8 text (vocab 256), so no tokenizer is ever downloaded.
Everything here is numpy, msgspec and the standard library: no TensorFlow, so it is cheap to
import.

The sources (text files, directories and globs, and JSONL files whose named field holds one
document a line) are streamed once, in chunks, into a token cache file (:func:`build_token_cache`)
and then memory-mapped: the corpus is never held whole in RAM, windows and batches are read from
the map. The cache is content-addressed (:func:`cache_key`: every source file's path, size and
mtime, the tokenizer, the separator and ``max_bytes``), so a changed source builds a new one, and
published atomically, so concurrent builders and readers never see half a file.

Only stage 0 of a pipeline builds a ``TextDataset``: it feeds the inputs of a batch, and the
targets travel down the chain with the activations (in every forward frame,
:mod:`silentswarm.agent.pipe.wire`) to the last stage, which scores them; the stages after stage
0 open no data file. Batches are still deterministic, all randomness coming from
``np.random.default_rng((seed, epoch))`` and nothing else: a one-process reference, a resumed
run and glue (which reads the validation batches again) see exactly the batches the pipeline
saw.
"""

from __future__ import annotations

import codecs
import contextlib
import fcntl
import glob
import hashlib
import json
import logging
import os
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import msgspec
import numpy as np

from silentswarm import datasets
from silentswarm.agent.errors import DataError
from silentswarm.agent.pipe.wire import token_dtype
from silentswarm.agent.runtime import datacache
from silentswarm.agent.runtime.cachedirs import user_cache_dir
from silentswarm.agent.runtime.tokenizer import (
    BYTE_VOCAB,
    BpeTokenizer,
    ByteTokenizer,
    Tokenizer,
    train_bpe,
)
from silentswarm.plan import DEFAULT_CORPUS

if TYPE_CHECKING:
    from silentswarm.plan import TrainConfig

__all__ = [
    "CACHE_ENV",
    "DEFAULT_CORPUS",
    "TOKENIZER",
    "TOKEN_DTYPE",
    "VOCAB_SIZE",
    "DataState",
    "TextDataset",
    "build_token_cache",
    "cache_key",
    "dataset_path",
    "default_cache_dir",
    "default_corpus_paths",
    "resolve_paths",
    "token_dtype",
]

log = logging.getLogger(__name__)


VOCAB_SIZE = BYTE_VOCAB
TOKENIZER = ByteTokenizer.name
"""The tokenizer every stage assumes (one token per byte, :data:`VOCAB_SIZE` of them): the
stages' handshake compares it, since only stage 0 tokenises anything."""
_ENCODE_BATCH = 1 << 20  # text bytes a BPE encodes at a time (in parallel pieces)
_ENCODE_PIECE = 1 << 16  # about this much text per piece
_CARRY_MAX = 1 << 22  # a line longer than this is cut where the read stopped
# A JSONL line is one document, read whole: longer ones are refused (a file of no newlines
# would be read into memory at once, a few times over as it is decoded).
JSONL_LINE_MAX = 64 << 20

CACHE_ENV = "SWARM_DATA_CACHE"
"""Where token caches go, when set (else ``$XDG_CACHE_HOME/silentswarm/tokens``, else
``~/.cache/silentswarm/tokens``)."""
_CACHE_FORMAT = 1  # bump when the file layout or what a key covers changes
_CHUNK = 1 << 20  # bytes read (and UTF-8 checked) at a time
_SCAN = 1 << 18  # tokens per step of a pass over the whole map (bincount makes them intp)


TOKEN_DTYPE = token_dtype(VOCAB_SIZE)


class JsonlEntry(Protocol):
    """A ``train.data`` entry naming JSONL files (:class:`silentswarm.plan.JsonlSource`, duck
    typed here so that this module does not import the plan's dependencies)."""

    jsonl: str
    field: str


Pattern = str | JsonlEntry


@dataclass(frozen=True)
class DataState:
    """A training position: ``index`` is the next window within ``epoch``'s permutation."""

    epoch: int
    index: int


@dataclass(frozen=True)
class _Source:
    """One file to read: whole (``field`` None) or, JSONL, that field of every line."""

    path: str  # absolute
    field: str | None = None

    def sort_key(self) -> tuple[str, int, str]:
        return (self.path, self.field is not None, self.field or "")


def default_corpus_paths() -> list[str]:
    """The standard library's top-level ``.py`` files, sorted.

    Real text (about 170 files, a few MB) that exists on every machine with Python, so a job
    can train on something meaningful without a download.
    """
    stdlib = sysconfig.get_paths()["stdlib"]
    return sorted(glob.glob(os.path.join(glob.escape(stdlib), "*.py")))


def default_cache_dir() -> Path:
    """``$SWARM_DATA_CACHE``, else ``$XDG_CACHE_HOME/silentswarm/tokens``, else
    ``~/.cache/silentswarm/tokens``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    return user_cache_dir("tokens")


def _cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    """``cache_dir`` if given, else :func:`default_cache_dir`."""
    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def dataset_path(sha256: str, cache_dir: Path | None = None) -> Path:
    """Where an uploaded dataset with this digest lives once its agent downloaded it:
    ``<data cache>/datasets/<sha256>`` (:mod:`silentswarm.agent.datafetch`)."""
    return _cache_dir(cache_dir) / "datasets" / sha256


def _dataset_file(text: str) -> str:
    """The local file of a ``dataset:NAME@SHA256`` entry; DataError when it is not pinned or
    not downloaded."""
    try:
        ref = datasets.parse(text)
    except ValueError as exc:
        raise DataError(f"data entry {text[:140]!r}: {exc}") from None
    if ref.sha256 is None:
        raise DataError(
            f"{text!r} names a dataset uploaded to a leader: submit the job to that leader "
            "(it pins the entry to the dataset's content and stage 0's agent downloads it)"
        )
    path = dataset_path(ref.sha256)
    if path.is_file():
        datacache.touch([path])
        return str(path)
    stored = _leader_dataset(ref.sha256)  # glue on the leader's machine, say
    if stored is not None:
        return str(stored)
    raise DataError(
        f"dataset {ref.name!r} ({ref.sha256[:12]}...) is not in this fellow's data cache "
        f"({path.parent}): its agent downloads it before the stage starts"
    )


def _leader_dataset(sha256: str) -> Path | None:
    """The content a leader on this machine keeps (SWARM_DATASET_ROOT, else
    ``<SWARM_STATE_DIR>/datasets``), if it is there."""
    from silentswarm.errors import ConfigError
    from silentswarm.settings import Settings

    try:
        root = Settings.from_env().datasets_dir
    except ConfigError:
        return None
    path = root / "blobs" / sha256
    return path if path.is_file() else None


def _files_below(directory: str) -> list[str]:
    found = []
    for root, _dirs, files in os.walk(directory):
        found.extend(os.path.join(root, name) for name in files)
    return [f for f in found if os.path.isfile(f)]


def _expand(pattern: str) -> list[str]:
    if pattern == DEFAULT_CORPUS:
        return default_corpus_paths()
    if datasets.is_dataset(pattern):
        return [_dataset_file(pattern)]
    path = os.path.expanduser(pattern)
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        return _files_below(path)
    if not glob.has_magic(path):
        return []
    out: list[str] = []
    for match in glob.glob(path, recursive=True):
        if os.path.isfile(match):
            out.append(match)
        elif os.path.isdir(match):
            out.extend(_files_below(match))
    return out


def _entry(pattern: Any) -> tuple[str, str | None]:
    """``(path or glob, field)``: field None for a text pattern, the JSON field for JSONL."""
    if isinstance(pattern, str):
        return pattern, None
    jsonl, field = getattr(pattern, "jsonl", None), getattr(pattern, "field", None)
    if isinstance(jsonl, str) and isinstance(field, str):
        if not field:
            raise DataError(f"{pattern!r}: the JSONL field name is empty")
        return jsonl, field
    raise TypeError(f"a data entry is a path/glob string or a JSONL source, not {pattern!r}")


def _candidates(patterns: Sequence[Pattern]) -> list[_Source]:
    """All files the patterns name, sorted and de-duplicated, not yet checked for UTF-8."""
    if isinstance(patterns, str):
        raise TypeError("patterns must be a sequence of strings, not a single string")
    if not patterns:
        raise DataError("no file patterns given")
    seen: set[_Source] = set()
    for pattern in patterns:
        path, field = _entry(pattern)
        if field is not None and path == DEFAULT_CORPUS:
            raise DataError(f"{pattern!r}: {DEFAULT_CORPUS!r} is Python source, not JSONL")
        files = _expand(path)
        if not files:
            raise DataError(f"no files match {path!r}")
        seen.update(_Source(os.path.abspath(f), field) for f in files)
    return sorted(seen, key=_Source.sort_key)


class _Utf8Chunks:
    """A file in chunks, each checked as UTF-8 (a character may straddle two) before it is
    yielded; iteration stops at the first invalid byte or a character cut off at the end, and
    :attr:`problem` then says where and why (None: the whole file is valid)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.problem: str | None = None

    def __iter__(self) -> Iterator[bytes]:
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset = 0
        try:
            with open(self.path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    try:
                        decoder.decode(chunk)
                    except UnicodeDecodeError as exc:
                        self.problem = f"byte {offset + exc.start}: {exc.reason}"
                        return
                    yield chunk
                    offset += len(chunk)
                try:
                    decoder.decode(b"", final=True)
                except UnicodeDecodeError as exc:
                    self.problem = f"byte {offset + exc.start}: {exc.reason} at the end"
        except OSError as exc:
            raise DataError(f"cannot read {self.path}: {exc}") from exc


def _utf8_problem(path: str) -> str | None:
    """Why the file is not valid UTF-8 (None if it is), checked chunk by chunk."""
    chunks = _Utf8Chunks(path)
    for _ in chunks:
        pass
    return chunks.problem


def resolve_paths(patterns: Sequence[Pattern]) -> list[Path]:
    """Expand file paths, directories (recursively) and globs (``**`` allowed) to text files.

    ``"stdlib"`` expands to :func:`default_corpus_paths`. The result is sorted and de-duplicated
    (by absolute path). A pattern that matches nothing raises :class:`DataError`; files that are
    not valid UTF-8 are skipped with a logged warning, unless none is left. JSONL sources are
    listed as they are (their lines are checked when the tokens are built).
    """
    paths: list[Path] = []
    for source in _candidates(patterns):
        problem = None if source.field is not None else _utf8_problem(source.path)
        if problem is None:
            paths.append(Path(source.path))
        else:
            log.warning("skipping %s: not valid UTF-8 (%s)", source.path, problem)
    if not paths:
        raise DataError(f"no valid UTF-8 text files among {list(patterns)!r}")
    return list(dict.fromkeys(paths))


# --- building the token file --------------------------------------------------------------------


class _TokenWriter:
    """Encodes documents with ``tokenizer`` and appends their ids to the cache file, up to
    ``limit`` bytes of text (separators count one byte each); a document can be taken back
    whole.

    Text arrives in chunks of any size; a BPE sees it cut only at line ends (a piece never
    ends inside a line unless the line is longer than :data:`_CARRY_MAX`), so the ids do not
    depend on where a read happened to stop, and pieces go to the tokenizer in batches
    (:data:`_ENCODE_BATCH` bytes) that it encodes in parallel."""

    def __init__(self, out: IO[bytes], limit: int | None, tokenizer: Tokenizer) -> None:
        self.out = out
        self.limit = limit
        self.tokenizer = tokenizer
        self.n_tokens = 0
        self.n_bytes = 0
        self.n_docs = 0
        self._carry = b""
        self._pieces: list[bytes] = []
        self._pending = 0

    @property
    def full(self) -> bool:
        return self.limit is not None and self.n_bytes >= self.limit

    def write(self, data: bytes) -> None:
        if self.limit is not None:
            data = data[: max(0, self.limit - self.n_bytes)]
        if not data:
            return
        self.n_bytes += len(data)
        if isinstance(self.tokenizer, ByteTokenizer):  # a token is a byte: no cutting
            self._emit(self.tokenizer.encode(data))
            return
        data = self._carry + data
        cut = data.rfind(b"\n") + 1
        if cut == 0 and len(data) > _CARRY_MAX:
            cut = len(data)
        self._carry = data[cut:]
        if cut:
            self._queue(data[:cut])

    def end_document(self) -> None:
        """Encode what the document left (a last line without its newline)."""
        if self._carry:
            self._queue(self._carry)
            self._carry = b""
        self._flush()
        self.n_docs += 1

    def begin_document(self) -> tuple[int, int]:
        """Write the separator (but before the first document); the position to roll back to."""
        mark = (self.n_tokens, self.n_bytes)
        if self.n_docs and not self.full:
            self.n_bytes += 1
            self._emit(self.tokenizer.separator)
        return mark

    def rollback(self, mark: tuple[int, int]) -> None:
        self._carry, self._pieces, self._pending = b"", [], 0
        self.n_tokens, self.n_bytes = mark
        self.out.seek(self.n_tokens * self.tokenizer.dtype.itemsize)
        self.out.truncate()

    def _queue(self, text: bytes) -> None:
        self._pieces.append(text)
        self._pending += len(text)
        if self._pending >= _ENCODE_BATCH:
            self._flush()

    def _flush(self) -> None:
        if self._pieces:
            assert isinstance(self.tokenizer, BpeTokenizer)
            self._emit(self.tokenizer.encode_many(_cut_lines(self._pieces)))
            self._pieces, self._pending = [], 0

    def _emit(self, ids: np.ndarray) -> None:
        self.out.write(np.ascontiguousarray(ids, dtype=self.tokenizer.dtype).tobytes())
        self.n_tokens += len(ids)


def _cut_lines(pieces: list[bytes]) -> list[bytes]:
    """The pieces joined and cut again at line ends into parts of about :data:`_ENCODE_PIECE`
    bytes: the units a BPE encodes in parallel (where they are cut depends only on the text)."""
    text = b"".join(pieces)
    out, begin = [], 0
    while begin < len(text):
        end = text.find(b"\n", begin + _ENCODE_PIECE) + 1 or len(text)
        out.append(text[begin:end])
        begin = end
    return out


def _append_text(path: str, writer: _TokenWriter) -> bool:
    """The file as one document, UTF-8 checked chunk by chunk as it streams; False (and nothing
    written, with a warning) when it is not valid UTF-8. Past ``max_bytes`` the rest of the file
    is still checked (but not written), so the same files are skipped as when files were read
    whole."""
    mark = writer.begin_document()
    chunks = _Utf8Chunks(path)
    for chunk in chunks:
        writer.write(chunk)
    problem = chunks.problem
    if problem is not None:
        log.warning("skipping %s: not valid UTF-8 (%s)", path, problem)
        writer.rollback(mark)
        return False
    writer.end_document()
    return True


_json = msgspec.json.Decoder()


def _append_jsonl(path: str, field: str, writer: _TokenWriter) -> bool:
    """Each line's ``field`` as one document; a bad line is a :class:`DataError` naming the
    file and the line (blank lines are skipped). Reading stops at ``max_bytes``. True when the
    file gave at least one document."""
    used = False
    try:
        with open(path, "rb") as f:
            for lineno, line in enumerate(iter(lambda: f.readline(JSONL_LINE_MAX + 1), b""), 1):
                if writer.full:
                    break
                where = f"{path}, line {lineno}"
                if len(line) > JSONL_LINE_MAX:
                    raise DataError(
                        f"{where}: longer than {JSONL_LINE_MAX >> 20} MiB (one document a "
                        "line: split it)"
                    )
                if not line.strip():
                    continue
                try:
                    record = _json.decode(line)
                except msgspec.DecodeError as exc:
                    raise DataError(f"{where}: not valid JSON ({exc})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{where}: not a JSON object")
                if field not in record:
                    raise DataError(f"{where}: no field {field!r}")
                text = record[field]
                if not isinstance(text, str):
                    kind = type(text).__name__ if text is not None else "null"
                    raise DataError(f"{where}: field {field!r} is {kind}, not a string")
                try:
                    data = text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise DataError(
                        f"{where}: field {field!r} is not valid Unicode ({exc})"
                    ) from None
                writer.begin_document()
                writer.write(data)
                writer.end_document()
                used = True
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    return used


def _write_tokens(
    sources: Sequence[_Source], out: IO[bytes], max_bytes: int | None, tokenizer: Tokenizer
) -> tuple[int, list[str]]:
    """Stream the sources into ``out``: the token count and the files used."""
    writer = _TokenWriter(out, max_bytes, tokenizer)
    used: list[str] = []
    for source in sources:
        if writer.full:
            break
        if source.field is None:
            ok = _append_text(source.path, writer)
        else:
            ok = _append_jsonl(source.path, source.field, writer)
        if ok:
            used.append(source.path)
    return writer.n_tokens, used


def cache_key(
    sources: Sequence[_Source], max_bytes: int | None, tokenizer: Tokenizer | None = None
) -> str:
    """What the tokens depend on, hashed: every source's path (and JSONL field), size and
    mtime_ns, the tokenizer, its dtype, the separator and ``max_bytes``.

    Size and mtime rather than a hash of the content: hashing would read every source at every
    start, the very cost the cache saves (minutes for a large corpus), and an edit changes the
    mtime. A rewrite that keeps both size and mtime (``touch -r``, some copy tools) goes unseen:
    delete the cache then.
    """
    tokenizer = tokenizer or ByteTokenizer()
    files = []
    for source in sources:
        try:
            st = os.stat(source.path)
        except OSError as exc:
            raise DataError(f"cannot read {source.path}: {exc}") from exc
        files.append([source.path, source.field, st.st_size, st.st_mtime_ns])
    described = {
        "format": _CACHE_FORMAT,
        "tokenizer": tokenizer.name,
        "dtype": tokenizer.dtype.str,
        "separator": tokenizer.separator.tobytes().hex(),
        "max_bytes": max_bytes,
        "sources": files,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class _Cached:
    tokens: np.ndarray  # read-only, memory-mapped
    paths: list[str]
    file: Path | None  # None: an unnamed temporary file (the cache directory was not writable)


def _map(file: Any, n_tokens: int, dtype: np.dtype) -> np.ndarray:
    if n_tokens == 0:  # mmap cannot map nothing
        tokens = np.zeros(0, dtype=dtype)
    else:
        # .view: a plain read-only ndarray whose base keeps the map alive (no np.memmap subclass
        # leaking into batches)
        tokens = np.memmap(file, dtype=dtype, mode="r", shape=(n_tokens,)).view(np.ndarray)
    tokens.flags.writeable = False
    return tokens


def _open_cached(directory: Path, key: str, dtype: np.dtype) -> _Cached | None:
    """The published cache for ``key``, mapped; None when there is none (or it is damaged)."""
    meta_file, token_file = directory / f"{key}.json", directory / f"{key}.tokens"
    try:
        meta = json.loads(meta_file.read_bytes())
        n_tokens, paths = int(meta["n_tokens"]), [str(p) for p in meta["paths"]]
        if meta["dtype"] != dtype.str or meta["key"] != key:
            return None
        if os.stat(token_file).st_size != n_tokens * dtype.itemsize:
            return None
        datacache.touch([meta_file, token_file])
        return _Cached(_map(token_file, n_tokens, dtype), paths, token_file)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _publish(directory: Path, name: str, write: Any) -> None:
    """Write ``directory/name`` atomically: a unique temporary file, flushed, renamed."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _build_cached(
    directory: Path,
    key: str,
    sources: Sequence[_Source],
    max_bytes: int | None,
    tokenizer: Tokenizer,
) -> _Cached:
    """Build the cache for ``key`` under an exclusive lock (a second builder waits, then maps
    what the first published): tokens first, then the metadata that makes them visible."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{key}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = _open_cached(directory, key, tokenizer.dtype)
        if found is not None:
            return found
        result: dict[str, Any] = {}

        def tokens(f: IO[bytes]) -> None:
            result["n"], result["paths"] = _write_tokens(sources, f, max_bytes, tokenizer)

        _publish(directory, f"{key}.tokens", tokens)
        meta = {
            "key": key,
            "format": _CACHE_FORMAT,
            "tokenizer": tokenizer.name,
            "dtype": tokenizer.dtype.str,
            "n_tokens": result["n"],
            "max_bytes": max_bytes,
            "paths": result["paths"],
        }
        _publish(directory, f"{key}.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
        log.info(
            "built token cache %s: %d tokens from %d files",
            key[:12],
            result["n"],
            len(result["paths"]),
        )
    found = _open_cached(directory, key, tokenizer.dtype)
    if found is None:
        raise DataError(f"the token cache {directory / key}.tokens vanished as it was built")
    return found


def _build_unnamed(
    sources: Sequence[_Source], max_bytes: int | None, tokenizer: Tokenizer
) -> _Cached:
    """The tokens in an unnamed temporary file (gone when the map is), when no cache can be
    written: still memory-mapped, just built again next time."""
    with tempfile.TemporaryFile() as f:
        n_tokens, paths = _write_tokens(sources, f, max_bytes, tokenizer)
        f.flush()
        return _Cached(_map(f, n_tokens, tokenizer.dtype), paths, None)


def build_token_cache(
    patterns: Sequence[Pattern],
    max_bytes: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    tokenizer: Tokenizer | None = None,
) -> _Cached:
    """The memory-mapped tokens of ``patterns`` (``tokenizer``'s ids; default: bytes), from the
    cache under ``cache_dir`` (default: :func:`default_cache_dir`) when it holds them, else
    built there first."""
    tokenizer = tokenizer or ByteTokenizer()
    sources = _candidates(patterns)
    key = cache_key(sources, max_bytes, tokenizer)
    directory = _cache_dir(cache_dir)
    found = _open_cached(directory, key, tokenizer.dtype)
    if found is None:
        try:
            found = _build_cached(directory, key, sources, max_bytes, tokenizer)
        except OSError as exc:  # a read-only home, say: build without a cache
            log.warning(
                "cannot write the token cache in %s (%s): building it uncached", directory, exc
            )
            found = _build_unnamed(sources, max_bytes, tokenizer)
    if not found.paths:
        raise DataError(f"no valid UTF-8 text files among {list(patterns)!r}")
    return found


class TextDataset:
    """Byte tokens from text and JSONL sources, cut into windows of ``seq_len + 1`` (inputs and
    targets), read from the memory-mapped token cache (:func:`build_token_cache`).

    The last ``val_fraction`` of the tokens is the validation split, the rest is training, so the
    two never overlap. Training windows start at ``0, seq_len, 2 * seq_len, ...`` (non-overlapping
    inputs) and are visited in a permutation drawn from ``np.random.default_rng((seed, epoch))``.
    """

    def __init__(
        self,
        patterns: Sequence[Pattern],
        *,
        seq_len: int,
        seed: int,
        val_fraction: float = 0.05,
        max_bytes: int | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.seq_len = seq_len
        self.seed = seed
        self.val_fraction = val_fraction
        self.tokenizer = tokenizer or ByteTokenizer()
        cached = build_token_cache(patterns, max_bytes, cache_dir, self.tokenizer)
        self._tokens = cached.tokens
        self.paths = [Path(p) for p in cached.paths]
        self.cache_file = cached.file
        """The token file mapped (None when no cache could be written)."""

        n = len(self._tokens)
        n_val = int(n * val_fraction)
        self.val_start = n - n_val
        """Token offset where the validation split begins (training uses ``[0, val_start)``)."""
        self._train = self._tokens[: self.val_start]
        self._val = self._tokens[self.val_start :]
        self._num_train = self._num_windows(len(self._train))
        self._num_val = self._num_windows(len(self._val))
        if self._num_train < 1 or self._num_val < 1:
            raise DataError(
                f"not enough text for seq_len={seq_len}: {n} tokens give {len(self._train)} "
                f"training and {len(self._val)} validation tokens (val_fraction={val_fraction}); "
                f"each split needs at least {seq_len + 1} for one window"
            )
        self._window = np.arange(seq_len + 1, dtype=np.int64)
        self._epoch = 0
        self._index = 0
        self._perm_epoch = -1
        self._perm = np.zeros(0, dtype=np.int64)

    def _num_windows(self, n_tokens: int) -> int:
        # A window needs seq_len + 1 tokens; consecutive windows share one token (the last target
        # of one is the first input of the next), hence the stride of seq_len.
        return max(0, (n_tokens - 1) // self.seq_len)

    @property
    def n_tokens(self) -> int:
        """All tokens, training and validation (after ``max_bytes`` truncation)."""
        return len(self._tokens)

    @property
    def num_train_windows(self) -> int:
        return self._num_train

    @property
    def num_val_windows(self) -> int:
        return self._num_val

    @property
    def tokens(self) -> np.ndarray:
        """The whole corpus as a read-only array of the tokenizer's dtype, memory-mapped (pages are
        read from the cache file as they are touched)."""
        return self._tokens

    def tokens_sha256(self) -> str:
        """The sha256 of the tokens' bytes, read through the map a chunk at a time."""
        digest = hashlib.sha256()
        for begin in range(0, self.n_tokens, _SCAN):
            digest.update(self._tokens[begin : begin + _SCAN].tobytes())
        return digest.hexdigest()

    def train_window_offsets(self, epoch: int) -> np.ndarray:
        """Start offsets (into :attr:`tokens`) of the training windows, in ``epoch``'s order."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        # The shuffle moves positions, whatever they hold: the permutation of the window
        # indices, scaled, is the permutation of the offsets (without a second array of them).
        order = np.random.default_rng((self.seed, epoch)).permutation(self._num_train)
        order *= self.seq_len
        return order

    def val_window_offsets(self) -> np.ndarray:
        """Start offsets (into :attr:`tokens`) of the validation windows, in order."""
        return self.val_start + np.arange(self._num_val, dtype=np.int64) * self.seq_len

    def _epoch_order(self) -> np.ndarray:
        if self._perm_epoch != self._epoch:
            self._perm = self.train_window_offsets(self._epoch)
            self._perm_epoch = self._epoch
        return self._perm

    def _windows(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        windows = self._tokens[offsets[:, None] + self._window].astype(np.int32)
        return windows[:, :-1], windows[:, 1:]

    def next_batch(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``(inputs, targets)``, int32 of shape ``(batch_size, seq_len)``.

        A batch that runs past the end of an epoch continues with the next epoch's permutation.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        parts = []
        needed = batch_size
        while needed:
            order = self._epoch_order()
            take = min(needed, self._num_train - self._index)
            parts.append(order[self._index : self._index + take])
            self._index += take
            needed -= take
            if self._index == self._num_train:
                self._epoch += 1
                self._index = 0
        return self._windows(np.concatenate(parts))

    def state(self) -> DataState:
        """The current position; an epoch that has just been used up reports as the next one."""
        return DataState(epoch=self._epoch, index=self._index)

    def restore(self, state: DataState) -> None:
        """Continue from ``state``: the following batches are exactly those that followed it."""
        epoch, index = int(state.epoch), int(state.index)
        if epoch < 0 or not 0 <= index <= self._num_train:
            raise ValueError(
                f"invalid data state {state}: this dataset has {self._num_train} training "
                "windows per epoch"
            )
        if index == self._num_train:
            epoch, index = epoch + 1, 0
        self._epoch, self._index = epoch, index

    def val_batches(
        self, batch_size: int, max_batches: int | None = None, *, drop_remainder: bool = False
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The validation windows in order, non-overlapping, as ``(inputs, targets)`` batches.

        With ``max_batches`` smaller than the split, the windows are spread evenly over the
        whole validation split (not the first few files only), so a short evaluation still
        measures the same text a full one does. The last batch is shorter when the windows
        do not divide evenly, unless ``drop_remainder`` (for fixed shapes).
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        offsets = self.val_window_offsets()
        if max_batches is not None and max_batches * batch_size < len(offsets):
            picks = np.linspace(0, len(offsets) - 1, max_batches * batch_size).round()
            offsets = offsets[np.unique(picks.astype(np.int64))]
        stop = len(offsets)
        if drop_remainder:
            stop -= stop % batch_size
        for i, begin in enumerate(range(0, stop, batch_size)):
            if max_batches is not None and i >= max_batches:
                return
            yield self._windows(offsets[begin : min(begin + batch_size, stop)])

    def unigram_entropy_nats(self) -> float:
        """Entropy (nats) of the training split's token frequencies.

        This is the loss of a model that learned only how often each token occurs, the baseline
        a trained model must beat.
        """
        vocab = self.tokenizer.vocab_size
        counts = np.zeros(vocab, dtype=np.int64)
        for begin in range(0, len(self._train), _SCAN):  # a chunk at a time through the map
            counts += np.bincount(self._train[begin : begin + _SCAN], minlength=vocab)
        p = counts[counts > 0] / len(self._train)
        return float(-(p * np.log(p)).sum()) + 0.0  # + 0.0 turns -0.0 into 0.0

    def __repr__(self) -> str:
        return (
            f"TextDataset({len(self.paths)} files, {self.n_tokens} tokens, seq_len={self.seq_len}, "
            f"train_windows={self._num_train}, val_windows={self._num_val}, seed={self.seed})"
        )


def job_dataset(
    train: TrainConfig,
    seq_len: int,
    patterns: Sequence[Pattern] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    tokenizer: Tokenizer | None = None,
) -> TextDataset:
    """The dataset stage 0 of a job reads (and glue, to score the same validation), in
    ``tokenizer``'s ids (default: bytes; a BPE job passes :func:`job_tokenizer`'s). Then the
    data cache is pruned to ``SWARM_DATA_CACHE_MAX_BYTES`` (what this dataset uses stays)."""
    dataset = TextDataset(
        patterns if patterns else list(train.data),
        seq_len=seq_len,
        seed=train.seed,
        val_fraction=train.val_fraction,
        max_bytes=train.max_data_bytes,
        cache_dir=cache_dir,
        tokenizer=tokenizer,
    )
    keep = [*dataset.paths, *getattr(tokenizer, "files", ())]
    if dataset.cache_file is not None:
        keep += [dataset.cache_file, dataset.cache_file.with_suffix(".json")]
    directory = _cache_dir(cache_dir)
    with contextlib.suppress(OSError):
        datacache.prune(directory, keep)
    return dataset


def job_tokenizer(
    train: TrainConfig,
    vocab_size: int,
    patterns: Sequence[Pattern] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Tokenizer:
    """The tokenizer a job's spec asks for: bytes, or a BPE of ``vocab_size`` tokens trained on
    the first ``train.tokenizer.train_bytes`` of the job's data (once: the trained JSON is kept
    in the data cache under a key of the sources, the limits and the library's version, so a
    restart or another job on the same data reuses it)."""
    config = train.tokenizer
    if config.kind == "byte":
        return ByteTokenizer()
    sources = _candidates(patterns if patterns else list(train.data))
    limit = min(config.train_bytes, train.max_data_bytes or config.train_bytes)
    import tokenizers

    described = {
        "text": cache_key(sources, limit),
        "kind": "bpe",
        "vocab_size": vocab_size,
        "library": tokenizers.__version__,
    }
    key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
    directory = _cache_dir(cache_dir) / "tokenizers"
    path = directory / f"{key}.json"
    with contextlib.suppress(OSError):
        kept = BpeTokenizer(path.read_text(), vocab_size)
        datacache.touch([path])
        kept.files = (path,)
        return kept
    with tempfile.TemporaryFile() as text:
        n_bytes, _ = _write_tokens(sources, text, limit, ByteTokenizer())
        text.flush()
        log.info("training a BPE of %d tokens on %d bytes of text", vocab_size, n_bytes)
        trained = train_bpe(_line_chunks(text), vocab_size)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _publish(directory, path.name, lambda f: f.write(trained.to_json().encode()))
        trained.files = (path,)
    except OSError as exc:
        log.warning("cannot keep the trained tokenizer in %s (%s)", directory, exc)
    return trained


def _line_chunks(f: IO[bytes]) -> Iterator[bytes]:
    """A file's bytes from the start, in pieces of about 1 MiB cut at line ends."""
    f.seek(0)
    carry = b""
    while chunk := f.read(_CHUNK):
        data = carry + chunk
        cut = data.rfind(b"\n") + 1 or len(data)
        carry = data[cut:]
        yield data[:cut]
    if carry:
        yield carry


def job_val_batches(dataset: TextDataset, train: TrainConfig) -> Iterator[tuple[Any, Any]]:
    """The validation batches stage 0 reads and sends down the chain (their targets for the
    last stage to score): fixed shape, at most ``val_batches``."""
    return dataset.val_batches(train.batch_size, max_batches=train.val_batches, drop_remainder=True)
