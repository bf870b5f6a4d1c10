"""The kernels lower for CUDA (Pallas -> Triton) for every configuration we support.

No GPU is needed: ``jax.export`` with ``platforms=["cuda"]`` runs the Pallas Triton
lowering on the CPU and embeds the Triton module in a ``__gpu$xla.gpu.triton`` custom
call.  The lowering rejects what Triton cannot compile (non-power-of-two tiles,
unsupported ops), so this catches GPU-only breakage that interpret mode cannot.  Nothing
is executed.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.paged_attention import (
    DEFAULT_MASK_VALUE,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_HEAD_DIMS,
    paged_attention,
    paged_attention_grid,
)
from pallas_kernels.paged_attention_chunk import paged_attention_chunk

TRITON_CALL = "__gpu$xla.gpu.triton"
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
GQA = ((4, 4), (16, 4), (32, 4))  # (num_q_heads, num_kv_heads): group 1, 4, 8
S = jax.ShapeDtypeStruct


def _export_for_cuda(fn, *args):
    """jax.export for CUDA; returns the StableHLO text, or skips if CUDA export is absent."""
    try:
        disabled = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled)(*args)
    except (AttributeError, NotImplementedError) as e:
        if "cuda" in str(e).lower() or "export" in str(e).lower():
            pytest.skip(f"CUDA lowering via jax.export is unavailable here: {e}")
        raise
    return exported.mlir_module()


def _pages(dtype, head_dim, block_size, num_kv_heads, num_blocks=1000):
    return S((num_kv_heads, num_blocks, block_size, head_dim), dtype)


# Every dtype x head_dim x block_size x GQA ratio, both kernels.  Splits and blocks per
# step rotate through their values so every combination is covered across the sweep
# without multiplying the (already cheap) case count.
CASES = list(itertools.product(DTYPES, SUPPORTED_HEAD_DIMS, SUPPORTED_BLOCK_SIZES, GQA))


def _tuning(index: int, block_size: int):
    splits = (1, 4, 2)[index % 3]
    bps = max(1, 16 // block_size) * (1, 2)[index % 2]  # >= 16 tokens per step
    if bps * block_size > 256:
        bps = 256 // block_size
    return splits, bps


@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[f"{jnp.dtype(d).name}-d{h}-bs{b}-g{q // k}" for d, h, b, (q, k) in CASES]
)
def test_decode_lowers_for_cuda(index):
    dtype, head_dim, block_size, (hq, hk) = CASES[index]
    splits, bps = _tuning(index, block_size)
    batch, width = 8, 64
    fn = functools.partial(paged_attention, num_splits=splits, blocks_per_step=bps)
    text = _export_for_cuda(
        fn,
        S((batch, hq, head_dim), dtype),
        _pages(dtype, head_dim, block_size, hk),
        _pages(dtype, head_dim, block_size, hk),
        S((batch, width), jnp.int32),
        S((batch,), jnp.int32),
    )
    assert TRITON_CALL in text


@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[f"{jnp.dtype(d).name}-d{h}-bs{b}-g{q // k}" for d, h, b, (q, k) in CASES]
)
def test_chunk_lowers_for_cuda(index):
    dtype, head_dim, block_size, (hq, hk) = CASES[index]
    splits, bps = _tuning(index, block_size)
    chunk = (4, 16, 7)[index % 3]  # speculative verify, chunked prefill, odd size
    batch, width = 4, 64
    fn = functools.partial(paged_attention_chunk, num_splits=splits, blocks_per_step=bps)
    text = _export_for_cuda(
        fn,
        S((batch, chunk, hq, head_dim), dtype),
        _pages(dtype, head_dim, block_size, hk),
        _pages(dtype, head_dim, block_size, hk),
        S((batch, width), jnp.int32),
        S((batch,), jnp.int32),
        S((batch,), jnp.int32),
    )
    assert TRITON_CALL in text


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_warps=8, num_stages=3),
        dict(num_warps=2, num_stages=1),
        dict(blocks_per_step=16),  # 256 tokens of block size 16 per step
    ],
)
def test_decode_tuning_variants_lower(kwargs):
    text = _export_for_cuda(
        functools.partial(paged_attention, **kwargs),
        S((64, 32, 128), jnp.bfloat16),
        _pages(jnp.bfloat16, 128, 16, 4),
        _pages(jnp.bfloat16, 128, 16, 4),
        S((64, 256), jnp.int32),
        S((64,), jnp.int32),
    )
    assert TRITON_CALL in text


@pytest.mark.parametrize("block_rows", [16, 32, 64, 128])
def test_chunk_block_rows_lower(block_rows):
    text = _export_for_cuda(
        functools.partial(paged_attention_chunk, block_rows=block_rows, num_splits=2),
        S((2, 64, 32, 128), jnp.bfloat16),
        _pages(jnp.bfloat16, 128, 32, 4),
        _pages(jnp.bfloat16, 128, 32, 4),
        S((2, 128), jnp.int32),
        S((2,), jnp.int32),
        S((2,), jnp.int32),
    )
    assert TRITON_CALL in text


def test_large_group_lowers():
    """64 q heads on one kv head: a 64-row q tile."""
    text = _export_for_cuda(
        paged_attention,
        S((2, 64, 128), jnp.bfloat16),
        _pages(jnp.bfloat16, 128, 16, 1),
        _pages(jnp.bfloat16, 128, 16, 1),
        S((2, 32), jnp.int32),
        S((2,), jnp.int32),
    )
    assert TRITON_CALL in text


def test_lowering_check_is_not_vacuous():
    """A 24-row q tile (not a power of two) must be rejected by the Triton lowering."""
    fn = functools.partial(
        paged_attention_grid,
        scale=1.0,
        blocks_per_step=1,
        num_splits=1,
        num_warps=4,
        num_stages=2,
        interpret=False,
        mask_value=DEFAULT_MASK_VALUE,
    )
    with pytest.raises(Exception, match="power of 2"):
        _export_for_cuda(
            fn,
            S((2, 2, 24, 64), jnp.bfloat16),
            _pages(jnp.bfloat16, 64, 16, 2),
            _pages(jnp.bfloat16, 64, 16, 2),
            S((2, 16), jnp.int32),
            S((2,), jnp.int32),
        )
