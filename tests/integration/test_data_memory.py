"""The loader streams and memory-maps: a corpus four times larger than the anonymous memory
it may use is tokenised, trained on and validated in a process without TensorFlow."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
MB = 1 << 20
CORPUS_MB = 200
ALLOWANCE_MB = 50

_LOADER = textwrap.dedent(
    """
    import json, sys, threading, time

    def rss_anon_kb():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
        raise RuntimeError("no RssAnon")

    peak = [rss_anon_kb()]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon_kb())
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()

    from silentswarm.agent.runtime.data import TextDataset
    from silentswarm.plan import JsonlSource

    corpus, cache = sys.argv[1], sys.argv[2]
    data = [corpus + "/text", JsonlSource(jsonl=corpus + "/docs.jsonl", field="text")]
    ds = TextDataset(data, seq_len=256, seed=0, val_fraction=0.02, cache_dir=cache)
    built = rss_anon_kb()
    checksum = 0
    for _ in range(3000):
        x, y = ds.next_batch(16)
        checksum += int(x[:, 0].sum())
    n_val = 0
    for x, y in ds.val_batches(16):
        n_val += len(x)
    entropy = ds.unigram_entropy_nats()
    digest = ds.tokens_sha256()
    after = rss_anon_kb()
    done.set()
    print(json.dumps({
        "tensorflow": "tensorflow" in sys.modules,
        "n_tokens": ds.n_tokens, "n_val": n_val, "num_val": ds.num_val_windows,
        "peak_kb": max(peak[0], after), "built_kb": built, "after_kb": after,
        "entropy": entropy, "digest": digest, "files": len(ds.paths),
    }))
    """
)


def _write_corpus(root: Path) -> int:
    """~200 MB: 48 text files of 4 MiB and a JSONL file of ~8 MiB, varied lines of UTF-8."""
    rng = np.random.default_rng(0)
    words = np.array(["the", "pipeline", "stage", "gradient", "naïve", "δ", "token", "swarm"])
    lines = [" ".join(rng.choice(words, size=int(rng.integers(3, 20)))) + "\n" for _ in range(4000)]
    (root / "text").mkdir(parents=True)
    total = 0
    for i in range(48):
        piece = "".join(lines[i:] + lines[:i]).encode()  # whole lines: valid UTF-8
        with (root / "text" / f"{i:03d}.txt").open("wb") as f:
            for _ in range(4 * MB // len(piece)):
                f.write(piece)
        total += (root / "text" / f"{i:03d}.txt").stat().st_size
    with (root / "docs.jsonl").open("w", encoding="utf-8") as f:
        while f.tell() < 8 * MB:
            f.write(json.dumps({"id": 1, "text": "".join(lines[:50])}) + "\n")
    return total + (root / "docs.jsonl").stat().st_size


@pytest.mark.timeout(300)
def test_a_corpus_four_times_the_allowance_streams_through_a_map(tmp_path: Path):
    corpus = tmp_path / "corpus"
    size = _write_corpus(corpus)
    assert size >= 4 * ALLOWANCE_MB * MB * 0.95
    out = subprocess.run(
        [sys.executable, "-c", _LOADER, str(corpus), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    print(report)
    assert report["tensorflow"] is False
    assert report["n_tokens"] > size * 0.97  # all of it, JSON escapes aside
    assert report["files"] == 49
    assert report["n_val"] == report["num_val"] > 100
    assert report["peak_kb"] < ALLOWANCE_MB * 1024, str(report)
    assert report["after_kb"] < ALLOWANCE_MB * 1024, report
    assert (tmp_path / "cache").is_dir()
