"""KV page store: per-block K/V (and later scales) as one pytree; pure jittable helpers."""

from paged_jax.kv.pages import (
    BLOCK_AXIS,
    NO_BLOCK,
    NO_SLOT,
    KVPages,
    bytes_per_block,
    bytes_per_token,
    canonical_dtype,
    copy_blocks,
    init_pages,
    kv_bytes_per_token,
    poison_free_blocks,
    read_blocks,
    write_blocks,
    write_tokens,
)

__all__ = [
    "BLOCK_AXIS", "NO_BLOCK", "NO_SLOT", "KVPages", "bytes_per_block", "bytes_per_token",
    "canonical_dtype", "copy_blocks", "init_pages", "kv_bytes_per_token", "poison_free_blocks",
    "read_blocks", "write_blocks", "write_tokens",
]
