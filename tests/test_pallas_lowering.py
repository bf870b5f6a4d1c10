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

from pallas_kernels.chunk import paged_attention_chunk
from pallas_kernels.common import DEFAULT_MASK_VALUE, SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_DIMS
from pallas_kernels.decode import paged_attention_decode, paged_attention_decode_grid

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
# The inner loop (make test-fast) lowers every fourth case; the full suite lowers them all.
CASE_PARAMS = [
    pytest.param(i, id=f"{jnp.dtype(d).name}-d{h}-bs{b}-g{q // k}", marks=() if i % 4 == 0 else pytest.mark.slow)
    for i, (d, h, b, (q, k)) in enumerate(CASES)
]


def _tuning(index: int, block_size: int):
    splits = (1, 4, 2)[index % 3]
    bps = max(1, 16 // block_size) * (1, 2)[index % 2]  # >= 16 tokens per step
    if bps * block_size > 256:
        bps = 256 // block_size
    return splits, bps


@pytest.mark.parametrize("index", CASE_PARAMS)
def test_decode_lowers_for_cuda(index):
    dtype, head_dim, block_size, (hq, hk) = CASES[index]
    splits, bps = _tuning(index, block_size)
    batch, width = 8, 64
    fn = functools.partial(paged_attention_decode, num_splits=splits, blocks_per_step=bps)
    text = _export_for_cuda(
        fn,
        S((batch, hq, head_dim), dtype),
        _pages(dtype, head_dim, block_size, hk),
        _pages(dtype, head_dim, block_size, hk),
        S((batch, width), jnp.int32),
        S((batch,), jnp.int32),
    )
    assert TRITON_CALL in text


@pytest.mark.parametrize("index", CASE_PARAMS)
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
        functools.partial(paged_attention_decode, **kwargs),
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
        paged_attention_decode,
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
        paged_attention_decode_grid,
        num_blocks=16,
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
            S((2 * 16, 16, 64), jnp.bfloat16),  # flat pages: 2 kv heads x 16 blocks
            S((2 * 16, 16, 64), jnp.bfloat16),
            S((1,), jnp.int32),
            S((2, 16), jnp.int32),
            S((2,), jnp.int32),
        )


# ------------------------------------------------------------- layer-stacked pages
# Distinctive sizes so that the pool's shapes cannot be mistaken for any other tensor.
LAYERS, KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM = 3, 4, 101, 16, 128
STACKED = S((LAYERS, KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM), jnp.bfloat16)
STACKED_TYPE = f"tensor<{LAYERS}x{KV_HEADS}x{NUM_BLOCKS}x{BLOCK_SIZE}x{HEAD_DIM}xbf16>"
# The kernels' view of the stacked pages: [layers * kv heads * blocks, block_size, head_dim].
FLAT_TYPE = f"tensor<{LAYERS * KV_HEADS * NUM_BLOCKS}x{BLOCK_SIZE}x{HEAD_DIM}xbf16>"
# Any tensor holding whole [.., num_blocks, block_size, head_dim] pools: the stacked pages
# themselves, or a copy of (part of) them such as pages[layer] or one head's pool; and any
# flat [M, block_size, head_dim] tensor with at least a pool's worth of blocks.
POOL_TYPE = re.compile(rf"tensor<((?:\d+x)*){NUM_BLOCKS}x{BLOCK_SIZE}x{HEAD_DIM}xbf16>")
FLAT_POOL_TYPE = re.compile(rf"tensor<(\d+)x{BLOCK_SIZE}x{HEAD_DIM}xbf16>")
TRITON_OPERANDS = re.compile(r"stablehlo\.custom_call @__gpu\$xla\.gpu\.triton\(([^)]*)\)")
RESHAPE_OF_ARG = re.compile(
    rf"(%\S+) = stablehlo\.reshape %arg\d+ : \({re.escape(STACKED_TYPE)}\) -> {re.escape(FLAT_TYPE)}"
)


def _pages_reach_kernel_unsliced(text: str) -> list[str]:
    """Problems with how the stacked pages reach the Triton call ([] = none).

    The StableHLO module must (1) hold no pool-sized tensor but the stacked pages and
    their flat view (no slice, copy or gather of them, e.g. pages[layer]: [Hkv, N, bs, D]);
    (2) use the stacked pages only in function signatures, calls/returns and a reshape of
    a function argument to the flat view (free: a bitcast of a contiguous array); (3) use
    the flat view only there and in the Triton call; and (4) pass the Triton call, as its
    K and V operands, those reshapes.
    """
    problems = []
    other = {m.group(0) for m in POOL_TYPE.finditer(text)} - {STACKED_TYPE}
    other |= {m.group(0) for m in FLAT_POOL_TYPE.finditer(text) if int(m.group(1)) >= NUM_BLOCKS} - {
        FLAT_TYPE
    }
    if other:
        problems.append(f"a layer-sized (or other) copy of the pool exists: {sorted(other)}")
    reshapes = set()
    for line in text.splitlines():
        stmt = line.strip()
        match = RESHAPE_OF_ARG.match(stmt)
        if match:
            reshapes.add(match.group(1))
            continue
        if STACKED_TYPE in stmt:
            if stmt.startswith(("func.func", "return", "func.return")) or re.match(
                r"(%\S+ = )?(func\.)?call @", stmt
            ):
                continue
            problems.append(
                f"an op other than a call or the flat reshape uses the stacked pages: {stmt[:200]}"
            )
        elif FLAT_TYPE in stmt and not TRITON_OPERANDS.search(stmt):
            problems.append(f"an op other than the Triton call uses the flat pages: {stmt[:200]}")
    calls = [line for line in text.splitlines() if TRITON_OPERANDS.search(line)]
    if len(calls) != 1:
        return [*problems, f"expected one Triton call, found {len(calls)}"]
    operands = [o.strip() for o in TRITON_OPERANDS.search(calls[0]).group(1).split(",")]
    signature = calls[0].rsplit("} : (", 1)[-1].split(") -> ", 1)[0]
    types = re.findall(r"tensor<[^>]*>", signature)
    if len(types) != len(operands):
        return [*problems, f"cannot match operands {operands} to types {types}"]
    for name, typ in zip(operands[-2:], types[-2:]):  # K, V: the last two operands
        if typ != FLAT_TYPE or name not in reshapes:
            problems.append(f"Triton call gets {name}: {typ}, not a {FLAT_TYPE} reshape of the stacked pages")
    return problems


