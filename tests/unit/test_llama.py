"""The llama family against keras-hub's Llama: the same weights give the same logits.

keras-hub is a test dependency only (installed with ``--no-deps`` by .ci/run: its
tensorflow-text requirement pins an older TensorFlow), and this is the test that needs it.
"""

from __future__ import annotations

import numpy as np
import pytest

from silentswarm.plan import ModelConfig

CFG = ModelConfig(
    family="llama",
    vocab_size=97,
    seq_len=12,
    n_layers=3,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    intermediate_dim=48,
    rope_theta=500.0,
    norm_eps=1e-5,
)


def keras_hub_llama(cfg: ModelConfig):
    import keras_hub

    return keras_hub.models.LlamaBackbone(
        vocabulary_size=cfg.vocab_size,
        num_layers=cfg.n_layers,
        num_query_heads=cfg.n_heads,
        hidden_dim=cfg.d_model,
        intermediate_dim=cfg.hidden_dim,
        num_key_value_heads=cfg.kv_heads,
        rope_max_wavelength=cfg.rope_theta,
        layer_norm_epsilon=cfg.norm_eps,
    )


def copy_weights(backbone, glued, cfg: ModelConfig, directory) -> int:
    """keras-hub's Llama weights into ours, through a preset directory keras-hub writes."""
    from silentswarm.agent.runtime.presets import init_from_preset

    backbone.save_to_preset(str(directory))
    return init_from_preset(directory, cfg, [glued.embed, *glued.blocks, glued.head])


def randomize(backbone, seed: int) -> None:
    """Weights far from their initial values (norm scales too), so every one matters."""
    rng = np.random.default_rng(seed)
    for variable in backbone.weights:
        shape = tuple(variable.shape)
        base = 1.0 if variable.path.endswith("scale") else 0.0
        variable.assign(base + rng.normal(0, 0.2, shape).astype("float32"))


@pytest.mark.parametrize("stage_layers", [[[0, 3]], [[0, 1], [1, 3]]])
def test_llama_logits_match_keras_hub_on_the_same_weights(stage_layers, tmp_path):
    pytest.importorskip("keras_hub", reason="keras-hub: pip install --no-deps keras-hub")
    from silentswarm.agent.runtime.model import GluedTransformer

    backbone = keras_hub_llama(CFG)
    randomize(backbone, 0)
    glued = GluedTransformer(CFG, 7, "none", stage_layers)
    assert copy_weights(backbone, glued, CFG, tmp_path / "preset") == len(glued.weights)
    tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, (2, CFG.seq_len))
    hidden = backbone({"token_ids": tokens, "padding_mask": np.ones_like(tokens)})
    want = np.asarray(backbone.token_embedding(hidden, reverse=True))
    got = np.asarray(glued(tokens))
    assert got.shape == (2, CFG.seq_len, CFG.vocab_size)
    assert np.abs(want).max() > 1.0, "logits of a size that tests something"
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_a_llama_config_is_checked():
    import msgspec

    from silentswarm.jobspec import decode_job_spec

    def problems(**model) -> str:
        with pytest.raises(Exception) as caught:
            decode_job_spec(msgspec.json.encode({"model": {"family": "llama", **model}}))
        return str(caught.value)

    assert "n_kv_heads (3) must divide model.n_heads (4)" in problems(n_kv_heads=3)
    assert "must be even for rotary" in problems(d_model=12, n_heads=4)
    with pytest.raises(Exception, match='n_kv_heads is for the "llama" family'):
        decode_job_spec(msgspec.json.encode({"model": {"n_kv_heads": 2}}))


def test_a_preset_that_does_not_fit_the_job_is_refused_naming_each_field(tmp_path):
    pytest.importorskip("keras_hub", reason="keras-hub: pip install --no-deps keras-hub")
    import msgspec

    from silentswarm.agent.runtime.presets import check_model
    from silentswarm.errors import ConfigError

    keras_hub_llama(CFG).save_to_preset(str(tmp_path))
    check_model(tmp_path, CFG)  # the very architecture: fine
    misfit = msgspec.structs.replace(CFG, d_model=64, n_kv_heads=None)
    with pytest.raises(ConfigError) as caught:
        check_model(tmp_path, misfit)
    assert "model.d_model is 64, the preset's hidden_dim 32" in caught.value.message
    assert "model.n_kv_heads is 4, the preset's num_key_value_heads 2" in caught.value.message
    with pytest.raises(ConfigError, match=r'model\.family is "gpt2"'):
        check_model(tmp_path, msgspec.structs.replace(CFG, family="gpt2", n_kv_heads=None))
    with pytest.raises(ConfigError, match="not a keras-hub preset"):
        check_model(tmp_path / "nowhere", CFG)
