"""The byte-level text loader on real files: tmp_path corpora and the real stdlib sources."""

from __future__ import annotations

import logging
import math
import string
from pathlib import Path

import numpy as np
import pytest

from silentswarm.agent.errors import DataError
from silentswarm.agent.runtime.data import (
    DEFAULT_CORPUS,
    DataState,
    TextDataset,
    default_corpus_paths,
    resolve_paths,
)


def _text(n: int, seed: int = 0) -> bytes:
    """Random ASCII letters: every window of a few bytes is distinguishable from the others."""
    alphabet = np.frombuffer(string.ascii_letters.encode(), dtype=np.uint8)
    return np.random.default_rng(seed).choice(alphabet, size=n).tobytes()


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    _write(tmp_path / "a.txt", _text(3000, seed=1))
    _write(tmp_path / "b.txt", _text(2000, seed=2))
    return tmp_path


def _batches(ds: TextDataset, n: int, batch_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [ds.next_batch(batch_size) for _ in range(n)]


def _assert_same(a, b) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)


def _expected(ds: TextDataset, offsets: np.ndarray) -> np.ndarray:
    return np.stack([ds.tokens[o : o + ds.seq_len] for o in offsets]).astype(np.int32)


# --- the default corpus -------------------------------------------------------------------------


def test_default_corpus_is_real_python_text():
    paths = default_corpus_paths()
    assert len(paths) > 50
    assert paths == sorted(paths)
    assert all(p.endswith(".py") and Path(p).is_file() for p in paths)
    sample = b"".join(Path(p).read_bytes() for p in paths[:20])
    assert b"def " in sample and b"import " in sample
    assert resolve_paths([DEFAULT_CORPUS]) == [Path(p) for p in paths]


def test_default_corpus_dataset_with_max_bytes():
    ds = TextDataset([DEFAULT_CORPUS], seq_len=64, seed=0, max_bytes=200_000)
    assert ds.n_tokens == 200_000
    assert ds.num_train_windows == (190_000 - 1) // 64
    x, y = ds.next_batch(4)
    assert x.shape == y.shape == (4, 64)
    # Python source: the byte distribution is far from uniform, but far from trivial too.
    assert 3.0 < ds.unigram_entropy_nats() < math.log(256)


# --- resolving paths ----------------------------------------------------------------------------


def test_files_directories_globs_and_dedupe(tmp_path: Path):
    a = _write(tmp_path / "a.txt", b"alpha")
    b = _write(tmp_path / "sub" / "b.txt", b"beta")
    c = _write(tmp_path / "sub" / "deep" / "c.md", b"gamma")
    assert resolve_paths([str(a)]) == [a]
    assert resolve_paths([str(tmp_path / "sub")]) == [b, c]
    assert resolve_paths([str(tmp_path / "**" / "*.txt")]) == [a, b]
    assert resolve_paths([str(tmp_path / "*.txt")]) == [a]
    # Overlapping patterns name each file once, in sorted order.
    both = resolve_paths([str(c), str(tmp_path), str(tmp_path / "**" / "*"), str(a)])
    assert both == [a, b, c]


def test_relative_paths_are_made_absolute_and_deduplicated(tmp_path: Path, monkeypatch):
    a = _write(tmp_path / "a.txt", b"alpha")
    monkeypatch.chdir(tmp_path)
    assert resolve_paths(["a.txt", "./a.txt", str(a)]) == [a]


def test_no_match_names_the_pattern(tmp_path: Path):
    _write(tmp_path / "a.txt", b"alpha")
    missing = str(tmp_path / "nope" / "*.txt")
    with pytest.raises(DataError, match=r"no files match '.*nope/\*\.txt'"):
        resolve_paths([str(tmp_path / "a.txt"), missing])
    with pytest.raises(DataError, match="no files match"):
        resolve_paths([str(tmp_path / "absent.txt")])
    with pytest.raises(DataError, match="no files match"):
        resolve_paths([str(_empty_dir(tmp_path))])


def _empty_dir(tmp_path: Path) -> Path:
    d = tmp_path / "empty"
    d.mkdir()
    return d


def test_non_utf8_files_are_skipped_with_a_warning(tmp_path: Path, caplog):
    good = _write(tmp_path / "good.txt", "héllo wörld\n".encode())
    bad = _write(tmp_path / "bad.bin", b"\xff\xfe\x00binary\x80")
    with caplog.at_level(logging.WARNING, logger="silentswarm.agent.runtime.data"):
        assert resolve_paths([str(tmp_path)]) == [good]
    assert any(str(bad) in r.getMessage() and "UTF-8" in r.getMessage() for r in caplog.records)
    with pytest.raises(DataError, match="no valid UTF-8"):
        resolve_paths([str(bad)])


