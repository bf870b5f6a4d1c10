"""Cost ablations: stand-ins for a piece of the model that time everything but that piece.

``no_attention`` has the attention contract's signature (``paged_jax.attention.contract``)
and returns zeros of q's shape without reading the pages. A study run with it
(``python -m experiments throughput --attention none``) times everything but attention;
its outputs are meaningless, and its throughput bounds what any faster attention could
give. ``register()`` makes it ``impl="none"`` for ``paged_jax.attention.dispatch``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NO_ATTENTION = "none"


def no_attention(q, pages, block_tables, lengths, q_lens, *, layer=None, scale=None) -> jax.Array:
    """Zeros of q's shape and dtype [B, T, Hq, D]; reads nothing else."""
    del pages, block_tables, lengths, q_lens, layer, scale
    return jnp.zeros_like(q)


def register() -> str:
    """Register ``no_attention`` as the attention impl "none"; returns that name."""
    from paged_jax.attention import dispatch

    # Reads nothing, so any page format; computes zeros, so the contract suite leaves it out.
    dispatch.register_impl(NO_ATTENTION, no_attention, reads_quantized=True, obeys_contract=False)
    return NO_ATTENTION
