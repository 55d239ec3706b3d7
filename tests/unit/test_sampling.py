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


def whole_vocabulary_pick(logits, *, temperature, top_k, rng, top_p=1.0) -> int:
    """The sampler before it sorted only what it needs: the whole vocabulary masked."""
    scaled = np.asarray(logits, dtype=np.float64) / temperature
    if 0 < top_k < scaled.size:
        cut = np.partition(scaled, -top_k)[-top_k]
        scaled = np.where(scaled >= cut, scaled, -np.inf)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        keep = order[: int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1]
        kept = np.zeros_like(probs)
        kept[keep] = probs[keep]
        probs = kept / kept.sum()
    return int(rng.choice(probs.size, p=probs))


@pytest.mark.parametrize("vocab", [5, 256, 32_000])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied"])
def test_a_seed_draws_the_token_the_whole_vocabulary_sampler_drew(vocab, ties):
    """Same seed, same token, ties at a cut included (rounded logits tie by the hundred):
    a user's seeded completions do not change with the faster sampler."""
    for seed in range(40):
        logits = np.random.default_rng(seed).normal(size=vocab) * 3
        if ties:
            logits = np.round(logits)
        for top_k, top_p in ((0, 1.0), (40, 1.0), (0, 0.9), (40, 0.9), (2, 0.5)):
            kw = {"temperature": 0.8, "top_k": top_k, "top_p": top_p}
            want = whole_vocabulary_pick(logits, rng=np.random.default_rng(seed), **kw)
            assert pick(logits, rng=np.random.default_rng(seed), **kw) == want, (seed, kw)
