"""Paged decode attention for GPUs, written as a Pallas Triton-backend kernel.

One query token per sequence attends over that sequence's KV cache, which lives in a
shared pool of fixed-size physical blocks addressed through a block table:

  k_pages, v_pages: [num_kv_heads, num_blocks, block_size, head_dim], or every layer's
                    pool [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
                    with a static ``layer=i`` naming the one to read.
  block_tables:     int32[batch, max_blocks_per_seq]; logical block j of sequence b is
                    physical block block_tables[b, j]; unused entries are -1.
  lengths:          int32[batch]; valid KV tokens of each sequence (0 allowed).

Kernel design (one program per (sequence, kv head, split)):

* All query heads that share one kv head (the GQA group) are processed by the same
  program as the rows of one [block_h, head_dim] tile, padded to at least 16 rows (the
  smallest tensor-core dot), so each K/V block is read from HBM once per kv head.
* The program walks only the logical blocks that hold tokens: the loop trip count
  comes from ``lengths`` (a dynamic ``fori_loop``), so a short row in a wide table costs
  nothing for the unused columns.  Each loop step gathers ``blocks_per_step`` physical
  blocks (ids read from the table) and treats them as one [block_k, head_dim] tile.
* Online softmax in float32, in base 2 (``exp2`` with log2(e) folded into the scale).
* Flash-decoding: ``num_splits > 1`` cuts each sequence's *actual* blocks into equal
  parts processed by different programs; each writes its unnormalised partial output and
  running (max, sum), and a log-sum-exp combine in plain jnp merges them.  With one split
  the kernel normalises and writes the final output itself (no second pass).
* Layer-stacked pages: with ``layer=i`` the 5-D pool goes to the kernel whole and its
  BlockSpec index map pins the leading dimension to ``i`` (a squeezed dimension), so the
  kernel reads that layer in place.  Slicing ``pages[i]`` outside the kernel instead would
  make XLA materialise a copy of the layer's entire pool on every call, because a slice
  cannot be fused into a custom call's operand.
* Robust to garbage: table entries are clamped to >= 0 before they are dereferenced (the
  last step may cover columns past the sequence's end, which may hold -1), masked logits
  get a finite mask value, masked probabilities are forced to exactly 0, and masked V rows
  are zeroed so that NaN/Inf in unwritten slots or unreferenced blocks cannot leak into the
  output.  A length-0 row produces exactly 0.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LOG2E = math.log2(math.e)
# The smallest M/N/K of a Triton tensor-core dot: the q-head tile and the KV tile of one
# loop step must both be at least this large.
MIN_DOT_DIM = 16
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64, 128)
MAX_GROUP = 64  # q heads per kv head; the [group, head_dim] f32 accumulator lives in registers
MAX_BLOCK_K = 256  # tokens per loop step (register/shared-memory budget)

# `None` marks a squeezed block dimension in every JAX we support; newer versions also
# spell it `pl.squeezed`.
_SQUEEZED = getattr(pl, "squeezed", None)


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _dot(a: jax.Array, b: jax.Array, *, trans_b: bool = False) -> jax.Array:
    """a @ b (or a @ b.T) with float32 accumulation.

    float32 operands ask for HIGHEST precision so that Triton uses IEEE fp32 instead of
    TF32 (its default for f32 dots); bf16/fp16 operands go to the tensor cores as they are.
    """
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    contract_b = 1 if trans_b else 0
    return lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def online_softmax_step(
    q: jax.Array,  # [rows, head_dim] q dtype
    k: jax.Array,  # [block_k, head_dim] kv dtype
    v: jax.Array,  # [block_k, head_dim] kv dtype
    mask: jax.Array,  # bool[rows, block_k] or bool[1, block_k]; True = attend
    kv_valid: jax.Array,  # bool[block_k]; True where the KV slot is visible to any row
    carry: tuple[jax.Array, jax.Array, jax.Array],  # o [rows, head_dim], m [rows], l [rows] f32
    *,
    qk_scale: float,  # softmax scale * log2(e): logits are kept in base 2
    mask_value: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One flash-attention update of (unnormalised output, running max, running sum)."""
    o_prev, m_prev, l_prev = carry
    # Slots no row may see can hold anything (stale data, other blocks, NaN): zero V there so
    # that 0 * garbage cannot appear in the p @ v product.  K needs no cleaning because its
    # logits are replaced below.
    v = jnp.where(kv_valid[:, None], v, jnp.zeros_like(v))
    s = _dot(q, k, trans_b=True) * qk_scale  # [rows, block_k] f32, base-2 logits
    s = jnp.where(mask, s, mask_value)
    m_next = jnp.maximum(m_prev, s.max(axis=-1))
    correction = jnp.exp2(m_prev - m_next)
    # Force masked probabilities to exactly 0: with a finite mask value a fully masked row
    # would otherwise get exp2(0) = 1 for every masked slot.
    p = jnp.where(mask, jnp.exp2(s - m_next[:, None]), 0.0)
    l_next = l_prev * correction + p.sum(axis=-1)
    o_next = o_prev * correction[:, None] + _dot(p.astype(v.dtype), v)
    return o_next, m_next, l_next


