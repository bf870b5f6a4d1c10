"""Plain-XLA attention: the paged oracle, and dense causal attention over contiguous keys.

``paged_attention`` is the reference implementation of the contract in
``paged_jax.attention.contract`` (its conventions: GQA head mapping, query positions,
fp32 arithmetic, masked memory never read into the result): it gathers every block of
every row's table and runs one masked softmax, so every other implementation is tested
against it. ``dense_causal_attention`` (the model's dense and contiguous-cache backends)
shares its masked-softmax core, ``_attend``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from paged_jax.attention import contract
from paged_jax.kv import quant

# A finite mask value: exp(_MASKED - max) underflows to 0 without Inf - Inf = NaN.
_MASKED = -1e30


def _check_heads(num_q_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}"
        )
    return num_q_heads // num_kv_heads


def _attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    q_lens: jax.Array,
    scale: float | None,
) -> jax.Array:
    """Masked causal attention over contiguous keys.

    Args:
      q: [B, T, Hq, D]. k, v: [B, Hkv, S, D] (head-major, the page layout's order).
        lengths, q_lens: int32[B] as in ``contract``; keys at ``s >= lengths[b]`` are ignored.

    Returns [B, T, Hq, D] in q.dtype.
    """
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    groups = _check_heads(hq, hkv)
    scale = d**-0.5 if scale is None else scale
    lengths = lengths.astype(jnp.int32)
    q_lens = q_lens.astype(jnp.int32)

    q_pos = (lengths - q_lens)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    k_pos = jnp.arange(s, dtype=jnp.int32)  # [S]
    key_ok = k_pos[None, :] < lengths[:, None]  # [B, S]
    row_ok = jnp.arange(t)[None, :] < q_lens[:, None]  # [B, T]
    mask = key_ok[:, None, :] & (k_pos[None, None, :] <= q_pos[:, :, None]) & row_ok[:, :, None]

    qg = q.astype(jnp.float32).reshape(b, t, hkv, groups, d)
    kf = jnp.where(key_ok[:, None, :, None], k.astype(jnp.float32), 0.0)
    vf = jnp.where(key_ok[:, None, :, None], v.astype(jnp.float32), 0.0)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, kf, precision=jax.lax.Precision.HIGHEST) * scale
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = jnp.where(mask[:, None, None], probs, 0.0)
    denom = probs.sum(axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)  # all-masked rows: 0, not NaN
    out = jnp.einsum("bkgts,bksd->btkgd", probs, vf, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def gather_blocks(leaf: jax.Array, block_ids: jax.Array, layer: int | jax.Array | None = None) -> jax.Array:
    """Whole blocks of one layer, read through block ids in one gather.

    Args:
      leaf: a page leaf, every layer's [L, Hkv, N, ...] (``layer`` naming one) or one
        layer's [Hkv, N, ...] (``layer`` None); "..." is [bs, D] for K and V, [bs] or
        [D] for quantised pages' scales.
      block_ids: int[...] of any shape; ids outside [0, N) (-1) are clamped into range
        (callers mask what they read there), and so is a traced layer outside [0, L).
      layer: a Python int or an int32 scalar (traced or not), or None for one layer's leaf.

    Returns [Hkv, *block_ids.shape, ...] in leaf.dtype. The layer is a coordinate of the
    gather, not a slice taken first: a ``leaf[layer]`` slice feeding a loop is
    materialised (the whole layer's pool copied per call), while the gather reads only the
    named blocks. Sub-fp32 floats are gathered as unsigned integers of their width (free
    bitcasts): XLA:CPU has no bf16/f16 gather and converts the whole operand to f32, and
    when the pages are loop-invariant (a scan over layers, the blocked loops) that convert
    is hoisted out of the loop and materialised, i.e. the whole pool converted per call.
    """
    if layer is None:
        leaf, layer = leaf[None], 0  # a free reshape: one code path for one layer and every layer
    dtype = jnp.dtype(leaf.dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        leaf = jax.lax.bitcast_convert_type(leaf, jnp.dtype(f"uint{8 * dtype.itemsize}"))
    num_layers, hkv, n, trailing = leaf.shape[0], leaf.shape[1], leaf.shape[2], leaf.shape[3:]
    # Whole blocks as rows of a flat [L * Hkv * N, prod(trailing)] view (a free reshape),
    # one row index per (head, block): XLA:CPU runs this gather as contiguous row copies,
    # and its output [Hkv, *ids, row] is already the attention dots' layout. The 5-D
    # gather it replaced (a [1, Hkv, 1, bs, D] slice per id, the head axis moved to the
    # front) was ~1.6x slower and was followed by a transposing copy.
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1)
    ids = jnp.clip(block_ids.astype(jnp.int32), 0, n - 1)
    heads = jnp.arange(hkv, dtype=jnp.int32).reshape(hkv, *(1,) * ids.ndim)
    rows = (layer * hkv + heads) * n + ids[None]  # [Hkv, *block_ids.shape]
    flat = leaf.reshape(num_layers * hkv * n, math.prod(trailing))
    out = jnp.take(flat, rows, axis=0, mode="clip").reshape(hkv, *ids.shape, *trailing)
    return jax.lax.bitcast_convert_type(out, dtype) if out.dtype != dtype else out


def gather_dequantized(pages, which: str, block_ids: jax.Array, layer=None) -> jax.Array:
    """``gather_blocks`` of ``pages.k`` or ``pages.v`` (``which``), dequantised with its
    scale leaf when the pages are quantised -> float32[Hkv, *block_ids.shape, bs, D].
    Scales are gathered per block like the values and broadcast: nothing pool-sized is
    ever dequantised."""
    out = gather_blocks(getattr(pages, which), block_ids, layer)
    out = (pages.values(out) if hasattr(pages, "values") else out).astype(jnp.float32)
    scales = getattr(pages, f"{which}_scale", None)
    if scales is None:
        return out
    return quant.dequantize(out, gather_blocks(scales, block_ids, layer), pages.format.per_channel)


def paged_attention(
    q: jax.Array,
    pages,
    block_tables: jax.Array,
    lengths: jax.Array,
    q_lens: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """The oracle: every table column of every row gathered, then masked fp32 attention.

    Arguments and result as in ``contract`` (q [B, T, Hq, D]; pages a KVPages with leaves
    [L, Hkv, N, bs, D] and ``layer``, or [Hkv, N, bs, D]; int32 block_tables [B, P],
    lengths and q_lens [B]) -> [B, T, Hq, D] in q.dtype. Costs ``B x P`` blocks whatever
    the rows hold; simple enough to trust, which is its job.
    """
    contract.check(q, pages, block_tables, lengths, q_lens, layer)
    b, p = block_tables.shape

    def rows(which):  # [B, Hkv, P * bs, D] f32, head-major like the pages
        g = jnp.swapaxes(gather_dequantized(pages, which, block_tables, layer), 0, 1)  # [B, Hkv, P, bs, D]
        return g.reshape(b, g.shape[1], p * g.shape[3], g.shape[4])

    return _attend(q, rows("k"), rows("v"), lengths, q_lens, scale)


def dense_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    lengths: jax.Array | None = None,
    q_lens: jax.Array | None = None,
    scale: float | None = None,
    heads_first: bool = False,
) -> jax.Array:
    """Causal attention over contiguous (non-paged) keys and values.

    With the defaults this is ordinary causal self-attention of T tokens over S >= T
    keys, the queries being the last T positions. ``lengths``/``q_lens`` (int32[B])
    follow the conventions of ``contract``, for a contiguous cache ``[B, max_len]`` holding
    ``lengths[b]`` valid keys.

    Args:
      q: [B, T, Hq, D]. k, v: [B, S, Hkv, D], or [B, Hkv, S, D] with ``heads_first``
        (the layout of a contiguous cache that avoids transposes).

    Returns [B, T, Hq, D] in q.dtype.
    """
    if not heads_first:
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    b, t = q.shape[:2]
    s = k.shape[2]
    if lengths is None:
        lengths = jnp.full((b,), s, jnp.int32)
    if q_lens is None:
        q_lens = jnp.full((b,), t, jnp.int32)
    return _attend(q, k, v, lengths, q_lens, scale)
