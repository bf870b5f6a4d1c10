"""Hugging Face checkpoints: our loader + model reproduce transformers' logits and greedy
tokens (fixtures made by scripts/make_hf_fixtures.py), and bad checkpoints fail clearly.

The parity tests run every fixture directory holding an ``expected.npz`` (a new fixture is
tested without editing a list), and every registered family must have one."""

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from paged_jax import CacheConfig
from paged_jax.buckets import pad_batch
from paged_jax.cache import init_state, open_sequences, raise_for_status
from paged_jax.model import FAMILIES, CheckpointError, ModelConfig, dense_forward, load_model, save_params
from paged_jax.steps import init_pages_for, make_step_fns

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
NAMES = ("llama", "qwen2", "mistral", "qwen3")
# Every HF checkpoint fixture with transformers' outputs (llama_yarn: yarn RoPE, by
# scripts/make_rope_fixture.py); fixtures/gguf holds GGUF files (tests/test_gguf.py).
PARITY = tuple(sorted(n for n in os.listdir(FIXTURES)
                     if all(os.path.exists(os.path.join(FIXTURES, n, f)) for f in ("expected.npz", "config.json"))))
# The inner loop (make test-fast) runs the paged-greedy parity on these two (plain Llama and
# Qwen3's per-head norms); the full suite runs it on every fixture.
FAST_PARITY = ("llama", "qwen3")
ATOL = 1e-4
T = 16  # every prompt is padded to this length: one compiled shape per model


def _expected(name):
    return np.load(os.path.join(FIXTURES, name, "expected.npz"))


@functools.cache
def _load(name):
    return load_model(os.path.join(FIXTURES, name), dtype=jnp.float32)


def _metadata():
    with open(os.path.join(FIXTURES, "metadata.json")) as f:
        return json.load(f)


def test_fixture_metadata_records_versions():
    meta = _metadata()
    assert meta["transformers"] and meta["torch"]
    assert meta["fixtures"]["llama"]["sharded"] and meta["fixtures"]["mistral"]["saved_dtype"] == "bfloat16"
    assert os.path.exists(os.path.join(FIXTURES, "llama", "model.safetensors.index.json"))
    assert set(NAMES) <= set(PARITY) and set(meta["fixtures"]) <= set(PARITY)


def test_every_registered_family_has_a_parity_fixture():
    """A family added to the registry (by this package) is not done until transformers'
    outputs for it are a fixture here: its parity tests then run without editing a list."""
    covered = set()
    for name in PARITY:
        with open(os.path.join(FIXTURES, name, "config.json")) as f:
            covered.add(json.load(f)["architectures"][0])
    ours = {a for a, f in FAMILIES.items() if f.module.__module__.startswith("paged_jax.")}
    assert ours <= covered, f"families without a fixture: {sorted(ours - covered)}"


def test_num_params_equals_transformers_count():
    counted = {n: f["num_parameters"] for n, f in _metadata()["fixtures"].items() if "num_parameters" in f}
    assert "qwen3" in counted  # has parameters beyond the Llama layout (its q/k norms)
    for name, want in counted.items():
        assert _load(name)[0].num_params == want, name


def test_configs_parsed_from_hf():
    llama, qwen2, mistral, qwen3 = (_load(n)[0] for n in NAMES)
    assert llama.architecture == "LlamaForCausalLM" and llama.rope_scaling.factor == 8.0
    assert (llama.num_heads, llama.num_kv_heads) == (4, 2) and not llama.tie_word_embeddings
    assert qwen2.attention_bias and not qwen2.attention_out_bias and qwen2.tie_word_embeddings
    assert mistral.num_kv_heads == 1 and mistral.sliding_window == 4096 and mistral.max_seq_len == 128
    assert qwen3.architecture == "Qwen3ForCausalLM" and (qwen3.num_heads, qwen3.num_kv_heads) == (4, 2)
    assert qwen3.head_dim == 32 != qwen3.hidden_size // qwen3.num_heads and qwen3.rms_norm_eps == 1e-6
    assert qwen3.tie_word_embeddings and not qwen3.attention_bias and not qwen3.attention_out_bias
    assert qwen3.sliding_window is None and qwen3.rope_scaling is None and qwen3.rope_theta == 1e6
    native, _, params = load_model(os.path.join(FIXTURES, "mistral"))  # the checkpoint's own dtype
    assert native.dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    upcast = _load("mistral")[2]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(upcast)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b))  # exact upcast


