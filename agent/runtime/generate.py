"""Sample text from a glued model.

``python -m silentswarm.agent.runtime.generate --model-dir DIR [--adapter DIR] --prompt TEXT
[--max-new-tokens 100] [--temperature 0.8] [--top-k 40] [--seed 0]``

``DIR`` is what ``python -m silentswarm.agent.runtime.glue`` wrote (``inference_manifest.json`` and
``model.keras``, or the ``model.weights.h5`` + ``config.json`` fallback), or the export
directory that holds it as ``full_model/``. The model file's sha256 is checked against the
manifest before it is loaded.

Tokens are the model's tokenizer's (``tokenizer`` in the manifest): bytes (the prompt's
UTF-8), or the job's BPE (``tokenizer.json`` beside the model); an empty prompt starts from the
separator the dataset puts between documents (``"\\n"``, or ``<|endoftext|>``), so a "start of
a document". The model was trained on windows of
``seq_len`` tokens with positions ``0 .. seq_len - 1``, so the context is the last ``seq_len``
tokens; it is padded on the right to a fixed ``(1, seq_len)`` window, and one ``tf.function``
traced once for that shape gives the logits at the last real position (causal attention: the
padding after it changes nothing). Sampling: logits / temperature, the ``top_k`` largest kept,
softmax, one draw from ``numpy.random.default_rng(seed)``; temperature 0 is greedy. The same
model, prompt and flags give the same text.

Output: the generated tokens' text (the continuation only, not the prompt) decoded as UTF-8 with
``errors="replace"``, written to stdout. Exit 0; 2 for a bad argument or model directory
(one line ``generate: error: ...`` on stderr); 1 if TensorFlow fails.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from silentswarm.agent.errors import DataError, GenerateError
from silentswarm.agent.runtime.adapters import check_base, merge_into, read_adapter
from silentswarm.agent.runtime.glue.manifest import sha256_file
from silentswarm.agent.runtime.glue.save import DEFAULT_OUT as DEFAULT_SUBDIR
from silentswarm.agent.runtime.tfsetup import graph_function
from silentswarm.agent.runtime.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from silentswarm.agent.runtime.tool import ToolParser, exit_with, first_line
from silentswarm.cpus import usable_cores
from silentswarm.errors import ManifestError
from silentswarm.types.manifests import (
    INFERENCE_MANIFEST,
    InferenceManifest,
    decode_inference_manifest,
)

PROG = "generate"
MAX_VOCAB = 2**22  # the arguments are checked against the model's own once it is loaded


@dataclass
class LoadedModel:
    model: Any  # a GluedTransformer
    manifest: InferenceManifest
    directory: Path
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)

    @property
    def seq_len(self) -> int:
        return self.manifest.seq_len

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size


def find_model_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` if it holds an inference manifest, else ``path/full_model`` if that does."""
    path = Path(path)
    for candidate in (path, path / DEFAULT_SUBDIR):
        if (candidate / INFERENCE_MANIFEST).is_file():
            return candidate
    raise GenerateError(
        f"{path}: no {INFERENCE_MANIFEST} here or in {DEFAULT_SUBDIR}/ (run agent.runtime.glue)"
    )


def size_thread_pools() -> None:
    """TensorFlow's thread pools by the CPUs this process may use (a container's quota, an
    affinity mask: silentswarm.cpus), not the host's count; before TensorFlow starts."""
    import tensorflow as tf

    cores = usable_cores()
    try:
        tf.config.threading.set_intra_op_parallelism_threads(cores)
        tf.config.threading.set_inter_op_parallelism_threads(cores)
    except RuntimeError:  # TensorFlow already runs in this process: its pools stay
        pass


