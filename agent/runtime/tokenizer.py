"""Tokenizers: text to the ids a model trains on, and back.

``byte`` (the default) is the UTF-8 bytes themselves, 256 ids, nothing to train or ship.
``bpe`` is a byte-level BPE (GPT-2's scheme: every byte is in the base alphabet, so any text
encodes without an unknown token) trained on the job's own data by stage 0 before training
starts, with Hugging Face's ``tokenizers`` (Rust; keras-hub has no BPE trainer). It has two
special tokens: ``<|endoftext|>`` (id 0), which separates documents in the token stream, and
``<|pad|>`` (id 1), for batching prompts of different lengths.

A trained BPE is its JSON (``Tokenizer.to_str()``): it goes into stage 0's checkpoint metadata
(so a resumed attempt encodes exactly as the first did, on whatever fellow), into the export,
and into the glued model's directory, where generate reads it. Its ``name`` (``bpe-<digest>``)
keys the token cache.

No TensorFlow: only numpy and ``tokenizers`` (imported when a BPE is used).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from silentswarm.agent.errors import DataError
from silentswarm.agent.pipe.wire import token_dtype

END_OF_TEXT = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (END_OF_TEXT, PAD)
BYTE_VOCAB = 256
MIN_BPE_VOCAB = BYTE_VOCAB + len(SPECIAL_TOKENS)


class ByteTokenizer:
    """One id per UTF-8 byte."""

    kind = "byte"
    name = "utf8-bytes"
    vocab_size = BYTE_VOCAB
    dtype = np.dtype(np.uint8)
    separator = np.frombuffer(b"\n", dtype=np.uint8)
    pad_id: int | None = None

    def encode(self, text: bytes) -> np.ndarray:
        return np.frombuffer(text, dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> bytes:
        return bytes(int(i) & 0xFF for i in ids)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one id stands for (a stream decodes token by token with these)."""
        return bytes([int(token) & 0xFF])

    max_token_bytes = 1

    def to_json(self) -> str | None:
        return None


class BpeTokenizer:
    """A trained byte-level BPE, from its JSON (:func:`train_bpe` makes one)."""

    kind = "bpe"

    def __init__(self, text: str, vocab_size: int) -> None:
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises a bare Exception for bad JSON
            raise DataError(f"not a tokenizer's JSON: {exc}") from None
        self._json = text
        self.vocab_size = vocab_size
        if self._tok.get_vocab_size() > vocab_size:
            raise DataError(
                f"the BPE has {self._tok.get_vocab_size()} tokens, more than the model's "
                f"vocabulary of {vocab_size}"
            )
        ids = [self._tok.token_to_id(token) for token in SPECIAL_TOKENS]
        if any(i is None for i in ids):
            raise DataError(f"the BPE lacks its special tokens {SPECIAL_TOKENS}")
        self.eot_id, self.pad_id = ids
        self.dtype = token_dtype(vocab_size)
        self.separator = np.array([self.eot_id], dtype=self.dtype)
        self.name = "bpe-" + hashlib.sha256(text.encode()).hexdigest()[:32]
        # Where the data cache keeps it, if it does (pruning leaves it while in use).
        self.files: tuple[Path, ...] = ()

    def encode(self, text: bytes) -> np.ndarray:
        """The ids of UTF-8 ``text`` (invalid bytes become U+FFFD)."""
        return self.encode_many([text])

    def encode_many(self, texts: list[bytes]) -> np.ndarray:
        """The ids of the pieces one after another, encoded in parallel."""
        strings = [t.decode("utf-8", errors="replace") for t in texts]
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        out = [np.asarray(e.ids, dtype=self.dtype) for e in encode(strings)]
        return np.concatenate(out) if out else np.zeros(0, dtype=self.dtype)

    def decode(self, ids: Iterable[int]) -> bytes:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False).encode("utf-8")

    def token_bytes(self, token: int) -> bytes:
        """The bytes one id stands for: its byte-level symbols mapped back to bytes (a
        special token: its text), so that a stream can decode token by token even where a
        character spans tokens; :meth:`decode` of many ids is these bytes joined."""
        table = self._bytes_table()
        return table[token] if 0 <= token < len(table) else b""

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The longest token's bytes (a scan of the vocabulary, once: the server asks it of
        every request)."""
        return max((len(b) for b in self._bytes_table()), default=1)

    def _bytes_table(self) -> list[bytes]:
        table = getattr(self, "_table", None)
        if table is None:
            to_byte = {ch: b for b, ch in byte_level_alphabet().items()}
            table = []
            for i in range(self._tok.get_vocab_size()):
                token = self._tok.id_to_token(i)
                if token is None:
                    table.append(b"")
                elif token in SPECIAL_TOKENS:
                    table.append(token.encode())
                else:
                    table.append(bytes(to_byte[ch] for ch in token if ch in to_byte))
            self._table = table
        return table

    def to_json(self) -> str:
        return self._json


Tokenizer = ByteTokenizer | BpeTokenizer


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-to-symbol map, which byte-level BPEs (``tokenizers``' ByteLevel) write
    tokens in: printable bytes stand for themselves, the others for symbols from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    out, extra = {}, 0
    for b in range(256):
        if b in kept:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def train_bpe(texts: Iterable[bytes], vocab_size: int) -> BpeTokenizer:
    """A byte-level BPE of (at most) ``vocab_size`` tokens trained on ``texts`` (UTF-8 pieces,
    streamed: the trainer keeps word counts, not the text). Deterministic for the same
    pieces."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_BPE_VOCAB:
        raise DataError(f"a BPE vocabulary needs at least {MIN_BPE_VOCAB} tokens")
    tok = HfTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((t.decode("utf-8", errors="replace") for t in texts), trainer)
    return BpeTokenizer(tok.to_str(), vocab_size)


def load_tokenizer(kind: str, vocab_size: int, text: str | None) -> Tokenizer:
    """The tokenizer a checkpoint, an export or a glued model names (``text``: a BPE's JSON)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe" and text:
        return BpeTokenizer(text, vocab_size)
    raise DataError(f"cannot load a {kind!r} tokenizer" + ("" if text else " without its JSON"))


def describe(tokenizer: Any) -> dict[str, Any]:
    """What a manifest says of a tokenizer (its JSON goes in a file of its own)."""
    return {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size, "name": tokenizer.name}
