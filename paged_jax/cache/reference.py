"""A pure-Python block manager: lists and dicts, one sequence at a time, obviously correct.

The test oracle for ``ops.py``. Each method takes the same batch arguments as the jitted
op, returns the same status list, and applies nothing unless every status is OK. Every
entry is validated against the state before the call, then the entries are applied one
after another in batch order, which is what the jitted ops reproduce.
"""

from __future__ import annotations

import collections

from paged_jax.cache.policies import AllocationPolicy, get_policy
from paged_jax.cache.sentinels import NO_BLOCK, NO_SEQ, NO_SLOT
from paged_jax.cache.state import Status
from paged_jax.config import blocks_for

_PREDICTABLE = ("lifo", "fifo", "lowest_id_first")


class ReferenceFreeList:
    """The free pool of one policy, with Python containers.

    ``lifo``, ``fifo`` and ``lowest_id_first`` are predicted exactly. Any policy marked
    ``deterministic=False`` (``random`` or one of your own) is followed instead: ``pop``
    takes the id the device chose and checks that it was free.
    """

    def __init__(self, policy: str | AllocationPolicy, num_blocks: int):
        policy = get_policy(policy)
        self.policy = policy.name if policy.deterministic else None  # None: follow the device
        if self.policy == "lifo":
            self.items = list(range(num_blocks - 1, -1, -1))  # top of stack at the end
        elif self.policy == "fifo":
            self.items = collections.deque(range(num_blocks))
        elif self.policy == "lowest_id_first" or self.policy is None:
            self.items = set(range(num_blocks))
        else:
            raise ValueError(
                f"no reference for the deterministic policy {policy.name!r}: add a branch for it "
                f"to ReferenceFreeList (known: {', '.join(_PREDICTABLE)}) or mark it deterministic=False"
            )

    def __len__(self):
        return len(self.items)

    def pop(self, chosen: int | None = None) -> int:
        """Take a block; for a non-deterministic policy, ``chosen`` is the id the device picked."""
        if self.policy == "lifo":
            return self.items.pop()
        if self.policy == "fifo":
            return self.items.popleft()
        if self.policy == "lowest_id_first":
            block = min(self.items)
            self.items.remove(block)
            return block
        if chosen is None:
            raise ValueError("a non-deterministic policy's reference needs the id the device chose")
        self.items.remove(chosen)  # raises if the device picked a block that is not free
        return chosen

    def push(self, block: int) -> None:
        if isinstance(self.items, set):
            self.items.add(block)
        else:
            self.items.append(block)

    def ordered(self) -> list[int]:
        """Free ids in the order the next allocations take them (sorted where the device
        decides)."""
        if self.policy == "lifo":
            return self.items[::-1]
        if self.policy == "fifo":
            return list(self.items)
        return sorted(self.items)


class ReferenceBlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int,
        policy: str | AllocationPolicy = "lifo",
    ):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_seqs, self.max_blocks_per_seq = max_seqs, max_blocks_per_seq
        self.free = ReferenceFreeList(policy, num_blocks)
        self.tables: dict[int, list[int]] = {}  # live sequence -> physical blocks
        self.lens: dict[int, int] = {}
        self.counts = [0] * num_blocks  # table entries naming each block, +1 if cached
        self.cached: set[int] = set()  # blocks the prefix cache holds

    # ------------------------------------------------------------------ validation

    def _status(self, ids, *, want_active, unique):
        status = []
        in_range = [0 <= s < self.max_seqs for s in ids]
        hits = collections.Counter(s for s, ok in zip(ids, in_range) if ok)
        for s, ok in zip(ids, in_range):
            if s == NO_SEQ:
                status.append(Status.OK)
            elif not ok:
                status.append(Status.INVALID_SEQ_ID)
            elif want_active is True and s not in self.tables:
                status.append(Status.INACTIVE_SEQ)
            elif want_active is False and s in self.tables:
                status.append(Status.ACTIVE_SEQ)
            elif unique and hits[s] > 1:
                status.append(Status.DUPLICATE_SEQ)
            else:
                status.append(Status.OK)
        return status

    def _pair_status(self, a, b, a_kw, b_kw):
        sa, sb = self._status(a, **a_kw), self._status(b, **b_kw)
        status = [x if x != Status.OK else y for x, y in zip(sa, sb)]
        for i, (x, y) in enumerate(zip(a, b)):
            real_x, real_y = 0 <= x < self.max_seqs, 0 <= y < self.max_seqs
            if status[i] == Status.OK and real_x != real_y:
                status[i] = Status.INVALID_SEQ_ID
        return status

    @staticmethod
    def _all_ok(status):
        return all(s == Status.OK for s in status)

    def _drop_reference(self, block: int) -> None:
        self.counts[block] -= 1
        assert self.counts[block] >= 0
        if self.counts[block] == 0:
            self.free.push(block)

    # ------------------------------------------------------------------ ops

    def open_sequences(self, ids, prefix_blocks=None):
        status = self._status(ids, want_active=False, unique=True)
        prefixes = [[] for _ in ids]
        if prefix_blocks is not None:
            for i, (s, row) in enumerate(zip(ids, prefix_blocks)):
                row = [int(b) for b in row]
                named = [b for b in row if b != NO_BLOCK]
                bad = (row[: len(named)] != named or len(set(named)) < len(named)
                       or any(b not in self.cached for b in named))
                if s != NO_SEQ and status[i] == Status.OK and bad:
                    status[i] = Status.BAD_TABLE
                prefixes[i] = named
        if self._all_ok(status):
            for s, named in zip(ids, prefixes):
                if s != NO_SEQ:
                    self.tables[s], self.lens[s] = list(named), len(named) * self.block_size
                    for b in named:
                        self.counts[b] += 1
        return status

    def _block_status(self, block_ids, ok):
        hits = collections.Counter(block_ids)
        return [Status.OK if b == NO_BLOCK else
                Status.BAD_BLOCK if not (0 <= b < self.num_blocks) or hits[b] > 1 or not ok(b) else Status.OK
                for b in block_ids]

    def mark_cached(self, block_ids):
        status = self._block_status(block_ids, lambda b: self.counts[b] >= 1 and b not in self.cached)
        if self._all_ok(status):
            for b in block_ids:
                if b != NO_BLOCK:
                    self.cached.add(b)
                    self.counts[b] += 1
        return status

    def evict_cached(self, block_ids):
        status = self._block_status(block_ids, lambda b: b in self.cached and self.counts[b] == 1)
        if self._all_ok(status):
            for b in block_ids:
                if b != NO_BLOCK:
                    self.cached.remove(b)
                    self._drop_reference(b)
        return status

    def num_cached_free(self) -> int:
        return sum(self.counts[b] == 1 for b in self.cached)

    def blocks_needed(self, ids, num_tokens):
        """Blocks each append would take, appending in batch order (copy-on-write included)."""
        counts = collections.Counter()  # references dropped by earlier copies in the batch
        need = []
        bs = self.block_size
        for s, n in zip(ids, num_tokens):
            if s not in self.tables or n <= 0:
                need.append(0)
                continue
            length, table = self.lens[s], self.tables[s]
            k = blocks_for(length + n, bs) - blocks_for(length, bs)
            if length % bs:
                b = table[length // bs]
                if self.counts[b] - counts[b] > 1:
                    counts[b] += 1
                    k += 1
            need.append(k)
        return need

    def append_slots(self, ids, num_tokens, max_tokens, device_ids=None):
        """Returns (status, slot_mapping rows, copies [(src, dst)] in batch order).

        ``device_ids``: for a non-deterministic policy, the ids the device allocated, in order.
        """
        status = self._status(ids, want_active=True, unique=True)
        bs = self.block_size
        for i, (s, n) in enumerate(zip(ids, num_tokens)):
            if status[i] == Status.OK and s != NO_SEQ and not 0 <= n <= max_tokens:
                status[i] = Status.BAD_NUM_TOKENS
        for i, (s, n) in enumerate(zip(ids, num_tokens)):
            if status[i] == Status.OK and s != NO_SEQ and blocks_for(self.lens[s] + n, bs) > self.max_blocks_per_seq:
                status[i] = Status.TABLE_FULL
        empty = [[NO_SLOT] * max_tokens for _ in ids]
        if not self._all_ok(status):
            return status, empty, []
        need = self.blocks_needed(ids, num_tokens)
        if sum(need) > len(self.free):
            return [Status.NO_FREE_BLOCKS if k else Status.OK for k in need], empty, []
        device_ids = list(device_ids) if device_ids is not None else None
        take = lambda: self.free.pop(device_ids.pop(0) if device_ids is not None else None)
        slots, copies = [], []
        for s, n in zip(ids, num_tokens):
            row = [NO_SLOT] * max_tokens
            if s != NO_SEQ and n > 0:
                table, length = self.tables[s], self.lens[s]
                if length % bs and self.counts[table[length // bs]] > 1:
                    src, dst = table[length // bs], take()
                    self.counts[src] -= 1
                    self.counts[dst] += 1
                    table[length // bs] = dst
                    copies.append((src, dst))
                while len(table) < blocks_for(length + n, bs):
                    block = take()
                    self.counts[block] += 1
                    table.append(block)
                for t in range(n):
                    pos = length + t
                    row[t] = table[pos // bs] * bs + pos % bs
                self.lens[s] = length + n
            slots.append(row)
        return status, slots, copies

    def fork(self, parents, children):
        status = self._pair_status(parents, children, dict(want_active=True, unique=False), dict(want_active=False, unique=True))
        if self._all_ok(status):
            for p, c in zip(parents, children):
                if c != NO_SEQ:
                    self.tables[c], self.lens[c] = list(self.tables[p]), self.lens[p]
                    for b in self.tables[c]:
                        self.counts[b] += 1
        return status

    def release(self, ids):
        return self._shrink(ids, [0] * len(ids), deactivate=True)

    def truncate(self, ids, new_lens):
        return self._shrink(ids, new_lens, deactivate=False)

    def _shrink(self, ids, new_lens, *, deactivate):
        status = self._status(ids, want_active=True, unique=True)
        for i, (s, n) in enumerate(zip(ids, new_lens)):
            if status[i] == Status.OK and s != NO_SEQ and not 0 <= n <= self.lens[s]:
                status[i] = Status.BAD_NUM_TOKENS
        if self._all_ok(status):
            for s, n in zip(ids, new_lens):
                if s == NO_SEQ:
                    continue
                keep = blocks_for(n, self.block_size)
                for b in self.tables[s][keep:]:
                    self._drop_reference(b)
                del self.tables[s][keep:]
                self.lens[s] = n
                if deactivate:
                    del self.tables[s], self.lens[s]
        return status

    def select_parents(self, ids, parents):
        status = self._pair_status(ids, parents, dict(want_active=None, unique=True), dict(want_active=True, unique=False))
        if self._all_ok(status):
            new = [(s, list(self.tables[p]), self.lens[p]) for s, p in zip(ids, parents) if s != NO_SEQ]
            for _, row, _ in new:
                for b in row:
                    self.counts[b] += 1
            for s, _, _ in new:
                for b in self.tables.get(s, []):
                    self._drop_reference(b)
            for s, row, length in new:
                self.tables[s], self.lens[s] = row, length
        return status

    def unshare(self, ids, device_ids=None):
        """Private copies of shared blocks, rows in batch order, each in logical order.
        Returns (status, copies [(src, dst)] in order); ``device_ids`` as for
        ``append_slots``."""
        status = self._status(ids, want_active=True, unique=True)
        if not self._all_ok(status):
            return status, []
        counts, need = collections.Counter(), []
        for s in ids:
            k = 0
            for b in self.tables.get(s, []) if s != NO_SEQ else []:
                if self.counts[b] - counts[b] > 1:
                    counts[b] += 1
                    k += 1
            need.append(k)
        if sum(need) > len(self.free):
            return [Status.NO_FREE_BLOCKS if k else Status.OK for k in need], []
        device_ids = list(device_ids) if device_ids is not None else None
        copies = []
        for s in ids:
            if s == NO_SEQ:
                continue
            table = self.tables[s]
            for j, b in enumerate(table):
                if self.counts[b] > 1:
                    dst = self.free.pop(device_ids.pop(0) if device_ids is not None else None)
                    self.counts[b] -= 1
                    self.counts[dst] += 1
                    table[j] = dst
                    copies.append((b, dst))
        return status, copies

    def restore_rows(self, ids, lens, local_tables, num_local, max_local, device_ids=None):
        """Rebuild rows naming ``num_local`` fresh blocks by local index (see
        ``ops.restore_rows``). Returns (status, physical id of each local id, NO_BLOCK
        past num_local or when rejected); ``device_ids`` as for ``append_slots``."""
        status = self._status(ids, want_active=False, unique=True)
        bs = self.block_size
        width = len(local_tables[0]) if local_tables else 0
        real = [0 <= s < self.max_seqs for s in ids]
        need = [blocks_for(min(max(n, 0), width * bs), bs) for n in lens]
        for i, n in enumerate(lens):
            if status[i] == Status.OK and real[i] and not 0 <= n <= width * bs:
                status[i] = Status.BAD_NUM_TOKENS
        for i, row in enumerate(local_tables):
            held, rest = row[: need[i]], row[need[i]:]
            well_formed = (
                all(0 <= x < num_local for x in held)
                and len(set(held)) == len(held)
                and all(x == NO_BLOCK for x in rest)
            )
            if status[i] == Status.OK and real[i] and not well_formed:
                status[i] = Status.BAD_TABLE
        named = {x for i, row in enumerate(local_tables) if real[i] for x in row[: need[i]]}
        group_bad = not 0 <= num_local <= max_local or any(x not in named for x in range(num_local))
        if self._all_ok(status) and group_bad:
            status = [Status.BAD_TABLE] * len(ids)
        rejected = [NO_BLOCK] * max_local
        if not self._all_ok(status):
            return status, rejected
        if num_local > len(self.free):
            return [Status.NO_FREE_BLOCKS if real[i] and need[i] else Status.OK for i in range(len(ids))], rejected
        chosen = list(device_ids) if device_ids is not None else [None] * num_local
        phys = [self.free.pop(chosen[i]) for i in range(num_local)]
        for i, s in enumerate(ids):
            if real[i]:
                self.tables[s] = [phys[x] for x in local_tables[i][: need[i]]]
                self.lens[s] = lens[i]
                for b in self.tables[s]:
                    self.counts[b] += 1
        return status, phys + [NO_BLOCK] * (max_local - num_local)

    # ------------------------------------------------------------------ observation

    def num_free_blocks(self) -> int:
        return len(self.free)

    def snapshot(self):
        """(tables, lens, counts, ordered free list) in the device state's terms (the
        cached blocks are ``self.cached``)."""
        tables = [[NO_BLOCK] * self.max_blocks_per_seq for _ in range(self.max_seqs)]
        lens = [0] * self.max_seqs
        for s, row in self.tables.items():
            tables[s][: len(row)] = row
            lens[s] = self.lens[s]
        return tables, lens, list(self.counts), self.free.ordered()