def load_model(
    path: str | os.PathLike[str], adapter: str | os.PathLike[str] | None = None
) -> LoadedModel:
    """The glued model of a model (or export) directory, its files checked first; with
    ``adapter`` (a LoRA adapter's export), that adapter merged in once its base is checked to
    be this model (:mod:`silentswarm.agent.runtime.adapters`). Once the files are checked,
    and before TensorFlow starts, its thread pools are sized by the CPUs this process may
    use (:func:`size_thread_pools`)."""
    directory = find_model_dir(path)
    source = directory / INFERENCE_MANIFEST
    try:
        manifest = decode_inference_manifest(source.read_bytes(), str(source))
    except OSError as exc:
        raise GenerateError(f"{source}: unreadable ({exc})") from None
    except ManifestError as exc:
        raise GenerateError(exc.message) from None
    for name, entry in manifest.files.items():
        file = directory / name
        if not file.is_file():
            raise GenerateError(f"{file}: missing")
        if sha256_file(file) != entry.sha256:
            raise GenerateError(f"{file}: sha256 does not match {INFERENCE_MANIFEST}")
    size_thread_pools()
    import keras

    import silentswarm.agent.runtime.model  # noqa: F401  (registers the layers with Keras)
    from silentswarm.agent.runtime.glue import load_fallback

    tokenizer = _tokenizer(directory, manifest)
    lora = None
    if adapter is not None:  # checked before the model is loaded
        lora = read_adapter(adapter)
        check_base(
            lora, manifest.run_manifest_sha256, f"job {manifest.job_id}'s model in {directory}"
        )
    if manifest.config_file:
        model = load_fallback(directory)
    else:
        model = keras.saving.load_model(directory / manifest.model_file, compile=False)
    if lora is not None:
        merge_into(model, lora)
    return LoadedModel(model=model, manifest=manifest, directory=directory, tokenizer=tokenizer)


def _tokenizer(directory: Path, manifest: InferenceManifest) -> Tokenizer:
    """The tokenizer the model was trained with (its file was checked with the others)."""
    text = None
    if manifest.tokenizer_file is not None:
        if manifest.tokenizer_file not in manifest.files:
            raise GenerateError(f"{INFERENCE_MANIFEST}: the tokenizer file is not among files")
        text = (directory / manifest.tokenizer_file).read_text()
    try:
        return load_tokenizer(manifest.tokenizer, manifest.vocab_size, text)
    except DataError as exc:
        raise GenerateError(f"{directory}: {exc.message}") from None


class Sampler:
    """Next-token logits from a fixed ``(1, seq_len)`` window, traced once."""

    def __init__(self, loaded: LoadedModel) -> None:
        import tensorflow as tf

        self.seq_len = loaded.seq_len
        model = loaded.model

        @graph_function(
            input_signature=[
                tf.TensorSpec((1, self.seq_len), tf.int32),
                tf.TensorSpec((), tf.int32),
            ]
        )
        def next_logits(window, position):
            return model(window, training=False)[0, position]

        self._next_logits = next_logits

    def logits(self, context: Sequence[int]) -> np.ndarray:
        tail = list(context)[-self.seq_len :]
        window = np.zeros((1, self.seq_len), dtype=np.int32)
        window[0, : len(tail)] = tail
        return self._next_logits(window, np.int32(len(tail) - 1)).numpy().astype(np.float64)


# A temperature below this samples greedily (logits divided by it would overflow).
GREEDY_BELOW = 1e-4


