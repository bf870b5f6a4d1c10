"""Pallas (Triton-backend) GPU kernels for paged attention: decode and multi-query chunk.

Raw-array APIs, independent of any framework:

  paged_attention_decode(q [B, Hq, D], k_pages, v_pages, block_tables, lengths, *, layer, ...)
  paged_attention_chunk(q [B, T, Hq, D], k_pages, v_pages, block_tables, lengths, q_lens, *, layer, ...)

K/V pages are [num_kv_heads, num_blocks, block_size, head_dim] (``layer=None``), or every
layer's pool [num_layers, num_kv_heads, ...] with ``layer`` a Python int or a traced int32
scalar: the kernels read that layer in place (no per-layer copy).  Block tables are
int32[batch, max_blocks_per_seq] (entries past a sequence's blocks may be anything),
lengths int32[batch].  Every kernel also runs on CPU with ``interpret=True``.

These are Triton-backend kernels (deprecated in JAX 0.11). Where ``jax.experimental.pallas.triton``
no longer imports, this package still imports: ``TRITON_ERROR`` says why, the two names
above are absent, and ``pallas_kernels.mosaic`` (the Mosaic GPU kernel) is unaffected.
"""

from pallas_kernels.common import default_blocks_per_step, default_num_splits

try:
    from pallas_kernels.chunk import paged_attention_chunk
    from pallas_kernels.decode import paged_attention_decode
except ImportError as e:  # a jax without Pallas' Triton backend
    TRITON_ERROR: ImportError | None = e
else:
    TRITON_ERROR = None

__all__ = [
    "TRITON_ERROR",
    "default_blocks_per_step",
    "default_num_splits",
    "paged_attention_chunk",
    "paged_attention_decode",
]
