"""Quantised KV pages through the model step and the engine, on the real tiny Llama
checkpoint: a copy-on-write that forgets the scales is caught (the silent failure
quantised caches are known for), and greedy outputs with quantised pages do not change
under memory pressure (swap, recompute, prefix-cache eviction, forks)."""

from __future__ import annotations

import functools
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import steps
from paged_jax.cache import check_invariants, fork, init_state, open_sequences
from paged_jax.config import CacheConfig
from paged_jax.engine import LLM, SamplingParams
from paged_jax.kv import copy_blocks, init_pages
from paged_jax.model import load_model

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "llama")
QUANTIZED = ["int8", "int8_channel", "fp8_e4m3"]
CONFIG = dict(block_size=8, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16, debug_checks=True)
SMALL = 18
GREEDY = SamplingParams(temperature=0, max_tokens=16)


def _copy_values_only(pages, src, dst):
    """The bug: block values copied, scales left behind (the destination keeps whatever
    scales its previous owner wrote, here zeros)."""
    moved = copy_blocks({"k": pages.k, "v": pages.v}, src, dst)
    return pages.replace(k=moved["k"], v=moved["v"])


@functools.cache
def _model():
    config, _, params = load_model(FIXTURE)
    return config, params


def _fork_and_decode(name: str, copy) -> np.ndarray:
    """Row 0 prefills 11 tokens (one full block of 8 and a partial one), is forked into
    row 1, and both decode two different tokens: the first decode copies the shared
    partial block on write. Returns f32[2 steps, 2 rows, vocab] logits."""
    config, params = _model()
    cc = CacheConfig(num_blocks=8, block_size=8, max_seqs=2, max_blocks_per_seq=4)
    with mock.patch.object(steps, "copy_blocks", copy):  # a fresh jit: nothing cached elsewhere
        step = jax.jit(functools.partial(steps._model_step, steps.abstract_graphdef(config), config, "xla"))
        state, _ = open_sequences(init_state(cc), jnp.array([0], jnp.int32))
        pages = steps.init_pages_for(config, cc, kv_cache_dtype=name)
        prompt = jnp.arange(3, 14, dtype=jnp.int32)[None]
        _, state, pages, status = step(params, state, pages, prompt, jnp.array([0]), jnp.array([11]))
        state, status2 = fork(state, jnp.array([0], jnp.int32), jnp.array([1], jnp.int32))
        assert not np.asarray(status).any() and not np.asarray(status2).any()
        out = []
        for tokens in ([[40], [90]], [[41], [91]]):
            logits, state, pages, status = step(
                params, state, pages, jnp.array(tokens, jnp.int32), jnp.array([0, 1]), jnp.array([1, 1])
            )
            assert not np.asarray(status).any()
            out.append(np.asarray(logits))
        check_invariants(state)
    return np.stack(out)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int8", "int8_channel"])  # fp8 shares int8's per-token path
def test_copy_on_write_carries_scales(name):
    """Our copy keeps both rows' logits equal to the same computation without sharing
    (each row forked from an identical prefill, so a fork changes nothing); a copy that
    moves values without scales silently changes them (finite, wrong)."""
    good = _fork_and_decode(name, copy_blocks)
    bad = _fork_and_decode(name, _copy_values_only)
    config, params = _model()
    fns = steps.make_step_fns(config, attention_impl="xla")
    cc = CacheConfig(num_blocks=8, block_size=8, max_seqs=2, max_blocks_per_seq=4)
    for row, tokens in ((0, (40, 41)), (1, (90, 91))):
        state, _ = open_sequences(init_state(cc), jnp.array([0], jnp.int32))
        pages = steps.init_pages_for(config, cc, kv_cache_dtype=name)
        prompt = jnp.arange(3, 14, dtype=jnp.int32)[None]
        _, state, pages, _ = fns.prefill(params, state, pages, prompt, jnp.array([0]), jnp.array([11]))
        for i, token in enumerate(tokens):
            logits, state, pages, _ = fns.decode(params, state, pages, jnp.array([token]), jnp.array([0]))
            np.testing.assert_allclose(good[i, row], np.asarray(logits[0]), rtol=1e-5, atol=1e-5)
    assert np.isfinite(bad).all()
    assert np.abs(bad - good).max() > 1e-2  # one of the rows read a block with wrong scales


