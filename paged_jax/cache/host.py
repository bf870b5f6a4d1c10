"""The block manager on the host: one NumPy model, the scheduler's view and the test oracle.

``HostBlockManager`` holds what a ``CacheState`` holds (tables, lengths, live flags,
reference counts, cached flags, and the free pool through the allocation policy's host
counterpart, ``policies.HostPool``) and implements every op of ``ops.py`` with the same
arguments, statuses and atomicity: each entry is validated against the state before the
call, then the valid batch is applied one entry after another in batch order, which is
what the jitted ops reproduce. Because every policy's host counterpart hands out the ids
the device would, the model predicts the device exactly, ids included:

- **the oracle**: ``tests/test_cache_ops.py`` and ``test_cache_stateful.py`` run the
  device ops and this model side by side (hypothesis drives random op sequences) and
  compare everything observable, the free pool's order included (``mismatch``);
- **the engine's view**: an engine keeps one, advanced through the very ops the runner ran
  on the device (``engine/kv_cache_manager.py``), so the scheduler plans on the host with
  no snapshot fetched and no device sync, and its what-if questions are the ops themselves
  on a copy (``released``, ``opened``, ``forked``, ... return the model after the op).

Written for clarity first: loops over the batch and its blocks, O(batch x
max_blocks_per_seq) Python per op; ``blocks_needed`` runs the device's own append
arithmetic (``ops._plan_append``) vectorised. A ``copy`` is O(num_blocks) memcpy.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from paged_jax.cache.ops import _int32_args, _plan_append
from paged_jax.cache.policies import AllocationPolicy, HostPool, get_policy
from paged_jax.cache.sentinels import NO_BLOCK, NO_SEQ, NO_SLOT
from paged_jax.cache.state import CacheState, Status
from paged_jax.config import CacheConfig, blocks_for

_OK = Status.OK


class PlanningError(AssertionError):
    """A what-if (``released``, ``opened``, ...) asked for an op the state refuses: the
    caller planned something impossible (an engine bug)."""


class HostBlockManager:
    """The block manager's state and ops in NumPy (module docstring).

    Attributes:
      block_tables: int32[max_seqs, max_blocks_per_seq]; NO_BLOCK past each row's end.
      seq_lens: int32[max_seqs]. active: bool[max_seqs].
      ref_counts: int32[num_blocks]: table entries naming each block, +1 while cached.
      cached: bool[num_blocks]. pool: the policy's ``HostPool``.
    """

    def __init__(self, config: CacheConfig, policy: str | AllocationPolicy = "lifo", *, pool: HostPool | None = None):
        self.policy = get_policy(policy)
        self.block_size, self.num_blocks = config.block_size, config.num_blocks
        self.max_seqs, self.max_blocks_per_seq = config.max_seqs, config.max_blocks_per_seq
        self.block_tables = np.full((self.max_seqs, self.max_blocks_per_seq), NO_BLOCK, np.int32)
        self.seq_lens = np.zeros(self.max_seqs, np.int32)
        self.active = np.zeros(self.max_seqs, bool)
        self.ref_counts = np.zeros(self.num_blocks, np.int32)
        self.cached = np.zeros(self.num_blocks, bool)
        self.pool = self.policy.host(self.num_blocks) if pool is None else pool
        # A planning copy (``elastic``) never runs out: past the pool it hands out virtual
        # blocks (ids from num_blocks up), and ``num_free`` goes negative by that overdraft.
        # What-ifs plan allocations that evictions later in the step will pay for.
        self.elastic, self.overdraft = False, 0

    @classmethod
    def from_state(cls, state: CacheState) -> HostBlockManager:
        """A host copy of a device state (one fetch)."""
        import jax

        host = jax.device_get(state)
        config = CacheConfig(num_blocks=state.num_blocks, block_size=state.block_size, max_seqs=state.max_seqs,
                             max_blocks_per_seq=state.max_blocks_per_seq)
        new = cls(config, state.policy, pool=state.policy.host_pool(host.pool))
        new.block_tables[:] = host.block_tables
        new.seq_lens[:] = host.seq_lens
        new.active[:] = host.active
        new.ref_counts[:] = host.ref_counts
        new.cached[:] = host.cached
        return new

    def copy(self, *, elastic: bool | None = None) -> HostBlockManager:
        """An independent copy (``elastic``: a planning copy, see ``__init__``)."""
        new = object.__new__(HostBlockManager)
        new.__dict__.update(self.__dict__)
        for name in ("block_tables", "seq_lens", "active", "ref_counts", "cached"):
            setattr(new, name, getattr(self, name).copy())
        new.pool = self.pool.copy()
        if elastic is not None:
            new.elastic = elastic
        return new

    def _take(self) -> int:
        if self.pool.num_free > 0 or not self.elastic:
            return self.pool.take()
        self.overdraft += 1
        block = self.ref_counts.shape[0]
        self.ref_counts = np.append(self.ref_counts, np.int32(0))
        self.cached = np.append(self.cached, False)
        return block

    def _short(self, need: int) -> bool:
        """Whether the pool cannot hand out ``need`` blocks (never, for a planning copy)."""
        return not self.elastic and need > self.pool.num_free

    def mismatch(self, state: CacheState) -> str | None:
        """What differs between this model and the device ``state`` (None: nothing): every
        array and the free pool in allocation order."""
        import jax

        host = jax.device_get(state)
        for name in ("block_tables", "seq_lens", "active", "ref_counts", "cached"):
            mine, theirs = getattr(self, name), np.asarray(getattr(host, name))
            if not np.array_equal(mine, theirs):
                where = np.argwhere(mine != theirs)[:4].tolist()
                return f"{name} differs at {where}: host {mine[tuple(np.array(where).T)].tolist()}, " \
                       f"device {theirs[tuple(np.array(where).T)].tolist()}"
        mine, theirs = self.pool.ordered(), np.asarray(state.policy.free_blocks(host.pool))
        if not np.array_equal(mine, theirs):
            return f"free pool differs: host {mine[:8].tolist()}..., device {theirs[:8].tolist()}..."
        return None

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        """Blocks in the free pool (negative on a planning copy that overdrew it)."""
        return self.pool.num_free - self.overdraft

    @property
    def num_cached_free(self) -> int:
        """Cached blocks no table names (an eviction would return them to the pool)."""
        return int((self.cached & (self.ref_counts == 1)).sum())

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: the pool plus the cached-free blocks."""
        return self.num_free + self.num_cached_free

    def named_blocks(self) -> np.ndarray:
        """int32[]: the distinct (real) blocks some table names, sorted."""
        tables = self.block_tables
        return np.unique(tables[(tables >= 0) & (tables < self.num_blocks)])

    def blocks_needed(self, seq_ids, num_tokens) -> np.ndarray:
        """int32[B]: what ``append_slots`` would take for these appends (new blocks plus
        copy-on-write targets, the batch appended together), by the device's own arithmetic."""
        seq_ids, num_tokens = _int32_args("blocks_needed", ("seq_ids", seq_ids, 1), ("num_tokens", num_tokens, 1),
                                          xp=np)
        real = (seq_ids >= 0) & (seq_ids < self.max_seqs)
        plan = _plan_append(
            np, block_size=self.block_size, seq_lens=self.seq_lens, block_tables=self.block_tables,
            count_at=lambda rows, cols: self.ref_counts[np.clip(self.block_tables[rows, cols], 0,
                                                                 self.ref_counts.shape[0] - 1)],
            seq_ids=seq_ids, num_tokens=num_tokens, real=real,
        )
        return (plan.grow + plan.cow).astype(np.int32)

    def _live_rows(self, seq_ids) -> np.ndarray:
        seq_ids = np.asarray(seq_ids, np.int64).reshape(-1)
        rows = np.unique(seq_ids[(seq_ids >= 0) & (seq_ids < self.max_seqs)])
        return rows[self.active[rows]]

    def blocks_held(self, seq_ids) -> int:
        """Distinct physical blocks these rows name (a block they share counted once);
        padding, out-of-range and dead ids hold nothing."""
        tables = self.block_tables[self._live_rows(seq_ids)]
        return int(np.unique(tables[tables != NO_BLOCK]).size)

    def blocks_freed(self, seq_ids) -> int:
        """Blocks that become available (``num_available``) if these rows are released
        together: those whose every table reference comes from these rows."""
        tables = self.block_tables[self._live_rows(seq_ids)]
        blocks, hits = np.unique(tables[tables != NO_BLOCK], return_counts=True)
        return int((hits == self.ref_counts[blocks] - self.cached[blocks]).sum())

    def entry_counts(self, rows) -> np.ndarray:
        """int32[len(rows), max_blocks_per_seq]: the count of the block each entry of these
        rows names (0 at NO_BLOCK)."""
        tables = self.block_tables[np.asarray(rows, np.int64)]
        return np.where(tables != NO_BLOCK, self.ref_counts[np.maximum(tables, 0)], 0).astype(np.int32)

    # ------------------------------------------------------------------ validation

    def _status(self, ids, *, want_active, unique) -> list[int]:
        status = []
        in_range = [0 <= s < self.max_seqs for s in ids]
        hits = collections.Counter(s for s, ok in zip(ids, in_range, strict=True) if ok)
        for s, ok in zip(ids, in_range, strict=True):
            if s == NO_SEQ:
                status.append(_OK)
            elif not ok:
                status.append(Status.INVALID_SEQ_ID)
            elif want_active is True and not self.active[s]:
                status.append(Status.INACTIVE_SEQ)
            elif want_active is False and self.active[s]:
                status.append(Status.ACTIVE_SEQ)
            elif unique and hits[s] > 1:
                status.append(Status.DUPLICATE_SEQ)
            else:
                status.append(_OK)
        return status

    def _pair_status(self, a, b, a_kw, b_kw) -> list[int]:
        sa, sb = self._status(a, **a_kw), self._status(b, **b_kw)
        status = [x if x != _OK else y for x, y in zip(sa, sb, strict=True)]
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if status[i] == _OK and (0 <= x < self.max_seqs) != (0 <= y < self.max_seqs):
                status[i] = Status.INVALID_SEQ_ID
        return status

    @staticmethod
    def _all_ok(status) -> bool:
        return all(s == _OK for s in status)

    @staticmethod
    def _out(status) -> np.ndarray:
        return np.asarray(status, np.int32)

    def _row(self, s: int) -> list[int]:
        table = self.block_tables[s]
        return [int(b) for b in table[table != NO_BLOCK]]

    def _set_row(self, s: int, blocks: list[int], length: int) -> None:
        self.block_tables[s] = NO_BLOCK
        self.block_tables[s, : len(blocks)] = blocks
        self.seq_lens[s] = length

    def _drop_reference(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0
        if self.ref_counts[block] == 0:
            if block >= self.num_blocks:  # a planning copy's virtual block: the overdraft shrinks
                self.overdraft -= 1
            else:
                self.pool.give(block)

    def _block_status(self, block_ids, ok) -> list[int]:
        hits = collections.Counter(block_ids)
        return [_OK if b == NO_BLOCK else
                Status.BAD_BLOCK if not (0 <= b < self.num_blocks) or hits[b] > 1 or not ok(b) else _OK
                for b in block_ids]

    @staticmethod
    def _ints(op: str, *specs) -> list:
        """Checked int32 arguments as Python ints (lists for rank 1, nested for rank 2)."""
        return [a.tolist() for a in _int32_args(op, *specs, xp=np)]

    # ------------------------------------------------------------------ ops

    def open_sequences(self, seq_ids, prefix_blocks=None) -> np.ndarray:
        if prefix_blocks is None:
            (ids,) = self._ints("open_sequences", ("seq_ids", seq_ids, 1))
        else:
            ids, prefix_blocks = self._ints("open_sequences", ("seq_ids", seq_ids, 1),
                                            ("prefix_blocks", prefix_blocks, 2))
        status = self._status(ids, want_active=False, unique=True)
        prefixes = [[] for _ in ids]
        if prefix_blocks is not None:
            for i, (s, row) in enumerate(zip(ids, prefix_blocks, strict=True)):
                named = [b for b in row if b != NO_BLOCK]
                bad = (row[: len(named)] != named or len(set(named)) < len(named)
                       or any(not (0 <= b < self.num_blocks and self.cached[b]) for b in named))
                if s != NO_SEQ and status[i] == _OK and bad:
                    status[i] = Status.BAD_TABLE
                prefixes[i] = named
        if self._all_ok(status):
            for s, named in zip(ids, prefixes, strict=True):
                if s != NO_SEQ:
                    self._set_row(s, named, len(named) * self.block_size)
                    self.active[s] = True
                    for b in named:
                        self.ref_counts[b] += 1
        return self._out(status)

    def mark_cached(self, block_ids) -> np.ndarray:
        (blocks,) = self._ints("mark_cached", ("block_ids", block_ids, 1))
        status = self._block_status(blocks, lambda b: self.ref_counts[b] >= 1 and not self.cached[b])
        if self._all_ok(status):
            for b in blocks:
                if b != NO_BLOCK:
                    self.cached[b] = True
                    self.ref_counts[b] += 1
        return self._out(status)

    def evict_cached(self, block_ids) -> np.ndarray:
        (blocks,) = self._ints("evict_cached", ("block_ids", block_ids, 1))
        status = self._block_status(blocks, lambda b: self.cached[b] and self.ref_counts[b] == 1)
        if self._all_ok(status):
            for b in blocks:
                if b != NO_BLOCK:
                    self.cached[b] = False
                    self._drop_reference(b)
        return self._out(status)

    def append_slots(self, seq_ids, num_tokens, *, max_tokens: int = 1, slots: bool = True):
        """Returns (status, slot_mapping int32[B, max_tokens] (None unless ``slots``),
        copies [(src, dst)] in batch order)."""
        ids, counts = self._ints("append_slots", ("seq_ids", seq_ids, 1), ("num_tokens", num_tokens, 1))
        status = self._status(ids, want_active=True, unique=True)
        bs = self.block_size
        for i, (s, n) in enumerate(zip(ids, counts, strict=True)):
            if status[i] == _OK and s != NO_SEQ and not 0 <= n <= max_tokens:
                status[i] = Status.BAD_NUM_TOKENS
        for i, (s, n) in enumerate(zip(ids, counts, strict=True)):
            if status[i] == _OK and s != NO_SEQ and blocks_for(int(self.seq_lens[s]) + n, bs) > self.max_blocks_per_seq:
                status[i] = Status.TABLE_FULL
        empty = np.full((len(ids), max_tokens), NO_SLOT, np.int32) if slots else None
        if not self._all_ok(status):
            return self._out(status), empty, []
        need = self.blocks_needed(ids, counts).tolist() if ids else []
        if self._short(sum(need)):
            return self._out([Status.NO_FREE_BLOCKS if k else _OK for k in need]), empty, []
        mapping, copies = empty, []
        for i, (s, n) in enumerate(zip(ids, counts, strict=True)):
            if s == NO_SEQ or n <= 0:
                continue
            length = int(self.seq_lens[s])
            table = self._row(s)
            if length % bs and self.ref_counts[table[length // bs]] > 1:
                src, dst = table[length // bs], self._take()
                self.ref_counts[src] -= 1
                self.ref_counts[dst] += 1
                table[length // bs] = dst
                copies.append((src, dst))
            while len(table) < blocks_for(length + n, bs):
                block = self._take()
                self.ref_counts[block] += 1
                table.append(block)
            self._set_row(s, table, length + n)
            if slots:
                pos = length + np.arange(n)
                mapping[i, :n] = np.asarray(table, np.int32)[pos // bs] * bs + pos % bs
        return self._out(status), mapping, copies

    def fork(self, parent_ids, child_ids) -> np.ndarray:
        parents, children = self._ints("fork", ("parent_ids", parent_ids, 1), ("child_ids", child_ids, 1))
        status = self._pair_status(parents, children, dict(want_active=True, unique=False),
                                   dict(want_active=False, unique=True))
        if self._all_ok(status):
            for p, c in zip(parents, children, strict=True):
                if c != NO_SEQ:
                    row = self._row(p)
                    self._set_row(c, row, int(self.seq_lens[p]))
                    self.active[c] = True
                    for b in row:
                        self.ref_counts[b] += 1
        return self._out(status)

    def release(self, seq_ids) -> np.ndarray:
        (ids,) = self._ints("release", ("seq_ids", seq_ids, 1))
        return self._shrink(ids, [0] * len(ids), deactivate=True)

    def truncate(self, seq_ids, new_lens) -> np.ndarray:
        ids, lens = self._ints("truncate", ("seq_ids", seq_ids, 1), ("new_lens", new_lens, 1))
        return self._shrink(ids, lens, deactivate=False)

    def _shrink(self, ids, new_lens, *, deactivate) -> np.ndarray:
        status = self._status(ids, want_active=True, unique=True)
        for i, (s, n) in enumerate(zip(ids, new_lens, strict=True)):
            if status[i] == _OK and s != NO_SEQ and not 0 <= n <= self.seq_lens[s]:
                status[i] = Status.BAD_NUM_TOKENS
        if self._all_ok(status):
            for s, n in zip(ids, new_lens, strict=True):
                if s == NO_SEQ:
                    continue
                row, keep = self._row(s), blocks_for(n, self.block_size)
                for b in row[keep:]:
                    self._drop_reference(b)
                self._set_row(s, row[:keep], n)
                if deactivate:
                    self._set_row(s, [], 0)
                    self.active[s] = False
        return self._out(status)

    def select_parents(self, seq_ids, parent_ids) -> np.ndarray:
        ids, parents = self._ints("select_parents", ("seq_ids", seq_ids, 1), ("parent_ids", parent_ids, 1))
        status = self._pair_status(ids, parents, dict(want_active=None, unique=True),
                                   dict(want_active=True, unique=False))
        if self._all_ok(status):
            new = [(s, self._row(p), int(self.seq_lens[p])) for s, p in zip(ids, parents, strict=True) if s != NO_SEQ]
            for _, row, _ in new:
                for b in row:
                    self.ref_counts[b] += 1
            for s, _, _ in new:
                for b in self._row(s) if self.active[s] else []:
                    self._drop_reference(b)
            for s, row, length in new:
                self._set_row(s, row, length)
                self.active[s] = True
        return self._out(status)

    def unshare(self, seq_ids):
        """Returns (status, copies [(src, dst)] in order)."""
        (ids,) = self._ints("unshare", ("seq_ids", seq_ids, 1))
        status = self._status(ids, want_active=True, unique=True)
        if not self._all_ok(status):
            return self._out(status), []
        dropped, need = collections.Counter(), []
        for s in ids:
            k = 0
            for b in self._row(s) if s != NO_SEQ else []:
                if self.ref_counts[b] - dropped[b] > 1:
                    dropped[b] += 1
                    k += 1
            need.append(k)
        if self._short(sum(need)):
            return self._out([Status.NO_FREE_BLOCKS if k else _OK for k in need]), []
        copies = []
        for s in ids:
            if s == NO_SEQ:
                continue
            table = self._row(s)
            for j, b in enumerate(table):
                if self.ref_counts[b] > 1:
                    dst = self._take()
                    self.ref_counts[b] -= 1
                    self.ref_counts[dst] += 1
                    table[j] = dst
                    copies.append((b, dst))
            self._set_row(s, table, int(self.seq_lens[s]))
        return self._out(status), copies

    def restore_rows(self, seq_ids, seq_lens, local_tables, num_local, *, max_local: int):
        """Rebuild rows naming ``num_local`` fresh blocks by local index (``ops.restore_rows``).
        Returns (status, int32[max_local]: the physical id of each local id, NO_BLOCK past
        num_local or when rejected)."""
        ids, lens, local_tables, num_local = self._ints(
            "restore_rows", ("seq_ids", seq_ids, 1), ("seq_lens", seq_lens, 1), ("local_tables", local_tables, 2),
            ("num_local", num_local, 0))
        status = self._status(ids, want_active=False, unique=True)
        bs = self.block_size
        width = len(local_tables[0]) if local_tables else 0
        real = [0 <= s < self.max_seqs for s in ids]
        need = [blocks_for(min(max(n, 0), width * bs), bs) for n in lens]
        for i, n in enumerate(lens):
            if status[i] == _OK and real[i] and not 0 <= n <= width * bs:
                status[i] = Status.BAD_NUM_TOKENS
        for i, row in enumerate(local_tables):
            held, rest = row[: need[i]], row[need[i]:]
            well_formed = (all(0 <= x < num_local for x in held) and len(set(held)) == len(held)
                           and all(x == NO_BLOCK for x in rest))
            if status[i] == _OK and real[i] and not well_formed:
                status[i] = Status.BAD_TABLE
        named = {x for i, row in enumerate(local_tables) if real[i] for x in row[: need[i]]}
        group_bad = not 0 <= num_local <= max_local or any(x not in named for x in range(num_local))
        if self._all_ok(status) and group_bad:
            status = [Status.BAD_TABLE] * len(ids)
        rejected = np.full(max_local, NO_BLOCK, np.int32)
        if not self._all_ok(status):
            return self._out(status), rejected
        if self._short(num_local):
            return self._out([Status.NO_FREE_BLOCKS if real[i] and need[i] else _OK for i in range(len(ids))]), rejected
        phys = [self._take() for _ in range(num_local)]
        for i, s in enumerate(ids):
            if real[i]:
                row = [phys[x] for x in local_tables[i][: need[i]]]
                self._set_row(s, row, lens[i])
                self.active[s] = True
                for b in row:
                    self.ref_counts[b] += 1
        out = rejected.copy()
        out[:num_local] = phys
        return self._out(status), out

    # ------------------------------------------------------------------ planning
    # The model after an op that must succeed: the scheduler's what-if questions. The
    # receiver is unchanged (each returns a copy).

    def _after(self, op: str, *args, **kwargs) -> HostBlockManager:
        if all(np.size(a) == 0 or (np.ndim(a) == 1 and np.all(np.asarray(a) == NO_SEQ)) for a in args[:1]):
            return self  # nothing to do: the model as it is (what-ifs never change their receiver)
        new = self.copy(elastic=True)
        out = getattr(new, op)(*args, **kwargs)
        status = out[0] if isinstance(out, tuple) else out
        if np.any(status != _OK):
            raise PlanningError(f"planned {op} is refused: statuses {status.tolist()} for {args}")
        return new

    def released(self, seq_ids) -> HostBlockManager:
        """After ``release``: dead and padding ids are skipped, a repeated id counts once
        (its first place: the order decides the pool's)."""
        seq_ids = np.asarray(seq_ids, np.int64).reshape(-1)
        live = [int(s) for s in dict.fromkeys(seq_ids.tolist()) if 0 <= s < self.max_seqs and self.active[s]]
        return self._after("release", np.asarray(live, np.int32))

    def opened(self, seq_ids, prefix_blocks=None) -> HostBlockManager:
        return self._after("open_sequences", seq_ids, prefix_blocks)

    def forked(self, parent_ids, child_ids) -> HostBlockManager:
        return self._after("fork", parent_ids, child_ids)

    def selected(self, seq_ids, parent_ids) -> HostBlockManager:
        return self._after("select_parents", seq_ids, parent_ids)

    def unshared(self, seq_ids) -> HostBlockManager:
        return self._after("unshare", seq_ids)

    def restored(self, seq_ids, seq_lens, local_tables, num_local) -> HostBlockManager:
        local_tables = np.asarray(local_tables)
        return self._after("restore_rows", seq_ids, seq_lens, local_tables, num_local,
                           max_local=max(int(num_local), 1))

    def marked(self, block_ids) -> HostBlockManager:
        return self._after("mark_cached", block_ids)

    def evicted(self, block_ids) -> HostBlockManager:
        return self._after("evict_cached", block_ids)

    def appended(self, seq_ids, num_tokens) -> HostBlockManager:
        counts = np.asarray(num_tokens, np.int32)
        return self._after("append_slots", seq_ids, counts, max_tokens=max(int(counts.max(initial=1)), 1),
                           slots=False)

    # ------------------------------------------------------------------ replay

    def apply(self, op: str, args: tuple, kwargs: dict[str, Any] | None = None) -> None:
        """Run one op the device ran (the runner's op log), refusing nothing: a status the
        device accepted must be accepted here too (else the two have diverged)."""
        out = getattr(self, op)(*args, **(kwargs or {}))
        status = out[0] if isinstance(out, tuple) else out
        if np.any(status != _OK):
            raise PlanningError(f"host model refused {op} the device ran: statuses {status.tolist()}")
