"""The length-aware XLA attention (dispatch's "xla") against the reference, shape by shape.

Fresh random pages and tables every case; every slot no row owns (free blocks, the stale
tail of each last block) holds NaN, so a masked key that leaks shows up. fp32 is compared
at rtol/atol 1e-5, bf16 loosely.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention import (
    paged_attention,
    paged_attention_blocked,
    paged_attention_chunk,
    paged_chunk_attention,
    paged_decode_attention,
    paged_decode_attention_blocked,
)


def _case(seed, *, b, t, hq, hkv, bs, d, p, n, shared_prefix=False):
    """Random queries/pages; rows own random disjoint blocks (or share a prefix)."""
    rng = np.random.default_rng(seed)
    k_pages = rng.standard_normal((hkv, n, bs, d)).astype(np.float32)
    v_pages = rng.standard_normal((hkv, n, bs, d)).astype(np.float32)
    cap = min(p * bs, (n // b) * bs)  # tokens a row can hold with disjoint blocks
    lengths = rng.integers(0, cap + 1, b)
    lengths[rng.integers(b)] = cap  # the longest possible row is always there
    q_lens = np.minimum(rng.integers(1, t + 1, b), lengths)
    perm = rng.permutation(n)
    tables = np.full((b, p), -1, np.int32)
    owned = np.zeros((n, bs), bool)
    used = 0
    for i, length in enumerate(lengths):
        nb = -(-int(length) // bs)
        if shared_prefix and i > 0 and nb >= 2:
            tables[i, :1] = tables[0, :1]  # a forked prefix block, read by two rows
            tables[i, 1:nb] = perm[used : used + nb - 1]
            used += nb - 1
        else:
            tables[i, :nb] = perm[used : used + nb]
            used += nb
        for j in range(int(length)):
            owned[tables[i, j // bs], j % bs] = True
    if shared_prefix:
        lengths = np.where((lengths >= 2 * bs) | (np.arange(b) == 0), lengths, 0)
        q_lens = np.minimum(q_lens, lengths)
    k_pages[:, ~owned] = np.nan
    v_pages[:, ~owned] = np.nan
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    return q, k_pages, v_pages, tables, lengths.astype(np.int32), q_lens.astype(np.int32)


# (b, t, hq, hkv, bs, d, p, n): decode and chunk, MHA/GQA/MQA, ragged everything, batch
# sizes that are and are not multiples of the group size, tables narrower than a chunk.
SHAPES = [
    (1, 1, 4, 4, 4, 8, 6, 12),
    (5, 1, 4, 2, 4, 8, 9, 48),
    (17, 1, 8, 2, 16, 16, 5, 96),
    (9, 1, 4, 1, 8, 32, 3, 40),
    (3, 4, 4, 2, 4, 8, 7, 30),
    (2, 16, 4, 2, 4, 16, 10, 24),
    (6, 3, 8, 8, 2, 8, 12, 80),
]
TUNING = [
    dict(),
    dict(query_tile=1, blocks_per_chunk=1, tail_blocks=1),
    dict(query_tile=16, min_groups=1, blocks_per_chunk=3, tail_blocks=3),  # one group of all rows
    dict(query_tile=4, min_groups=2, blocks_per_chunk=4, tail_blocks=3),  # tail chunks not dividing main ones
]


@functools.cache
def _blocked(**tuning):
    return jax.jit(functools.partial(paged_attention_blocked, **tuning))


_reference = jax.jit(paged_chunk_attention)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"b{s[0]}t{s[1]}h{s[2]}:{s[3]}bs{s[4]}d{s[5]}p{s[6]}" for s in SHAPES])
@pytest.mark.parametrize("tuning", TUNING, ids=["default", "tile1chunk1", "tile16chunk3", "tile4chunk4tail3"])
def test_blocked_matches_reference(shape, tuning):
    b, t, hq, hkv, bs, d, p, n = shape
    for seed in range(3):
        q, kp, vp, tables, lens, qls = _case(seed, b=b, t=t, hq=hq, hkv=hkv, bs=bs, d=d, p=p, n=n)
        out = np.asarray(_blocked(**tuning)(q, kp, vp, tables, lens, qls))
        ref = np.asarray(_reference(q, kp, vp, tables, lens, qls))
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
        past = np.arange(t)[None, :] >= qls[:, None]
        assert not out[past].any()  # rows past q_len (and keyless rows) are exactly 0


def test_blocked_shared_prefix_blocks_and_scale():
    q, kp, vp, tables, lens, qls = _case(11, b=6, t=2, hq=4, hkv=2, bs=4, d=8, p=8, n=40, shared_prefix=True)
    out = paged_attention_blocked(q, kp, vp, tables, lens, qls, scale=0.7, blocks_per_chunk=2)
    ref = paged_chunk_attention(q, kp, vp, tables, lens, qls, scale=0.7)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_blocked_decode_and_padding_rows():
    q, kp, vp, tables, lens, _ = _case(12, b=7, t=1, hq=4, hkv=2, bs=4, d=8, p=6, n=42)
    lens[[1, 4]] = 0  # padding rows
    out = np.asarray(paged_decode_attention_blocked(q[:, 0], kp, vp, tables, lens))
    ref = np.asarray(paged_decode_attention(q[:, 0], kp, vp, tables, lens))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert not out[[1, 4]].any()


def test_blocked_all_layers_pages_with_layer_index():
    """5-D pages + ``layer`` read exactly that layer (other layers hold other data)."""
    q, kp, vp, tables, lens, qls = _case(13, b=4, t=2, hq=4, hkv=2, bs=4, d=8, p=5, n=24)
    rng = np.random.default_rng(0)
    k_all = np.stack([rng.standard_normal(kp.shape).astype(np.float32), kp, np.full(kp.shape, np.nan, np.float32)])
    v_all = np.stack([rng.standard_normal(vp.shape).astype(np.float32), vp, np.full(vp.shape, np.nan, np.float32)])
    want = np.asarray(paged_attention_blocked(q, kp, vp, tables, lens, qls))
    got = paged_attention_blocked(q, k_all, v_all, tables, lens, qls, layer=1)
    np.testing.assert_array_equal(np.asarray(got), want)
    dec = paged_attention(q[:, 0], k_all, v_all, tables, lens, layer=1, impl="xla")
    np.testing.assert_allclose(
        np.asarray(dec), np.asarray(paged_decode_attention(q[:, 0], kp, vp, tables, lens)), rtol=1e-5, atol=1e-5
    )
    ref = paged_attention_chunk(q, k_all, v_all, tables, lens, qls, layer=1, impl="reference")
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(paged_chunk_attention(q, kp, vp, tables, lens, qls)))
    with pytest.raises(ValueError, match="layer"):
        paged_attention_blocked(q, k_all, v_all, tables, lens, qls)
    with pytest.raises(ValueError, match="layer"):
        paged_attention_blocked(q, kp, vp, tables, lens, qls, layer=0)
    with pytest.raises(ValueError, match="layer"):
        paged_attention(q[:, 0], k_all, v_all, tables, lens, impl="reference")


def test_blocked_bf16_close_to_fp32():
    q, kp, vp, tables, lens, qls = _case(14, b=5, t=3, hq=4, hkv=2, bs=4, d=16, p=6, n=30)
    kp, vp = np.nan_to_num(kp), np.nan_to_num(vp)
    ref = paged_chunk_attention(q, kp, vp, tables, lens, qls)
    low = paged_attention_blocked(*(jnp.asarray(x, jnp.bfloat16) for x in (q, kp, vp)), tables, lens, qls)
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(low, np.float32), np.asarray(ref), atol=3e-2)


def test_blocked_rejects_bad_arguments():
    q, kp, vp, tables, lens, qls = _case(15, b=2, t=1, hq=4, hkv=2, bs=4, d=8, p=3, n=8)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention_blocked(q[:, :, :3], kp, vp, tables, lens, qls)
    with pytest.raises(ValueError, match="must be >= 1"):
        paged_attention_blocked(q, kp, vp, tables, lens, qls, blocks_per_chunk=0)
    with pytest.raises(ValueError, match="tail_blocks=0"):
        paged_attention_blocked(q, kp, vp, tables, lens, qls, tail_blocks=0)
    with pytest.raises(ValueError, match="min_groups=0"):
        paged_attention_blocked(q, kp, vp, tables, lens, qls, min_groups=0)


def test_blocked_cost_follows_lengths_not_table_width():
    """One compiled program serves every length, and its inner loop runs as many chunks
    as the longest row of each group needs: the trip count is computed from the lengths
    (a while loop with a data-dependent bound), not from the table's width."""
    q, kp, vp, tables, lens, qls = _case(16, b=4, t=1, hq=4, hkv=2, bs=4, d=8, p=64, n=300)
    fn = jax.jit(paged_attention_blocked)
    hlo = fn.lower(q, kp, vp, tables, lens, qls).as_text()
    # Loops over groups, then whole chunks, then tail chunks: none unrolled over the width.
    assert hlo.count("stablehlo.while") == 3
    short = lens.copy()
    short[:] = np.minimum(short, 4)
    before = fn._cache_size()
    fn(q, kp, vp, tables, short, np.minimum(qls, short))
    fn(q, kp, vp, tables, lens, qls)
    assert fn._cache_size() - before <= 1  # no retrace per length