def init_carry(rows: int, head_dim: int, mask_value: float):
    """Empty online-softmax state: o = 0, m = mask_value (finite, so no inf - inf), l = 0."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), mask_value, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def split_range(num_steps_total: jax.Array, split: jax.Array, num_splits: int):
    """(first step, number of steps) of ``split`` when steps are shared evenly by splits."""
    steps_per_split = pl.cdiv(num_steps_total, num_splits)
    first = split * steps_per_split
    count = jnp.clip(num_steps_total - first, 0, steps_per_split)
    return first, count


def combine_splits(
    o: jax.Array,  # [..., num_splits, rows, head_dim] f32, unnormalised
    m: jax.Array,  # [..., num_splits, rows] f32, running max (base 2)
    l_sum: jax.Array,  # [..., num_splits, rows] f32, running sum
) -> jax.Array:
    """Log-sum-exp merge of flash-decoding partials -> [..., rows, head_dim] f32.

    Empty splits have l = 0 and o = 0 and contribute nothing; a row that is empty in every
    split (length 0, or a padded query row) gets 0 rather than 0 / 0.
    """
    m_max = m.max(axis=-2, keepdims=True)
    w = jnp.exp2(m - m_max)  # [..., splits, rows]
    num = (o * w[..., None]).sum(axis=-3)
    den = (l_sum * w).sum(axis=-2)
    return num / jnp.where(den == 0.0, 1.0, den)[..., None]


def finalize(o: jax.Array, l_sum: jax.Array) -> jax.Array:
    """o / l_sum with empty rows (l_sum = 0) giving 0."""
    return o / jnp.where(l_sum == 0.0, 1.0, l_sum)[:, None]


def paged_attention_kernel(
    # inputs
    lengths_ref,  # [1] int32: this sequence's KV length
    block_tables_ref,  # [padded_blocks_per_seq] int32: physical block ids (-1 = none)
    q_ref,  # [block_h, head_dim]: the q heads of one kv head, zero-padded rows
    k_pages_ref,  # [num_blocks, block_size, head_dim]: this kv head's K pool
    v_pages_ref,  # [num_blocks, block_size, head_dim]: this kv head's V pool
    # outputs
    o_ref: Any,  # [block_h, head_dim]: q dtype (one split) or f32 unnormalised (splits)
    *stat_refs: Any,  # splits > 1: m_ref [block_h] f32, l_ref [block_h] f32
    scale: float,
    blocks_per_step: int,
    num_splits: int,
    mask_value: float,
):
    split = pl.program_id(2)
    block_h, head_dim = q_ref.shape
    block_size = k_pages_ref.shape[-2]
    block_k = blocks_per_step * block_size

    length = lengths_ref[0]
    num_steps_total = pl.cdiv(length, block_k)
    first_step, num_steps = split_range(num_steps_total, split, num_splits)
    q = q_ref[...]

    def body(i, carry):
        step = first_step + i
        ids = block_tables_ref[pl.ds(step * blocks_per_step, blocks_per_step)]
        # Columns past the sequence's last block can hold -1: never dereference them.
        ids = jnp.maximum(ids, 0)
        k = k_pages_ref[ids].reshape(block_k, head_dim)
        v = v_pages_ref[ids].reshape(block_k, head_dim)
        kv_valid = step * block_k + jnp.arange(block_k, dtype=jnp.int32) < length
        return online_softmax_step(
            q, k, v, kv_valid[None, :], kv_valid, carry, qk_scale=scale * LOG2E, mask_value=mask_value
        )

    o, m, l_sum = lax.fori_loop(0, num_steps, body, init_carry(block_h, head_dim, mask_value))

    if num_splits == 1:
        o_ref[...] = finalize(o, l_sum).astype(o_ref.dtype)
    else:
        m_ref, l_ref = stat_refs
        o_ref[...] = o.astype(o_ref.dtype)
        m_ref[...] = m
        l_ref[...] = l_sum


def default_blocks_per_step(block_size: int, head_dim: int) -> int:
    """Blocks gathered per loop step: ~128 KV tokens (64 for head_dim 256), >= 16 tokens."""
    target = 64 if head_dim > 128 else 128
    return max(1, target // block_size, MIN_DOT_DIM // block_size)


def default_num_splits(batch: int, num_kv_heads: int, max_len: int, num_sms: int = 132) -> int:
    """Flash-decoding splits so that batch * kv_heads * splits roughly fills the GPU.

    A split should still own a useful amount of context (>= 512 tokens), so short contexts
    stay unsplit however small the batch.
    """
    programs = max(1, batch * num_kv_heads)
    want = max(1, num_sms // programs)
    cap = max(1, max_len // 512)
    return int(min(_next_pow2(want) if want > 1 else 1, _next_pow2(cap) if cap > 1 else 1, 64))


def check_layer(k_pages, layer) -> int | None:
    """Validates the rank of the pages against ``layer``; returns ``layer`` as an int or None.

    ``layer=None`` needs 4-D pages [num_kv_heads, num_blocks, block_size, head_dim];
    ``layer=i`` needs 5-D pages [num_layers, ...] and 0 <= i < num_layers.
    """
    if layer is None:
        if k_pages.ndim == 5:
            raise ValueError(
                f"k_pages of shape {k_pages.shape} is 5-D [num_layers, num_kv_heads, num_blocks, "
                "block_size, head_dim]: pass layer=i to choose the layer"
            )
        if k_pages.ndim != 4:
            raise ValueError(
                "k_pages must be [num_kv_heads, num_blocks, block_size, head_dim] (or 5-D "
                f"[num_layers, ...] with layer=i), got shape {k_pages.shape}"
            )
        return None
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise ValueError(f"layer must be a Python int (a static index) or None, got {layer!r}")
    if k_pages.ndim != 5:
        raise ValueError(
            f"layer={layer} needs 5-D pages [num_layers, num_kv_heads, num_blocks, block_size, "
            f"head_dim], got shape {k_pages.shape}; pass layer=None for one layer's 4-D pages"
        )
    num_layers = k_pages.shape[0]
    if not 0 <= layer < num_layers:
        raise ValueError(
            f"layer={layer} is out of range [0, {num_layers}) for pages of shape {k_pages.shape}"
        )
    return int(layer)


def page_shape(shape: tuple[int, ...], layer: int | None) -> tuple[int, int, int, int]:
    """(num_kv_heads, num_blocks, block_size, head_dim) of one layer's pool, from the shape
    of 4-D pages (layer None) or of 5-D layer-stacked pages (layer an index)."""
    return tuple(shape[1:] if layer is not None else shape)


def _check_common(
    q_heads: int,
    head_dim: int,
    q_dtype,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    batch: int,
    blocks_per_step: int | None,
    num_splits: int,
    num_warps: int,
    num_stages: int,
    layer: int | None = None,
) -> tuple[int, int, int | None]:
    """Validates what both kernels share; returns (group, blocks_per_step, layer)."""
    layer = check_layer(k_pages, layer)
    if k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages and v_pages must have the same shape, got {k_pages.shape} and {v_pages.shape}"
        )
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(
            f"k_pages and v_pages must have the same dtype, got {k_pages.dtype} and {v_pages.dtype}"
        )
    num_kv_heads, _, block_size, head_dim_k = page_shape(k_pages.shape, layer)
    if head_dim_k != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and of the pages ({head_dim_k}) differ")
    for name, dt in (("q", q_dtype), ("k_pages", k_pages.dtype)):
        if jnp.dtype(dt) not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {dt} is not supported; use float32, bfloat16 or float16")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported; use one of {SUPPORTED_HEAD_DIMS}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size={block_size} is not supported; use one of {SUPPORTED_BLOCK_SIZES}")
    if q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    group = q_heads // num_kv_heads
    if group > MAX_GROUP:
        raise ValueError(f"{group} q heads per kv head is more than the supported {MAX_GROUP}")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be int32[batch={batch}, max_blocks_per_seq], got shape {block_tables.shape}"
        )
    if block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    if lengths.shape != (batch,) or lengths.dtype != jnp.int32:
        raise ValueError(f"lengths must be int32[{batch}], got {lengths.dtype}{list(lengths.shape)}")
    if blocks_per_step is None:
        blocks_per_step = default_blocks_per_step(block_size, head_dim)
    if not _is_pow2(blocks_per_step):
        raise ValueError(f"blocks_per_step={blocks_per_step} must be a power of two")
    block_k = blocks_per_step * block_size
    if not MIN_DOT_DIM <= block_k <= MAX_BLOCK_K:
        raise ValueError(
            f"blocks_per_step * block_size = {block_k} tokens per step must be in "
            f"[{MIN_DOT_DIM}, {MAX_BLOCK_K}] (tensor-core minimum / register budget)"
        )
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be a positive int")
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps={num_warps} must be a power of two <= 16")
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    return group, blocks_per_step, layer


def pages_spec(shape: tuple[int, ...], layer: int | None, head_index) -> pl.BlockSpec:
    """BlockSpec handing the kernel one kv head's [num_blocks, block_size, head_dim] pool.

    ``head_index`` maps the grid indices to the kv head.  With ``layer`` set the pages are
    5-D and the layer dimension is squeezed too, its index pinned to ``layer``: the kernel
    reads the layer straight out of the stacked pool (no slice of it exists outside).
    """
    s = _SQUEEZED
    _, num_blocks, block_size, head_dim = page_shape(shape, layer)
    if layer is None:
        return pl.BlockSpec((s, num_blocks, block_size, head_dim), lambda *g: (head_index(*g), 0, 0, 0))
    return pl.BlockSpec((s, s, num_blocks, block_size, head_dim), lambda *g: (layer, head_index(*g), 0, 0, 0))


def prepare_table(
    block_tables: jax.Array, lengths: jax.Array, block_size: int, blocks_per_step: int
) -> tuple[jax.Array, jax.Array]:
    """Pads the table so every loop step reads in bounds; clamps lengths to the table.

    A step reads ``blocks_per_step`` consecutive columns starting at a multiple of
    ``blocks_per_step``, so the last one may run past the table width: pad with -1 (clamped
    to block 0 in the kernel, then masked).  Lengths beyond what the table can describe are
    cut so no step ever reads past the padding.
    """
    width = block_tables.shape[1]
    padded = pl.cdiv(width, blocks_per_step) * blocks_per_step
    if padded != width:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, padded - width)), constant_values=-1)
    lengths = jnp.clip(lengths, 0, width * block_size)
    return block_tables, lengths


def paged_attention_grid(
    q: jax.Array,  # [batch, num_kv_heads, block_h, head_dim], group rows zero-padded
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim] ([L, ...] with layer)
    v_pages: jax.Array,  # same shape as k_pages
    block_tables: jax.Array,  # int32[batch, padded_blocks_per_seq]
    lengths: jax.Array,  # int32[batch]
    *,
    scale: float,
    blocks_per_step: int,
    num_splits: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    mask_value: float,
    layer: int | None = None,
) -> jax.Array:
    """Builds the (batch, kv_head, split) grid; returns [batch, num_kv_heads, block_h, head_dim].

    ``layer=None``: 4-D pages; ``layer=i``: 5-D layer-stacked pages, layer i read in place.
    """
    batch, num_kv_heads, block_h, head_dim = q.shape
    _, _, block_size, _ = page_shape(k_pages.shape, layer)
    width = block_tables.shape[1]
    s = _SQUEEZED

    kernel = functools.partial(
        paged_attention_kernel,
        scale=scale,
        blocks_per_step=blocks_per_step,
        num_splits=num_splits,
        mask_value=mask_value,
    )
    in_specs = [
        pl.BlockSpec((1,), lambda b, h, j: (b,)),  # lengths
        pl.BlockSpec((s, width), lambda b, h, j: (b, 0)),  # block_tables
        pl.BlockSpec((s, s, block_h, head_dim), lambda b, h, j: (b, h, 0, 0)),  # q
        pages_spec(k_pages.shape, layer, lambda b, h, j: h),  # k_pages
        pages_spec(v_pages.shape, layer, lambda b, h, j: h),  # v_pages
    ]
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
        out_specs = pl.BlockSpec((s, s, block_h, head_dim), lambda b, h, j: (b, h, 0, 0))
    else:
        part = (batch, num_kv_heads, num_splits, block_h)
        out_shape = [
            jax.ShapeDtypeStruct((*part, head_dim), jnp.float32),  # o (unnormalised)
            jax.ShapeDtypeStruct(part, jnp.float32),  # m
            jax.ShapeDtypeStruct(part, jnp.float32),  # l
        ]
        out_specs = [
            pl.BlockSpec((s, s, s, block_h, head_dim), lambda b, h, j: (b, h, j, 0, 0)),
            pl.BlockSpec((s, s, s, block_h), lambda b, h, j: (b, h, j, 0)),
            pl.BlockSpec((s, s, s, block_h), lambda b, h, j: (b, h, j, 0)),
        ]
    out = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_attention_bh{block_h}_bk{blocks_per_step * block_size}_s{num_splits}",
    )(lengths, block_tables, q, k_pages, v_pages)
    if num_splits == 1:
        return out
    return combine_splits(*out).astype(q.dtype)


@functools.partial(
    jax.jit,
    static_argnames=[
        "scale",
        "blocks_per_step",
        "num_splits",
        "num_warps",
        "num_stages",
        "interpret",
        "mask_value",
        "layer",
    ],
)
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None = None,
    blocks_per_step: int | None = None,
    num_splits: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    mask_value: float = DEFAULT_MASK_VALUE,
    layer: int | None = None,
) -> jax.Array:
    """Paged (grouped-query) decode attention.

    Args:
      q: [batch, num_q_heads, head_dim] float32/bfloat16/float16; q head h reads kv head
        h // (num_q_heads // num_kv_heads).
      k_pages: [num_kv_heads, num_blocks, block_size, head_dim] when ``layer`` is None;
        [num_layers, num_kv_heads, num_blocks, block_size, head_dim] (every layer's pool)
        when ``layer`` is an int.  Same shape and dtype as v_pages.
      v_pages: same shape as k_pages.
      block_tables: int32[batch, max_blocks_per_seq]; entries past a sequence's blocks may
        be -1 (never dereferenced).
      lengths: int32[batch] valid KV tokens per sequence, 0 <= lengths <=
        max_blocks_per_seq * block_size (larger values are clamped to that).
      scale: softmax scale; default head_dim ** -0.5.
      blocks_per_step: physical blocks gathered per loop step (power of two; the step's
        blocks_per_step * block_size tokens must be in [16, 256]). Default: ~128 tokens
        (64 for head_dim 256).
      num_splits: flash-decoding splits of each sequence (1 = no split, no combine pass).
        See ``default_num_splits`` for a choice that fills the GPU.
      num_warps, num_stages: Triton launch parameters.
      interpret: run the kernel in the Pallas interpreter (CPU testing).
      mask_value: finite logit given to masked slots.
      layer: None for 4-D pages, or the static index (0 <= layer < num_layers) of the layer
        to read from 5-D pages.  The kernel reads that layer in place; slicing
        ``pages[layer]`` before the call would make XLA copy the layer's whole pool.

    Returns:
      [batch, num_q_heads, head_dim] in q's dtype; rows with length 0 are 0.

    Raises:
      ValueError: on shapes, dtypes or tuning parameters the kernel does not support
        (head_dim not in {64, 128, 256}, block_size not in {8..128}, ...), or when the
        rank of the pages and ``layer`` disagree or ``layer`` is out of range.
    """
    batch, num_q_heads, head_dim = q.shape
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
    num_kv_heads, _, block_size, _ = page_shape(k_pages.shape, layer)
    if scale is None:
        scale = head_dim**-0.5
    block_h = max(MIN_DOT_DIM, _next_pow2(group))

    block_tables, lengths = prepare_table(block_tables, lengths, block_size, blocks_per_step)
    q4 = q.reshape(batch, num_kv_heads, group, head_dim)
    if block_h != group:
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, block_h - group), (0, 0)))
    o = paged_attention_grid(
        q4,
        k_pages,
        v_pages,
        block_tables,
        lengths,
        scale=float(scale),
        blocks_per_step=blocks_per_step,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        mask_value=mask_value,
        layer=layer,
    )
    return o[:, :, :group, :].reshape(batch, num_q_heads, head_dim)


def gather_kv(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[num_kv_heads, num_blocks, block_size, D] x int32[batch, W] -> [batch, kv, W*bs, D].

    -1 entries are clamped to block 0; callers must mask those positions.
    """
    num_kv_heads, _, block_size, head_dim = pages.shape
    batch, width = block_tables.shape
    g = pages[:, jnp.maximum(block_tables, 0)]  # [kv, batch, W, bs, D]
    return jnp.moveaxis(g, 0, 1).reshape(batch, num_kv_heads, width * block_size, head_dim)


def masked_softmax_attention(q, k, v, mask, scale):
    """Plain fp32 attention with a boolean mask; fully masked rows give 0.

    q: [b, kv, r, D]; k, v: [b, kv, S, D]; mask: bool broadcastable to [b, kv, r, S].
    Masked V rows are zeroed (like the kernel) so garbage in unreadable slots cannot leak.
    """
    q = q.astype(jnp.float32)
    k = k.astype(jnp.float32)
    v = v.astype(jnp.float32)
    hi = lax.Precision.HIGHEST
    s = jnp.einsum("bkrd,bksd->bkrs", q, k, precision=hi) * scale
    s = jnp.where(mask, s, -jnp.inf)
    m = s.max(axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    den = p.sum(axis=-1, keepdims=True)
    any_visible = jnp.any(mask, axis=-2, keepdims=True)  # [.., 1, S]: slot seen by some row
    v = jnp.where(jnp.swapaxes(any_visible, -1, -2), v, 0.0)
    o = jnp.einsum("bkrs,bksd->bkrd", p, v, precision=hi)
    return o / jnp.where(den == 0.0, 1.0, den)


def select_layer(pages: jax.Array, layer: int | None) -> jax.Array:
    """One layer's [num_kv_heads, num_blocks, block_size, head_dim] pages (for the references)."""
    layer = check_layer(pages, layer)
    return pages if layer is None else pages[layer]


@functools.partial(jax.jit, static_argnames=["scale", "layer"])
def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None = None,
    layer: int | None = None,
) -> jax.Array:
    """Plain-jnp reference: gather K/V through the table, masked softmax in float32.

    Same arguments and result as ``paged_attention`` (no tuning parameters), including
    ``layer`` for 5-D layer-stacked pages.
    """
    k_pages, v_pages = select_layer(k_pages, layer), select_layer(v_pages, layer)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    if scale is None:
        scale = head_dim**-0.5
    k = gather_kv(k_pages, block_tables)
    v = gather_kv(v_pages, block_tables)
    lengths = jnp.clip(lengths, 0, block_tables.shape[1] * block_size)
    mask = jnp.arange(k.shape[2])[None, :] < lengths[:, None]  # [b, S]
    o = masked_softmax_attention(
        q.reshape(batch, num_kv_heads, group, head_dim), k, v, mask[:, None, None, :], scale
    )
    return o.reshape(q.shape).astype(q.dtype)
