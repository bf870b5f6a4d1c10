"""Paged attention: one contract (``contract``), its implementations, and a dispatcher.

Every implementation is ``paged_attention(q, pages, block_tables, lengths, q_lens, *,
layer=None, scale=None) -> [B, T, Hq, D]`` (``contract``'s module doc states the shapes and
conventions once):

- ``reference.paged_attention``: the oracle (whole-table gather + masked fp32 softmax).
- ``blocked.paged_attention``: length-aware plain XLA (dispatch's "xla").
- ``pallas.paged_attention``: the ``pallas_kernels`` GPU kernels (an optional import).
- ``mosaic.paged_attention``: the Mosaic GPU (Hopper) kernel, ``pallas_kernels.mosaic``.

``dispatch.ragged_paged_attention`` is the packed form (q [N, Hq, D] with per-row
``q_starts``): the native CPU kernel has its own, every other implementation runs it one
query per row (``contract.ragged_as_rows``).

``dispatch.paged_attention(..., impl=...)`` picks one by name ("auto", "reference", "xla",
"pallas", "pallas_interpret", "mosaic_gpu", or a name given to ``dispatch.register_impl``).
``dense_causal_attention`` is the non-paged counterpart for contiguous keys.
"""

from paged_jax.attention import blocked, contract, dispatch, mosaic, pallas, reference
from paged_jax.attention.dispatch import (
    IMPLS,
    paged_attention,
    ragged_paged_attention,
    register_impl,
    resolve_impl,
)
from paged_jax.attention.reference import dense_causal_attention, gather_blocks

__all__ = [
    "IMPLS", "blocked", "contract", "dense_causal_attention", "dispatch", "gather_blocks", "mosaic", "pallas",
    "paged_attention", "ragged_paged_attention", "reference", "register_impl", "resolve_impl",
]