def _while_shapes(hlo: str) -> list[str]:
    return [line for line in hlo.splitlines() if re.search(r"\swhile\(", line)]


def test_model_step_reads_layers_in_place():
    """Inside the jitted decode step the attention loops take every layer's pages, not a
    layer slice: a slice taken outside a loop would be materialised (one layer's pages
    copied per layer per step, i.e. the whole pool per step)."""
    from paged_jax import CacheConfig
    from paged_jax.cache import init_state
    from paged_jax.model import ModelConfig, init_params
    from paged_jax.steps import init_pages_for, make_step_fns

    cfg = ModelConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=256,
    )
    cc = CacheConfig(num_blocks=48, block_size=4, max_seqs=8, max_blocks_per_seq=18)
    _, params = init_params(cfg, 0)
    fns = make_step_fns(cfg, attention_impl="xla")
    state, pages = init_state(cc), init_pages_for(cfg, cc)
    hlo = fns.decode.lower(params, state, pages, jnp.zeros(4, jnp.int32), jnp.arange(4, dtype=jnp.int32))
    loops = _while_shapes(hlo.compile().as_text())
    layer_shape, all_shape = "f32[2,48,4,16]", "f32[2,2,48,4,16]"
    assert loops and all(all_shape in line for line in loops)
    assert not any(layer_shape in line for line in loops)


