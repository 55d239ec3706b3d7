"""Tokenizers: bytes and a BPE trained on the job's data (no TensorFlow in this process)."""

from __future__ import annotations

import numpy as np
import pytest

from silentswarm.agent.errors import CheckpointError, DataError
from silentswarm.agent.runtime import data as data_module
from silentswarm.agent.runtime.checkpoint import checkpoint_tokenizer
from silentswarm.agent.runtime.data import TextDataset, job_tokenizer
from silentswarm.agent.runtime.tokenizer import (
    BpeTokenizer,
    ByteTokenizer,
    load_tokenizer,
    train_bpe,
)
from silentswarm.jobspec import decode_job_spec
from silentswarm.plan import ModelConfig, TokenizerConfig, TrainConfig, single_process_plan

TEXT = (
    "def add(a, b):\n    return a + b\n\n"
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n"
    "Grüße, naïve café — ☃ ok\n"
) * 40


@pytest.fixture(scope="module")
def bpe() -> BpeTokenizer:
    return train_bpe([TEXT.encode()], 400)


def test_a_bpe_round_trips_any_text_and_is_shorter_than_bytes(bpe):
    for text in (TEXT, "unseen: 日本語 \x00 \U0001f600", ""):
        ids = bpe.encode(text.encode())
        assert bpe.decode(ids) == text.encode()
        assert ids.dtype == np.uint16 and (ids.size == 0 or int(ids.max()) < 400)
    assert len(bpe.encode(TEXT.encode())) < len(TEXT.encode()) / 2
    assert (bpe.eot_id, bpe.pad_id) == (0, 1) and list(bpe.separator) == [0]
    assert bpe.name.startswith("bpe-") and BpeTokenizer(bpe.to_json(), 400).name == bpe.name


def test_training_is_deterministic_and_bounded():
    one, two = train_bpe([TEXT.encode()], 300), train_bpe([TEXT.encode()], 300)
    assert one.to_json() == two.to_json()
    with pytest.raises(DataError, match="at least 258"):
        train_bpe([TEXT.encode()], 257)
    with pytest.raises(DataError, match="more than the model's vocabulary of 280"):
        BpeTokenizer(one.to_json(), 280)
    with pytest.raises(DataError, match="not a tokenizer's JSON"):
        BpeTokenizer("{}", 300)


def test_bytes_stay_bytes():
    tok = ByteTokenizer()
    assert bytes(tok.encode(b"ab\xff")) == b"ab\xff" and tok.decode([97, 98]) == b"ab"
    assert load_tokenizer("byte", 256, None).name == "utf8-bytes"
    with pytest.raises(DataError, match="without its JSON"):
        load_tokenizer("bpe", 300, None)


def corpus(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text("second document\n" * 30)
    return [str(tmp_path / "*.txt")]


def test_a_bpe_dataset_separates_documents_with_end_of_text(tmp_path, bpe):
    dataset = TextDataset(corpus(tmp_path), seq_len=8, seed=0, tokenizer=bpe)
    tokens = dataset.tokens
    assert tokens.dtype == np.uint16 and int((tokens == bpe.eot_id).sum()) == 1
    first, second = np.split(np.asarray(tokens), np.flatnonzero(tokens == bpe.eot_id))
    assert bpe.decode(first) == TEXT.encode()
    assert bpe.decode(second[1:]) == ("second document\n" * 30).encode()
    # The byte dataset of the same files is another cache (keyed by the tokenizer).
    assert TextDataset(corpus(tmp_path), seq_len=8, seed=0).cache_file != dataset.cache_file
    assert 0 < dataset.unigram_entropy_nats() < np.log(400)


def test_the_job_tokenizer_is_trained_once_and_kept_in_the_cache(tmp_path, monkeypatch):
    train = TrainConfig(data=corpus(tmp_path), tokenizer=TokenizerConfig(kind="bpe"))
    first = job_tokenizer(train, 300, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "tokenizers").glob("*.json"))

    def no_training(*_args, **_kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr(data_module, "train_bpe", no_training)
    again = job_tokenizer(train, 300, cache_dir=tmp_path / "cache")
    assert again.to_json() == first.to_json()
    assert isinstance(job_tokenizer(TrainConfig(data=corpus(tmp_path)), 256), ByteTokenizer)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"tokenizer": {"kind": "bpe"}}, "needs model.vocab_size >= 258"),
        (
            {"tokenizer": {"kind": "bpe", "vocab_size": 1000}, "model": {"vocab_size": 512}},
            "tokenizer.vocab_size (1000) must equal model.vocab_size (512)",
        ),
        ({"tokenizer": {"kind": "byte", "vocab_size": 300}}, "byte tokenizer is 256"),
        ({"model": {"vocab_size": 100}}, "must be >= 256 for byte tokens"),
    ],
)
def test_a_job_spec_names_a_tokenizer_that_cannot_feed_its_model(spec, says):
    import msgspec

    with pytest.raises(Exception, match=says.replace("(", r"\(").replace(")", r"\)")):
        decode_job_spec(msgspec.json.encode(spec))


def test_a_checkpoint_gives_back_the_tokenizer_it_was_written_with(bpe):
    model = ModelConfig(vocab_size=400, seq_len=8, n_layers=1, d_model=16, n_heads=2)
    train = TrainConfig(tokenizer=TokenizerConfig(kind="bpe"))
    plan = single_process_plan(job_id="j", model=model, train=train)
    assert checkpoint_tokenizer(plan, {"tokenizer": bpe.to_json()}).to_json() == bpe.to_json()
    with pytest.raises(CheckpointError, match="without its JSON"):
        checkpoint_tokenizer(plan, {"tokenizer": None})
    with pytest.raises(CheckpointError, match="not a tokenizer's JSON text"):
        checkpoint_tokenizer(plan, {"tokenizer": 5})
