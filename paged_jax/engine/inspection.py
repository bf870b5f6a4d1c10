"""What an engine's block manager holds, read from the device: the public way for tests,
notebooks and studies to look inside (``LLM.inspect()``), so none reaches into private
fields. Reading it syncs the device; nothing in the engine's own step calls it.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np

from paged_jax.cache import check_invariants
from paged_jax.cache.sentinels import NO_BLOCK


@dataclasses.dataclass(frozen=True)
class CacheInspection:
    """One engine's KV cache now (NumPy copies).

    Attributes:
      num_blocks, block_size: the pool's.
      block_tables: int32[max_num_seqs, max_blocks_per_seq]; NO_BLOCK (-1) past each row's end.
      seq_lens: int32[max_num_seqs]: tokens each row holds. active: bool[max_num_seqs].
      ref_counts: int32[num_blocks]: table entries naming each block, +1 while cached.
      cached: bool[num_blocks]: held by the prefix cache.
      free_blocks: int32[num_free]: the free pool, in the order the next allocations take it
        (sorted for a policy that decides at random).
      rows: request id -> the table rows its live members hold.
      swap_used, swap_capacity: host swap pool blocks held and available in all.
      prefix_cached_blocks: blocks the prefix cache indexes (0 without prefix caching).
    """

    num_blocks: int
    block_size: int
    block_tables: np.ndarray
    seq_lens: np.ndarray
    active: np.ndarray
    ref_counts: np.ndarray
    cached: np.ndarray
    free_blocks: np.ndarray
    rows: dict
    swap_used: int
    swap_capacity: int
    prefix_cached_blocks: int

    @property
    def num_free(self) -> int:
        """Blocks in the free pool."""
        return int(self.free_blocks.size)

    @property
    def num_cached_free(self) -> int:
        """Cached blocks no table names (reclaimable by eviction)."""
        return int((self.cached & (self.ref_counts == 1)).sum())

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: the pool plus the cached-free blocks."""
        return self.num_free + self.num_cached_free

    @property
    def num_used(self) -> int:
        """Blocks some sequence holds (neither free nor cached-free)."""
        return self.num_blocks - self.num_available

    def blocks_of(self, request_id: str) -> list[list[int]]:
        """The physical blocks each live member of ``request_id`` holds, in logical order."""
        out = []
        for row in self.rows.get(request_id, []):
            table = self.block_tables[row]
            out.append([int(b) for b in table[table != NO_BLOCK]])
        return out

    @property
    def idle(self) -> bool:
        """No row is live and no block is held by a sequence (cached-free blocks may remain)."""
        return not self.active.any() and self.num_used == 0


class EngineUsage(NamedTuple):
    """Counts of one engine (or summed over replicas) now, from the host side: no device
    sync, cheap enough to read after every step (a server's metrics).

    Attributes:
      waiting, running, swapped: unfinished requests in each state.
      blocks_used: blocks some sequence holds (neither free nor cached-free), counting the
        rows of sequences that finished in the last step until they are released.
      num_blocks: blocks in the pool(s).
      prefix_query_tokens, prefix_hit_tokens: prompt tokens looked up in the prefix cache
        and found there (0 without prefix caching), since construction or ``reset_stats``.
    """

    waiting: int
    running: int
    swapped: int
    blocks_used: int
    num_blocks: int
    prefix_query_tokens: int
    prefix_hit_tokens: int

    def __add__(self, other):  # replicas sum field by field
        return EngineUsage(*(a + b for a, b in zip(self, other, strict=True)))


def usage_of(engine) -> EngineUsage:
    """The ``EngineUsage`` of an ``LLMEngine``."""
    sched, kv = engine.scheduler, engine.kv
    pc = None if kv.prefix_cache is None else kv.prefix_cache.counters
    return EngineUsage(
        waiting=len(sched.waiting), running=len(sched.running), swapped=len(sched.swapped),
        blocks_used=kv.num_blocks - kv.num_available, num_blocks=kv.num_blocks,
        prefix_query_tokens=pc.query_tokens if pc else 0, prefix_hit_tokens=pc.hit_tokens if pc else 0,
    )


def inspect_engine(engine) -> CacheInspection:
    """The ``CacheInspection`` of an ``LLMEngine`` (its runner's device state), after checking
    the block manager's invariants."""
    runner = engine.runner
    state = runner.cache_state
    check_invariants(state, op="inspect")
    host = jax.device_get(state)
    rows = {}
    for g in engine.scheduler.running:
        live = [s.slot for s in g.live if s.row_live]
        if live:
            rows[g.request_id] = live
    cache = engine.scheduler.prefix_cache
    swap = engine.kv.swap_pool
    return CacheInspection(
        num_blocks=runner.num_blocks, block_size=runner.block_size,
        block_tables=np.asarray(host.block_tables), seq_lens=np.asarray(host.seq_lens),
        active=np.asarray(host.active), ref_counts=np.asarray(host.ref_counts), cached=np.asarray(host.cached),
        free_blocks=np.asarray(state.policy.free_blocks(host.pool), np.int32),
        rows=rows, swap_used=swap.capacity - swap.num_free, swap_capacity=swap.capacity,
        prefix_cached_blocks=0 if cache is None else cache.num_cached,
    )