def test_dataset_skips_non_utf8_files(tmp_path: Path):
    _write(tmp_path / "a.txt", b"A" * 500)
    _write(tmp_path / "b.bin", b"\xff" * 500)
    _write(tmp_path / "c.txt", b"C" * 500)
    ds = TextDataset([str(tmp_path)], seq_len=8, seed=0)
    assert ds.tokens.tobytes() == b"A" * 500 + b"\n" + b"C" * 500
    assert [p.name for p in ds.paths] == ["a.txt", "c.txt"]


# --- batches ------------------------------------------------------------------------------------


def test_two_instances_yield_identical_batches(corpus: Path):
    kw = dict(seq_len=16, seed=7)
    a = _batches(TextDataset([str(corpus)], **kw), 40, 8)
    b = _batches(TextDataset([str(corpus / "*.txt")], **kw), 40, 8)
    _assert_same(a, b)


def test_different_seeds_give_different_orders(corpus: Path):
    a = TextDataset([str(corpus)], seq_len=16, seed=1)
    b = TextDataset([str(corpus)], seq_len=16, seed=2)
    assert not np.array_equal(a.next_batch(8)[0], b.next_batch(8)[0])
    assert sorted(a.train_window_offsets(0)) == sorted(b.train_window_offsets(0))


def test_targets_are_inputs_shifted_by_one(corpus: Path):
    ds = TextDataset([str(corpus)], seq_len=16, seed=0)
    offsets = ds.train_window_offsets(0)[:8]
    x, y = ds.next_batch(8)
    assert x.dtype == y.dtype == np.int32
    assert x.shape == y.shape == (8, 16)
    assert x.min() >= 0 and x.max() < 256 and y.max() < 256
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    np.testing.assert_array_equal(x, _expected(ds, offsets))
    np.testing.assert_array_equal(y, _expected(ds, offsets + 1))


def test_files_are_joined_with_a_newline_and_truncated(corpus: Path):
    ds = TextDataset([str(corpus)], seq_len=16, seed=0)
    whole = (corpus / "a.txt").read_bytes() + b"\n" + (corpus / "b.txt").read_bytes()
    assert ds.tokens.tobytes() == whole
    assert ds.n_tokens == 5001
    short = TextDataset([str(corpus)], seq_len=16, seed=0, max_bytes=3500)
    assert short.tokens.tobytes() == whole[:3500]
    # Stops reading once max_bytes is covered: b.txt is not needed for the first 1000 bytes.
    assert [
        p.name for p in TextDataset([str(corpus)], seq_len=16, seed=0, max_bytes=1000).paths
    ] == ["a.txt"]


# --- train / validation split -------------------------------------------------------------------


def test_train_and_val_do_not_overlap(corpus: Path):
    ds = TextDataset([str(corpus)], seq_len=16, seed=0, val_fraction=0.1)
    assert ds.val_start == ds.n_tokens - int(ds.n_tokens * 0.1)
    train = ds.train_window_offsets(0)
    val = ds.val_window_offsets()
    window = ds.seq_len + 1
    # Every token a training window touches (inputs and targets) lies before val_start; every
    # validation window lies in [val_start, n_tokens).
    assert train.min() == 0 and train.max() + window <= ds.val_start
    assert val.min() == ds.val_start and val.max() + window <= ds.n_tokens
    assert len(train) == ds.num_train_windows and len(val) == ds.num_val_windows
    assert len(set(train.tolist())) == len(train)
    # Non-overlapping inputs: consecutive windows start seq_len apart.
    assert set(np.diff(np.sort(train)).tolist()) == {ds.seq_len}
    assert set(np.diff(val).tolist()) == {ds.seq_len}


def test_val_batches_are_deterministic_and_in_order(corpus: Path):
    ds = TextDataset([str(corpus)], seq_len=16, seed=0, val_fraction=0.1)
    assert ds.num_val_windows == (500 - 1) // 16 == 31
    ds.next_batch(5)  # training position does not affect validation
    batches = list(ds.val_batches(8))
    assert [len(x) for x, _ in batches] == [8, 8, 8, 7]
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    np.testing.assert_array_equal(x, _expected(ds, ds.val_window_offsets()))
    np.testing.assert_array_equal(y, _expected(ds, ds.val_window_offsets() + 1))
    _assert_same(batches, list(ds.val_batches(8)))
    other = TextDataset([str(corpus)], seq_len=16, seed=99, val_fraction=0.1)
    _assert_same(batches, list(other.val_batches(8)))
    assert len(list(ds.val_batches(8, max_batches=2))) == 2
    assert [len(x) for x, _ in ds.val_batches(8, drop_remainder=True)] == [8, 8, 8]


