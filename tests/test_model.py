"""ModelConfig validation and HF parsing; RoPE; the contiguous-cache backend."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_jax.model import (
    ContiguousKV,
    LlamaForCausalLM,
    ModelConfig,
    RopeScaling,
    dense_forward,
    forward,
    init_contiguous_kv,
    init_params,
    logits_from_hidden,
    make_contiguous_attend,
)
from paged_jax.model.llama import rope_inv_freq

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
CFG = ModelConfig(**TINY, max_position_embeddings=256)

HF4_LLAMA = {  # transformers 4 key names
    "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64},
    "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="num_heads=5 must be a multiple of num_kv_heads=2"):
        ModelConfig(**{**TINY, "num_heads": 5})
    with pytest.raises(ValueError, match="hidden_size=0"):
        ModelConfig(**{**TINY, "hidden_size": 0})
    with pytest.raises(ValueError, match="head_dim=15"):
        ModelConfig(**{**TINY, "head_dim": 15})
    with pytest.raises(ValueError, match="dtype='int8'"):
        ModelConfig(**TINY, dtype="int8")
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        ModelConfig(**TINY, architecture="GPT2LMHeadModel")
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        RopeScaling(8.0, 1.0, 4.0, 16, rope_type="dynamic")
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        RopeScaling(4.0, rope_type="yarn")
    assert hash(CFG) == hash(ModelConfig(**TINY, max_position_embeddings=256))  # usable as a static arg


def test_from_hf_transformers4_and_5_keys_agree():
    old = ModelConfig.from_hf(HF4_LLAMA)
    new_keys = {k: v for k, v in HF4_LLAMA.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    new_keys["rope_parameters"] = {**HF4_LLAMA["rope_scaling"], "rope_theta": 500000.0}
    new_keys["dtype"] = "bfloat16"
    assert ModelConfig.from_hf(new_keys) == old
    assert old.rope_theta == 500000.0 and old.rope_scaling.original_max_position_embeddings == 64
    assert old.dtype == "bfloat16" and old.head_dim == 16
    assert ModelConfig.from_hf(HF4_LLAMA, dtype="float32").dtype == "float32"
    # No "architectures": the model_type decides.
    by_type = {k: v for k, v in HF4_LLAMA.items() if k != "architectures"} | {"model_type": "mistral"}
    assert ModelConfig.from_hf(by_type).architecture == "MistralForCausalLM"


def test_from_hf_rejects_what_is_not_implemented():
    for bad, msg in [
        ({"architectures": ["BertModel"]}, "unsupported architecture 'BertModel'; supported: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "'longrope' is not supported"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ]:
        with pytest.raises(ValueError, match=msg):
            ModelConfig.from_hf({**HF4_LLAMA, **bad})


def test_from_hf_bias_and_window_flags():
    qwen = ModelConfig.from_hf({**HF4_LLAMA, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32, "use_sliding_window": False})
    assert qwen.attention_bias and not qwen.attention_out_bias and qwen.sliding_window is None
    llama_bias = ModelConfig.from_hf({**HF4_LLAMA, "attention_bias": True})
    assert llama_bias.attention_bias and llama_bias.attention_out_bias
    mistral = ModelConfig.from_hf({**HF4_LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 32})
    assert mistral.sliding_window == 32 and mistral.max_seq_len == 32


def _llama_layout_params(c: ModelConfig) -> int:
    """The Llama layout's parameter count in closed form (the oracle for ``num_params``)."""
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attn = 2 * h * q + 2 * h * kv + (q + 2 * kv) * c.attention_bias + h * c.attention_out_bias
    layer = attn + 3 * h * c.intermediate_size + 2 * h
    return c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + c.num_layers * layer + h


@pytest.mark.parametrize("changes", [{}, {"tie_word_embeddings": True}, {"attention_bias": True, "attention_out_bias": True},
                                     {"architecture": "Qwen3ForCausalLM", "head_dim": 24}])
def test_num_params_counts_every_parameter(changes):
    config = CFG.replace(**changes)
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(abstract))) == _llama_layout_params(config)
    qk_norms = 2 * config.head_dim * config.num_layers if config.architecture == "Qwen3ForCausalLM" else 0
    assert config.num_params == _llama_layout_params(config) + qk_norms


def test_kv_bytes_per_token():
    assert CFG.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 4
    assert CFG.kv_bytes_per_token("bfloat16") == 2 * 2 * 2 * 16 * 2
    assert CFG.replace(dtype="bfloat16").kv_bytes_per_token() == 256


