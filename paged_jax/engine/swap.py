"""The host swap pool: KV blocks of swapped-out requests, in NumPy, with a free list.

A second tier of blocks in host memory. It is deliberately not the device block manager:
it has its own capacity (``swap_space_blocks``) and needs nothing but a LIFO free list,
because a swapped request is stored as a whole. Its completions may share device blocks
(forked from one prompt); the pool holds each shared block once, and ``SwappedBlocks``
records which member names which, so the swap-in rebuilds the same sharing
(``cache.restore_rows``).

A block's data is whatever the KV page store keeps for one block (every leaf's slice at
the block axis: K and V, and scales for quantised pages): the pool keeps one NumPy array
per leaf with the block axis moved to the front, so it never needs to know the layout.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from paged_jax.kv.pages import block_axis


class SwapPoolFullError(RuntimeError):
    """The host pool cannot take a request's blocks (the scheduler checks first)."""


class SwappedBlocks(NamedTuple):
    """A swapped-out request: its distinct blocks in the host pool and who names which.

    ``host_ids[i]`` holds the request's i-th distinct device block; member ``m`` held
    ``lens[m]`` tokens in the blocks ``local_tables[m, :ceil(lens[m] / block_size)]``
    (indices into ``host_ids``; ``NO_BLOCK`` past them).
    """

    host_ids: list[int]
    local_tables: np.ndarray  # int32[members, max_blocks_per_seq]
    lens: list[int]


class HostSwapPool:
    """``capacity`` host blocks shaped like one device block.

    Args:
      capacity: blocks the pool can hold (>= 0; 0 disables swapping).
      block_leaves: ``[(shape, dtype), ...]`` of one block's data per pytree leaf, block
        axis removed (``for_pages`` derives them from the device page store).
      treedef: the pytree structure of a block's data.
    """

    def __init__(self, capacity: int, block_leaves, treedef):
        if capacity < 0:
            raise ValueError(f"swap_space_blocks={capacity}: must be >= 0")
        self.capacity = capacity
        self.treedef = treedef
        self.leaves = [np.zeros((capacity, *shape), dtype) for shape, dtype in block_leaves]
        # A stack: block 0 on top, so a fresh pool fills in address order.
        self._free = list(range(capacity - 1, -1, -1))

    @classmethod
    def for_pages(cls, capacity: int, pages) -> HostSwapPool:
        """A pool for blocks of ``pages`` (the store or its ``jax.eval_shape``): each leaf
        ``[(L,) Hkv, num_blocks, ...]`` gives a host leaf ``[capacity, (L,) Hkv, ...]``."""
        leaves, treedef = jax.tree.flatten(pages)
        axis = block_axis(pages)
        block_leaves = []
        for leaf in leaves:
            shape = list(leaf.shape)
            del shape[axis]
            block_leaves.append((tuple(shape), leaf.dtype))
        return cls(capacity, block_leaves, treedef)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_store(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def reserve(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` host blocks for data that ``write`` fills in later."""
        if not self.can_store(num_blocks):
            raise SwapPoolFullError(
                f"host swap pool: {num_blocks} blocks wanted, {self.num_free} free of {self.capacity}"
            )
        return [self._free.pop() for _ in range(num_blocks)]

    def store(self, leaves_block_first: list[np.ndarray]) -> list[int]:
        """Copy ``n`` blocks in (one array per leaf, ``[n, *block_shape]``); returns their
        host ids, in the given order."""
        ids = self.reserve(leaves_block_first[0].shape[0])
        self.write(ids, leaves_block_first)
        return ids

    def write(self, ids: list[int], leaves_block_first: list[np.ndarray]) -> None:
        """Fill reserved blocks ``ids`` (one array per leaf, ``[len(ids), *block_shape]``)."""
        for pool_leaf, data in zip(self.leaves, leaves_block_first, strict=True):
            pool_leaf[ids] = data[: len(ids)]

    def load(self, ids: list[int]) -> list[np.ndarray]:
        """The blocks ``ids`` (one array per leaf, ``[len(ids), *block_shape]``)."""
        return [leaf[ids] for leaf in self.leaves]

    def free(self, ids: list[int]) -> None:
        """Return blocks to the free list (their data is not cleared, as on the device)."""
        free = set(self._free)
        if len(ids) != len(set(ids)) or any(i in free or not 0 <= i < self.capacity for i in ids):
            raise ValueError(f"host swap pool: freeing blocks not held (or twice): {ids}")
        self._free.extend(reversed(ids))

    def check(self, held: list[list[int]]) -> None:
        """Invariant: every block is either free or held by exactly one swapped request."""
        flat = [i for ids in held for i in ids]
        every = sorted(flat + self._free)
        if every != list(range(self.capacity)):
            raise AssertionError(
                f"host swap pool inconsistent: {len(flat)} held + {len(self._free)} free "
                f"!= {self.capacity}, or a block is named twice"
            )
