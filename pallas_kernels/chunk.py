"""Paged multi-query attention (a chunk of queries per sequence) as a Pallas Triton kernel.

Used for chunked prefill and for verifying speculative-decoding drafts: each sequence
has up to ``chunk`` new query tokens whose K/V have already been written into the paged
cache, and query t attends causally to everything before it, including the earlier
queries of its own chunk.

  q:               [batch, chunk, num_q_heads, head_dim]
  k_pages/v_pages: [num_kv_heads, num_blocks, block_size, head_dim], or every layer's
                   pool [num_layers, num_kv_heads, num_blocks, block_size, head_dim] with
                   ``layer`` (a Python int or a traced int32 scalar) naming one
  block_tables:    int32[batch, max_blocks_per_seq]; unused entries may be anything (-1)
  lengths:         int32[batch] total KV length INCLUDING the chunk's own tokens
  q_lens:          int32[batch] valid queries per row (<= chunk)

Query t < q_lens[b] sits at position lengths[b] - q_lens[b] + t and sees KV positions
[0, that position].  Rows t >= q_lens[b] are 0.

Kernel design: the decode kernel (``decode.py``) with the q tile widened
from "the q heads of one kv head" to "(query token, q head of this kv head) pairs": row
r = t * group + g.  One program per (sequence, kv head, row block, split); a row block
holds ``block_rows`` such rows, so one K/V block read serves every query of the chunk and
every q head of the group.  The loop walks KV only up to the last position any valid row
of the block can see, and splits (flash-decoding) share that range evenly.  Pages and
layer reach the kernel as in the decode kernel (``common``'s module doc).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (
    DEFAULT_MASK_VALUE,
    LOG2E,
    MIN_DOT_DIM,
    SQUEEZED,
    block_ids,
    check_common,
    combine_splits,
    device_arch,
    finalize,
    flat_pages,
    flat_scales,
    init_carry,
    is_pow2,
    load_kv,
    next_pow2,
    online_softmax_step,
    page_shape,
    prepare_table,
    split_range,
    split_refs,
    whole_spec,
)

MAX_BLOCK_ROWS = 128


def paged_attention_chunk_kernel(
    # inputs
    lengths_ref,  # [1] int32: KV length of this sequence (chunk included)
    q_lens_ref,  # [1] int32: valid queries of this sequence
    layer_ref,  # [1] int32: the layer to read
    block_tables_ref,  # [padded_blocks_per_seq] int32: physical block ids (-1 = none)
    q_ref,  # [block_rows, head_dim]: rows r = t * group + g of this row block
    k_pages_ref,  # [num_layers * num_kv_heads * num_blocks, block_size, head_dim]: every K block
    v_pages_ref,  # [num_layers * num_kv_heads * num_blocks, block_size, head_dim]: every V block
    *refs: Any,  # quantised: k_scale_ref, v_scale_ref (flat like the pages); then the outputs:
    # o_ref  # [block_rows, head_dim]: q dtype (one split) or f32 unnormalised
    # [block_rows, head_dim]: q dtype (one split) or f32 unnormalised; splits > 1:
    # m_ref [block_rows] f32, l_ref [block_rows] f32
    scale: float,
    quantized: bool,
    per_channel: bool,
    group: int,
    num_kv_heads: int,
    num_blocks: int,
    blocks_per_step: int,
    num_splits: int,
    mask_value: float,
):
    k_scale_ref, v_scale_ref, (o_ref, *stat_refs) = split_refs(refs, quantized)
    head = pl.program_id(1)
    row_block = pl.program_id(2)
    split = pl.program_id(3)
    block_rows, head_dim = q_ref.shape
    block_size = k_pages_ref.shape[-2]
    block_k = blocks_per_step * block_size

    length = lengths_ref[0]
    q_len = q_lens_ref[0]
    layer = layer_ref[0]
    first_pos = length - q_len  # position of query 0 of the chunk
    rows = row_block * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    t = rows // group  # query index of each row
    row_valid = t < q_len  # also false for the zero padding rows (t >= chunk >= q_len)
    q_pos = first_pos + t

    # KV this row block needs: up to (and including) the position of its last valid query.
    t_lo = (row_block * block_rows) // group
    t_hi = ((row_block + 1) * block_rows - 1) // group
    kv_end = jnp.where(t_lo < q_len, first_pos + jnp.minimum(q_len, t_hi + 1), 0)
    num_steps_total = pl.cdiv(kv_end, block_k)
    first_step, num_steps = split_range(num_steps_total, split, num_splits)
    q = q_ref[...]

    def body(i, carry):
        step = first_step + i
        ids = block_ids(block_tables_ref, step, blocks_per_step, layer, head, num_kv_heads, num_blocks)
        k = load_kv(k_pages_ref, k_scale_ref, ids, block_k, head_dim, q.dtype, per_channel)
        v = load_kv(v_pages_ref, v_scale_ref, ids, block_k, head_dim, q.dtype, per_channel)
        kv_pos = step * block_k + jnp.arange(block_k, dtype=jnp.int32)
        mask = (kv_pos[None, :] <= q_pos[:, None]) & row_valid[:, None]
        return online_softmax_step(
            q, k, v, mask, kv_pos < kv_end, carry, qk_scale=scale * LOG2E, mask_value=mask_value
        )

    o, m, l_sum = lax.fori_loop(0, num_steps, body, init_carry(block_rows, head_dim, mask_value))

    if num_splits == 1:
        o_ref[...] = finalize(o, l_sum).astype(o_ref.dtype)
    else:
        m_ref, l_ref = stat_refs
        o_ref[...] = o.astype(o_ref.dtype)
        m_ref[...] = m
        l_ref[...] = l_sum


def paged_attention_chunk_grid(
    q: jax.Array,  # [batch, num_kv_heads, padded_rows, head_dim], rows r = t * group + g
    k_pages: jax.Array,  # [num_layers * num_kv_heads * num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # same shape as k_pages
    layer: jax.Array,  # int32[1]
    block_tables: jax.Array,  # int32[batch, padded_blocks_per_seq]
    lengths: jax.Array,  # int32[batch]
    q_lens: jax.Array,  # int32[batch]
    *,
    num_blocks: int,
    scale: float,
    group: int,
    block_rows: int,
    blocks_per_step: int,
    num_splits: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    mask_value: float,
    per_channel: bool = False,
    scales: tuple[jax.Array, jax.Array] | None = None,  # (k, v) [L * Hkv * N, bs or D]: quantised pages
) -> jax.Array:
    """Builds the (batch, kv_head, row_block, split) grid; returns q-shaped output."""
    batch, num_kv_heads, padded_rows, head_dim = q.shape
    block_size = k_pages.shape[-2]
    width = block_tables.shape[1]
    num_row_blocks = padded_rows // block_rows
    s = SQUEEZED

    kernel = functools.partial(
        paged_attention_chunk_kernel,
        scale=scale,
        group=group,
        num_kv_heads=num_kv_heads,
        num_blocks=num_blocks,
        blocks_per_step=blocks_per_step,
        num_splits=num_splits,
        mask_value=mask_value,
        quantized=scales is not None,
        per_channel=per_channel,
    )
    in_specs = [
        pl.BlockSpec((1,), lambda b, h, r, j: (b,)),  # lengths
        pl.BlockSpec((1,), lambda b, h, r, j: (b,)),  # q_lens
        pl.BlockSpec((1,), lambda b, h, r, j: (0,)),  # layer
        pl.BlockSpec((s, width), lambda b, h, r, j: (b, 0)),  # block_tables
        pl.BlockSpec((s, s, block_rows, head_dim), lambda b, h, r, j: (b, h, r, 0)),  # q
        whole_spec(k_pages.shape),  # k_pages: the kernel computes block indices itself
        whole_spec(v_pages.shape),  # v_pages
    ]
    scale_operands = () if scales is None else tuple(scales)
    in_specs += [whole_spec(x.shape) for x in scale_operands]  # scales, indexed like the pages
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
        out_specs = pl.BlockSpec((s, s, block_rows, head_dim), lambda b, h, r, j: (b, h, r, 0))
    else:
        part = (batch, num_kv_heads, num_splits, padded_rows)
        out_shape = [
            jax.ShapeDtypeStruct((*part, head_dim), jnp.float32),  # o (unnormalised)
            jax.ShapeDtypeStruct(part, jnp.float32),  # m
            jax.ShapeDtypeStruct(part, jnp.float32),  # l
        ]
        out_specs = [
            pl.BlockSpec((s, s, s, block_rows, head_dim), lambda b, h, r, j: (b, h, j, r, 0)),
            pl.BlockSpec((s, s, s, block_rows), lambda b, h, r, j: (b, h, j, r)),
            pl.BlockSpec((s, s, s, block_rows), lambda b, h, r, j: (b, h, j, r)),
        ]
    out = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_row_blocks, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_attention_chunk_br{block_rows}_bk{blocks_per_step * block_size}_s{num_splits}",
    )(lengths, q_lens, layer, block_tables, q, k_pages, v_pages, *scale_operands)
    if num_splits == 1:
        return out
    return combine_splits(*out).astype(q.dtype)


def default_block_rows(rows: int) -> int:
    """Rows (query x q-head pairs) per program: all of them up to 64, at least 16."""
    return min(max(MIN_DOT_DIM, next_pow2(rows)), 64)


def default_tuning(*, rows: int, head_dim: int, block_size: int, dtype, arch: int | None = None) -> dict:
    """The chunk kernel's default tuning for pages of ``dtype`` on ``arch`` (80, 90; None:
    90), ``rows`` = chunk * group (query, q head) rows. Chosen by compiling for sm_80 and
    sm_90a offline (``pallas_kernels.offline``, ``experiments/kernel_resources.py``): the
    first setting, in order of preference, without spills and within shared memory over
    head_dim 64/128, block 16/32/64, GQA 1/4/8 (tests/test_kernel_resources.py).

    - 16-bit and quantised pages: all rows up to 64 per program, ~128 tokens per step, 2
      stages, **8 warps** (with 4, a 64 x 128 tile at head_dim 128 needs 255 registers and
      spills on both archs); 64 tokens for 64-row tiles at head_dim 64 on sm_80.
    - fp32 pages (FMA dots, operands in registers): 16 rows per program, 8 warps; 64
      tokens and 2 stages at head_dim 64, 32 tokens and 1 stage at head_dim >= 128, where
      64-token blocks on sm_90 need 4 warps (no setting with 8 fits there).
    """
    arch = 90 if arch is None else arch
    if jnp.dtype(dtype).itemsize == 4:
        tokens, stages = (64, 2) if head_dim <= 64 else (32, 1)
        warps = 4 if head_dim > 64 and arch >= 90 and block_size >= 64 else 8
        return dict(block_rows=MIN_DOT_DIM, blocks_per_step=max(1, tokens // block_size), num_warps=warps,
                    num_stages=stages)
    block_rows = default_block_rows(rows)
    tokens = 64 if arch < 90 and head_dim <= 64 and block_rows >= 64 else 128
    if head_dim > 128:
        tokens = 64
    return dict(block_rows=block_rows, blocks_per_step=max(1, tokens // block_size, MIN_DOT_DIM // block_size),
                num_warps=8, num_stages=2)


def _rows_layout(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[batch, chunk, Hq, D] -> [batch, Hk, chunk * group, D] with row r = t * group + g."""
    batch, chunk, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    q = q.reshape(batch, chunk, num_kv_heads, group, head_dim)
    return jnp.transpose(q, (0, 2, 1, 3, 4)).reshape(batch, num_kv_heads, chunk * group, head_dim)


