"""Paged multi-query attention (a chunk of queries per sequence) as a Pallas Triton kernel.

Used for chunked prefill and for verifying speculative-decoding drafts: each sequence
has up to ``chunk`` new query tokens whose K/V have already been written into the paged
cache, and query t attends causally to everything before it, including the earlier
queries of its own chunk.

  q:            [batch, chunk, num_q_heads, head_dim]
  k_pages/v_pages: [num_kv_heads, num_blocks, block_size, head_dim], or every layer's
                pool [num_layers, num_kv_heads, num_blocks, block_size, head_dim] with a
                static ``layer=i`` (read in place by the kernel, as in the decode kernel)
  block_tables: int32[batch, max_blocks_per_seq] (-1 = no block)
  lengths:      int32[batch] total KV length INCLUDING the chunk's own tokens
  q_lens:       int32[batch] valid queries per row (<= chunk)

Query t < q_lens[b] sits at position lengths[b] - q_lens[b] + t and sees KV positions
[0, that position].  Rows t >= q_lens[b] are 0.

Kernel design: the decode kernel (``paged_attention.py``) with the q tile widened from
"the q heads of one kv head" to "(query token, q head of this kv head) pairs": row
r = t * group + g.  One program per (sequence, kv head, row block, split); a row block
holds ``block_rows`` such rows, so one K/V block read serves every query of the chunk and
every q head of the group.  The loop walks KV only up to the last position any valid row
of the block can see, and splits (flash-decoding) share that range evenly.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention import (
    _SQUEEZED,
    DEFAULT_MASK_VALUE,
    LOG2E,
    MIN_DOT_DIM,
    _check_common,
    _is_pow2,
    _next_pow2,
    combine_splits,
    finalize,
    gather_kv,
    init_carry,
    masked_softmax_attention,
    online_softmax_step,
    page_shape,
    pages_spec,
    prepare_table,
    select_layer,
    split_range,
)

MAX_BLOCK_ROWS = 128


def paged_attention_chunk_kernel(
    # inputs
    lengths_ref,  # [1] int32: KV length of this sequence (chunk included)
    q_lens_ref,  # [1] int32: valid queries of this sequence
    block_tables_ref,  # [padded_blocks_per_seq] int32: physical block ids (-1 = none)
    q_ref,  # [block_rows, head_dim]: rows r = t * group + g of this row block
    k_pages_ref,  # [num_blocks, block_size, head_dim]: this kv head's K pool
    v_pages_ref,  # [num_blocks, block_size, head_dim]: this kv head's V pool
    # outputs
    o_ref: Any,  # [block_rows, head_dim]: q dtype (one split) or f32 unnormalised
    *stat_refs: Any,  # splits > 1: m_ref [block_rows] f32, l_ref [block_rows] f32
    scale: float,
    group: int,
    blocks_per_step: int,
    num_splits: int,
    mask_value: float,
):
    row_block = pl.program_id(2)
    split = pl.program_id(3)
    block_rows, head_dim = q_ref.shape
    block_size = k_pages_ref.shape[-2]
    block_k = blocks_per_step * block_size

    length = lengths_ref[0]
    q_len = q_lens_ref[0]
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
        ids = block_tables_ref[pl.ds(step * blocks_per_step, blocks_per_step)]
        ids = jnp.maximum(ids, 0)  # -1 columns past the sequence: never dereference
        k = k_pages_ref[ids].reshape(block_k, head_dim)
        v = v_pages_ref[ids].reshape(block_k, head_dim)
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
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim] ([L, ...] with layer)
    v_pages: jax.Array,  # same shape as k_pages
    block_tables: jax.Array,  # int32[batch, padded_blocks_per_seq]
    lengths: jax.Array,  # int32[batch]
    q_lens: jax.Array,  # int32[batch]
    *,
    scale: float,
    group: int,
    block_rows: int,
    blocks_per_step: int,
    num_splits: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    mask_value: float,
    layer: int | None = None,
) -> jax.Array:
    """Builds the (batch, kv_head, row_block, split) grid; returns q-shaped output.

    ``layer=None``: 4-D pages; ``layer=i``: 5-D layer-stacked pages, layer i read in place.
    """
    batch, num_kv_heads, padded_rows, head_dim = q.shape
    _, _, block_size, _ = page_shape(k_pages.shape, layer)
    width = block_tables.shape[1]
    num_row_blocks = padded_rows // block_rows
    s = _SQUEEZED

    kernel = functools.partial(
        paged_attention_chunk_kernel,
        scale=scale,
        group=group,
        blocks_per_step=blocks_per_step,
        num_splits=num_splits,
        mask_value=mask_value,
    )
    in_specs = [
        pl.BlockSpec((1,), lambda b, h, r, j: (b,)),  # lengths
        pl.BlockSpec((1,), lambda b, h, r, j: (b,)),  # q_lens
        pl.BlockSpec((s, width), lambda b, h, r, j: (b, 0)),  # block_tables
        pl.BlockSpec((s, s, block_rows, head_dim), lambda b, h, r, j: (b, h, r, 0)),  # q
        pages_spec(k_pages.shape, layer, lambda b, h, r, j: h),  # k_pages
        pages_spec(v_pages.shape, layer, lambda b, h, r, j: h),  # v_pages
    ]
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
        name=(f"paged_attention_chunk_br{block_rows}_bk{blocks_per_step * block_size}_s{num_splits}"),
    )(lengths, q_lens, block_tables, q, k_pages, v_pages)
    if num_splits == 1:
        return out
    return combine_splits(*out).astype(q.dtype)


def default_block_rows(rows: int) -> int:
    """Rows (query x q-head pairs) per program: all of them up to 64, at least 16."""
    return min(max(MIN_DOT_DIM, _next_pow2(rows)), 64)


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


def _clamp_q_lens(q_lens: jax.Array, lengths: jax.Array, chunk: int) -> jax.Array:
    """A chunk cannot hold more queries than it has rows or than the sequence has tokens."""
    return jnp.clip(q_lens, 0, jnp.minimum(chunk, lengths))


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
        "layer",
    ],
)
def paged_attention_chunk(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    q_lens: jax.Array,
    *,
    scale: float | None = None,
    block_rows: int | None = None,
    blocks_per_step: int | None = None,
    num_splits: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    mask_value: float = DEFAULT_MASK_VALUE,
    layer: int | None = None,
) -> jax.Array:
    """Paged causal multi-query (chunk) attention with grouped-query heads.

    Args:
      q: [batch, chunk, num_q_heads, head_dim] float32/bfloat16/float16.
      k_pages: [num_kv_heads, num_blocks, block_size, head_dim] when ``layer`` is None;
        [num_layers, num_kv_heads, num_blocks, block_size, head_dim] (every layer's pool)
        when ``layer`` is an int.  Same shape and dtype as v_pages.
      v_pages: same shape as k_pages.
      block_tables: int32[batch, max_blocks_per_seq]; -1 past a sequence's blocks.
      lengths: int32[batch] KV length including this chunk's tokens (clamped to the
        table's capacity).
      q_lens: int32[batch] valid queries per row (clamped to [0, min(chunk, lengths)]).
      scale: softmax scale; default head_dim ** -0.5.
      block_rows: (query, q head) rows per program, a power of two in [16, 128]; default
        all chunk * group rows up to 64.  Each row block re-reads the KV it needs.
      blocks_per_step: physical blocks per loop step, as in ``paged_attention``.
      num_splits: flash-decoding splits of the KV range (1 = no combine pass).
      num_warps, num_stages: Triton launch parameters.
      interpret: run in the Pallas interpreter (CPU testing).
      mask_value: finite logit given to masked slots.
      layer: None for 4-D pages, or the static index (0 <= layer < num_layers) of the layer
        to read from 5-D pages, in place (no copy of the layer's pool), as in
        ``paged_attention``.

    Returns:
      [batch, chunk, num_q_heads, head_dim] in q's dtype; rows t >= q_lens[b] are 0.

    Raises:
      ValueError: on unsupported shapes, dtypes or tuning parameters, or when the rank of
        the pages and ``layer`` disagree or ``layer`` is out of range.
    """
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, chunk, num_q_heads, head_dim], got {q.shape}")
    batch, chunk, num_q_heads, head_dim = q.shape
    group, blocks_per_step, layer = _check_common(
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
        layer=layer,
    )
    if q_lens.shape != (batch,) or q_lens.dtype != jnp.int32:
        raise ValueError(f"q_lens must be int32[{batch}], got {q_lens.dtype}{list(q_lens.shape)}")
    num_kv_heads, _, block_size, _ = page_shape(k_pages.shape, layer)
    rows = chunk * group
    if block_rows is None:
        block_rows = default_block_rows(rows)
    if not (_is_pow2(block_rows) and MIN_DOT_DIM <= block_rows <= MAX_BLOCK_ROWS):
        raise ValueError(
            f"block_rows={block_rows} must be a power of two in [{MIN_DOT_DIM}, {MAX_BLOCK_ROWS}]"
        )
    if scale is None:
        scale = head_dim**-0.5

    block_tables, lengths = prepare_table(block_tables, lengths, block_size, blocks_per_step)
    q_lens = _clamp_q_lens(q_lens, lengths, chunk)
    q_rows = _rows_layout(q, num_kv_heads)
    padded_rows = pl.cdiv(rows, block_rows) * block_rows
    if padded_rows != rows:
        q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
    o = paged_attention_chunk_grid(
        q_rows,
        k_pages,
        v_pages,
        block_tables,
        lengths,
        q_lens,
        scale=float(scale),
        group=group,
        block_rows=block_rows,
        blocks_per_step=blocks_per_step,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        mask_value=mask_value,
        layer=layer,
    )
    return _from_rows_layout(o, chunk, group)


@functools.partial(jax.jit, static_argnames=["scale", "layer"])
def paged_attention_chunk_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    q_lens: jax.Array,
    *,
    scale: float | None = None,
    layer: int | None = None,
) -> jax.Array:
    """Plain-jnp reference: gather through the table, causal masked softmax in float32.

    Same arguments and result as ``paged_attention_chunk`` (no tuning parameters),
    including ``layer`` for 5-D layer-stacked pages.
    """
    k_pages, v_pages = select_layer(k_pages, layer), select_layer(v_pages, layer)
    batch, chunk, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    if scale is None:
        scale = head_dim**-0.5
    k = gather_kv(k_pages, block_tables)  # [b, Hk, S, D]
    v = gather_kv(v_pages, block_tables)
    lengths = jnp.clip(lengths, 0, block_tables.shape[1] * block_size)
    q_lens = _clamp_q_lens(q_lens, lengths, chunk)
    t = jnp.arange(chunk * group) // group  # query index of row r = t * group + g
    q_pos = (lengths - q_lens)[:, None] + t[None, :]  # [b, rows]
    row_valid = t[None, :] < q_lens[:, None]
    kv_pos = jnp.arange(k.shape[2])
    mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & row_valid[:, :, None]  # [b, r, S]
    o = masked_softmax_attention(_rows_layout(q, num_kv_heads), k, v, mask[:, None], scale)
    return _from_rows_layout(o, chunk, group).astype(q.dtype)
