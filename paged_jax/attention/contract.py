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

``reference.paged_attention`` is the oracle: every other implementation is tested against
it (``tests/test_attention_contract.py``). ``check`` below is the validation they share.
"""

from __future__ import annotations

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
