"""Starting a job from a keras-hub Llama preset directory (``"init_from": "preset:DIR"``).

A preset, as ``keras_hub`` saves it (``save_to_preset``, or a downloaded one): ``config.json``
(the backbone's class and arguments), ``metadata.json``, and ``model.weights.h5`` (Keras 3's
weights file: ``layers/<layer>/.../vars/<i>``). It is read here with h5py alone, no keras-hub:
each stage takes the weights of its own layers (the embedding on stage 0, its blocks, the
final norm and head on the last stage) and checks first that the job's ``model`` is the
preset's architecture, naming every field that differs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from silentswarm.errors import ConfigError
from silentswarm.plan import ModelConfig

PREFIX = "preset:"
WEIGHTS_FILE = "model.weights.h5"
CONFIG_FILE = "config.json"
# The preset's argument each ModelConfig field must equal.
FIELDS = {
    "vocab_size": "vocabulary_size",
    "n_layers": "num_layers",
    "n_heads": "num_query_heads",
    "n_kv_heads": "num_key_value_heads",
    "d_model": "hidden_dim",
    "intermediate_dim": "intermediate_dim",
    "rope_theta": "rope_max_wavelength",
    "norm_eps": "layer_norm_epsilon",
}
# RoPE variants this runtime does not compute (Llama 3.1's frequency adjustment, scaling).
UNSUPPORTED = {
    "rope_position_scaling_factor": 1.0,
    "rope_frequency_adjustment_factor": None,
}


def preset_dir(init_from: str) -> Path:
    return Path(init_from.removeprefix(PREFIX)).expanduser()


def preset_model(directory: Path) -> dict[str, Any]:
    """The ModelConfig fields a Llama preset fixes; ConfigError when it is not one."""
    try:
        described = json.loads((directory / CONFIG_FILE).read_text())
        config = described["config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{directory}: not a keras-hub preset ({CONFIG_FILE}: {exc})") from None
    if described.get("class_name") != "LlamaBackbone":
        raise ConfigError(
            f"{directory}: a {described.get('class_name')!r} preset; only LlamaBackbone presets "
            "can start a job"
        )
    for key, plain in UNSUPPORTED.items():
        if config.get(key, plain) != plain:
            raise ConfigError(f"{directory}: {key}={config[key]} is not supported")
    try:
        return {ours: config[theirs] for ours, theirs in FIELDS.items()}
    except KeyError as exc:
        raise ConfigError(f"{directory}: {CONFIG_FILE} lacks {exc}") from None


def check_model(directory: Path, model: ModelConfig) -> None:
    """ConfigError naming every field of ``model`` that is not the preset's."""
    want = preset_model(directory)
    have = {
        **{field: getattr(model, field) for field in FIELDS},
        "n_kv_heads": model.kv_heads,
        "intermediate_dim": model.hidden_dim,
    }
    wrong = [
        f"model.{field} is {have[field]}, the preset's {FIELDS[field]} {value}"
        for field, value in want.items()
        if not np.isclose(float(have[field]), float(value), rtol=1e-9, atol=0)
    ]
    if model.family != "llama":
        wrong.insert(0, f'model.family is "{model.family}", the preset is a "llama"')
    if wrong:
        raise ConfigError(f"{directory} does not fit the job: " + "; ".join(wrong))


def _decoder(index: int) -> str:
    return "layers/llama_transformer_decoder" + (f"_{index}" if index else "")


def _block_arrays(read: Any, index: int, cfg: ModelConfig) -> dict[str, np.ndarray]:
    d, head_dim = cfg.d_model, cfg.d_model // cfg.n_heads
    base = _decoder(index)
    attention = f"{base}/_self_attention_layer"
    return {
        "attn_norm/scale": read(f"{base}/_self_attention_layernorm/vars/0"),
        "w_q": read(f"{attention}/_query_dense/vars/0").reshape(d, cfg.n_heads * head_dim),
        "w_k": read(f"{attention}/_key_dense/vars/0").reshape(d, cfg.kv_heads * head_dim),
        "w_v": read(f"{attention}/_value_dense/vars/0").reshape(d, cfg.kv_heads * head_dim),
        "w_o": read(f"{attention}/_output_dense/vars/0").reshape(cfg.n_heads * head_dim, d),
        "mlp_norm/scale": read(f"{base}/_feedforward_layernorm/vars/0"),
        "w_gate": read(f"{base}/_feedforward_gate_dense/vars/0"),
        "w_up": read(f"{base}/_feedforward_intermediate_dense/vars/0"),
        "w_down": read(f"{base}/_feedforward_output_dense/vars/0"),
    }


def layer_arrays(directory: Path, cfg: ModelConfig, layers: list[Any]) -> Iterator[tuple[Any, Any]]:
    """``(variable, array)`` for every variable of ``layers`` (a stage's, or the glued model's
    embedding, blocks and head) from the preset's weights file."""
    import h5py

    from silentswarm.agent.runtime.model import LlamaBlock, LlamaHead, TokenEmbedding

    path = directory / WEIGHTS_FILE
    try:
        weights = h5py.File(path, "r")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the preset's weights ({exc})") from None
    with weights:

        def read(name: str) -> np.ndarray:
            if name not in weights:
                raise ConfigError(f"{path}: no {name} (not a Llama preset of this layout?)")
            return np.asarray(weights[name], dtype=np.float32)

        embedding = "layers/reversible_embedding/vars"
        for layer in layers:
            if type(layer) is TokenEmbedding:  # not gpt2's Embedding, a subclass
                arrays = {"tok": read(f"{embedding}/0")}
            elif isinstance(layer, LlamaBlock):
                arrays = _block_arrays(read, layer.layer_index, cfg)
            elif isinstance(layer, LlamaHead):
                # Untied: the reverse embedding; tied (no second array): the embedding's.
                tied = f"{embedding}/1" not in weights
                head = read(f"{embedding}/0").T if tied else read(f"{embedding}/1")
                arrays = {"norm_f/scale": read("layers/llama_layer_norm/vars/0"), "w_head": head}
            else:
                continue
            for variable in layer.weights:
                name = variable.path.rsplit(f"{layer.name}/", 1)[-1]
                array = arrays.get(name)
                if array is None or tuple(array.shape) != tuple(variable.shape):
                    raise ConfigError(
                        f"{path}: no array of shape {tuple(variable.shape)} for {variable.path}"
                    )
                yield variable, array


def init_from_preset(directory: Path, cfg: ModelConfig, layers: list[Any]) -> int:
    """Check the preset fits ``cfg``, then load its weights into ``layers``; how many
    variables were set."""
    check_model(directory, cfg)
    pairs = list(layer_arrays(directory, cfg, layers))  # all read before any is set
    for variable, array in pairs:
        variable.assign(array)
    return len(pairs)
