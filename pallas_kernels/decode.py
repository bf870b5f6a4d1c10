"""Paged decode attention for GPUs, written as a Pallas Triton-backend kernel.

One query token per sequence attends over that sequence's KV cache, which lives in a
shared pool of fixed-size physical blocks addressed through a block table:

  q:                [batch, num_q_heads, head_dim]
  k_pages, v_pages: [num_kv_heads, num_blocks, block_size, head_dim], or every layer's
                    pool [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
                    with ``layer`` (a Python int or a traced int32 scalar) naming one.
  block_tables:     int32[batch, max_blocks_per_seq]; logical block j of sequence b is
                    physical block block_tables[b, j]; unused entries may be anything (-1).
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
* The pages reach the kernel as one flat [layers * kv_heads * blocks, block_size,
  head_dim] array and the layer as an int32 operand (``common``'s module doc): the layer
  may be traced, and no per-layer copy of the pool is made.
* Robust to garbage: table entries are clamped into the pool before they are
  dereferenced (the last step may cover columns past the sequence's end), masked logits
  get a finite mask value, masked probabilities are forced to exactly 0, and masked V rows
  are zeroed so that NaN/Inf in unwritten slots or unreferenced blocks cannot leak into the
  output.  A length-0 row produces exactly 0.
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
    default_blocks_per_step,
    device_arch,
    finalize,
    flat_pages,
    flat_scales,
    init_carry,
    load_kv,
    next_pow2,
    online_softmax_step,
    page_shape,
    prepare_table,
    split_range,
    split_refs,
    whole_spec,
)


def paged_attention_decode_kernel(
    # inputs
    lengths_ref,  # [1] int32: this sequence's KV length
    layer_ref,  # [1] int32: the layer to read
    block_tables_ref,  # [padded_blocks_per_seq] int32: physical block ids (-1 = none)
    q_ref,  # [block_h, head_dim]: the q heads of one kv head, zero-padded rows
    k_pages_ref,  # [num_layers * num_kv_heads * num_blocks, block_size, head_dim]: every K block
    v_pages_ref,  # [num_layers * num_kv_heads * num_blocks, block_size, head_dim]: every V block
    *refs: Any,  # quantised: k_scale_ref, v_scale_ref (flat like the pages); then the outputs:
    # o_ref  # [block_h, head_dim]: q dtype (one split) or f32 unnormalised (splits)
    # [block_h, head_dim]: q dtype (one split) or f32 unnormalised (splits); splits > 1:
    # m_ref [block_h] f32, l_ref [block_h] f32
    scale: float,
    quantized: bool,
    per_channel: bool,
    num_kv_heads: int,
    num_blocks: int,
    blocks_per_step: int,
    num_splits: int,
    mask_value: float,
):
    k_scale_ref, v_scale_ref, (o_ref, *stat_refs) = split_refs(refs, quantized)
    head = pl.program_id(1)
    split = pl.program_id(2)
    block_h, head_dim = q_ref.shape
    block_size = k_pages_ref.shape[-2]
    block_k = blocks_per_step * block_size

    length = lengths_ref[0]
    layer = layer_ref[0]
    num_steps_total = pl.cdiv(length, block_k)
    first_step, num_steps = split_range(num_steps_total, split, num_splits)
    q = q_ref[...]

    def body(i, carry):
        step = first_step + i
        ids = block_ids(block_tables_ref, step, blocks_per_step, layer, head, num_kv_heads, num_blocks)
        k = load_kv(k_pages_ref, k_scale_ref, ids, block_k, head_dim, q.dtype, per_channel)
        v = load_kv(v_pages_ref, v_scale_ref, ids, block_k, head_dim, q.dtype, per_channel)
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


def paged_attention_decode_grid(
    q: jax.Array,  # [batch, num_kv_heads, block_h, head_dim], group rows zero-padded
    k_pages: jax.Array,  # [num_layers * num_kv_heads * num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # same shape as k_pages
    layer: jax.Array,  # int32[1]
    block_tables: jax.Array,  # int32[batch, padded_blocks_per_seq]
    lengths: jax.Array,  # int32[batch]
    *,
    num_blocks: int,
    scale: float,
    blocks_per_step: int,
    num_splits: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    mask_value: float,
    per_channel: bool = False,
    scales: tuple[jax.Array, jax.Array] | None = None,  # (k, v) [L * Hkv * N, bs or D]: quantised pages
) -> jax.Array:
    """Builds the (batch, kv_head, split) grid; returns [batch, num_kv_heads, block_h, head_dim]."""
    batch, num_kv_heads, block_h, head_dim = q.shape
    block_size = k_pages.shape[-2]
    width = block_tables.shape[1]
    s = SQUEEZED

    kernel = functools.partial(
        paged_attention_decode_kernel,
        scale=scale,
        num_kv_heads=num_kv_heads,
        num_blocks=num_blocks,
        blocks_per_step=blocks_per_step,
        num_splits=num_splits,
        mask_value=mask_value,
        quantized=scales is not None,
        per_channel=per_channel,
    )
    in_specs = [
        pl.BlockSpec((1,), lambda b, h, j: (b,)),  # lengths
        pl.BlockSpec((1,), lambda b, h, j: (0,)),  # layer
        pl.BlockSpec((s, width), lambda b, h, j: (b, 0)),  # block_tables
        pl.BlockSpec((s, s, block_h, head_dim), lambda b, h, j: (b, h, 0, 0)),  # q
        whole_spec(k_pages.shape),  # k_pages: the kernel computes block indices itself
        whole_spec(v_pages.shape),  # v_pages
    ]
    scale_operands = () if scales is None else tuple(scales)
    in_specs += [whole_spec(x.shape) for x in scale_operands]  # scales, indexed like the pages
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
        name=f"paged_attention_decode_bh{block_h}_bk{blocks_per_step * block_size}_s{num_splits}",
    )(lengths, layer, block_tables, q, k_pages, v_pages, *scale_operands)
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
        "per_channel_scales",
    ],
)
def _paged_attention_decode(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    layer,
    k_scales,
    v_scales,
    *,
    scale,
    blocks_per_step,
    num_splits,
    num_warps,
    num_stages,
    interpret,
    mask_value,
    per_channel_scales,
):
    """``paged_attention_decode`` after validation (``layer``: None, int or int32 scalar)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = page_shape(k_pages.shape)
    group = num_q_heads // num_kv_heads
    block_h = max(MIN_DOT_DIM, next_pow2(group))

    block_tables, lengths = prepare_table(block_tables, lengths, block_size, blocks_per_step)
    q4 = q.reshape(batch, num_kv_heads, group, head_dim)
    if block_h != group:
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, block_h - group), (0, 0)))
    k_flat, layer_index = flat_pages(k_pages, layer)
    v_flat, _ = flat_pages(v_pages, layer)
    scales = None if k_scales is None else (flat_scales(k_scales), flat_scales(v_scales))
    o = paged_attention_decode_grid(
        q4,
        k_flat,
        v_flat,
        layer_index,
        block_tables,
        lengths,
        num_blocks=num_blocks,
        scale=scale,
        blocks_per_step=blocks_per_step,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        mask_value=mask_value,
        per_channel=per_channel_scales,
        scales=scales,
    )
    return o[:, :, :group, :].reshape(batch, num_q_heads, head_dim)