# --- position, epochs ---------------------------------------------------------------------------


def test_restore_reproduces_the_following_batches_across_an_epoch(corpus: Path):
    ds = TextDataset([str(corpus)], seq_len=64, seed=3)
    n = ds.num_train_windows
    assert n == (4751 - 1) // 64 == 74
    _batches(ds, 6, 10)  # 60 windows in: the next batches cross into epoch 1
    saved = ds.state()
    assert saved == DataState(epoch=0, index=60)
    after = _batches(ds, 5, 10)
    assert ds.state().epoch == 1

    ds.restore(saved)
    _assert_same(after, _batches(ds, 5, 10))

    fresh = TextDataset([str(corpus)], seq_len=64, seed=3)
    fresh.restore(saved)
    _assert_same(after, _batches(fresh, 5, 10))


def test_epoch_wrap_uses_a_new_permutation_covering_all_windows(corpus: Path):
    ds = TextDataset([str(corpus)], seq_len=64, seed=5)
    n = ds.num_train_windows
    batch = 7  # does not divide n, so batches straddle epoch boundaries
    total = 3 * n + 5
    x = np.concatenate([ds.next_batch(batch)[0] for _ in range(-(-total // batch))])
    orders = [ds.train_window_offsets(e) for e in range(4)]
    expected_offsets = np.concatenate(orders)[: len(x)]
    np.testing.assert_array_equal(x, _expected(ds, expected_offsets))
    everything = np.arange(n) * ds.seq_len
    for order in orders:
        np.testing.assert_array_equal(np.sort(order), everything)
    assert not np.array_equal(orders[0], orders[1])
    assert ds.state() == DataState(epoch=3, index=len(x) - 3 * n)


def test_used_up_epoch_reports_as_the_next_and_restore_accepts_both(corpus: Path):
    ds = TextDataset([str(corpus)], seq_len=64, seed=0)
    n = ds.num_train_windows
    ds.next_batch(n)
    assert ds.state() == DataState(epoch=1, index=0)
    nxt = ds.next_batch(3)
    ds.restore(DataState(epoch=0, index=n))
    _assert_same([nxt], [ds.next_batch(3)])
    with pytest.raises(ValueError, match="invalid data state"):
        ds.restore(DataState(epoch=0, index=n + 1))


# --- too little text, entropy -------------------------------------------------------------------


def test_tiny_text_is_an_error_with_the_sizes(tmp_path: Path):
    _write(tmp_path / "tiny.txt", b"x" * 100)
    with pytest.raises(DataError, match=r"100 tokens give 95 training and 5 validation"):
        TextDataset([str(tmp_path)], seq_len=16, seed=0)
    with pytest.raises(DataError, match=r"seq_len=200"):
        TextDataset([str(tmp_path)], seq_len=200, seed=0, val_fraction=0.5)


def test_unigram_entropy_of_two_equally_frequent_bytes_is_ln2(tmp_path: Path):
    # One file, so no separator is added; 2000 tokens with val_fraction 0.05 leave exactly the
    # first 1900 for training, which hold 950 of each byte: the entropy is exactly ln 2.
    _write(tmp_path / "ab.txt", b"ab" * 1000)
    ds = TextDataset([str(tmp_path)], seq_len=8, seed=0, val_fraction=0.05)
    assert ds.val_start == 1900
    assert ds.unigram_entropy_nats() == pytest.approx(math.log(2), abs=1e-12)

    _write(tmp_path / "one" / "a.txt", b"a" * 1000)
    assert TextDataset([str(tmp_path / "one")], seq_len=8, seed=0).unigram_entropy_nats() == 0.0


def test_a_capped_validation_spreads_over_the_whole_split(tmp_path):
    text = "".join(f"line {i:05d} of a long file\n" for i in range(4000))
    (tmp_path / "a.txt").write_text(text)
    data = TextDataset([str(tmp_path / "a.txt")], seq_len=16, seed=0, val_fraction=0.2)
    everything = data.val_window_offsets()
    batches = list(data.val_batches(4, max_batches=3))
    assert [len(inputs) for inputs, _ in batches] == [4, 4, 4]
    seen = np.concatenate([inputs for inputs, _ in batches])
    full = np.concatenate([inputs for inputs, _ in data.val_batches(4)])
    # spread evenly: the first and the very last window of the split are both measured
    assert (seen[0] == full[0]).all() and (seen[-1] == full[len(everything) - 1]).all()
