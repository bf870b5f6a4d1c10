"""The engine's one host-side KV-cache manager: what the scheduler asks about blocks.

It holds, for one engine:

- ``blocks``: the block manager's host model (``cache.HostBlockManager``), equal to the
  device's ``CacheState`` after every step, ids and free-pool order included: the runner
  applies to it every block op it runs on the device, with the same arguments, in the same
  order (``apply``), and the debug checks compare the two (``check``). The scheduler plans
  on it (its what-ifs are the ops on a copy), so no decision waits for the device and no
  snapshot crosses from it;
- ``prefix_cache``: the index of cached blocks and the eviction policy (None with prefix
  caching off: a lookup then simply finds nothing);
- ``swap_pool``: the host memory swapped-out blocks live in (the runner fills and reads it;
  the scheduler asks whether a victim fits).

vLLM keeps one ``KVCacheManager`` the scheduler asks for blocks; this is ours, with the
difference that the device, not the host, picks block ids, and the host predicts them.
"""

from __future__ import annotations

import numpy as np

from paged_jax.cache import HostBlockManager
from paged_jax.engine.prefix_cache import PrefixCache
from paged_jax.engine.swap import HostSwapPool


class KVCacheManager:
    """Host side of one engine's KV cache (module docstring).

    Args:
      config: the ``EngineConfig``.
      pages: the device page store or its ``jax.eval_shape`` (shapes the swap pool).
    """

    def __init__(self, config, pages):
        cache = config.cache
        self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks
        self.blocks = HostBlockManager(config.device_shape(), cache.allocation_policy)
        self.prefix_cache = (
            PrefixCache(cache.num_blocks, cache.block_size, hash_fn=cache.prefix_cache_hash,
                        eviction_policy=cache.eviction_policy)
            if cache.prefix_caching else None
        )
        self.swap_pool = HostSwapPool.for_pages(cache.swap_space_blocks, pages)

    # ------------------------------------------------------------------ the device's ops

    def apply(self, op: str, *args, **kwargs) -> None:
        """The runner ran ``op(*args, **kwargs)`` on the device: run it on the host model."""
        self.blocks.apply(op, args, kwargs)

    def check(self, state) -> None:
        """Debug: the host model equals the device state (AssertionError naming the first
        difference). Syncs the device."""
        why = self.blocks.mismatch(state)
        if why is not None:
            raise AssertionError(f"the host model of the block manager differs from the device: {why}")

    # ------------------------------------------------------------------ questions

    @property
    def num_available(self) -> int:
        return self.blocks.num_available

    def rows_held(self, rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(tables int32[R, P], lengths int32[R]) of rows, from the host model."""
        return self.blocks.block_tables[rows], self.blocks.seq_lens[rows]