def _from_rows_layout(o: jax.Array, chunk: int, group: int) -> jax.Array:
    """Inverse of ``_rows_layout`` (after the padding rows are cut)."""
    batch, num_kv_heads, _, head_dim = o.shape
    o = o[:, :, : chunk * group].reshape(batch, num_kv_heads, chunk, group, head_dim)
    return jnp.transpose(o, (0, 2, 1, 3, 4)).reshape(batch, chunk, num_kv_heads * group, head_dim)


@functools.partial(
    jax.jit,
    static_argnames=[
        "scale",
        "block_rows",
        "blocks_per_step",
        "num_splits",
        "num_warps",
        "num_stages",
        "interpret",
        "mask_value",
        "per_channel_scales",
    ],
)
def _paged_attention_chunk(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    q_lens,
    layer,
    k_scales,
    v_scales,
    *,
    scale,
    block_rows,
    blocks_per_step,
    num_splits,
    num_warps,
    num_stages,
    interpret,
    mask_value,
    per_channel_scales,
):
    """``paged_attention_chunk`` after validation (``layer``: None, int or int32 scalar)."""
    batch, chunk, num_q_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = page_shape(k_pages.shape)
    group = num_q_heads // num_kv_heads
    rows = chunk * group

    block_tables, lengths = prepare_table(block_tables, lengths, block_size, blocks_per_step)
    # A chunk cannot hold more queries than it has rows or than the sequence has tokens.
    q_lens = jnp.clip(q_lens, 0, jnp.minimum(chunk, lengths))
    q_rows = _rows_layout(q, num_kv_heads)
    padded_rows = pl.cdiv(rows, block_rows) * block_rows
    if padded_rows != rows:
        q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
    k_flat, layer_index = flat_pages(k_pages, layer)
    v_flat, _ = flat_pages(v_pages, layer)
    scales = None if k_scales is None else (flat_scales(k_scales), flat_scales(v_scales))
    o = paged_attention_chunk_grid(
        q_rows,
        k_flat,
        v_flat,
        layer_index,
        block_tables,
        lengths,
        q_lens,
        num_blocks=num_blocks,
        scale=scale,
        group=group,
        block_rows=block_rows,
        blocks_per_step=blocks_per_step,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        mask_value=mask_value,
        per_channel=per_channel_scales,
        scales=scales,
    )
    return _from_rows_layout(o, chunk, group)


