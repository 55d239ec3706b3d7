"""The token cache (memory-mapped, content-addressed, atomic) and JSONL sources, on real files
in tmp_path; the cache always goes to a directory of the test's own."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import numpy as np
import pytest

from silentswarm.agent.errors import DataError
from silentswarm.agent.runtime import data as data_module
from silentswarm.agent.runtime.data import (
    CACHE_ENV,
    TOKEN_DTYPE,
    TextDataset,
    default_cache_dir,
    job_dataset,
    token_dtype,
)
from silentswarm.errors import FieldError, JobSpecError
from silentswarm.jobspec import decode_job_spec
from silentswarm.plan import JsonlSource, TrainConfig
from silentswarm.types.manifests import DataInfo

REPO = Path(__file__).resolve().parents[2]


def _docs(n: int, seed: int = 0) -> list[str]:
    """Documents of varied length with non-ASCII text, quotes and newlines in them."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gämma", "δέλτα", 'say "hi"', "tab\tbed", "line\nbreak", "🙂"]
    return [" ".join(rng.choice(words, size=int(rng.integers(5, 60)))) for _ in range(n)]


def _write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": i, field: doc, "meta": {"n": [1, 2]}}) + "\n")
    return path


def _write_texts(directory: Path, docs: list[str]) -> Path:
    """One file per document, named so that they sort in document order."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (directory / f"{i:05d}.txt").write_bytes(doc.encode())
    return directory


def _assert_same_batches(a: TextDataset, b: TextDataset, steps: int = 30, batch: int = 8) -> None:
    for _ in range(steps):
        for xa, xb in zip(a.next_batch(batch), b.next_batch(batch), strict=True):
            np.testing.assert_array_equal(xa, xb)
    va, vb = list(a.val_batches(batch)), list(b.val_batches(batch))
    assert len(va) == len(vb) > 0
    for (xa, ya), (xb, yb) in zip(va, vb, strict=True):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
    assert a.state() == b.state()


def _cache_files(directory: Path, suffix: str = ".tokens") -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(suffix))


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return _write_texts(tmp_path / "corpus", _docs(40, seed=1))


# --- the cache ----------------------------------------------------------------------------------


def test_tokens_are_a_read_only_map_of_the_cache_file(corpus: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    ds = TextDataset([str(corpus)], seq_len=16, seed=0, cache_dir=cache)
    assert ds.cache_file is not None and ds.cache_file.parent == cache
    assert ds.tokens.dtype == TOKEN_DTYPE == np.uint8
    assert not ds.tokens.flags.writeable and not ds.tokens.flags.owndata
    assert ds.cache_file.read_bytes() == ds.tokens.tobytes()
    expected = b"\n".join(p.read_bytes() for p in sorted(corpus.iterdir()))
    assert ds.tokens.tobytes() == expected
    meta = json.loads(ds.cache_file.with_suffix(".json").read_text())
    assert meta["n_tokens"] == len(expected) and meta["tokenizer"] == "utf8-bytes"
    assert [Path(p) for p in meta["paths"]] == ds.paths
    x, _ = ds.next_batch(4)
    assert type(x) is np.ndarray and x.dtype == np.int32  # not a np.memmap leaking out


def test_the_cache_is_built_once_then_reused(corpus: Path, tmp_path: Path, caplog):
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="silentswarm.agent.runtime.data"):
        first = TextDataset([str(corpus)], seq_len=16, seed=3, cache_dir=cache)
    assert sum("built token cache" in r.getMessage() for r in caplog.records) == 1
    before = os.stat(first.cache_file)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="silentswarm.agent.runtime.data"):
        second = TextDataset([str(corpus / "*.txt")], seq_len=16, seed=3, cache_dir=cache)
    assert not any("built token cache" in r.getMessage() for r in caplog.records)
    after = os.stat(second.cache_file)
    assert second.cache_file == first.cache_file
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert len(_cache_files(cache)) == 1
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]
    assert second.paths == first.paths
    _assert_same_batches(first, second)


def test_a_changed_source_rebuilds(corpus: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    first = TextDataset([str(corpus)], seq_len=16, seed=0, cache_dir=cache)
    target = sorted(corpus.iterdir())[0]
    old = target.read_bytes()
    # The same size, other bytes, and a different mtime: a rebuild all the same.
    new = old.replace(b"a", b"A", 1) if b"a" in old else b"Z" + old[1:]
    assert len(new) == len(old) and new != old
    target.write_bytes(new)
    st = os.stat(target)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    second = TextDataset([str(corpus)], seq_len=16, seed=0, cache_dir=cache)
    assert second.cache_file != first.cache_file
    assert second.tokens.tobytes()[: len(new)] == new
    assert first.tokens.tobytes()[: len(old)] == old  # the first map is still the old text
    # A new file, and other max_bytes: new keys too.
    (corpus / "zzz.txt").write_bytes(b"appended " * 50)
    third = TextDataset([str(corpus)], seq_len=16, seed=0, cache_dir=cache)
    assert third.tokens.tobytes().endswith(b"\n" + b"appended " * 50)
    capped = TextDataset([str(corpus)], seq_len=16, seed=0, cache_dir=cache, max_bytes=2000)
    assert capped.n_tokens == 2000
    assert len(_cache_files(cache)) == 4


def test_a_damaged_or_half_written_cache_is_rebuilt(corpus: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    good = TextDataset([str(corpus)], seq_len=16, seed=0, cache_dir=cache)
    expected = good.tokens.tobytes()
    token_file, meta_file = good.cache_file, good.cache_file.with_suffix(".json")
    del good
    # Truncated tokens (a crash before the rename would never publish this; a copy might).
    token_file.write_bytes(expected[:100])
    assert TextDataset([str(corpus)], seq_len=16, seed=0, cache_dir=cache).tokens.tobytes() == (
        expected
    )
    # Tokens without metadata: never published, so built again.
    meta_file.unlink()
    assert TextDataset([str(corpus)], seq_len=16, seed=0, cache_dir=cache).tokens.tobytes() == (
        expected
    )
    meta_file.write_text("{not json")
    assert TextDataset([str(corpus)], seq_len=16, seed=0, cache_dir=cache).tokens.tobytes() == (
        expected
    )


_BUILDER = textwrap.dedent(
    """
    import hashlib, sys
    from silentswarm.agent.runtime.data import TextDataset
    ds = TextDataset([sys.argv[1]], seq_len=64, seed=0, cache_dir=sys.argv[2])
    print(ds.tokens_sha256(), ds.cache_file)
    """
)


def test_concurrent_builders_do_not_corrupt_the_cache(tmp_path: Path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    line = ("the quick brown fox jumps over the lazy dög " * 20 + "\n").encode()
    for i in range(6):
        (corpus / f"{i}.txt").write_bytes(line * 2500)  # ~2 MB each: the builds overlap
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILDER, str(corpus), str(cache)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for _ in range(4)
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.append(out.split())
    expected = b"\n".join(p.read_bytes() for p in sorted(corpus.iterdir()))
    here = TextDataset([str(corpus)], seq_len=64, seed=0, cache_dir=cache)
    assert here.tokens.tobytes() == expected
    assert {tuple(o) for o in outputs} == {(here.tokens_sha256(), str(here.cache_file))}
    assert len(_cache_files(cache)) == 1
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]


def test_cache_location_defaults(monkeypatch, tmp_path: Path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv(CACHE_ENV)
    assert default_cache_dir() == tmp_path / "xdg" / "silentswarm" / "tokens"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "silentswarm" / "tokens"


def test_the_env_var_places_the_cache_and_job_dataset_takes_a_directory(
    corpus: Path, tmp_path: Path, monkeypatch
):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "from-env"))
    train = TrainConfig(data=[str(corpus)], seed=4)
    by_env = job_dataset(train, 16)
    assert by_env.cache_file.parent == tmp_path / "from-env"
    given = job_dataset(train, 16, cache_dir=tmp_path / "given")
    assert given.cache_file.parent == tmp_path / "given"
    _assert_same_batches(by_env, given)


def test_an_unwritable_cache_directory_still_maps_a_temporary_file(
    corpus: Path, tmp_path: Path, caplog
):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="silentswarm.agent.runtime.data"):
        ds = TextDataset([str(corpus)], seq_len=16, seed=0, cache_dir=blocker / "cache")
    assert ds.cache_file is None
    assert any("cannot write the token cache" in r.getMessage() for r in caplog.records)
    reference = TextDataset([str(corpus)], seq_len=16, seed=0, cache_dir=tmp_path / "ok")
    _assert_same_batches(ds, reference)


def test_invalid_utf8_after_the_first_chunk_is_skipped_and_taken_back(tmp_path: Path):
    # The bad byte lies past the first chunk, which was already written when it is found.
    _write_texts(tmp_path / "c", [])
    (tmp_path / "c" / "a.txt").write_bytes(b"A" * 500)
    (tmp_path / "c" / "b.txt").write_bytes(b"b" * (data_module._CHUNK + 10) + b"\xff" + b"b" * 9)
    (tmp_path / "c" / "c.txt").write_bytes("ç".encode() * 300)
    ds = TextDataset([str(tmp_path / "c")], seq_len=8, seed=0, cache_dir=tmp_path / "cache")
    assert ds.tokens.tobytes() == b"A" * 500 + b"\n" + "ç".encode() * 300
    assert [p.name for p in ds.paths] == ["a.txt", "c.txt"]
    # A multi-byte character cut by a chunk boundary is valid.
    (tmp_path / "d").mkdir()
    cut = b"x" * (data_module._CHUNK - 1) + "é".encode() + b"y" * 100
    (tmp_path / "d" / "cut.txt").write_bytes(cut)
    ds = TextDataset([str(tmp_path / "d")], seq_len=8, seed=0, cache_dir=tmp_path / "cache")
    assert ds.tokens.tobytes() == cut


def test_token_dtype_follows_the_vocabulary():
    assert token_dtype(256) == np.uint8
    assert token_dtype(257) == token_dtype(65536) == np.uint16
    assert token_dtype(65537) == token_dtype(2**22) == np.uint32
    with pytest.raises(ValueError):
        token_dtype(0)


def test_entropy_and_hash_read_the_map_in_chunks(corpus: Path, tmp_path: Path, monkeypatch):
    import hashlib

    ds = TextDataset([str(corpus)], seq_len=16, seed=0, cache_dir=tmp_path / "cache")
    whole = ds.tokens.tobytes()
    counts = np.bincount(np.frombuffer(whole[: ds.val_start], np.uint8), minlength=256)
    p = counts[counts > 0] / counts.sum()
    expected = float(-(p * np.log(p)).sum())
    assert hashlib.sha256(whole).hexdigest() == ds.tokens_sha256()
    monkeypatch.setattr(data_module, "_SCAN", 777)  # many chunks, one not full
    assert ds.unigram_entropy_nats() == pytest.approx(expected, rel=1e-12)
    assert 0 < expected < math.log(256)
    assert hashlib.sha256(whole).hexdigest() == ds.tokens_sha256()


# --- JSONL --------------------------------------------------------------------------------------


def test_jsonl_gives_the_same_tokens_and_batches_as_text_files(tmp_path: Path):
    docs = _docs(120, seed=5)
    texts = _write_texts(tmp_path / "texts", docs)
    half = len(docs) // 2
    _write_jsonl(tmp_path / "j" / "part-0.jsonl", docs[:half], field="body")
    _write_jsonl(tmp_path / "j" / "part-1.jsonl", docs[half:], field="body")
    cache = tmp_path / "cache"
    kw = dict(seq_len=16, seed=9, val_fraction=0.1, cache_dir=cache)
    plain = TextDataset([str(texts)], **kw)
    jsonl = TextDataset([JsonlSource(jsonl=str(tmp_path / "j" / "*.jsonl"), field="body")], **kw)
    assert jsonl.tokens.tobytes() == "\n".join(docs).encode() == plain.tokens.tobytes()
    assert [p.name for p in jsonl.paths] == ["part-0.jsonl", "part-1.jsonl"]
    assert jsonl.cache_file != plain.cache_file  # other sources, another key
    _assert_same_batches(plain, jsonl)
    assert jsonl.unigram_entropy_nats() == plain.unigram_entropy_nats()
    # max_bytes cuts the JSONL stream as it cuts the text one.
    capped = dict(kw, max_bytes=3000)
    a = TextDataset([str(texts)], **capped)
    b = TextDataset([JsonlSource(jsonl=str(tmp_path / "j"), field="body")], **capped)
    assert a.tokens.tobytes() == b.tokens.tobytes() and b.n_tokens == 3000
    assert [p.name for p in b.paths] == ["part-0.jsonl"]


def test_text_and_jsonl_sources_mix_in_path_order(tmp_path: Path):
    _write_jsonl(tmp_path / "b.jsonl", ["first doc", "", "third doc"])
    (tmp_path / "b.jsonl").write_text((tmp_path / "b.jsonl").read_text() + "\n   \n")
    (tmp_path / "a.txt").write_text("a text file " * 20)
    (tmp_path / "c.txt").write_text("another one " * 20)
    data = [str(tmp_path / "*.txt"), JsonlSource(jsonl=str(tmp_path / "b.jsonl"))]
    ds = TextDataset(data, seq_len=8, seed=0, cache_dir=tmp_path / "cache")
    # Blank lines are no documents; an empty string is an (empty) document.
    expected = ("a text file " * 20) + "\nfirst doc\n\nthird doc\n" + ("another one " * 20)
    assert ds.tokens.tobytes() == expected.encode()
    assert [p.name for p in ds.paths] == ["a.txt", "b.jsonl", "c.txt"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"text": "ok", ', r"line 3: not valid JSON"),
        ('["text", "a list"]', r"line 3: not a JSON object"),
        ('{"body": "the wrong field"}', r"line 3: no field 'text'"),
        ('{"text": 12}', r"line 3: field 'text' is int, not a string"),
        ('{"text": null}', r"line 3: field 'text' is null, not a string"),
    ],
)
def test_a_bad_jsonl_line_is_an_error_naming_file_and_line(tmp_path: Path, line, message):
    path = tmp_path / "dump.jsonl"
    good = json.dumps({"text": "a good document " * 10})
    path.write_text(f"{good}\n{good}\n{line}\n{good}\n")
    with pytest.raises(DataError, match=rf"{path}, {message}"):
        TextDataset([JsonlSource(jsonl=str(path))], seq_len=8, seed=0, cache_dir=tmp_path / "c")
    # Nothing was published for the failed build.
    assert not (tmp_path / "c").exists() or not _cache_files(tmp_path / "c", ".json")


def test_a_jsonl_line_past_the_limit_is_refused_before_it_is_read_whole(tmp_path, monkeypatch):
    """A file with no newlines would be one line read into memory whole: refused, naming it."""
    monkeypatch.setattr(data_module, "JSONL_LINE_MAX", 1000)
    path = tmp_path / "dump.jsonl"
    fits = json.dumps({"text": "x" * 900})
    path.write_text(f"{fits}\n" + json.dumps({"text": "y" * 5000}) + "\n")
    with pytest.raises(DataError, match=rf"{path}, line 2: longer than 0 MiB"):
        TextDataset([JsonlSource(jsonl=str(path))], seq_len=8, seed=0, cache_dir=tmp_path / "c")
    path.write_text(f"{fits}\n{fits}")  # a last line without its newline still reads
    built = TextDataset([JsonlSource(jsonl=str(path))], seq_len=8, seed=0, cache_dir=tmp_path / "d")
    assert built.tokens.size > 1800


def test_jsonl_that_is_not_utf8_or_matches_nothing(tmp_path: Path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"line 2: not valid JSON"):
        TextDataset([JsonlSource(jsonl=str(path))], seq_len=2, seed=0, cache_dir=tmp_path / "c")
    with pytest.raises(DataError, match=r"no files match '.*nothing\*\.jsonl'"):
        TextDataset(
            [JsonlSource(jsonl=str(tmp_path / "nothing*.jsonl"))],
            seq_len=2,
            seed=0,
            cache_dir=tmp_path / "c",
        )


# --- the job spec -------------------------------------------------------------------------------


def test_job_spec_data_takes_strings_and_jsonl_sources():
    spec = decode_job_spec(
        b'{"data": ["stdlib", {"jsonl": "dumps/*.jsonl", "field": "content"}, {"jsonl": "x"}]}'
    )
    assert spec.data == [
        "stdlib",
        JsonlSource(jsonl="dumps/*.jsonl", field="content"),
        JsonlSource(jsonl="x", field="text"),
    ]
    train = TrainConfig(data=spec.data)
    again = msgspec.json.decode(msgspec.json.encode(train), type=TrainConfig)
    assert again == train
    info = DataInfo(
        patterns=list(train.data),
        override=False,
        n_tokens=1,
        sha256="0",
        batch_size=1,
        val_batches=0,
    )
    assert msgspec.json.decode(msgspec.json.encode(info), type=DataInfo) == info


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"data": [{"jsonl": "a.jsonl", "field": ""}]}', "data[0].field"),
        (b'{"data": ["x", {"jsonl": ""}]}', "data[1].jsonl"),
        (b'{"data": [{"jsonl": "a.jsonl", "fields": "text"}]}', "data[0].fields"),
        (b'{"data": [{"field": "text"}]}', "data[0]"),
        (b'{"data": [3]}', "data[0]"),
    ],
)
def test_a_bad_data_entry_names_its_field(body: bytes, field: str):
    with pytest.raises(FieldError) as err:
        decode_job_spec(body)
    assert err.value.field == field, err.value


def test_blank_names_are_problems_that_name_the_entry():
    with pytest.raises(JobSpecError, match=r"data\[1\]\.field must name a JSON field"):
        decode_job_spec(b'{"data": ["x", {"jsonl": "a.jsonl", "field": "  "}]}')
    with pytest.raises(JobSpecError, match=r"data\[0\] must be a path or glob"):
        decode_job_spec(b'{"data": ["  "]}')
    train = TrainConfig(data=[JsonlSource(jsonl="a", field=" ")])
    assert train.problems() == ["train.data[0].field must name a JSON field"]