# ----------------------------------------------------------------------------- engine
def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    shared = rng.integers(0, 256, 17).tolist()  # a prefix several prompts share (cache hits)
    return [shared + rng.integers(0, 256, rng.integers(1, 20)).tolist() for _ in range(4)] + [
        rng.integers(0, 256, rng.integers(1, 44)).tolist() for _ in range(4)
    ]


# fp8 shares int8's per-token write and read paths (its numerics: tests/test_kv_quant.py).
@pytest.mark.slow
@pytest.mark.parametrize("name", ["int8", "int8_channel"])
def test_quantized_outputs_do_not_depend_on_memory_pressure(prompts, name):
    """Each prompt alone (no pressure) vs all at once in a pool that preempts by swap,
    vs the prefix cache evicting under the same pool (a second pass hits), vs two
    completions per request sharing the prompt (copy-on-write). Per-token formats also
    survive recompute preemption and prefill chunking. Per-channel scales depend on how
    a block was written (in one prefill chunk or token by token, ``kv.quant``), so that
    format runs with a token budget that prefills every prompt in one chunk, alone or
    batched, and without recompute (which refills a block in one chunk)."""
    config = dict(CONFIG, max_num_batched_tokens=256) if name == "int8_channel" else CONFIG
    llm = LLM(FIXTURE, num_gpu_blocks=SMALL, kv_cache_dtype=name, **config)
    alone = [_tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    swap = LLM(FIXTURE, num_gpu_blocks=SMALL, kv_cache_dtype=name, preemption_mode="swap", **config)
    assert _tokens(swap.generate(prompts, GREEDY, use_tqdm=False)) == alone
    assert swap.stats()["preemptions"]["swap"] > 0
    cached = LLM(FIXTURE, num_gpu_blocks=SMALL, kv_cache_dtype=name, preemption_mode="swap",
                 enable_prefix_caching=True, **config)
    assert _tokens(cached.generate(prompts, GREEDY, use_tqdm=False)) == alone
    assert _tokens(cached.generate(prompts, GREEDY, use_tqdm=False)) == alone
    stats = cached.stats()
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["prefix_cache_evictions"] > 0
    pair = SamplingParams(temperature=0, max_tokens=16, n=2)
    for out, want in zip(swap.generate(prompts[:4], pair, use_tqdm=False), alone[:4]):
        assert [c.token_ids for c in out.outputs] == [want, want]
    if name != "int8_channel":
        recompute = LLM(FIXTURE, num_gpu_blocks=SMALL, kv_cache_dtype=name, **config)
        assert _tokens(recompute.generate(prompts, GREEDY, use_tqdm=False)) == alone
        assert recompute.stats()["preemptions"]["recompute"] > 0
    for engine in (swap, cached):
        assert engine.inspect().num_free + engine.stats()["cached_blocks"] == SMALL


def test_byte_budget_counts_scales_and_bad_names_fail_first():
    """kv_cache_memory_bytes buys more blocks of a smaller format, scales included;
    an unknown name fails before any weight is read."""
    config, _ = _model()
    budget = 200_000
    blocks = {}
    for name in ("auto", *QUANTIZED):
        llm = LLM(FIXTURE, kv_cache_memory_bytes=budget, kv_cache_dtype=name, block_size=8, max_num_seqs=2)
        pages = init_pages(config.num_layers, config.num_kv_heads, 1, 8, config.head_dim, "float32", name)
        per_block = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pages))
        assert llm.num_gpu_blocks == budget // per_block
        assert llm.stats()["kv_cache_dtype"] == name and llm.stats()["bytes_per_block"] == per_block
        blocks[name] = budget // per_block
    assert blocks["int8"] > 3 * blocks["auto"]  # f32 pages: 4 bytes -> 1 byte + a bf16 scale per 16
    with mock.patch("paged_jax.model.load_model") as load:
        with pytest.raises(ValueError, match=r"kv_cache_dtype='int4': choose one of \['auto', 'float32'"):
            LLM(FIXTURE, kv_cache_dtype="int4")
        load.assert_not_called()
