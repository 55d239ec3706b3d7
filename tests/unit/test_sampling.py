"""``generate.pick``'s nucleus and top-k, which sort only as much of the vocabulary as they
need, against the whole sort they replace."""

from __future__ import annotations

import numpy as np
import pytest

from silentswarm.agent.runtime.generate import NUCLEUS_HEAD, _nucleus, pick


def reference_nucleus(probs: np.ndarray, top_p: float) -> set[int]:
    order = np.argsort(-probs, kind="stable")
    return set(order[: int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1].tolist())


@pytest.mark.parametrize("vocab", [5, NUCLEUS_HEAD, 256, 32_000])
@pytest.mark.parametrize("spread", [0.5, 3.0, 8.0], ids=["flat", "peaked", "sharp"])
@pytest.mark.parametrize("top_p", [0.01, 0.5, 0.9, 0.999])
def test_the_nucleus_is_the_whole_sorts_smallest_likeliest_set(vocab, spread, top_p):
    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=vocab) * spread  # no ties: one answer
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    ids, kept = _nucleus(probs, top_p)
    assert set(ids.tolist()) == reference_nucleus(probs, top_p)
    assert kept.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(kept, probs[ids] / probs[ids].sum())


def test_sampling_draws_only_from_the_top_k_and_the_nucleus_of_a_large_vocabulary():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=32_000) * 3
    likeliest = set(np.argsort(-logits)[:40].tolist())
    drawn = {pick(logits, temperature=1.0, top_k=40, rng=rng) for _ in range(300)}
    assert drawn <= likeliest and len(drawn) > 5
    probs = np.exp(logits - logits.max())
    nucleus = reference_nucleus(probs / probs.sum(), 0.9)
    assert len(nucleus) > NUCLEUS_HEAD  # the head had to grow
    drawn = {pick(logits, temperature=1.0, top_k=0, top_p=0.9, rng=rng) for _ in range(300)}
    assert drawn <= nucleus and len(drawn) > 50
    assert pick(logits, temperature=1.0, top_k=0, top_p=1e-9, rng=rng) == int(np.argmax(logits))
