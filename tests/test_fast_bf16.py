"""The 16-bit CPU path: bf16/f16 weights and KV as integer bits where XLA:CPU lacks the
float op (KV scatters/gathers, the layer scan's weight slices), dots accumulated in f32.

Checked here: the packed path gives the unpacked path's logits bit for bit, stays close to
fp32 on random inputs, compiles once per shape, and its optimised HLO holds no whole-pool or
whole-weights convert or copy (what made a bf16 decode step ~10x slower than fp32).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.cache import init_state, open_sequences
from paged_jax.config import CacheConfig
from paged_jax.model import ModelConfig, init_params
from paged_jax.model.llama import as_bits, from_bits, pack_params
from paged_jax.steps import init_pages_for, make_step_fns

CFG = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)
CC = CacheConfig(num_blocks=64, block_size=8, max_seqs=4, max_blocks_per_seq=8)


def _run(dtype: str, *, pack: bool, traces=None):
    """Prefill 2 rows (9 and 14 tokens), then 3 decode steps: float32 logits [8, vocab]."""
    cfg = CFG.replace(dtype=dtype)
    _, params = init_params(CFG, seed=1)  # fp32 weights, rounded to dtype: the same model
    params = jax.tree.map(lambda x: x.astype(cfg.jnp_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    if pack:
        params = pack_params(params)
    fns = make_step_fns(cfg, attention_impl="xla",
                        on_trace=None if traces is None else (lambda name, shape: traces.append(name)))
    state = init_state(CC)
    ids = jnp.array([0, 1], jnp.int32)
    state, _ = open_sequences(state, ids)
    pages = init_pages_for(cfg, CC)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 16)), jnp.int32)
    logits, state, pages, status = fns.prefill(params, state, pages, tokens, ids, jnp.array([9, 14], jnp.int32))
    out = [np.asarray(logits)]
    for _ in range(3):
        tok = jnp.asarray(rng.integers(0, CFG.vocab_size, 2), jnp.int32)
        logits, state, pages, status = fns.decode(params, state, pages, tok, ids)
        assert (np.asarray(status) == 0).all()
        out.append(np.asarray(logits))
    return np.concatenate(out), fns, params, state, pages


@pytest.fixture(scope="module")
def fp32():
    return _run("float32", pack=False)[0]


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.slow)])
def test_packed_equals_unpacked_and_close_to_fp32(dtype, fp32):
    traces: list[str] = []
    packed = _run(dtype, pack=True, traces=traces)[0]
    unpacked = _run(dtype, pack=False)[0]
    np.testing.assert_array_equal(packed, unpacked)  # bits are storage only
    assert np.isfinite(packed).all()
    err = np.abs(packed - fp32).max()
    assert err <= 0.05 * np.abs(fp32).max(), (dtype, err, np.abs(fp32).max())
    assert (packed.argmax(-1) == fp32.argmax(-1)).mean() >= 0.75
    assert traces == ["prefill", "decode"]  # one compile per shape, packed or not


def test_pack_params_holds_layer_bits_only():
    _, params = init_params(CFG.replace(dtype="bfloat16"), seed=0)
    packed = pack_params(params)
    flat = jax.tree_util.tree_flatten_with_path(packed)[0]
    for path, leaf in flat:
        in_layers = "layers" in jax.tree_util.keystr(path)
        assert leaf.dtype == (jnp.uint16 if in_layers else jnp.bfloat16), jax.tree_util.keystr(path)
    x = jnp.array([1.5, -2.25], jnp.bfloat16)
    assert from_bits(as_bits(x), jnp.bfloat16).tolist() == x.tolist()
    fp32 = init_params(CFG, seed=0)[1]
    assert jax.tree.leaves(pack_params(fp32))[0].dtype == jnp.float32  # 32-bit params untouched


def _stacked_converts(hlo: str, num_layers: int) -> list[str]:
    """Optimised-HLO instructions that produce a float array with a leading num_layers
    axis by conversion, fusion or copy: a whole-weights or whole-pool convert or copy."""
    pat = re.compile(rf"= (f32|bf16|f16|u16)\[{num_layers},[0-9,]+\]\S* (convert|fusion|copy|bitcast-convert)\(")
    # The pool's own scatters (u16 fusions named after them) update it in place.
    return [line.strip()[:160] for line in hlo.splitlines() if pat.search(line) and "scatter" not in line]


@pytest.mark.parametrize("kv_heads", [2, pytest.param(1, marks=pytest.mark.slow)])  # 1: XLA:CPU's layout trap
def test_decode_hlo_converts_no_stacked_weights_or_pool(kv_heads):
    """bf16 (f16 takes the same code path). Packed: no pool- or weights-sized convert/copy
    per step. Unpacked (the guard can fail): the stacked weights are converted or bitcast
    into copies on every call."""
    layers = 7  # a leading size no other array has: the stacked weights' and the pool's
    cfg = CFG.replace(num_layers=layers, dtype="bfloat16", num_kv_heads=kv_heads)
    fns = make_step_fns(cfg, attention_impl="xla")
    _, params = init_params(cfg, seed=0)
    state = init_state(CC)
    ids = jnp.arange(4, dtype=jnp.int32)
    state, _ = open_sequences(state, ids)
    pages = init_pages_for(cfg, CC)
    tok = jnp.zeros((4,), jnp.int32)
    packed = fns.decode.lower(pack_params(params), state, pages, tok, ids).compile().as_text()
    assert _stacked_converts(packed, layers) == []
    if kv_heads == 1:
        return
    unpacked = fns.decode.lower(params, state, pages, tok, ids).compile().as_text()
    assert _stacked_converts(unpacked, layers) != []
