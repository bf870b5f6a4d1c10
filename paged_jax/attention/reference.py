"""Plain-XLA attention: paged (through block tables) and dense, the oracle for kernels.

Conventions shared with ``pallas_kernels``:

- Query head ``h`` reads kv head ``h // (Hq // Hkv)`` (Hugging Face's ``repeat_kv``):
  MHA (Hq == Hkv), GQA, MQA (Hkv == 1).
- ``lengths[b]`` is the sequence's total KV length, the current tokens included (their
  K/V are already written). Query ``t < q_lens[b]`` sits at position
  ``lengths[b] - q_lens[b] + t`` and attends to keys ``[0, that position]``. Rows
  ``t >= q_lens[b]`` output 0, and so does a row with no key at all (length 0): finite,
  never NaN.
- Scores, softmax and the weighted sum are fp32; the output has ``q``'s dtype.
- ``scale`` defaults to ``head_dim ** -0.5``.

Masked positions never reach the result, even when their memory holds NaN or Inf (a
free block, a stale tail of the last block): masked scores are replaced rather than
added to, and masked values are zeroed before the weighted sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
        lengths, q_lens: int32[B] (see module doc); keys at ``s >= lengths[b]`` are ignored.

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


def select_layer(pages: jax.Array, layer: int | None) -> jax.Array:
    """One layer's pages ``[Hkv, N, bs, D]``: ``pages`` itself when 4-D (``layer`` None), or
    ``pages[layer]`` of every layer's ``[L, Hkv, N, bs, D]``. Raises ValueError when the
    rank and ``layer`` disagree. Implementations that loop over the pages should index
    the layer inside the loop instead (a slice taken outside is materialised)."""
    check_layer(pages, layer)
    return pages if layer is None else pages[layer]


def check_layer(pages: jax.Array, layer) -> None:
    """ValueError unless 4-D pages come with ``layer=None`` and 5-D ones with an index."""
    if (pages.ndim == 5) != (layer is not None) or pages.ndim not in (4, 5):
        raise ValueError(
            f"pages of shape {pages.shape} need layer=None when 4-D [Hkv, N, bs, D], a layer index "
            f"when 5-D [L, Hkv, N, bs, D] (got layer={layer})"
        )


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """Contiguous per-sequence keys (or values) read through the block tables.

    Args:
      pages: [Hkv, N, bs, D]. block_tables: int32[B, P]; ``NO_BLOCK`` (-1) entries read
        block 0 (callers mask them by length).

    Returns [B, Hkv, P * bs, D] (head-major).
    """
    hkv, n, bs, d = pages.shape
    b, p = block_tables.shape
    safe = jnp.clip(block_tables, 0, n - 1)
    gathered = pages[:, safe]  # [Hkv, B, P, bs, D]
    return jnp.swapaxes(gathered, 0, 1).reshape(b, hkv, p * bs, d)


def paged_chunk_attention(
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
    """Causal attention of a chunk of new tokens over a paged KV cache (prefill).

    Args:
      q: [B, T, Hq, D] queries of up to T new tokens per sequence.
      k_pages, v_pages: [Hkv, N, bs, D] one layer's pages, the chunk already written; or
        every layer's [L, Hkv, N, bs, D] with ``layer`` choosing one (``select_layer``).
      block_tables: int32[B, P] physical block of each logical block; -1 past the end.
      lengths: int32[B] KV length including the chunk; lengths[b] <= P * bs.
      q_lens: int32[B] real queries per row (<= T, <= lengths).

    Returns [B, T, Hq, D] in q.dtype; rows ``t >= q_lens[b]`` are 0.
    """
    k = gather_pages(select_layer(k_pages, layer), block_tables)
    v = gather_pages(select_layer(v_pages, layer), block_tables)
    return _attend(q, k, v, lengths, q_lens, scale)


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None = None,
    layer: int | None = None,
) -> jax.Array:
    """One new token per sequence attending to its whole paged KV cache (decode).

    Args:
      q: [B, Hq, D]. k_pages, v_pages: [Hkv, N, bs, D] (or 5-D with ``layer``, as for
        ``paged_chunk_attention``). block_tables: int32[B, P].
      lengths: int32[B] KV length including the new token; 0 = padding row.

    Returns [B, Hq, D] in q.dtype; 0 for rows of length 0.
    """
    q_lens = (lengths > 0).astype(jnp.int32)
    out = paged_chunk_attention(
        q[:, None], k_pages, v_pages, block_tables, lengths, q_lens, scale=scale, layer=layer
    )
    return out[:, 0]


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
    follow the module conventions, for a contiguous cache ``[B, max_len]`` holding
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