def test_xla_dispatch_sends_sub_fp32_pages_to_the_reference_on_cpu():
    """bf16 pages on XLA:CPU: "xla" is the reference (the blocked loop would convert the
    whole layer every call); elsewhere, or in fp32, it is the blocked implementation."""
    q, kp, vp, tables, lens, qls = _case(17, b=3, t=2, hq=4, hkv=2, bs=4, d=8, p=5, n=20)
    q16, k16, v16 = (jnp.asarray(np.nan_to_num(x), jnp.bfloat16) for x in (q, kp, vp))
    got = paged_attention_chunk(q16, k16, v16, tables, lens, qls, impl="xla")
    want = paged_attention_chunk(q16, k16, v16, tables, lens, qls, impl="reference")
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    text = jax.jit(functools.partial(paged_attention_chunk, impl="xla")).lower(q, kp, vp, tables, lens, qls).as_text()
    assert "stablehlo.while" in text  # fp32: the blocked loops


def test_blocked_single_query_rows_without_a_query_are_zero():
    """T == 1 takes a shortcut mask; a row with keys but q_len 0 must still output 0."""
    q, kp, vp, tables, lens, _ = _case(18, b=6, t=1, hq=4, hkv=2, bs=4, d=8, p=6, n=36)
    lens[:] = [5, 9, 24, 1, 13, 4]  # every row holds keys (its own blocks, from _case's cap)
    tables = np.arange(36, dtype=np.int32).reshape(6, 6)
    kp, vp = np.nan_to_num(kp), np.nan_to_num(vp)
    qls = np.array([1, 0, 1, 0, 1, 0], np.int32)
    out = np.asarray(paged_attention_blocked(q, kp, vp, tables, lens, qls))
    ref = np.asarray(paged_chunk_attention(q, kp, vp, tables, lens, qls))
    assert np.isfinite(out).all() and np.abs(out[[0, 2, 4]]).sum() > 0
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert not out[[1, 3, 5]].any()