def default_tuning(*, head_dim: int, block_size: int, dtype, arch: int | None = None,
                   per_channel: bool = False) -> dict:
    """The decode kernel's default tuning for pages of ``dtype`` on ``arch`` (80, 90; None:
    90): tokens per step, warps, stages. Chosen by compiling for sm_80 and sm_90a offline
    (``pallas_kernels.offline``, ``experiments/kernel_resources.py``): the first setting, in
    order of preference, without spills and within the arch's shared memory, over
    head_dim 64/128, block 16/32/64 (tests/test_kernel_resources.py keeps it so).

    - 16-bit and per-token quantised pages: ~128 tokens per step, 4 warps, 2 stages;
      per-channel scales: 8 warps (4 spill on sm_80).
    - fp32 pages: IEEE fp32 dots run on the FMA units, so the operands live in registers:
      8 warps and 64 tokens per step at head_dim 64; at head_dim >= 128 one block per step
      (>= 16 tokens), 1 stage past 16-token blocks, and 4 warps for 64-token blocks on
      sm_90 (8 spill there; at 128 tokens the 2-stage tiles need 264 KB of shared memory).
    """
    arch = 90 if arch is None else arch
    if jnp.dtype(dtype).itemsize == 4:
        if head_dim <= 64:
            return dict(blocks_per_step=max(1, 64 // block_size), num_warps=8, num_stages=2)
        warps = 4 if arch >= 90 and block_size >= 64 else 8
        return dict(blocks_per_step=max(1, 16 // block_size), num_warps=warps, num_stages=2 if block_size <= 16 else 1)
    return dict(blocks_per_step=default_blocks_per_step(block_size, head_dim), num_warps=8 if per_channel else 4,
                num_stages=2)


def paged_attention_decode(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    per_channel_scales: bool = False,
    blocks_per_step: int | None = None,
    num_splits: int = 1,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    mask_value: float = DEFAULT_MASK_VALUE,
) -> jax.Array:
    """Paged (grouped-query) decode attention.

    Validates its arguments in Python (so a bad call raises ValueError when traced), then
    runs a jitted program (tuning parameters static, ``layer`` traced).

    Args:
      q: [batch, num_q_heads, head_dim] float32/bfloat16/float16; q head h reads kv head
        h // (num_q_heads // num_kv_heads).
      k_pages: [num_kv_heads, num_blocks, block_size, head_dim] when ``layer`` is None;
        [num_layers, num_kv_heads, num_blocks, block_size, head_dim] (every layer's pool)
        otherwise.  Same shape and dtype as v_pages.
      v_pages: same shape as k_pages.
      block_tables: int32[batch, max_blocks_per_seq]; entries past a sequence's blocks may
        be anything (-1): they are clamped into the pool and their slots masked.
      lengths: int32[batch] valid KV tokens per sequence, 0 <= lengths <=
        max_blocks_per_seq * block_size (larger values are clamped to that).
      layer: None for 4-D pages; for 5-D pages the layer to read, a Python int in
        [0, num_layers) or an integer scalar array (traced; clamped into range).  The
        kernel reads that layer in place; slicing ``pages[layer]`` before the call would
        make XLA copy the layer's whole pool.
      scale: softmax scale (a Python float); default head_dim ** -0.5.
      k_scales, v_scales: for int8 / float8_e4m3fn pages, their scales: the pages' leading
        axes then [block_size] (per token) or [head_dim] (``per_channel_scales``);
        loaded with each tile and multiplied in f32. None for float pages.
      blocks_per_step: physical blocks gathered per loop step (power of two; the step's
        blocks_per_step * block_size tokens must be in [16, 256]). Default
        (``default_tuning``): ~128 tokens (64 for head_dim 256); fewer for fp32 pages.
      num_splits: flash-decoding splits of each sequence (1 = no split, no combine pass).
        See ``default_num_splits`` for a choice that fills the GPU.
      num_warps, num_stages: Triton launch parameters; None: ``default_tuning``'s for this
        GPU's arch.
      interpret: run the kernel in the Pallas interpreter (CPU testing).
      mask_value: finite logit given to masked slots.

    Returns:
      [batch, num_q_heads, head_dim] in q's dtype; rows with length 0 are 0.

    Raises:
      ValueError: on shapes, dtypes or tuning parameters the kernel does not support
        (head_dim not in {64, 128, 256}, block_size not in {8..128}, ...), or when the
        rank of the pages and ``layer`` disagree or an int ``layer`` is out of range.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, num_q_heads, head_dim], got shape {q.shape}")
    batch, num_q_heads, head_dim = q.shape
    defaults = default_tuning(head_dim=head_dim, block_size=k_pages.shape[-2], dtype=k_pages.dtype,
                              arch=device_arch(), per_channel=per_channel_scales)
    blocks_per_step = defaults["blocks_per_step"] if blocks_per_step is None else blocks_per_step
    num_warps = defaults["num_warps"] if num_warps is None else num_warps
    num_stages = defaults["num_stages"] if num_stages is None else num_stages
    _, blocks_per_step, layer = check_common(
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
    return _paged_attention_decode(
        q,
        k_pages,
        v_pages,
        block_tables,
        lengths,
        layer,
        k_scales,
        v_scales,
        scale=float(head_dim**-0.5 if scale is None else scale),
        blocks_per_step=blocks_per_step,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        mask_value=mask_value,
        per_channel_scales=per_channel_scales,
    )
