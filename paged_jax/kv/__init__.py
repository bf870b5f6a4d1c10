"""KV page store: per-block K/V (and later scales) as one pytree; pure jittable helpers."""

from paged_jax.kv.pages import (
    BLOCK_AXIS,
    OFFSET_AXIS,
    KVPages,
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
    "BLOCK_AXIS", "OFFSET_AXIS", "KVPages", "bytes_per_block", "bytes_per_token", "copy_blocks",
    "init_pages", "poison_free_blocks", "read_blocks", "write_blocks", "write_tokens",
]