def pick(
    logits: np.ndarray,
    *,
    temperature: float,
    top_k: int,
    rng: np.random.Generator,
    top_p: float = 1.0,
) -> int:
    """One token from ``logits``: greedy at temperature 0 (or below :data:`GREEDY_BELOW`),
    else sampling from the ``top_k`` likeliest (0: all), then from the smallest set of the
    likeliest whose mass reaches ``top_p`` (nucleus; 1: all)."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature < GREEDY_BELOW:
        return int(np.argmax(logits))
    scaled = logits / temperature
    # The candidates' ids in the vocabulary's order (None: all), so that a seed draws the
    # token it drew when the sampler masked the whole vocabulary; ties at the cut are kept.
    ids = None
    if 0 < top_k < scaled.size:
        ids = np.flatnonzero(scaled >= np.partition(scaled, -top_k)[-top_k])
        scaled = scaled[ids]
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_p < 1.0:
        kept, probs = _nucleus(probs, top_p)
        ids = kept if ids is None else ids[kept]
    drawn = rng.choice(probs.size, p=probs)
    return int(drawn if ids is None else ids[drawn])


NUCLEUS_HEAD = 64  # the likeliest sorted first; 8 times as many while their mass falls short


def _nucleus(probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The positions in ``probs`` of the smallest set of the likeliest whose mass reaches
    ``top_p``, and their probabilities renormalised. Sorted only as far as it needs: a 32k
    vocabulary sorted whole for every token of every request took 3.4 ms, on the engine's
    one thread (``exp/bench/sampling.py``)."""
    head = min(probs.size, NUCLEUS_HEAD)
    while True:
        if head < probs.size:
            part = np.sort(np.argpartition(-probs, head - 1)[:head])  # ties: lower id first
        else:
            part = np.arange(probs.size)
        part = part[np.argsort(-probs[part], kind="stable")]
        mass = np.cumsum(probs[part])
        if mass[-1] >= top_p or head == probs.size:
            break
        head = min(probs.size, head * 8)
    keep = np.sort(part[: int(np.searchsorted(mass, top_p)) + 1])  # the vocabulary's order
    kept = probs[keep]
    return keep, kept / kept.sum()


def generate(
    loaded: LoadedModel,
    prompt: bytes,
    *,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    sampler: Sampler | None = None,
) -> bytes:
    """The text (UTF-8 bytes) of ``max_new_tokens`` tokens that follow ``prompt``."""
    check_args(max_new_tokens, temperature, top_k, seed, loaded.vocab_size)
    tokenizer = loaded.tokenizer
    ids = tokenizer.encode(prompt) if prompt else tokenizer.separator
    if ids.size and int(ids.max()) >= loaded.vocab_size:
        raise GenerateError(
            f"the prompt has tokens beyond the model's vocabulary of {loaded.vocab_size}"
        )
    sampler = sampler or Sampler(loaded)
    rng = np.random.default_rng(seed)
    context = [int(i) for i in ids]
    out = []
    for _ in range(max_new_tokens):
        token = pick(sampler.logits(context), temperature=temperature, top_k=top_k, rng=rng)
        context.append(token)
        out.append(token)
    return tokenizer.decode(out)


def check_args(max_new_tokens: int, temperature: float, top_k: int, seed: int, vocab: int) -> None:
    if max_new_tokens < 0:
        raise GenerateError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if not (temperature >= 0 and np.isfinite(temperature)):
        raise GenerateError(f"--temperature must be a finite number >= 0, got {temperature}")
    if not 0 <= top_k <= vocab:
        raise GenerateError(f"--top-k must be in 0..{vocab} (0: no limit), got {top_k}")
    if seed < 0:
        raise GenerateError(f"--seed must be >= 0, got {seed}")


def fail(message: str, code: int) -> NoReturn:
    exit_with(PROG, message, code)


def main(argv: Sequence[str] | None = None) -> int:
    parser = ToolParser(prog=PROG, description="Sample text from a glued SilentSwarm model.")
    parser.add_argument(
        "--model-dir", required=True, type=Path, help="the glued model (or its export directory)"
    )
    parser.add_argument("--adapter", type=Path, help="a LoRA adapter's export, for this model")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=40, help="0: no limit")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        check_args(args.max_new_tokens, args.temperature, args.top_k, args.seed, MAX_VOCAB)
        loaded = load_model(args.model_dir, args.adapter)
        text = generate(
            loaded,
            args.prompt.encode("utf-8", errors="surrogateescape"),
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
        )
    except GenerateError as exc:
        fail(str(exc), 2)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Exception as exc:  # TensorFlow or Keras: one line, not a traceback
        fail(first_line(exc), 1)
    sys.stdout.buffer.write(text.decode("utf-8", errors="replace").encode("utf-8") + b"\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
