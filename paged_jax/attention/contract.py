"""The paged-attention contract: one signature, one set of conventions, every implementation.

Every implementation (``reference``, ``blocked``, ``pallas``, and whatever a study
registers in ``dispatch``) is a function

    paged_attention(q, pages, block_tables, lengths, q_lens, *, layer=None, scale=None) -> out

  q:            [B, T, Hq, D] float (fp32, bf16, fp16); T = 1 is decode, T > 1 a chunk
                (prefill, or verification of draft tokens).
  pages:        ``paged_jax.kv.KVPages``; ``.k`` and ``.v`` are every layer's
                [L, Hkv, N, bs, D], or one layer's [Hkv, N, bs, D] with ``layer=None``.
                Quantised pages (``kv.quant``: int8 / float8 values) carry
                ``.k_scale`` and ``.v_scale`` ([.., N, bs] per token, [.., N, D] per
                channel); every implementation reads values * scale, block by
                block, never a dequantised copy of the pool.
  block_tables: int32[B, P]: logical block j of row b is physical block block_tables[b, j];
                entries past a row's blocks may be anything (-1).
  lengths:      int32[B]: KV length of each row including the new tokens, whose K/V are
                already written; 0 <= lengths <= P * bs.
  q_lens:       int32[B]: real queries per row, <= T and <= lengths. Query t < q_lens[b]
                sits at position lengths[b] - q_lens[b] + t and attends to keys
                [0, that position].
  layer:        which layer of 5-D pages: a Python int, or a traced int32 scalar (a model
                scanning over its layers); None for 4-D pages. A traced layer outside
                [0, L) is clamped.
  scale:        a Python float; default D ** -0.5.
  out:          [B, T, Hq, D] in q's dtype. Rows t >= q_lens[b] are exactly 0, and so is
                a row with no key at all (length 0): finite, never NaN.

Conventions:

- GQA: query head h reads kv head h // (Hq // Hkv) (Hugging Face's ``repeat_kv``): MHA
  (Hq == Hkv), GQA, MQA (Hkv == 1).
- Scores, softmax and the weighted sum are fp32 whatever the input dtype.
- Masked keys never reach the result, even when their memory holds NaN or Inf (a free
  block, the stale tail of a row's last block, a table entry past the row's blocks):
  masked scores are replaced rather than added to, and masked values are zeroed.
- The layer is indexed where the pages are read, never sliced first: ``pages.k[layer]``
  handed to a loop or to a custom call is materialised, i.e. a whole layer's pool copied
  per layer per step. Plain XLA gathers with the layer as one more coordinate; the Pallas
  kernels take the pool as one flat array and the layer as an operand.

**The ragged (packed) form.** A step that packs its rows' new tokens one after another
(no padding between rows; ``paged_jax.steps``) calls

    ragged_paged_attention(q, pages, block_tables, lengths, q_starts, q_lens, *, layer=None, scale=None) -> out

  q:            [N, Hq, D]: every row's queries, packed; row b's are
                q[q_starts[b] : q_starts[b] + q_lens[b]].
  q_starts:     int32[B]: rows in order, spans inside [0, N) and not overlapping
                (q_starts[b] + q_lens[b] <= q_starts[b + 1]); gaps are allowed.
  block_tables, lengths, q_lens, layer, scale: as above (q_lens <= lengths).
  out:          [N, Hq, D] in q's dtype; a query that belongs to no row is exactly 0.

Query t of row b sits at position lengths[b] - q_lens[b] + t, as in the padded form: the
padded call is the ragged one with q_starts[b] = b * T. An implementation without a ragged
variant of its own runs it as a padded call of one query per token (``ragged_as_rows``:
each token a row of its own, its length its position + 1): exact, and no padding computed.

``reference.paged_attention`` is the oracle: every other implementation is tested against
it (``tests/test_attention_contract.py``). ``check`` below is the validation they share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np


class AttentionFn(Protocol):
    """The signature every implementation has (see the module doc)."""

    def __call__(
        self,
        q: jax.Array,
        pages,
        block_tables: jax.Array,
        lengths: jax.Array,
        q_lens: jax.Array,
        *,
        layer: int | jax.Array | None = None,
        scale: float | None = None,
    ) -> jax.Array: ...


class Shapes(NamedTuple):
    """The sizes of one call, as ``check`` found them."""

    batch: int  # B
    queries: int  # T
    q_heads: int  # Hq
    kv_heads: int  # Hkv
    group: int  # Hq // Hkv
    num_blocks: int  # N
    block_size: int  # bs
    head_dim: int  # D
    num_layers: int | None  # L, or None for one layer's 4-D pages


def check_layer(k: jax.Array, layer) -> None:
    """ValueError unless 4-D pages come with ``layer=None`` and 5-D ones with a layer: a
    Python int in [0, L), or an integer scalar array (traced or not)."""
    if k.ndim not in (4, 5) or (k.ndim == 5) != (layer is not None):
        raise ValueError(
            f"pages of shape {k.shape} need layer=None when 4-D [Hkv, N, bs, D], a layer index "
            f"when 5-D [L, Hkv, N, bs, D] (got layer={layer})"
        )
    if layer is None:
        return
    if isinstance(layer, (bool, np.bool_)):
        raise ValueError(f"layer must be an int or an integer scalar array, got {layer!r}")
    if isinstance(layer, (int, np.integer)):
        if not 0 <= layer < k.shape[0]:
            raise ValueError(f"layer={layer} is out of range [0, {k.shape[0]}) for pages of shape {k.shape}")
        return
    if not (
        isinstance(layer, (jax.Array, np.ndarray))
        and layer.shape == ()
        and jnp.issubdtype(layer.dtype, jnp.integer)
    ):
        raise ValueError(f"layer must be an int or an integer scalar array, got {layer!r}")


def check_scales(pages) -> None:
    """ValueError unless the scale leaves match the values: both absent for float pages,
    both present for int8 / float8 ones, shaped ``[.., N, bs]`` (per token) or
    ``[.., N, D]`` (per channel) as ``pages.kv_format`` says."""
    k, ks, vs = pages.k, getattr(pages, "k_scale", None), getattr(pages, "v_scale", None)
    dtype = jnp.dtype(getattr(pages, "dtype", k.dtype))  # the values' dtype (stored bits: what they hold)
    quantized = not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize == 1
    if (ks is None) != (vs is None) or (ks is None) == quantized:
        raise ValueError(
            f"pages of dtype {k.dtype} need {'scales' if quantized else 'no scales'}: got k_scale "
            f"{None if ks is None else ks.shape}, v_scale {None if vs is None else vs.shape}"
        )
    if ks is None:
        return
    *lead, bs, d = k.shape
    want = (*lead, d) if pages.format.per_channel else (*lead, bs)
    if ks.shape != want or vs.shape != want:
        raise ValueError(
            f"scales {ks.shape} / {vs.shape} do not fit {pages.kv_format!r} pages {k.shape}: want {want}"
        )


def check(q, pages, block_tables, lengths, q_lens, layer) -> Shapes:
    """Validates one call's shapes and dtypes against the contract (at trace time: shapes
    only, never values). Raises ValueError; returns the sizes."""
    k, v = pages.k, pages.v
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, D], got shape {q.shape}")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"pages.k and pages.v differ: {k.dtype}{list(k.shape)} vs {v.dtype}{list(v.shape)}")
    check_scales(pages)
    check_layer(k, layer)
    b, t, hq, d = q.shape
    hkv, n, bs, dk = k.shape[-4:]
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) and of the pages ({dk}) differ")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"num_q_heads={hq} must be a multiple of num_kv_heads={hkv}")
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be int32[B={b}, P], got shape {block_tables.shape}")
    for name, x in (("block_tables", block_tables), ("lengths", lengths), ("q_lens", q_lens)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be int32, got {x.dtype}")
    for name, x in (("lengths", lengths), ("q_lens", q_lens)):
        if x.shape != (b,):
            raise ValueError(f"{name} must be int32[B={b}], got shape {x.shape}")
    return Shapes(b, t, hq, hkv, hq // hkv, n, bs, d, k.shape[0] if k.ndim == 5 else None)


def default_scale(head_dim: int, scale: float | None) -> float:
    """``scale``, or ``head_dim ** -0.5`` when None."""
    return head_dim**-0.5 if scale is None else scale


def kernel_tiling_problem(limits, *, head_dim: int, block_size: int, num_heads: int,
                          num_kv_heads: int) -> str | None:
    """Why a kernel family cannot tile this shape, or None. ``limits`` is the module holding its
    ``SUPPORTED_HEAD_DIMS``, ``SUPPORTED_BLOCK_SIZES`` and ``MAX_GROUP`` (query heads per kv head)."""
    if head_dim not in limits.SUPPORTED_HEAD_DIMS:
        return f"head_dim={head_dim} is not supported (one of {limits.SUPPORTED_HEAD_DIMS})"
    if block_size not in limits.SUPPORTED_BLOCK_SIZES:
        return f"block_size={block_size} is not supported (one of {limits.SUPPORTED_BLOCK_SIZES})"
    if num_heads // num_kv_heads > limits.MAX_GROUP:
        return f"{num_heads // num_kv_heads} query heads per kv head is more than the kernel's {limits.MAX_GROUP}"
    return None


def check_ragged(q, pages, block_tables, lengths, q_starts, q_lens, layer) -> Shapes:
    """``check`` for the ragged form (q [N, Hq, D], q_starts int32[B]); ``Shapes.batch`` is
    B (rows) and ``Shapes.queries`` N (packed queries)."""
    if q.ndim != 3:
        raise ValueError(f"ragged q must be [N, Hq, D], got shape {q.shape}")
    b = block_tables.shape[0] if block_tables.ndim == 2 else -1
    if q_starts.shape != (b,) or not jnp.issubdtype(q_starts.dtype, jnp.integer):
        raise ValueError(f"q_starts must be int32[B={b}], got {q_starts.dtype}{list(q_starts.shape)}")
    # The padded check on a view of B rows (the queries' count does not enter it).
    shapes = check(jax.ShapeDtypeStruct((b, 1, *q.shape[1:]), q.dtype), pages, block_tables, lengths, q_lens, layer)
    return shapes._replace(queries=q.shape[0])


def ragged_token_rows(q_starts: jax.Array, q_lens: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For ``n`` packed queries: ``(row int32[N], offset int32[N], valid bool[N])``: the row
    each query belongs to (clamped into [0, B)), its index within that row's queries, and
    whether it belongs to a row at all (gaps and the tail belong to none)."""
    q_starts, q_lens = q_starts.astype(jnp.int32), q_lens.astype(jnp.int32)
    i = jnp.arange(n, dtype=jnp.int32)
    ends = q_starts + jnp.maximum(q_lens, 0)
    row = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)  # the first row ending past i
    b = q_starts.shape[0]
    safe = jnp.minimum(row, b - 1)
    offset = i - q_starts[safe]
    return safe, offset, (row < b) & (offset >= 0)


def ragged_as_rows(fn: AttentionFn) -> Callable:
    """The ragged form of a padded implementation ``fn``: one row per query (its row's
    block table, length = its position + 1, one query), so a causal query attends to
    exactly its keys and nothing padded is computed. Any padded implementation gets a ragged
    form this way; a kernel that reads a row's blocks once for all its queries registers
    its own (``dispatch.AttentionImpl.ragged``)."""

    def ragged(q, pages, block_tables, lengths, q_starts, q_lens, *, layer=None, scale=None):
        n = q.shape[0]
        row, offset, valid = ragged_token_rows(q_starts, q_lens, n)
        q_lens = jnp.minimum(q_lens.astype(jnp.int32), lengths.astype(jnp.int32))
        valid &= offset < q_lens[row]
        position = lengths[row] - q_lens[row] + offset
        out = fn(q[:, None], pages, block_tables[row], jnp.where(valid, position + 1, 0).astype(jnp.int32),
                 valid.astype(jnp.int32), layer=layer, scale=scale)
        return out[:, 0]

    return ragged
