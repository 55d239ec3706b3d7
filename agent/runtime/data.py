"""Byte-level text data: files to one token array, deterministic training windows, a held-out
validation split, and a position that can be reported and restored.

A token is one byte of the UTF-8 file content (vocab 256), so no tokenizer is ever downloaded.
Everything here is numpy and the standard library: no TensorFlow, so it is cheap to import.

Only stage 0 of a pipeline builds a ``TextDataset``: it feeds the inputs of a batch, and the
targets travel down the chain with the activations (in every forward frame,
:mod:`silentswarm.agent.pipe.wire`) to the last stage, which scores them; the stages after stage
0 open no data file. Batches are still deterministic, all randomness coming from
``np.random.default_rng((seed, epoch))`` and nothing else: a one-process reference, a resumed
run and glue (which reads the validation batches again) see exactly the batches the pipeline
saw.
"""

from __future__ import annotations

import glob
import logging
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from silentswarm.agent.errors import DataError

if TYPE_CHECKING:
    from silentswarm.plan import TrainConfig

__all__ = [
    "DEFAULT_CORPUS",
    "TOKENIZER",
    "VOCAB_SIZE",
    "DataState",
    "TextDataset",
    "default_corpus_paths",
    "resolve_paths",
]

log = logging.getLogger(__name__)

DEFAULT_CORPUS = "stdlib"
"""Sentinel pattern: the top-level ``*.py`` files of the Python standard library."""

VOCAB_SIZE = 256
TOKENIZER = "utf8-bytes"
"""The tokenizer every stage assumes (one token per byte, :data:`VOCAB_SIZE` of them): the
stages' handshake compares it, since only stage 0 tokenises anything."""
_SEPARATOR = b"\n"


@dataclass(frozen=True)
class DataState:
    """A training position: ``index`` is the next window within ``epoch``'s permutation."""

    epoch: int
    index: int


def default_corpus_paths() -> list[str]:
    """The standard library's top-level ``.py`` files, sorted.

    Real text (about 170 files, a few MB) that exists on every machine with Python, so a job
    can train on something meaningful without a download.
    """
    stdlib = sysconfig.get_paths()["stdlib"]
    return sorted(glob.glob(os.path.join(glob.escape(stdlib), "*.py")))


def _files_below(directory: str) -> list[str]:
    found = []
    for root, _dirs, files in os.walk(directory):
        found.extend(os.path.join(root, name) for name in files)
    return [f for f in found if os.path.isfile(f)]


def _expand(pattern: str) -> list[str]:
    if pattern == DEFAULT_CORPUS:
        return default_corpus_paths()
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


def _candidates(patterns: Sequence[str]) -> list[Path]:
    """All files the patterns name, sorted and de-duplicated, not yet checked for UTF-8."""
    if isinstance(patterns, str):
        raise TypeError("patterns must be a sequence of strings, not a single string")
    if not patterns:
        raise DataError("no file patterns given")
    seen: set[str] = set()
    for pattern in patterns:
        files = _expand(pattern)
        if not files:
            raise DataError(f"no files match {pattern!r}")
        seen.update(os.path.abspath(f) for f in files)
    return [Path(p) for p in sorted(seen)]


def _read_text_bytes(path: Path) -> bytes | None:
    """The file's bytes, or None (with a warning) when it is not valid UTF-8."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        log.warning("skipping %s: not valid UTF-8 (%s)", path, exc)
        return None
    return data


def resolve_paths(patterns: Sequence[str]) -> list[Path]:
    """Expand file paths, directories (recursively) and globs (``**`` allowed) to text files.

    ``"stdlib"`` expands to :func:`default_corpus_paths`. The result is sorted and de-duplicated
    (by absolute path). A pattern that matches nothing raises :class:`DataError`; files that are
    not valid UTF-8 are skipped with a logged warning, unless none is left.
    """
    paths = [p for p in _candidates(patterns) if _read_text_bytes(p) is not None]
    if not paths:
        raise DataError(f"no valid UTF-8 text files among {list(patterns)!r}")
    return paths


def _load_tokens(patterns: Sequence[str], max_bytes: int | None) -> tuple[np.ndarray, list[Path]]:
    """Concatenate the valid files with a separator; stop reading once ``max_bytes`` is reached."""
    chunks: list[bytes] = []
    used: list[Path] = []
    total = 0
    for path in _candidates(patterns):
        if max_bytes is not None and total >= max_bytes:
            break
        data = _read_text_bytes(path)
        if data is None:
            continue
        total += len(data) + (len(_SEPARATOR) if chunks else 0)
        chunks.append(data)
        used.append(path)
    if not chunks:
        raise DataError(f"no valid UTF-8 text files among {list(patterns)!r}")
    joined = _SEPARATOR.join(chunks)
    if max_bytes is not None:
        joined = joined[:max_bytes]
    # frombuffer over immutable bytes gives a read-only array: nothing can corrupt the corpus.
    return np.frombuffer(joined, dtype=np.uint8), used


class TextDataset:
    """Byte tokens from text files, cut into windows of ``seq_len + 1`` (inputs and targets).

    The last ``val_fraction`` of the tokens is the validation split, the rest is training, so the
    two never overlap. Training windows start at ``0, seq_len, 2 * seq_len, ...`` (non-overlapping
    inputs) and are visited in a permutation drawn from ``np.random.default_rng((seed, epoch))``.
    """

    def __init__(
        self,
        patterns: Sequence[str],
        *,
        seq_len: int,
        seed: int,
        val_fraction: float = 0.05,
        max_bytes: int | None = None,
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
        self._tokens, self.paths = _load_tokens(patterns, max_bytes)

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
        self._offsets = np.arange(self._num_train, dtype=np.int64) * seq_len
        self._window = np.arange(seq_len + 1, dtype=np.int64)
        self._epoch = 0
        self._index = 0
        self._perm_epoch = -1
        self._perm = self._offsets

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
        """The whole corpus as a read-only uint8 array."""
        return self._tokens

    def train_window_offsets(self, epoch: int) -> np.ndarray:
        """Start offsets (into :attr:`tokens`) of the training windows, in ``epoch``'s order."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        return np.random.default_rng((self.seed, epoch)).permutation(self._offsets)

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
        """Entropy (nats) of the training split's byte frequencies.

        This is the loss of a model that learned only how often each byte occurs, the baseline
        a trained model must beat.
        """
        counts = np.bincount(self._train, minlength=VOCAB_SIZE)
        p = counts[counts > 0] / len(self._train)
        return float(-(p * np.log(p)).sum()) + 0.0  # + 0.0 turns -0.0 into 0.0

    def __repr__(self) -> str:
        return (
            f"TextDataset({len(self.paths)} files, {self.n_tokens} tokens, seq_len={self.seq_len}, "
            f"train_windows={self._num_train}, val_windows={self._num_val}, seed={self.seed})"
        )


def job_dataset(train: TrainConfig, seq_len: int, patterns: list[str] | None = None) -> TextDataset:
    """The dataset stage 0 of a job reads (and glue, to score the same validation)."""
    return TextDataset(
        patterns if patterns else list(train.data),
        seq_len=seq_len,
        seed=train.seed,
        val_fraction=train.val_fraction,
        max_bytes=train.max_data_bytes,
    )


def job_val_batches(dataset: TextDataset, train: TrainConfig) -> Iterator[tuple[Any, Any]]:
    """The validation batches stage 0 reads and sends down the chain (their targets for the
    last stage to score): fixed shape, at most ``val_batches``."""
    return dataset.val_batches(train.batch_size, max_batches=train.val_batches, drop_remainder=True)