def _lower_decode_stacked(pages_fn, *, traced_layer: bool = False, **kwargs):
    q, bt, lengths = S((8, 16, HEAD_DIM), jnp.bfloat16), S((8, 64), jnp.int32), S((8,), jnp.int32)
    if traced_layer:
        return _export_for_cuda(
            lambda q, k, v, bt, lengths, layer: paged_attention_decode(
                q, *pages_fn(k, v), bt, lengths, layer=layer, **kwargs
            ),
            q,
            STACKED,
            STACKED,
            bt,
            lengths,
            S((), jnp.int32),
        )
    return _export_for_cuda(
        lambda q, k, v, bt, lengths: paged_attention_decode(q, *pages_fn(k, v), bt, lengths, **kwargs),
        q,
        STACKED,
        STACKED,
        bt,
        lengths,
    )


@pytest.mark.parametrize("layer,splits", [(0, 1), (LAYERS - 1, 2), ("traced", 2)])
def test_decode_stacked_pages_lower_without_layer_copy(layer, splits):
    if layer == "traced":
        text = _lower_decode_stacked(lambda k, v: (k, v), traced_layer=True, num_splits=splits)
    else:
        text = _lower_decode_stacked(lambda k, v: (k, v), layer=layer, num_splits=splits)
    assert TRITON_CALL in text
    assert _pages_reach_kernel_unsliced(text) == []


@pytest.mark.parametrize("layer,splits", [(0, 2), ("traced", 1)])
def test_chunk_stacked_pages_lower_without_layer_copy(layer, splits):
    args = [
        S((4, 7, 16, HEAD_DIM), jnp.bfloat16),
        STACKED,
        STACKED,
        S((4, 64), jnp.int32),
        S((4,), jnp.int32),
        S((4,), jnp.int32),
    ]
    tuning = dict(num_splits=splits, block_rows=32)
    if layer == "traced":
        fn = lambda q, k, v, bt, lengths, q_lens, layer: paged_attention_chunk(
            q, k, v, bt, lengths, q_lens, layer=layer, **tuning
        )
        args.append(S((), jnp.int32))
    else:
        fn = functools.partial(paged_attention_chunk, layer=layer, **tuning)
    text = _export_for_cuda(fn, *args)
    assert TRITON_CALL in text
    assert _pages_reach_kernel_unsliced(text) == []


def test_layer_copy_check_is_not_vacuous():
    """Slicing pages[layer] outside the kernel, by a static or a traced index, is caught."""
    problems = _pages_reach_kernel_unsliced(_lower_decode_stacked(lambda k, v: (k[1], v[1])))
    assert any("layer-sized" in p for p in problems)
    assert any("an op other than" in p for p in problems)
    assert any("not a" in p for p in problems)
    text = _export_for_cuda(
        lambda q, k, v, bt, lengths, layer: paged_attention_decode(
            q,
            jax.lax.dynamic_index_in_dim(k, layer, keepdims=False),
            jax.lax.dynamic_index_in_dim(v, layer, keepdims=False),
            bt,
            lengths,
        ),
        S((8, 16, HEAD_DIM), jnp.bfloat16),
        STACKED,
        STACKED,
        S((8, 64), jnp.int32),
        S((8,), jnp.int32),
        S((), jnp.int32),
    )
    problems = _pages_reach_kernel_unsliced(text)
    assert any("layer-sized" in p for p in problems) and any("not a" in p for p in problems)


# ------------------------------------------------------------------- quantised pages
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-token", "per-channel"])
@pytest.mark.parametrize("values", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("kernel", ["decode", "chunk"])
def test_quantized_pages_lower_for_cuda(kernel, values, per_channel):
    """Both kernels over int8 / float8 pages with bf16 scales held as uint16 bits
    ([kv, N, bs] per token, [kv, N, D] per channel), q in bf16: the Triton lowering
    accepts the scale loads and the in-kernel dequantisation."""
    hq, hk, head_dim, block_size, batch, width = 16, 4, 128, 16, 8, 64
    pages = _pages(values, head_dim, block_size, hk)
    scales = S((hk, 1000, head_dim if per_channel else block_size), jnp.uint16)
    if kernel == "decode":
        def fn(q, k, v, ks, vs, bt, lengths):
            return paged_attention_decode(q, k, v, bt, lengths, k_scales=ks, v_scales=vs,
                                          per_channel_scales=per_channel, num_splits=2)
        q = S((batch, hq, head_dim), jnp.bfloat16)
        extra = ()
    else:
        def fn(q, k, v, ks, vs, bt, lengths, q_lens):
            return paged_attention_chunk(q, k, v, bt, lengths, q_lens, k_scales=ks, v_scales=vs,
                                         per_channel_scales=per_channel)
        q = S((batch, 4, hq, head_dim), jnp.bfloat16)
        extra = (S((batch,), jnp.int32),)
    text = _export_for_cuda(fn, q, pages, pages, scales, scales, S((batch, width), jnp.int32),
                            S((batch,), jnp.int32), *extra)
    assert TRITON_CALL in text
