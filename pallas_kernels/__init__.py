"""Pallas (Triton-backend) GPU kernels for paged attention.

Layout shared with ``paged_jax``: K/V pages are [num_kv_heads, num_blocks, block_size,
head_dim], block tables int32[batch, max_blocks_per_seq] with -1 for no block, lengths
int32[batch].  Every layer's pages stacked as [num_layers, num_kv_heads, ...] can be passed
whole with ``layer=i``: the kernels read that layer in place (no per-layer copy).  Every
kernel also runs on CPU with ``interpret=True``.
"""

from pallas_kernels.paged_attention import (
    default_num_splits,
    paged_attention,
    paged_attention_reference,
)
from pallas_kernels.paged_attention_chunk import (
    paged_attention_chunk,
    paged_attention_chunk_reference,
)

__all__ = [
    "default_num_splits",
    "paged_attention",
    "paged_attention_chunk",
    "paged_attention_chunk_reference",
    "paged_attention_reference",
]