def test_rope_llama3_scaling_bands():
    plain = rope_inv_freq(CFG.replace(rope_theta=500000.0))
    np.testing.assert_allclose(plain, 500000.0 ** (-np.arange(0, 16, 2) / 16), rtol=1e-6)
    scaled = rope_inv_freq(CFG.replace(rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64)))
    wavelen = 2 * np.pi / plain
    high = wavelen < 64 / 4  # short wavelengths: untouched
    low = wavelen > 64 / 1  # long wavelengths: slowed by the factor
    assert high.any() and low.any() and (~high & ~low).any()
    np.testing.assert_allclose(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / 8.0, rtol=1e-6)
    mid = ~high & ~low
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8.0)).all()


@functools.cache
def _model():
    return init_params(CFG, seed=1)


def test_dense_forward_is_causal():
    graphdef, params = _model()
    fn = jax.jit(functools.partial(dense_forward, graphdef))
    rng = np.random.default_rng(0)
    a = rng.integers(0, 128, (2, 12)).astype(np.int32)
    b = a.copy()
    b[:, 7:] = rng.integers(0, 128, (2, 5))
    la, lb = np.asarray(fn(params, a)), np.asarray(fn(params, b))
    np.testing.assert_array_equal(la[:, :7], lb[:, :7])
    assert np.abs(la[:, 7:] - lb[:, 7:]).max() > 1e-3


def test_contiguous_cache_decoding_equals_dense():
    """The non-paged baseline cache (used by experiments/decode_step) is exact too."""
    graphdef, params = _model()
    b, max_len, t = 2, 32, 8

    @jax.jit
    def step(params, kv, tokens, lengths, q_lens):
        positions = (lengths - q_lens)[:, None] + jnp.arange(tokens.shape[1])[None, :]
        attend = make_contiguous_attend(positions, lengths, q_lens)
        hidden, kv = forward(graphdef, params, tokens, positions, kv, attend)
        last = hidden[jnp.arange(b), jnp.maximum(q_lens - 1, 0)]
        return logits_from_hidden(graphdef, params, last), kv

    rng = np.random.default_rng(1)
    seqs = [list(rng.integers(0, 128, 5)), list(rng.integers(0, 128, 8))]
    kv = init_contiguous_kv(CFG, b, max_len)
    assert isinstance(kv, ContiguousKV) and kv.k.shape == (2, b, 2, max_len, 16)
    tokens = np.zeros((b, t), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    lengths = np.array([5, 8], np.int32)
    logits, kv = step(params, kv, tokens, lengths, lengths)
    dense = jax.jit(functools.partial(dense_forward, graphdef))
    for _ in range(3):
        want = np.zeros((b, max_len), np.int32)
        for i, s in enumerate(seqs):
            want[i, : len(s)] = s
        ref = np.asarray(dense(params, want))[np.arange(b), lengths - 1]
        np.testing.assert_allclose(np.asarray(logits), ref, rtol=1e-5, atol=1e-5)
        nxt = np.asarray(logits).argmax(-1)
        for i in range(b):
            seqs[i].append(int(nxt[i]))
        lengths = lengths + 1
        pad = np.zeros((b, t), np.int32)
        pad[:, 0] = nxt
        logits, kv = step(params, kv, pad, lengths, np.ones(b, np.int32))


def test_rope_scaling_stretches_the_context_as_vllm_derives_it():
    from paged_jax.steps import validate_prompt

    base = CFG.replace(max_position_embeddings=64)
    assert base.max_seq_len == 64
    linear = base.replace(rope_scaling=RopeScaling(2.0, rope_type="linear"))
    yarn = base.replace(rope_scaling=RopeScaling(4.0, original_max_position_embeddings=32, rope_type="yarn"))
    llama3 = base.replace(rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16))  # states its extended length itself
    assert (linear.max_seq_len, yarn.max_seq_len, llama3.max_seq_len) == (128, 128, 64)
    assert yarn.replace(sliding_window=100).max_seq_len == 100
    validate_prompt([1] * 100, model_config=yarn, max_new_tokens=28)
    with pytest.raises(ValueError, match=r"exceeds the model's context of 128 \(yarn RoPE scaling by 4\)"):
        validate_prompt([1] * 100, model_config=yarn, max_new_tokens=29)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings = 64"):
        validate_prompt([1] * 60, model_config=llama3, max_new_tokens=5)
