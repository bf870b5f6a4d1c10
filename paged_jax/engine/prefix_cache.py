"""The engine's prefix cache: which device blocks hold which token prefixes, and when
blocks are marked, reused and evicted.

Host side, beside the scheduler (the index is ``cache.PrefixIndex``: chained keys, salts,
collision-checked hits; the eviction order is a ``cache.EvictionPolicy``). The device
only sees three ops, planned into the step like any other (``SchedulerOutput.mark``,
``SchedulerOutput.prefix``, ``SchedulerOutput.evict``):

- **mark**: after a step, every block that became full (prompt or generated tokens) is
  indexed and, in the next step's housekeeping, ``mark_cached``: the cache takes a
  reference of its own, so when the sequence ends the block stays out of the pool,
  *cached-free*, and an append never writes into it again (copy-on-write).
- **hit**: an admitted request's leader is opened on the longest cached run of its
  tokens' full blocks (``open_sequences(..., prefix_blocks)``: references +1, no copy,
  no recompute), never the block of its last token, so the first output has logits.
- **evict**: admission and preemption count cached-free blocks as free
  (``HostBlockManager.num_available``); when a step's allocations exceed the pool, the
  eviction policy picks that many cached-free blocks (never one a table names) and the
  step's housekeeping returns them to the pool before anything allocates.

A recompute-preempted request re-hits its own blocks when it comes back. Members of a
parallel-sampling or beam group after the leader get their rows by fork or beam
selection, as without the cache, so they share the leader's hit.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.cache import HostBlockManager, PrefixIndex, block_keys
from paged_jax.engine.sequence import Sequence, SequenceGroup


@dataclasses.dataclass
class PrefixCacheCounters:
    query_tokens: int = 0  # tokens of admitted requests looked up
    hit_tokens: int = 0  # of which found cached (not computed)
    evictions: int = 0  # blocks evicted
    peak_cached_blocks: int = 0


class PrefixCache:
    """The index of cached blocks, the marks the device still owes, and counters.

    Args:
      num_blocks, block_size: the pool's.
      hash_fn: ``cache.HASH_FUNCTIONS`` name or a ``HashFunction``.
      eviction_policy: ``cache.EVICTION_POLICIES`` name or an ``EvictionPolicy``.
    """

    def __init__(self, num_blocks: int, block_size: int, *, hash_fn="sha256", eviction_policy="lru"):
        self.index = PrefixIndex(num_blocks, block_size, hash_fn=hash_fn, eviction_policy=eviction_policy)
        self.block_size = block_size
        self.pending_marks: list[int] = []  # indexed, not yet marked on the device
        self.counters = PrefixCacheCounters()
        self._coming: set = set()  # keys of blocks this step's admissions compute

    @property
    def num_cached(self) -> int:
        return len(self.index)

    # ------------------------------------------------------------------ admission

    @staticmethod
    def _lookup_tokens(group: SequenceGroup, seq: Sequence) -> list[int]:
        tokens = seq.token_ids()
        if len(group.live) > 1 and group.forks_members():
            tokens = tokens[: group.shared_prefix]
        return tokens

    def lookup(self, group: SequenceGroup, seq: Sequence) -> list[int]:
        """Cached blocks the leader ``seq`` of an admitted ``group`` can start on (not
        recorded as a use: ``use`` does that once the group is admitted). A group that
        forks its members from the leader stops the hit before the fork point, so the
        leader computes at least one token before its members fork."""
        return self.index.match(self._lookup_tokens(group, seq), group.cache_salt, touch=False)

    def begin_step(self) -> None:
        self._coming = set()

    def should_wait(self, group: SequenceGroup, seq: Sequence, hits: list[int]) -> bool:
        """Whether the leader's next blocks past its ``hits`` are being computed this step
        by a request admitted before it: then it waits one step and reuses them, rather
        than computing them again (blocks are cached once computed, so two requests
        admitted in one step could not share otherwise)."""
        if not self._coming:
            return False
        tokens = self._lookup_tokens(group, seq)
        limit = max(len(tokens) - 1, 0) // self.block_size
        if limit <= len(hits):
            return False
        return self._keys_after(hits, tokens[: (len(hits) + 1) * self.block_size], group.cache_salt)[0] in self._coming

    def _keys_after(self, hits: list[int], tokens: list[int], salt) -> list:
        """The chained keys of ``tokens``' full blocks past the cached ``hits`` (the chain
        resumes from the last hit's own key)."""
        parent = self.index.entries[hits[-1]].key if hits else None
        return block_keys(tokens[len(hits) * self.block_size:], self.block_size, salt=salt,
                          hash_fn=self.index.hash, parent=parent)

    def will_compute(self, group: SequenceGroup, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        """An admitted leader, opened on ``hits``, will hold its first ``num_tokens``
        tokens after this step."""
        self._coming.update(self._keys_after(hits, seq.token_ids()[:num_tokens], group.cache_salt))

    def use(self, blocks: list[int], query_tokens: int) -> None:
        """An admission looked up ``query_tokens`` tokens and starts on ``blocks``."""
        self.counters.query_tokens += query_tokens
        self.counters.hit_tokens += len(blocks) * self.block_size
        if blocks:
            self.index.touch(blocks)

    # ------------------------------------------------------------------ after a step

    def record(self, seq: Sequence, computed_before: int, view: HostBlockManager) -> None:
        """``seq``'s row now holds ``seq.num_computed`` tokens (``computed_before`` before
        the step): index the blocks that became full; the next plan marks them."""
        bs = self.block_size
        full = seq.num_computed // bs
        if full <= computed_before // bs:
            return
        tokens = seq.token_ids()[: full * bs]
        blocks = view.block_tables[seq.slot, :full]
        self.pending_marks += self.index.insert(tokens, blocks, seq.group.cache_salt, start=computed_before // bs)
        self.counters.peak_cached_blocks = max(self.counters.peak_cached_blocks, len(self.index))

    def released(self, view: HostBlockManager, rows: list[int]) -> None:
        """``rows`` end now: the cached blocks they name were in use until now (the
        eviction policy's ``release``), a row's last block first, so that its head
        (the prefix other requests are likeliest to share) counts as the most recent
        use, as in vLLM, which frees a sequence's blocks in reverse order."""
        if rows:
            tail_first = view.block_tables[rows].T[::-1].ravel()
            self.index.released(tail_first[tail_first >= 0])

    def take_marks(self) -> list[int]:
        marks, self.pending_marks = self.pending_marks, []
        return marks

    # ------------------------------------------------------------------ eviction

    def evict(self, view: HostBlockManager, k: int) -> list[int]:
        """Choose and drop ``k`` cached-free blocks of ``view`` (the step's state once its
        housekeeping ran), in the policy's order."""
        if k <= 0:
            return []
        unreferenced = np.ones(self.index.num_blocks, bool)
        unreferenced[view.named_blocks()] = False
        chosen = self.index.evict(unreferenced, k)
        if len(chosen) < k:
            raise AssertionError(f"planned {k} evictions but only {len(chosen)} cached blocks are free")
        self.counters.evictions += len(chosen)
        return chosen

    def check(self, cached: np.ndarray, rows: dict[int, tuple[int, ...]], view: HostBlockManager) -> None:
        """Debug check against the device: the index holds exactly the blocks the device
        marks ``cached`` (bool[num_blocks], less the marks still owed), and every cached
        block a live row names holds that row's tokens at that position (``rows``: slot
        -> the tokens its KV holds)."""
        indexed = self.index.cached()
        indexed[self.pending_marks] = False
        if not np.array_equal(indexed, cached):
            diff = np.flatnonzero(indexed != cached)[:10].tolist()
            raise AssertionError(f"prefix index and device disagree on cached blocks {diff}")
        self.index.check()
        bs = self.block_size
        for slot, tokens in rows.items():
            for j, block in enumerate(view.block_tables[slot, : len(tokens) // bs]):
                entry = self.index.entries.get(int(block))
                if entry is not None and entry.tokens != tuple(tokens[j * bs: (j + 1) * bs]):
                    raise AssertionError(f"cached block {int(block)} (row {slot}, block {j}) holds other tokens")
