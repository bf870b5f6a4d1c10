"""A host-side view of the block manager, for scheduling without a device sync per question.

Forked sequences share blocks, and a block returns to the pool only when its last
reference goes, so a scheduler cannot count blocks from sequence lengths alone. Once per
engine step it fetches a compact ``snapshot`` of the state (the tables, each entry's
ref count, lengths, live flags and the free count: O(max_seqs x max_blocks_per_seq),
nothing pool-sized, and jittable so it can ride along with the step's own outputs) and
answers its questions on the host in NumPy through ``HostView``.

``HostView.blocks_needed`` runs the jitted ops' own append arithmetic
(``ops._plan_append``, written once over an array namespace) on the snapshot, so it
equals ``ops.blocks_needed`` for the same state and batch, copy-on-write included.
``blocks_freed`` and ``blocks_held`` count shared blocks once. ``released``, ``opened``,
``forked`` and ``restored`` return the view after those ops, so a step's releases,
preemptions and swap-ins can be planned on the host before the device runs any of them.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.cache.ops import _int32_args, _plan_append, num_cached_free, num_free_blocks
from paged_jax.cache.sentinels import NO_BLOCK
from paged_jax.cache.state import CacheState
from paged_jax.config import blocks_for


class Snapshot(NamedTuple):
    """What the host needs to count blocks; a pytree of arrays (jax or numpy)."""

    block_tables: jax.Array  # int32[S, P]; NO_BLOCK past each row's end
    entry_counts: jax.Array  # int32[S, P]; ref count of the block each entry names, 0 at NO_BLOCK
    seq_lens: jax.Array  # int32[S]
    active: jax.Array  # bool[S]
    num_free: jax.Array  # int32[]; blocks in the free pool
    entry_cached: jax.Array  # bool[S, P]; the block each entry names is cached (False at NO_BLOCK)
    num_cached_free: jax.Array  # int32[]; cached blocks no table names


def snapshot(state: CacheState) -> Snapshot:
    """The compact snapshot of ``state`` (jittable). The ref counts are gathered at the
    table entries, so nothing of size num_blocks leaves the device."""
    tables = state.block_tables
    at = jnp.clip(tables, 0, state.num_blocks - 1)
    named = tables != NO_BLOCK
    return Snapshot(
        block_tables=tables,
        entry_counts=jnp.where(named, state.ref_counts[at], 0),
        seq_lens=state.seq_lens,
        active=state.active,
        num_free=num_free_blocks(state),
        entry_cached=named & state.cached[at],
        num_cached_free=num_cached_free(state),
    )


def _frozen(x, dtype) -> np.ndarray:
    a = np.array(x, dtype=dtype)  # a private copy, so freezing it freezes nobody else's array
    a.flags.writeable = False
    return a


@dataclasses.dataclass(frozen=True, eq=False)
class HostView:
    """NumPy copy of a ``Snapshot`` with the scheduler's block arithmetic. Read-only
    (the arrays are private read-only copies); ``released`` and ``restored`` return new
    views, so a scheduler can plan a whole step's releases and swap-ins on the host.

    Attributes:
      block_size: tokens per block (the state's static ``block_size``).
      block_tables, entry_counts: int32[S, P]; seq_lens: int32[S]; active: bool[S].
      num_free: blocks in the free pool.
      entry_cached: bool[S, P]: the entry's block is cached (prefix caching; its count
        then includes the cache's own reference).
      num_cached_free: cached blocks no table names: reclaimable, so counted by
        ``num_available`` with the pool.
    """

    block_size: int
    block_tables: np.ndarray
    entry_counts: np.ndarray
    seq_lens: np.ndarray
    active: np.ndarray
    num_free: int
    entry_cached: np.ndarray | None = None  # None: nothing cached
    num_cached_free: int = 0

    def __post_init__(self):
        # Private read-only copies with fixed dtypes, however the view was built.
        if self.entry_cached is None:
            object.__setattr__(self, "entry_cached", np.zeros(np.shape(self.block_tables), bool))
        for name, dtype in [("block_tables", np.int32), ("entry_counts", np.int32), ("seq_lens", np.int32),
                            ("active", bool), ("entry_cached", bool)]:
            object.__setattr__(self, name, _frozen(getattr(self, name), dtype))
        object.__setattr__(self, "block_size", int(self.block_size))
        object.__setattr__(self, "num_free", int(self.num_free))
        object.__setattr__(self, "num_cached_free", int(self.num_cached_free))

    @classmethod
    def from_snapshot(cls, snap: Snapshot, block_size: int) -> HostView:
        """A view of a snapshot (device arrays are fetched in one transfer)."""
        snap = jax.device_get(snap)
        return cls(block_size, snap.block_tables, snap.entry_counts, snap.seq_lens, snap.active, snap.num_free,
                   snap.entry_cached, snap.num_cached_free)

    def same_as(self, other: HostView) -> bool:
        """Every field equal (the views describe the same state)."""
        return (
            self.block_size == other.block_size
            and self.num_free == other.num_free
            and self.num_cached_free == other.num_cached_free
            and all(
                np.array_equal(getattr(self, f), getattr(other, f))
                for f in ("block_tables", "entry_counts", "seq_lens", "active", "entry_cached")
            )
        )

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: the free pool plus the cached-free blocks an
        eviction would return to it."""
        return self.num_free + self.num_cached_free

    @property
    def max_seqs(self) -> int:
        return self.block_tables.shape[0]

    def blocks_needed(self, seq_ids, num_tokens) -> np.ndarray:
        """int32[B]: what ``ops.blocks_needed(state, seq_ids, num_tokens)`` returns for the
        snapshot's state: new blocks plus copy-on-write targets, the batch appended
        together (rows of one call sharing a partly filled block: all copy except the
        last, which keeps it if nobody else holds it).

        seq_ids, num_tokens: integer sequences or arrays of equal length [B]; checked
        like the ops' arguments (TypeError / ValueError).
        """
        seq_ids, num_tokens = _int32_args(
            "HostView.blocks_needed", ("seq_ids", seq_ids, 1), ("num_tokens", num_tokens, 1), xp=np
        )
        real = (seq_ids >= 0) & (seq_ids < self.max_seqs)
        plan = _plan_append(
            np,
            block_size=self.block_size,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            count_at=lambda rows, cols: self.entry_counts[rows, cols],
            seq_ids=seq_ids,
            num_tokens=num_tokens,
            real=real,
        )
        return (plan.grow + plan.cow).astype(np.int32)

    def _live_rows(self, op: str, seq_ids) -> np.ndarray:
        """The distinct live rows among ``seq_ids`` (padding, out-of-range and dead ids dropped)."""
        (seq_ids,) = _int32_args(op, ("seq_ids", seq_ids, 1), xp=np)
        rows = np.unique(seq_ids[(seq_ids >= 0) & (seq_ids < self.max_seqs)])
        return rows[self.active[rows]]

    def _named_entries(self, op: str, seq_ids) -> tuple[np.ndarray, np.ndarray]:
        """(block ids, their table references) of every entry of the distinct live rows
        named (a cached block's own reference left out)."""
        rows = self._live_rows(op, seq_ids)
        tables, counts = self.block_tables[rows], self.entry_counts[rows] - self.entry_cached[rows]
        named = tables != NO_BLOCK
        return tables[named], counts[named]

    def _freed(self, seq_ids, op: str) -> tuple[int, int]:
        """(to the pool, to cached-free): blocks whose every table reference comes from
        these rows, uncached and cached."""
        rows = self._live_rows(op, seq_ids)
        tables, cached = self.block_tables[rows], self.entry_cached[rows]
        counts = self.entry_counts[rows] - cached
        named = tables != NO_BLOCK
        _, first, hits = np.unique(tables[named], return_index=True, return_counts=True)
        gone = hits == counts[named][first]
        to_cache = int((gone & cached[named][first]).sum())
        return int(gone.sum()) - to_cache, to_cache

    def blocks_freed(self, seq_ids) -> int:
        """Blocks that become available (``num_available``) if these rows are released
        together: those whose every table reference comes from these rows (to the pool,
        or cached-free if cached). Padding, out-of-range and dead ids hold nothing; a
        repeated id counts once.

        seq_ids: integer sequence or array [B].
        """
        return sum(self._freed(seq_ids, "HostView.blocks_freed"))

    def blocks_held(self, seq_ids) -> int:
        """Distinct physical blocks these rows name (a block they share counted once).

        seq_ids: integer sequence or array [B]; ids as for ``blocks_freed``.
        """
        blocks, _ = self._named_entries("HostView.blocks_held", seq_ids)
        return int(np.unique(blocks).size)

    # ------------------------------------------------------------------ planning
    # A scheduler plans a step's releases, opens, forks and restores before the device
    # runs them; these return the view of the state after them, assuming the device
    # accepts the call (it reports a rejection in its status). Blocks a restore takes
    # have no ids until the device picks them: they appear as stand-in ids below
    # NO_BLOCK (-2, -3, ...), distinct from every real block, so counts, sharing and
    # every answer above stay exact.

    def _replace(self, **fields) -> HostView:
        return dataclasses.replace(self, **fields)  # __post_init__ makes frozen copies

    @staticmethod
    def _add_to_entries(tables, counts, blocks, delta) -> None:
        """counts[e] += delta[i] for every entry e naming blocks[i] (blocks sorted, distinct)."""
        if not blocks.size:
            return
        hit = (tables != NO_BLOCK) & np.isin(tables, blocks)
        counts[hit] += delta[np.searchsorted(blocks, tables[hit])]

    def released(self, seq_ids) -> HostView:
        """The view after ``release(state, seq_ids)``: the rows emptied, the blocks they
        name lose their references, ``blocks_freed(seq_ids)`` more free blocks. Ids as for
        ``blocks_freed``."""
        rows = self._live_rows("HostView.released", seq_ids)
        if not rows.size:
            return self
        to_pool, to_cache = self._freed(rows, "HostView.released")
        gone = self.block_tables[rows]
        blocks, hits = np.unique(gone[gone != NO_BLOCK], return_counts=True)
        tables, counts = self.block_tables.copy(), self.entry_counts.copy()
        self._add_to_entries(tables, counts, blocks, -hits)
        tables[rows], counts[rows] = NO_BLOCK, 0
        cached = self.entry_cached.copy()
        cached[rows] = False
        lens, active = self.seq_lens.copy(), self.active.copy()
        lens[rows], active[rows] = 0, False
        return self._replace(block_tables=tables, entry_counts=counts, seq_lens=lens, active=active,
                             entry_cached=cached, num_free=self.num_free + to_pool,
                             num_cached_free=self.num_cached_free + to_cache)

    def opened(self, seq_ids, prefix_blocks=None) -> HostView:
        """The view after ``open_sequences(state, seq_ids, prefix_blocks)``: the rows are
        live, empty or starting with the cached blocks ``prefix_blocks`` (int[B, K],
        NO_BLOCK-padded) names. A named block no table named before was cached-free."""
        if prefix_blocks is None:
            (seq_ids,) = _int32_args("HostView.opened", ("seq_ids", seq_ids, 1), xp=np)
            prefix_blocks = np.full((seq_ids.shape[0], 0), NO_BLOCK, np.int32)
        else:
            seq_ids, prefix_blocks = _int32_args(
                "HostView.opened", ("seq_ids", seq_ids, 1), ("prefix_blocks", prefix_blocks, 2), xp=np
            )
        real = (seq_ids >= 0) & (seq_ids < self.max_seqs)
        rows, prefix = seq_ids[real], prefix_blocks[real]
        lens, active = self.seq_lens.copy(), self.active.copy()
        tables, counts, cached = self.block_tables.copy(), self.entry_counts.copy(), self.entry_cached.copy()
        named_before = self.block_tables != NO_BLOCK
        ids_before, first = np.unique(self.block_tables[named_before], return_index=True)
        for row, row_blocks in zip(rows, prefix, strict=True):
            ids = row_blocks[row_blocks != NO_BLOCK]
            tables[row], cached[row] = NO_BLOCK, False
            tables[row, : ids.size], cached[row, : ids.size] = ids, True
            lens[row], active[row] = ids.size * self.block_size, True
        blocks, hits = np.unique(prefix[prefix != NO_BLOCK], return_counts=True)
        idle = 0
        if blocks.size:
            known = np.isin(blocks, ids_before)
            total = np.ones(blocks.shape, np.int32)  # cached-free: the cache's own reference
            total[known] = self.entry_counts[named_before][first[np.searchsorted(ids_before, blocks[known])]]
            total += hits.astype(np.int32)
            hit = (tables != NO_BLOCK) & np.isin(tables, blocks)
            counts[hit] = total[np.searchsorted(blocks, tables[hit])]
            idle = int((~known).sum())
        return self._replace(block_tables=tables, entry_counts=counts, seq_lens=lens, active=active,
                             entry_cached=cached, num_cached_free=self.num_cached_free - idle)

    def marked(self, block_ids) -> HostView:
        """The view after ``mark_cached(state, block_ids)``: the blocks (referenced) are
        cached and hold one more reference, the cache's."""
        (block_ids,) = _int32_args("HostView.marked", ("block_ids", block_ids, 1), xp=np)
        blocks = np.unique(block_ids[block_ids != NO_BLOCK])
        if not blocks.size:
            return self
        hit = (self.block_tables != NO_BLOCK) & np.isin(self.block_tables, blocks)
        counts, cached = self.entry_counts.copy(), self.entry_cached.copy()
        counts[hit] += 1
        cached[hit] = True
        return self._replace(entry_counts=counts, entry_cached=cached)

    def evicted(self, block_ids) -> HostView:
        """The view after ``evict_cached(state, block_ids)``: the (cached-free) blocks
        return to the pool."""
        (block_ids,) = _int32_args("HostView.evicted", ("block_ids", block_ids, 1), xp=np)
        k = int(np.unique(block_ids[block_ids != NO_BLOCK]).size)
        return self._replace(num_free=self.num_free + k, num_cached_free=self.num_cached_free - k)

    def named_blocks(self) -> np.ndarray:
        """int32[]: the distinct (real) blocks some table names, sorted."""
        tables = self.block_tables
        return np.unique(tables[tables >= 0])

    def forked(self, parent_ids, child_ids) -> HostView:
        """The view after ``fork(state, parent_ids, child_ids)``: each child row is a copy of
        its parent's (as before the call) and every block it names gains a reference."""
        parents, children = _int32_args(
            "HostView.forked", ("parent_ids", parent_ids, 1), ("child_ids", child_ids, 1), xp=np
        )
        real = (children >= 0) & (children < self.max_seqs) & (parents >= 0) & (parents < self.max_seqs)
        parents, children = parents[real], children[real]
        if not children.size:
            return self
        tables, counts = self.block_tables.copy(), self.entry_counts.copy()
        lens, active = self.seq_lens.copy(), self.active.copy()
        new = self.block_tables[parents]
        blocks, hits = np.unique(new[new != NO_BLOCK], return_counts=True)
        tables[children], counts[children] = new, self.entry_counts[parents]
        cached = self.entry_cached.copy()
        cached[children] = self.entry_cached[parents]
        lens[children], active[children] = self.seq_lens[parents], True
        self._add_to_entries(tables, counts, blocks, hits)
        return self._replace(block_tables=tables, entry_counts=counts, seq_lens=lens, active=active,
                             entry_cached=cached)

    def selected(self, seq_ids, parent_ids) -> HostView:
        """The view after ``select_parents(state, seq_ids, parent_ids)``: row ``seq_ids[i]``
        becomes a copy of the old row ``parent_ids[i]`` (live or not before); every block
        changes its count by the references gained minus those lost, and blocks left with
        none return to the pool."""
        rows, parents = _int32_args(
            "HostView.selected", ("seq_ids", seq_ids, 1), ("parent_ids", parent_ids, 1), xp=np
        )
        real = (rows >= 0) & (rows < self.max_seqs) & (parents >= 0) & (parents < self.max_seqs)
        rows, parents = rows[real], parents[real]
        if not rows.size:
            return self
        new = self.block_tables[parents]
        old = self.block_tables[rows[self.active[rows]]]
        gained, plus = np.unique(new[new != NO_BLOCK], return_counts=True)
        lost, minus = np.unique(old[old != NO_BLOCK], return_counts=True)
        blocks = np.union1d(gained, lost)
        delta = np.zeros(blocks.shape, np.int32)
        delta[np.searchsorted(blocks, gained)] += plus.astype(np.int32)
        delta[np.searchsorted(blocks, lost)] -= minus.astype(np.int32)
        before = np.zeros(blocks.shape, np.int32)  # table references before the call
        was_cached = np.zeros(blocks.shape, bool)
        named = self.block_tables != NO_BLOCK
        ids, first = np.unique(self.block_tables[named], return_index=True)
        present = np.isin(blocks, ids)
        at = first[np.searchsorted(ids, blocks[present])]
        was_cached[present] = self.entry_cached[named][at]
        before[present] = self.entry_counts[named][at] - was_cached[present]
        tables, counts = self.block_tables.copy(), self.entry_counts.copy()
        cached = self.entry_cached.copy()
        new_counts = self.entry_counts[parents].copy()
        tables[rows], counts[rows], cached[rows] = new, new_counts, self.entry_cached[parents]
        self._add_to_entries(tables, counts, blocks, delta)
        lens, active = self.seq_lens.copy(), self.active.copy()
        lens[rows], active[rows] = self.seq_lens[parents], True
        gone = (before > 0) & (before + delta == 0)
        return self._replace(block_tables=tables, entry_counts=counts, seq_lens=lens, active=active,
                             entry_cached=cached, num_free=self.num_free + int((gone & ~was_cached).sum()),
                             num_cached_free=self.num_cached_free + int((gone & was_cached).sum()))

    def unshared(self, seq_ids) -> HostView:
        """The view after ``unshare(state, seq_ids)``: rows in batch order, each in logical
        order, replace every block still counted more than once by a fresh one (a
        stand-in id below every id the view names, as in ``restored``). Padding,
        out-of-range and dead ids are skipped."""
        (seq_ids,) = _int32_args("HostView.unshared", ("seq_ids", seq_ids, 1), xp=np)
        tables, counts = self.block_tables.copy(), self.entry_counts.copy()
        cached = self.entry_cached.copy()
        stand_in = min(int(tables.min(initial=NO_BLOCK)), NO_BLOCK) - 1
        taken, left_cached = 0, []
        for s in seq_ids[(seq_ids >= 0) & (seq_ids < self.max_seqs)]:
            if not self.active[s]:
                continue
            for j in np.flatnonzero((tables[s] != NO_BLOCK) & (counts[s] > 1)):
                block = tables[s, j]
                counts[tables == block] -= 1
                if cached[s, j]:
                    left_cached.append(block)
                tables[s, j], counts[s, j], cached[s, j] = stand_in - taken, 1, False
                taken += 1
        if not taken:
            return self
        # A cached block whose last table reference moved to a copy is cached-free.
        idle = int((~np.isin(np.unique(left_cached), tables)).sum()) if left_cached else 0
        return self._replace(block_tables=tables, entry_counts=counts, entry_cached=cached,
                             num_free=self.num_free - taken, num_cached_free=self.num_cached_free + idle)

    def restored(self, seq_ids, seq_lens, local_tables, num_local) -> HostView:
        """The view after ``restore_rows(state, seq_ids, seq_lens, local_tables, num_local)``:
        ``num_local`` blocks leave the pool and the rows name them as ``local_tables``
        says, local id ``i`` as the stand-in id ``stand_in - i`` where ``stand_in`` is one
        below the lowest id the view names (-2 on a view without stand-ins).

        seq_ids, seq_lens: int[B] (NO_SEQ = padding); local_tables: int[B, P], P <= the
        view's table width; num_local: int. Only a row's first ceil(len / block_size)
        entries are read.
        """
        op = "HostView.restored"
        seq_ids, seq_lens, local_tables, num_local = _int32_args(
            op, ("seq_ids", seq_ids, 1), ("seq_lens", seq_lens, 1), ("local_tables", local_tables, 2),
            ("num_local", num_local, 0), xp=np,
        )
        width, p, num_local = self.block_tables.shape[1], local_tables.shape[1], int(num_local)
        if p > width:
            raise ValueError(f"{op}: local_tables has shape {local_tables.shape}; its width must be at most {width}")
        real = (seq_ids >= 0) & (seq_ids < self.max_seqs)
        need = blocks_for(np.clip(seq_lens, 0, p * self.block_size), self.block_size)
        held = (np.arange(p)[None, :] < need[:, None]) & real[:, None]
        held &= (local_tables >= 0) & (local_tables < num_local)
        counts = np.bincount(local_tables[held], minlength=max(num_local, 0))
        stand_in = min(int(self.block_tables.min(initial=NO_BLOCK)), NO_BLOCK) - 1
        pad = ((0, 0), (0, width - p))
        phys = np.pad(np.where(held, stand_in - local_tables, NO_BLOCK), pad, constant_values=NO_BLOCK)
        entry = np.pad(np.where(held, counts[np.where(held, local_tables, 0)] if counts.size else 0, 0), pad)
        rows = seq_ids[real]
        tables, entry_counts = self.block_tables.copy(), self.entry_counts.copy()
        lens, active = self.seq_lens.copy(), self.active.copy()
        tables[rows], entry_counts[rows] = phys[real], entry[real]
        cached = self.entry_cached.copy()
        cached[rows] = False
        lens[rows], active[rows] = seq_lens[real], True
        return self._replace(block_tables=tables, entry_counts=entry_counts, seq_lens=lens, active=active,
                             entry_cached=cached, num_free=self.num_free - num_local)


def host_view(state: CacheState) -> HostView:
    """``HostView`` of ``state`` now (one snapshot, one device-to-host transfer). An engine
    that already fetched a ``snapshot`` with its step's outputs uses
    ``HostView.from_snapshot`` instead."""
    return HostView.from_snapshot(snapshot(state), state.block_size)
