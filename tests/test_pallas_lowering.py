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
import re

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


# ------------------------------------------------------------- layer-stacked pages
# Distinctive sizes so that the pool's shapes cannot be mistaken for any other tensor.
LAYERS, KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM = 3, 4, 101, 16, 128
STACKED = S((LAYERS, KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM), jnp.bfloat16)
STACKED_TYPE = f"tensor<{LAYERS}x{KV_HEADS}x{NUM_BLOCKS}x{BLOCK_SIZE}x{HEAD_DIM}xbf16>"
# Any tensor holding whole [.., num_blocks, block_size, head_dim] pools: the stacked pages
# themselves, or a copy of (part of) them such as pages[layer] or one head's pool.
POOL_TYPE = re.compile(rf"tensor<((?:\d+x)*){NUM_BLOCKS}x{BLOCK_SIZE}x{HEAD_DIM}xbf16>")
TRITON_OPERANDS = re.compile(r"stablehlo\.custom_call @__gpu\$xla\.gpu\.triton\(([^)]*)\)")


def _pages_reach_kernel_unsliced(text: str) -> list[str]:
    """Problems with how the stacked pages reach the Triton call ([] = none).

    The StableHLO module must (1) hold no tensor of any other pool shape (a slice, copy or
    gather of the pages -- e.g. pages[layer]: [Hkv, N, bs, D]); (2) use the stacked pages
    in no op other than function signatures, calls/returns and the Triton custom call, so
    nothing slices, reshapes or copies them; and (3) pass the Triton call, as its K and V
    operands, function arguments (not op results) of the full 5-D type.
    """
    problems = []
    other = {m.group(0) for m in POOL_TYPE.finditer(text)} - {STACKED_TYPE}
    if other:
        problems.append(f"a layer-sized (or other) copy of the pool exists: {sorted(other)}")
    for line in text.splitlines():
        if STACKED_TYPE not in line:
            continue
        stmt = line.strip()
        if stmt.startswith("func.func") or stmt.startswith("return") or stmt.startswith("func.return"):
            continue
        if re.match(r"(%\S+ = )?(func\.)?call @", stmt) or TRITON_OPERANDS.search(stmt):
            continue
        problems.append(f"an op other than a call uses the stacked pages: {stmt[:200]}")
    calls = [line for line in text.splitlines() if TRITON_OPERANDS.search(line)]
    if len(calls) != 1:
        return [*problems, f"expected one Triton call, found {len(calls)}"]
    operands = [o.strip() for o in TRITON_OPERANDS.search(calls[0]).group(1).split(",")]
    signature = calls[0].rsplit("} : (", 1)[-1].split(") -> ", 1)[0]
    types = re.findall(r"tensor<[^>]*>", signature)
    if len(types) != len(operands):
        return [*problems, f"cannot match operands {operands} to types {types}"]
    pages = [(o, t) for o, t in zip(operands[-2:], types[-2:])]  # K, V: the last two operands
    for name, typ in pages:
        if typ != STACKED_TYPE or not re.fullmatch(r"%arg\d+", name):
            problems.append(f"Triton call gets {name}: {typ}, not a {STACKED_TYPE} function argument")
    return problems


def _lower_decode_stacked(pages_fn, **kwargs):
    return _export_for_cuda(
        lambda q, k, v, bt, lengths: paged_attention(q, *pages_fn(k, v), bt, lengths, **kwargs),
        S((8, 16, HEAD_DIM), jnp.bfloat16),
        STACKED,
        STACKED,
        S((8, 64), jnp.int32),
        S((8,), jnp.int32),
    )


@pytest.mark.parametrize("layer,splits", [(0, 1), (LAYERS - 1, 2)])
def test_decode_stacked_pages_lower_without_layer_copy(layer, splits):
    text = _lower_decode_stacked(lambda k, v: (k, v), layer=layer, num_splits=splits)
    assert TRITON_CALL in text
    assert _pages_reach_kernel_unsliced(text) == []


@pytest.mark.parametrize("layer,splits", [(0, 2), (LAYERS - 1, 1)])
def test_chunk_stacked_pages_lower_without_layer_copy(layer, splits):
    text = _export_for_cuda(
        functools.partial(paged_attention_chunk, layer=layer, num_splits=splits, block_rows=32),
        S((4, 7, 16, HEAD_DIM), jnp.bfloat16),
        STACKED,
        STACKED,
        S((4, 64), jnp.int32),
        S((4,), jnp.int32),
        S((4,), jnp.int32),
    )
    assert TRITON_CALL in text
    assert _pages_reach_kernel_unsliced(text) == []


def test_layer_copy_check_is_not_vacuous():
    """Slicing pages[layer] outside the kernel (the old way) is caught by the check."""
    text = _lower_decode_stacked(lambda k, v: (k[1], v[1]))
    problems = _pages_reach_kernel_unsliced(text)
    assert any("layer-sized" in p for p in problems)
    assert any("an op other than a call" in p for p in problems)
    assert any("not a" in p for p in problems)
