"""The host swap pool: KV blocks of swapped-out sequences, in numpy, with a free list.

A second tier of blocks in host memory (seed M5, M10). It is deliberately not the device
block manager: the host pool has its own capacity (``swap_space_blocks``), holds each
swapped sequence's blocks privately (ref count 1: there is no sharing between swapped
sequences), and needs nothing but a LIFO free list. Pure numpy; the runner moves data
between it and the device pages.

A block's data is whatever the KV page store keeps for one block (K and V today, scales
too once quantised KV lands, ROADMAP): the pool stores one numpy array per leaf of that
pytree, with the block axis moved to the front, so it never needs to know the layout.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


class SwapPoolFullError(RuntimeError):
    """The host pool cannot take a sequence's blocks (the scheduler checks first)."""


class HostSwapPool:
    """``capacity`` host blocks shaped like one device block.

    Args:
      capacity: blocks the pool can hold (>= 0; 0 disables swapping).
      block_leaves: ``[(shape, dtype), ...]`` of one block's data per pytree leaf, block
        axis removed (e.g. ``(num_layers, num_kv_heads, block_size, head_dim)`` for K).
      treedef: the pytree structure of a block's data.
    """

    def __init__(self, capacity: int, block_leaves: list[tuple[tuple[int, ...], Any]], treedef):
        if capacity < 0:
            raise ValueError(f"swap_space_blocks={capacity}: must be >= 0")
        self.capacity = capacity
        self.treedef = treedef
        self.leaves = [np.zeros((capacity, *shape), dtype) for shape, dtype in block_leaves]
        # A stack: block 0 on top, so a fresh pool fills in address order.
        self._free = list(range(capacity - 1, -1, -1))

    # --------------------------------------------------------------------- accounting

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def bytes_per_block(self) -> int:
        return sum(leaf[0].nbytes for leaf in self.leaves) if self.capacity else 0

    def can_store(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    # --------------------------------------------------------------------- data

    def store(self, leaves_block_first: list[np.ndarray]) -> list[int]:
        """Copy ``n`` blocks in (one array per leaf, shape ``[n, *block_shape]``);
        returns their host ids, in the given order."""
        n = leaves_block_first[0].shape[0]
        if not self.can_store(n):
            raise SwapPoolFullError(f"host swap pool: {n} blocks wanted, {self.num_free} free of {self.capacity}")
        ids = [self._free.pop() for _ in range(n)]
        for pool_leaf, data in zip(self.leaves, leaves_block_first, strict=True):
            pool_leaf[ids] = data
        return ids

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
        """Invariant: every block is either free or held by exactly one swapped sequence."""
        flat = [i for ids in held for i in ids]
        every = sorted(flat + self._free)
        if every != list(range(self.capacity)):
            raise AssertionError(
                f"host swap pool inconsistent: {len(flat)} held + {len(self._free)} free "
                f"!= {self.capacity}, or a block is named twice"
            )


def block_layout(read_blocks, pages) -> tuple[list[tuple[tuple[int, ...], Any]], Any, list[int]]:
    """Find how ``read_blocks(pages, ids)`` lays out blocks, without running it.

    Returns ``(block_leaves, treedef, block_axes)``: each leaf's per-block shape and
    dtype, the pytree structure, and which axis of each leaf indexes the blocks (the one
    whose size follows ``len(ids)``).
    """
    import jax.numpy as jnp

    one = jax.eval_shape(read_blocks, pages, jax.ShapeDtypeStruct((1,), jnp.int32))
    two = jax.eval_shape(read_blocks, pages, jax.ShapeDtypeStruct((2,), jnp.int32))
    leaves1, treedef = jax.tree.flatten(one)
    leaves2 = jax.tree.leaves(two)
    block_leaves, axes = [], []
    for a, b in zip(leaves1, leaves2, strict=True):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y]
        if len(diff) != 1 or a.shape[diff[0]] != 1:
            raise ValueError(f"read_blocks output {a.shape} has no single block axis")
        ax = diff[0]
        axes.append(ax)
        block_leaves.append((a.shape[:ax] + a.shape[ax + 1 :], a.dtype))
    return block_leaves, treedef, axes
