"""How long the completion server spends choosing one token of one request: ``generate.pick``
(temperature 0.8) over random logits, per vocabulary size and setting.

    python exp/bench/sampling.py            # ~10 s here
    python exp/bench/sampling.py --quick    # a smoke run

The engine picks every running request's token on its one thread, one after another, between
batched model steps: at 8 slots a millisecond here is 8 ms of every step. Printed as one JSON
line: ``{"bench": "sampling", "ms_per_token": {"<vocab>": {"<setting>": ms}}}``; the settings
are ``top_k_40``, ``top_p_0.9`` (top_k 0: the whole vocabulary) and ``plain`` (neither). No
TensorFlow.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _common import emit, load_avg, median  # puts the repo on sys.path

from silentswarm.agent.runtime.generate import pick

SETTINGS = {"plain": (0, 1.0), "top_k_40": (40, 1.0), "top_p_0.9": (0, 0.9)}


def ms_per_token(logits: np.ndarray, top_k: int, top_p: float, n: int, rounds: int) -> float:
    """The median over ``rounds`` of the mean time of ``n`` picks."""
    rng = np.random.default_rng(0)
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(n):
            pick(logits, temperature=0.8, top_k=top_k, top_p=top_p, rng=rng)
        times.append((time.perf_counter() - began) / n * 1e3)
    return median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--vocab", type=int, nargs="+", default=[256, 4096, 32_000])
    args = parser.parse_args()
    n, rounds = (20, 1) if args.quick else (300, 5)
    figures: dict[str, dict[str, float]] = {}
    for vocab in args.vocab:
        logits = np.random.default_rng(vocab).normal(size=vocab) * 3
        figures[str(vocab)] = {
            name: ms_per_token(logits, top_k, top_p, n, rounds)
            for name, (top_k, top_p) in SETTINGS.items()
        }
        row = "  ".join(f"{k} {v:.3f} ms" for k, v in figures[str(vocab)].items())
        print(f"  vocabulary {vocab:6d}: {row}", flush=True)
    emit(
        {"bench": "sampling", "quick": args.quick, "ms_per_token": figures, "load_avg": load_avg()}
    )


if __name__ == "__main__":
    main()
