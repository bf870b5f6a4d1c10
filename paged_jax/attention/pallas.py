"""The Pallas kernels (``pallas_kernels``) behind the attention contract.

``paged_attention`` takes the contract's arguments (``paged_jax.attention.contract``) and
runs the decode kernel when T == 1 (q [B, 1, Hq, D] becomes the kernel's [B, Hq, D] and
back), the chunk kernel otherwise. The kernels take raw arrays (``pages.k``,
``pages.v``) and the layer as a Python int or a traced scalar, and read that layer in
place; quantised pages pass their scale leaves beside them. ``pallas_kernels`` is an optional import, made on first use: without it the call
raises ImportError saying so.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from paged_jax.attention import contract

# Tuning parameters only the chunk kernel takes; a decode call (T == 1) drops them.
_CHUNK_ONLY = ("block_rows",)


@functools.cache
def kernels():
    """The ``pallas_kernels`` module, or ImportError with the reason and the way out."""
    try:
        module = importlib.import_module("pallas_kernels")
    except ImportError as e:
        raise ImportError(
            "attention impl 'pallas'/'pallas_interpret' needs the pallas_kernels package, "
            f"which could not be imported ({e}); use impl='xla'"
        ) from e
    missing = [n for n in ("paged_attention_decode", "paged_attention_chunk") if not hasattr(module, n)]
    if missing:
        why = getattr(module, "TRITON_ERROR", None)
        raise ImportError(f"pallas_kernels has no {', '.join(missing)}" + (f" ({why})" if why else "")
                          + "; use impl='xla' (or 'mosaic_gpu' on Hopper)")
    return module


def paged_attention(
    q: jax.Array,
    pages,
    block_tables: jax.Array,
    lengths: jax.Array,
    q_lens: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    scale: float | None = None,
    interpret: bool = False,
    **tuning,
) -> jax.Array:
    """Paged attention through the Pallas kernels.

    Args:
      q, pages, block_tables, lengths, q_lens, layer, scale: as in ``contract`` (q
        [B, T, Hq, D]; pages leaves [L, Hkv, N, bs, D] with ``layer``, or [Hkv, N, bs, D];
        int32 block_tables [B, P], lengths and q_lens [B]).
      interpret: run the kernels in the Pallas interpreter (any backend; tests).
      **tuning: keyword tuning parameters of the kernels (``blocks_per_step``,
        ``num_splits``, ``num_warps``, ``num_stages``; ``block_rows`` for chunks only).

    Returns [B, T, Hq, D] in q.dtype.

    Raises:
      ImportError: ``pallas_kernels`` is missing.
      ValueError: the call breaks the contract, or the kernel does not take its shapes
        (head_dim not in {64, 128, 256}, block_size not in {8..128}, ...).
    """
    contract.check(q, pages, block_tables, lengths, q_lens, layer)
    module = kernels()
    block_tables = jnp.asarray(block_tables, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    q_lens = jnp.asarray(q_lens, jnp.int32)
    if q.shape[1] == 1:
        decode_tuning = {k: v for k, v in tuning.items() if k not in _CHUNK_ONLY}
        # A decode row without a query (q_len 0) must output 0, as a keyless row does.
        out = module.paged_attention_decode(
            q[:, 0],
            pages.values(pages.k),  # stored bits: the kernels read floats (a whole-pool bitcast)
            pages.values(pages.v),
            block_tables,
            jnp.where(q_lens > 0, lengths, 0),
            layer=layer,
            scale=scale,
            k_scales=pages.k_scale,
            v_scales=pages.v_scale,
            per_channel_scales=pages.format.per_channel,
            interpret=interpret,
            **decode_tuning,
        )
        return out[:, None]
    return module.paged_attention_chunk(
        q,
        pages.values(pages.k),
        pages.values(pages.v),
        block_tables,
        lengths,
        q_lens,
        layer=layer,
        scale=scale,
        k_scales=pages.k_scale,
        v_scales=pages.v_scale,
        per_channel_scales=pages.format.per_channel,
        interpret=interpret,
        **tuning,
    )
