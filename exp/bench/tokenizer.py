"""How fast stage 0 turns a corpus into tokens: bytes against a BPE trained on it.

    python exp/bench/tokenizer.py [--mb 32] [--vocab 4096 16384]    # ~1 minute here
    python exp/bench/tokenizer.py --quick                           # a smoke run

The corpus is the standard library's top-level sources repeated up to ``--mb`` MB, in files of
about 1 MB (real code, the same on every machine). Each arm starts from an empty data cache:
``byte`` builds the token cache; each ``bpe_<vocab>`` trains the tokenizer on the first
``train_bytes`` (the spec's default, or all of a smaller corpus) and builds the cache with it.
Printed as one JSON line: ``{"bench": "tokenizer", "corpus_bytes", "arms": {name: {"seconds",
"train_s", "encode_mb_per_s", "tokens", "bytes_per_token"}}}``. No TensorFlow.
"""

from __future__ import annotations

import argparse
import sysconfig
import tempfile
import time
from pathlib import Path

from _common import emit, load_avg  # puts the repo on sys.path

from silentswarm.agent.runtime.data import TextDataset, job_tokenizer
from silentswarm.plan import TokenizerConfig, TrainConfig


def write_corpus(directory: Path, n_bytes: int) -> list[str]:
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text = b"\n".join(p.read_bytes() for p in sources)
    directory.mkdir(parents=True)
    written, i = 0, 0
    while written < n_bytes:
        part = text[(i * 1_000_000) % len(text) :][: min(1_000_000, n_bytes - written)]
        (directory / f"part-{i:04d}.txt").write_bytes(part.decode("utf-8", "ignore").encode())
        written += len(part)
        i += 1
    return [str(directory / "*.txt")]


def arm(patterns: list[str], cache: Path, vocab: int | None) -> dict[str, float]:
    kind = "byte" if vocab is None else "bpe"
    train = TrainConfig(data=patterns, tokenizer=TokenizerConfig(kind=kind))
    started = time.perf_counter()
    tokenizer = job_tokenizer(train, vocab or 256, cache_dir=cache)
    trained = time.perf_counter()
    dataset = TextDataset(patterns, seq_len=64, seed=0, cache_dir=cache, tokenizer=tokenizer)
    done = time.perf_counter()
    text_bytes = sum(Path(p).stat().st_size for p in dataset.paths)
    return {
        "seconds": round(done - started, 3),
        "train_s": round(trained - started, 3),
        "encode_mb_per_s": round(text_bytes / 1e6 / max(done - trained, 1e-9), 2),
        "tokens": dataset.n_tokens,
        "bytes_per_token": round(text_bytes / max(dataset.n_tokens, 1), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=32.0, help="corpus size in MB")
    parser.add_argument("--vocab", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    mb, vocabs = (2.0, [512]) if args.quick else (args.mb, args.vocab)
    with tempfile.TemporaryDirectory(prefix="swarm-tok-") as tmp:
        patterns = write_corpus(Path(tmp) / "corpus", int(mb * 1e6))
        load_start = load_avg()
        arms = {}
        for vocab in [None, *vocabs]:
            name = "byte" if vocab is None else f"bpe_{vocab}"
            arms[name] = arm(patterns, Path(tmp) / f"cache-{name}", vocab)
            print(f"{name}: {arms[name]}", flush=True)
    emit(
        {
            "bench": "tokenizer",
            "quick": args.quick,
            "corpus_bytes": int(mb * 1e6),
            "arms": arms,
            "load_avg": {"start": load_start, "end": load_avg()},
        }
    )


if __name__ == "__main__":
    main()
