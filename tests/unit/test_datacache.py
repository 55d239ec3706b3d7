"""The data cache under a size: least recently used entries go first, what is in use stays."""

from __future__ import annotations

import os

from silentswarm.agent.runtime import datacache
from silentswarm.agent.runtime.data import TextDataset, job_dataset
from silentswarm.plan import TrainConfig


def test_prune_removes_the_least_recently_used_entries_whole(tmp_path):
    cache = tmp_path / "cache"
    (cache / "tokenizers").mkdir(parents=True)
    (cache / "datasets").mkdir()
    files = {
        "old": [cache / "aaa.json", cache / "aaa.tokens", cache / "aaa.lock"],
        "mid": [cache / "tokenizers" / "bbb.json"],
        "new": [cache / "datasets" / ("c" * 64)],
        "kept": [cache / "ddd.json", cache / "ddd.tokens"],
    }
    used = {"old": 700.0, "kept": 750.0, "mid": 800.0, "new": 900.0}
    for name, paths in files.items():
        for path in paths:
            path.write_bytes(b"x" * 100)
            os.utime(path, (used[name], used[name]))
    (cache / ".aaa.tokens.123.tmp").write_bytes(b"x" * 5000)  # a build under way: no entry
    # 700 bytes of entries; keep at most 350: "old" (the oldest, 300) goes, "kept" (older than
    # "mid" but in use) stays, "mid" goes, and 300 bytes are left.
    removed = datacache.prune(cache, keep=files["kept"][:1], limit=350)
    assert sorted(removed) == sorted(files["old"] + files["mid"])
    assert all(p.exists() for p in files["new"] + files["kept"])
    assert (cache / ".aaa.tokens.123.tmp").exists()
    assert datacache.prune(cache, keep=[], limit=None) == []


def test_a_dataset_prunes_the_cache_but_never_itself(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SWARM_DATA_CACHE_MAX_BYTES", "1")
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    one.write_text("first corpus " * 500)
    two.write_text("second corpus " * 500)
    first = TextDataset([str(one)], seq_len=8, seed=0, cache_dir=cache)
    assert first.cache_file is not None and first.cache_file.exists()
    second = job_dataset(TrainConfig(data=[str(two)]), 8, cache_dir=cache)
    assert second.cache_file is not None and second.cache_file.exists()
    assert not first.cache_file.exists(), "the older cache went to make room"
    assert bytes(first.tokens[:5]) == b"first", "a mapped cache stays readable once removed"
    monkeypatch.setenv("SWARM_DATA_CACHE_MAX_BYTES", "lots")
    assert datacache.max_bytes() is None


def test_marking_an_entry_used_keeps_its_mtime_to_the_nanosecond(tmp_path):
    path = tmp_path / "entry.tokens"
    path.write_bytes(b"x")
    os.utime(path, ns=(1, 1_234_567_891_123_456_789))
    datacache.touch([path])
    after = path.stat()
    assert after.st_mtime_ns == 1_234_567_891_123_456_789 and after.st_atime_ns > 1
