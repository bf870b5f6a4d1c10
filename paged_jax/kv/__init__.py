"""KV page store: per-block K/V (and, quantised, their scales) as one pytree; pure jittable helpers."""

from paged_jax.kv import quant
from paged_jax.kv.pages import (
    BLOCK_AXIS,
    OFFSET_AXIS,
    KVPages,
    block_axis,
    bytes_per_block,
    bytes_per_token,
    copy_blocks,
    init_pages,
    poison_free_blocks,
    read_blocks,
    write_blocks,
    write_tokens,
)

__all__ = [
    "BLOCK_AXIS", "OFFSET_AXIS", "KVPages", "block_axis", "bytes_per_block", "bytes_per_token", "copy_blocks",
    "init_pages", "poison_free_blocks", "quant", "read_blocks", "write_blocks", "write_tokens",
]
