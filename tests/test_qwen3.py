"""Qwen3's family rules (paged_jax/model/qwen3.py) against transformers 5.24's
``Qwen3Config`` / ``Qwen3ForCausalLM``: config defaults, sliding-window semantics, and the
checkpoint tensors (names, shapes, count) a Qwen3 with biases has. Logit, greedy and beam
parity on a real checkpoint are in test_checkpoint.py / test_beam_parity.py (fixture
``qwen3``)."""

import jax
import pytest
from flax import nnx

from paged_jax.model import FAMILIES, ModelConfig, Qwen3ForCausalLM
from paged_jax.model.checkpoint import hf_names
from paged_jax.model.llama import abstract_model

BASE = {  # transformers always writes these keys
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}

# Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=24,
# num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
# attention_bias=True)).state_dict() shapes, and its num_parameters() (3856).
HF_TENSORS = {
    "model.embed_tokens.weight": (32, 16), "lm_head.weight": (32, 16), "model.norm.weight": (16,),
    "model.layers.0.self_attn.q_proj.weight": (32, 16), "model.layers.0.self_attn.q_proj.bias": (32,),
    "model.layers.0.self_attn.k_proj.weight": (16, 16), "model.layers.0.self_attn.k_proj.bias": (16,),
    "model.layers.0.self_attn.v_proj.weight": (16, 16), "model.layers.0.self_attn.v_proj.bias": (16,),
    "model.layers.0.self_attn.o_proj.weight": (16, 32), "model.layers.0.self_attn.o_proj.bias": (16,),
    "model.layers.0.self_attn.q_norm.weight": (8,), "model.layers.0.self_attn.k_norm.weight": (8,),
    "model.layers.0.mlp.gate_proj.weight": (24, 16), "model.layers.0.mlp.up_proj.weight": (24, 16),
    "model.layers.0.mlp.down_proj.weight": (16, 24), "model.layers.0.input_layernorm.weight": (16,),
    "model.layers.0.post_attention_layernorm.weight": (16,),
}


def _parse(**changes):
    hf = {**BASE, **changes}
    return ModelConfig.from_hf({k: v for k, v in hf.items() if v is not ...})


def test_registered_with_its_names():
    family = FAMILIES["Qwen3ForCausalLM"]
    assert family.module is Qwen3ForCausalLM and family.gguf_architecture == "qwen3"
    assert _parse(architectures=..., model_type="qwen3").architecture == "Qwen3ForCausalLM"


def test_checkpoint_tensors_are_transformers_with_attention_bias():
    """attention_bias=True: bias on q, k, v and o_proj (transformers; vLLM has none on o_proj)."""
    config = _parse(num_hidden_layers=1, attention_bias=True)
    assert config.attention_bias and config.attention_out_bias
    ours = {}
    for path, var in nnx.to_flat_state(nnx.state(abstract_model(config))):
        names, transposed = hf_names(path, config.num_layers)
        shape = tuple(var.shape[1:] if path[0] == "layers" else var.shape)
        ours.update({n: shape[::-1] if transposed else shape for n in names})
    assert ours == HF_TENSORS
    assert config.num_params == 3856


def test_config_defaults_are_qwen3configs():
    """Keys a hand-written config.json may omit take Qwen3Config's defaults, not Llama's."""
    config = _parse(head_dim=..., num_key_value_heads=..., max_position_embeddings=..., rms_norm_eps=...,
                    num_attention_heads=32, hidden_size=64)
    assert config.head_dim == 128 != 64 // 32 and config.num_kv_heads == 32
    assert config.max_position_embeddings == 32768 and config.rms_norm_eps == 1e-6
    assert not config.attention_bias and not config.tie_word_embeddings and config.rope_theta == 10000.0
    kept = _parse()
    assert (kept.head_dim, kept.num_kv_heads, kept.max_position_embeddings) == (8, 2, 256)


@pytest.mark.parametrize("keys, window", [
    ({}, None),  # Qwen3Config: sliding_window 4096, but use_sliding_window False
    ({"use_sliding_window": False, "sliding_window": 64, "layer_types": ["sliding_attention"] * 4}, None),
    ({"use_sliding_window": True, "sliding_window": 64}, None),  # max_window_layers 28 >= 4 layers: none slide
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 4}, None),
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}, 64),  # every layer slides
    ({"use_sliding_window": True, "max_window_layers": 0}, 4096),  # Qwen3Config's default window
    ({"use_sliding_window": True, "sliding_window": 64, "layer_types": ["sliding_attention"] * 4}, 64),
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0,
      "layer_types": ["full_attention"] * 4}, None),  # layer_types wins over max_window_layers
])
def test_sliding_window_as_transformers_applies_it(keys, window):
    config = _parse(**keys)
    assert config.sliding_window == window
    assert config.max_seq_len == (256 if window is None else min(256, window))


def test_window_on_some_layers_only_is_refused_clearly():
    with pytest.raises(ValueError, match=r"some layers only is not supported \(2 of 4 layers slide"):
        _parse(use_sliding_window=True, sliding_window=64, max_window_layers=2)
    with pytest.raises(ValueError, match="some layers only"):
        _parse(use_sliding_window=True, sliding_window=64, layer_types=["full_attention", "sliding_attention"] * 2)
    with pytest.raises(ValueError, match="layer_types=.*expected 4 entries"):
        _parse(layer_types=["full_attention"] * 3)
    with pytest.raises(ValueError, match="layer_types=.*expected 4 entries"):
        _parse(layer_types=["chunked_attention"] * 4)


def test_q_and_k_norms_are_per_head_over_head_dim():
    """One [head_dim] weight per layer for all heads (the tensor-parallel split replicates it)."""
    config = _parse()
    state = nnx.state(abstract_model(config))
    attn = state["layers"]["self_attn"]
    for norm in ("q_norm", "k_norm"):
        assert attn[norm]["weight"].shape == (config.num_layers, config.head_dim)
    assert sum(x.size for x in jax.tree.leaves(state)) == config.num_params