@pytest.mark.parametrize("name", PARITY)
def test_dense_logits_match_transformers(name):
    config, graphdef, params = _load(name)
    exp = _expected(name)
    prompts = [exp["prompt_0"], exp["prompt_1"]]
    tokens = np.zeros((2, T), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    logits = np.asarray(jax.jit(functools.partial(dense_forward, graphdef))(params, tokens))
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(logits[i, : len(p)], exp[f"logits_{i}"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", [n if n in FAST_PARITY else pytest.param(n, marks=pytest.mark.slow) for n in PARITY])
def test_paged_greedy_decoding_matches_transformers(name):
    """Prefill both prompts in one batch, then 8 greedy steps through the paged cache."""
    config, _, params = _load(name)
    exp = _expected(name)
    steps = exp["greedy_0"].shape[0]
    cc = CacheConfig(num_blocks=16, block_size=4, max_seqs=4, max_blocks_per_seq=8)
    fns = make_step_fns(config, attention_impl="xla")
    state, pages = init_state(cc, "random"), init_pages_for(config, cc)
    ids = np.array([2, 0], np.int32)
    state, status = open_sequences(state, jnp.asarray(ids))
    batch = pad_batch(ids, [exp["prompt_0"], exp["prompt_1"]], batch_buckets=[2], length_buckets=[T])
    logits, state, pages, status = fns.prefill(params, state, pages, *batch)
    raise_for_status("prefill", ids, status)
    for i in range(2):
        np.testing.assert_allclose(np.asarray(logits[i]), exp[f"logits_{i}"][-1], atol=ATOL, rtol=0)
    got_tokens = []
    for step in range(steps):
        logits = np.asarray(logits)
        for i in range(2):
            np.testing.assert_allclose(logits[i], exp[f"greedy_logits_{i}"][step], atol=ATOL, rtol=0)
        nxt = logits.argmax(-1).astype(np.int32)
        got_tokens.append(nxt)
        logits, state, pages, status = fns.decode(params, state, pages, jnp.asarray(nxt), jnp.asarray(ids))
        raise_for_status("decode", ids, status)
    got_tokens = np.stack(got_tokens, axis=1)
    for i in range(2):
        np.testing.assert_array_equal(got_tokens[i], exp[f"greedy_{i}"])


# --------------------------------------------------------------------------- bad checkpoints


@pytest.fixture
def qwen2_copy(tmp_path):
    target = tmp_path / "qwen2"
    shutil.copytree(os.path.join(FIXTURES, "qwen2"), target)
    return target


def _edit_config(path, **changes):
    with open(path / "config.json") as f:
        hf = json.load(f)
    hf.update(changes)
    with open(path / "config.json", "w") as f:
        json.dump(hf, f)


def _edit_tensors(path, fn):
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_unsupported_architecture_names_it_and_the_supported_ones(qwen2_copy):
    _edit_config(qwen2_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"):
        load_model(qwen2_copy)


def test_missing_tensor_is_named(qwen2_copy):
    _edit_tensors(qwen2_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_model(qwen2_copy)


def test_wrong_shape_names_tensor_and_both_shapes(qwen2_copy):
    _edit_config(qwen2_copy, intermediate_size=80)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.down_proj.weight' has shape \(64, 96\); the config implies \(64, 80\)"):
        load_model(qwen2_copy)


def test_dtype_mismatch_names_tensor(qwen2_copy):
    def to_fp16(t):
        t["model.norm.weight"] = t["model.norm.weight"].astype(np.float16)

    _edit_tensors(qwen2_copy, to_fp16)
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has dtype float16 but config.json declares float32"):
        load_model(qwen2_copy)


def test_integer_tensor_rejected(qwen2_copy):
    def to_int(t):
        t["model.norm.weight"] = t["model.norm.weight"].astype(np.int32)

    _edit_tensors(qwen2_copy, to_int)
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has dtype I32"):
        load_model(qwen2_copy)


def test_no_weights_at_all(tmp_path):
    shutil.copy(os.path.join(FIXTURES, "qwen2", "config.json"), tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(tmp_path)


def test_save_params_round_trip(tmp_path):
    config, _, params = _load("qwen2")
    save_params(tmp_path, params)
    shutil.copy(os.path.join(FIXTURES, "qwen2", "config.json"), tmp_path / "config.json")
    config2, _, params2 = load_model(tmp_path, dtype=jnp.float32)
    assert config2 == config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert ModelConfig.from_hf(tmp_path).num_params == sum(x.size for x in jax.tree.leaves(params))