def paged_attention_chunk(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    q_lens: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    per_channel_scales: bool = False,
    block_rows: int | None = None,
    blocks_per_step: int | None = None,
    num_splits: int = 1,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    mask_value: float = DEFAULT_MASK_VALUE,
) -> jax.Array:
    """Paged causal multi-query (chunk) attention with grouped-query heads.

    Validates its arguments in Python (so a bad call raises ValueError when traced), then
    runs a jitted program (tuning parameters static, ``layer`` traced).

    Args:
      q: [batch, chunk, num_q_heads, head_dim] float32/bfloat16/float16.
      k_pages: [num_kv_heads, num_blocks, block_size, head_dim] when ``layer`` is None;
        [num_layers, num_kv_heads, num_blocks, block_size, head_dim] (every layer's pool)
        otherwise.  Same shape and dtype as v_pages.
      v_pages: same shape as k_pages.
      block_tables: int32[batch, max_blocks_per_seq]; entries past a sequence's blocks may
        be anything (-1).
      lengths: int32[batch] KV length including this chunk's tokens (clamped to the
        table's capacity).
      q_lens: int32[batch] valid queries per row (clamped to [0, min(chunk, lengths)]).
      layer: None for 4-D pages; for 5-D pages a Python int in [0, num_layers) or an
        integer scalar array (traced; clamped into range), read in place as in
        ``paged_attention_decode``.
      scale: softmax scale (a Python float); default head_dim ** -0.5.
      k_scales, v_scales: for int8 / float8_e4m3fn pages, their scales: the pages' leading
        axes then [block_size] (per token) or [head_dim] (``per_channel_scales``);
        loaded with each tile and multiplied in f32. None for float pages.
      block_rows: (query, q head) rows per program, a power of two in [16, 128]; default
        all chunk * group rows up to 64.  Each row block re-reads the KV it needs.
      blocks_per_step: physical blocks per loop step, as in ``paged_attention_decode``.
      num_splits: flash-decoding splits of the KV range (1 = no combine pass).
      num_warps, num_stages: Triton launch parameters; None (and block_rows,
        blocks_per_step None): ``default_tuning``'s for this GPU.
      interpret: run in the Pallas interpreter (CPU testing).
      mask_value: finite logit given to masked slots.

    Returns:
      [batch, chunk, num_q_heads, head_dim] in q's dtype; rows t >= q_lens[b] are 0.

    Raises:
      ValueError: on unsupported shapes, dtypes or tuning parameters, or when the rank of
        the pages and ``layer`` disagree or an int ``layer`` is out of range.
    """
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, chunk, num_q_heads, head_dim], got {q.shape}")
    batch, chunk, num_q_heads, head_dim = q.shape
    if k_pages.ndim >= 4 and num_q_heads % max(1, k_pages.shape[-4]) == 0:
        defaults = default_tuning(rows=chunk * (num_q_heads // k_pages.shape[-4]), head_dim=head_dim,
                                  block_size=k_pages.shape[-2], dtype=k_pages.dtype, arch=device_arch())
        block_rows = defaults["block_rows"] if block_rows is None else block_rows
        blocks_per_step = defaults["blocks_per_step"] if blocks_per_step is None else blocks_per_step
        num_warps = defaults["num_warps"] if num_warps is None else num_warps
        num_stages = defaults["num_stages"] if num_stages is None else num_stages
    num_warps = 4 if num_warps is None else num_warps  # shapes check_common refuses below
    num_stages = 2 if num_stages is None else num_stages
    group, blocks_per_step, layer = check_common(
        num_q_heads,
        head_dim,
        q.dtype,
        k_pages,
        v_pages,
        block_tables,
        lengths,
        batch,
        blocks_per_step,
        num_splits,
        num_warps,
        num_stages,
        layer,
        k_scales,
        v_scales,
        per_channel_scales,
    )
    if q_lens.shape != (batch,) or q_lens.dtype != jnp.int32:
        raise ValueError(f"q_lens must be int32[{batch}], got {q_lens.dtype}{list(q_lens.shape)}")
    if block_rows is None:
        block_rows = default_block_rows(chunk * group)
    if not (is_pow2(block_rows) and MIN_DOT_DIM <= block_rows <= MAX_BLOCK_ROWS):
        raise ValueError(
            f"block_rows={block_rows} must be a power of two in [{MIN_DOT_DIM}, {MAX_BLOCK_ROWS}]"
        )
    return _paged_attention_chunk(
        q,
        k_pages,
        v_pages,
        block_tables,
        lengths,
        q_lens,
        layer,
        k_scales,
        v_scales,
        scale=float(head_dim**-0.5 if scale is None else scale),
        block_rows=block_rows,
        blocks_per_step=blocks_per_step,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        mask_value=mask_value,
        per_channel_scales=per_channel_scales,
    )
