"""Frozen, validated configuration for the paged KV cache.

A bad value raises ``ValueError`` naming the field, the value and what is allowed, at
construction time, so nothing downstream ever sees an impossible configuration.
"""

from __future__ import annotations

import dataclasses

_INT32_MAX = 2**31 - 1


def blocks_for(num_tokens, block_size: int):
    """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size).

    Works on Python ints and elementwise on NumPy / JAX integer arrays (the result has
    the input's integer dtype). Written as floor quotient plus "is there a remainder"
    rather than ``(n + block_size - 1) // block_size``, so it never forms a value larger
    than ``num_tokens``: no int32 overflow for any int32 input.

    Args:
      num_tokens: int, or an integer array of any shape.
      block_size: a positive Python int.
    """
    return num_tokens // block_size + (num_tokens % block_size != 0)


def _check_int(name: str, value, lo: int, hi: int = _INT32_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r}: must be an int in [{lo}, {hi}]")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value}: must be in [{lo}, {hi}]")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Shape of the block pool and the block tables.

    Attributes:
      num_blocks: physical blocks in the pool.
      block_size: tokens per block; a power of two in [1, 256] (offsets are a mask and a
        shift, and every attention kernel tiles on it).
      max_seqs: rows of the block table (sequence slots that can be live at once).
      max_blocks_per_seq: columns of the block table (logical blocks one sequence may own).
    """

    num_blocks: int
    block_size: int = 16
    max_seqs: int = 256
    max_blocks_per_seq: int = 128

    def __post_init__(self):
        _check_int("num_blocks", self.num_blocks, 1)
        _check_int("block_size", self.block_size, 1, 256)
        if self.block_size & (self.block_size - 1):
            raise ValueError(
                f"block_size={self.block_size}: must be a power of two in [1, 256] "
                "(1, 2, 4, ..., 256)"
            )
        _check_int("max_seqs", self.max_seqs, 1)
        _check_int("max_blocks_per_seq", self.max_blocks_per_seq, 1)
        if self.max_blocks_per_seq * self.block_size > _INT32_MAX:
            raise ValueError(
                f"max_blocks_per_seq={self.max_blocks_per_seq}: max_blocks_per_seq * "
                f"block_size must fit in int32 (<= {_INT32_MAX})"
            )
        if self.num_blocks * self.block_size > _INT32_MAX:
            raise ValueError(
                f"num_blocks={self.num_blocks}: num_blocks * block_size (physical slots) "
                f"must fit in int32 (<= {_INT32_MAX})"
            )

    @property
    def max_tokens_per_seq(self) -> int:
        """Longest sequence a table row can describe."""
        return self.max_blocks_per_seq * self.block_size

    @property
    def num_slots(self) -> int:
        """Physical token slots in the pool (num_blocks * block_size)."""
        return self.num_blocks * self.block_size

    @property
    def table_bytes(self) -> int:
        """Bytes of the int32 block tables (about 0.4 MB for a 100k-block pool)."""
        return self.max_seqs * self.max_blocks_per_seq * 4

    @property
    def ref_count_bytes(self) -> int:
        """Bytes of the int32 reference counts."""
        return self.num_blocks * 4

    def blocks_for(self, num_tokens):
        """Blocks needed to hold ``num_tokens`` tokens (ceil division; see ``blocks_for``)."""
        return blocks_for(num_tokens, self.block_size)
