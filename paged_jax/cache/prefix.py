"""The prefix index: which cached block holds the KV of which token prefix (host side).

Every *full* block of a sequence gets a chained key,
``key_i = H(key_{i-1}, salt, token ids of block i)`` (``key_{-1}`` empty), so a key names
the whole prefix up to and including its block, under one cache salt: blocks of
different salts (tenants) never match. A request reuses the longest run of cached
blocks that matches its prompt, stopping before the block holding the prompt's last
token, which is always computed so that the first output has logits.

Guarantees, by hash (``HASH_FUNCTIONS``):
- ``"sha256"`` (default) and ``"blake2b"``: 256-bit cryptographic digests; a collision is
  not expected to ever happen.
- ``"python"``: Python's built-in 64-bit tuple hash, fast and not collision-resistant.
Every hit is also checked against the entry's stored token ids, salt and parent key;
without a collision-resistant hash also against its parent *block* (the previous block
of the match, itself checked), so a collision costs a miss, never another sequence's
KV. A custom ``HashFunction`` passed in is treated by its ``collision_resistant`` flag.
With a collision-resistant hash a block whose parent was evicted is found again once the
parent prefix is cached anew (its key is the same); otherwise it is unreachable until
evicted.

``PrefixIndex`` is the host-side map (key -> block, block -> entry) plus the eviction
metadata of the policy it was given (``eviction.py``). It knows nothing of reference
counts: the caller says which cached blocks are unreferenced when it asks for victims.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from paged_jax.cache.eviction import EvictionPolicy, get_eviction_policy
from paged_jax.cache.sentinels import NO_BLOCK


class HashFunction(NamedTuple):
    """``fn(parent_key, salt, tokens) -> key``; keys must be hashable."""

    name: str
    fn: Callable[[Any, str | None, tuple[int, ...]], Any]
    collision_resistant: bool


def _digest(algorithm: str):
    new = getattr(hashlib, algorithm)  # the named constructor: faster than hashlib.new per call

    def fn(parent, salt, tokens):
        h = new(parent or b"")
        salt_bytes = b"" if salt is None else salt.encode()
        h.update(len(salt_bytes).to_bytes(4, "little") + salt_bytes + (b"\x01" if salt is not None else b"\x00"))
        h.update(struct.pack(f"<{len(tokens)}q", *tokens))
        return h.digest()

    return fn


HASH_FUNCTIONS: dict[str, HashFunction] = {
    "sha256": HashFunction("sha256", _digest("sha256"), True),
    "blake2b": HashFunction("blake2b", _digest("blake2b"), True),
    "python": HashFunction("python", lambda parent, salt, tokens: hash((parent, salt, tokens)), False),
}


def get_hash(name: str | HashFunction) -> HashFunction:
    """The hash named ``name`` (or ``name`` itself); ValueError listing the names."""
    if isinstance(name, HashFunction):
        return name
    if name not in HASH_FUNCTIONS:
        raise ValueError(f"prefix_cache_hash={name!r}: unknown; choose one of {sorted(HASH_FUNCTIONS)}")
    return HASH_FUNCTIONS[name]


def block_keys(tokens: Sequence[int], block_size: int, *, salt: str | None = None,
               hash_fn: str | HashFunction = "sha256", parent=None) -> list:
    """The chained key of every full block of ``tokens`` (a partial last block has none);
    ``parent``: the key of the block before ``tokens[0]`` (None: they start a sequence)."""
    fn = get_hash(hash_fn).fn
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = fn(parent, salt, tuple(map(int, tokens[start: start + block_size])))
        keys.append(parent)
    return keys


class Entry(NamedTuple):
    key: Any
    tokens: tuple[int, ...]  # the block's token ids
    salt: str | None
    parent_key: Any  # the previous block's key, None for a first block
    parent: int  # the block that held the previous block when this one was cached, or NO_BLOCK


class PrefixIndex:
    """Cached full blocks by chained key, with their eviction metadata.

    Args:
      num_blocks, block_size: the pool's.
      hash_fn: a name in ``HASH_FUNCTIONS`` or a ``HashFunction``.
      eviction_policy: a name in ``eviction.EVICTION_POLICIES`` or an ``EvictionPolicy``.
    """

    def __init__(self, num_blocks: int, block_size: int, *, hash_fn: str | HashFunction = "sha256",
                 eviction_policy: str | EvictionPolicy = "lru"):
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.hash = get_hash(hash_fn)
        self.policy = get_eviction_policy(eviction_policy)
        self.meta = self.policy.init(self.num_blocks)
        self.by_key: dict[Any, int] = {}
        self.entries: dict[int, Entry] = {}
        self.clock = 0

    def __len__(self) -> int:
        return len(self.entries)

    def cached(self) -> np.ndarray:
        """bool[num_blocks]: blocks the index holds."""
        mask = np.zeros(self.num_blocks, bool)
        mask[list(self.entries)] = True
        return mask

    def _hits(self, tokens: Sequence[int], salt: str | None, limit: int) -> list[int]:
        """Cached blocks along the chain of ``tokens``' first ``limit`` blocks, up to the
        first miss."""
        key, prev, hits = None, NO_BLOCK, []
        bs = self.block_size
        for i in range(limit):
            block_tokens = tuple(map(int, tokens[i * bs: (i + 1) * bs]))
            parent_key, key = key, self.hash.fn(key, salt, block_tokens)
            block = self.by_key.get(key)
            if block is None or not self._same(self.entries[block], block_tokens, salt, parent_key, prev):
                break
            hits.append(block)
            prev = block
        return hits

    def match(self, tokens: Sequence[int], salt: str | None = None, *, touch: bool = True) -> list[int]:
        """Cached blocks holding the longest cached prefix of ``tokens``, at most
        ``(len(tokens) - 1) // block_size`` of them (the last token is always computed).
        ``touch`` records the hit with the eviction policy."""
        limit = max(len(tokens) - 1, 0) // self.block_size
        hit = self._hits(tokens, salt, limit)
        if touch and hit:
            self.touch(hit)
        return hit

    def touch(self, blocks: Sequence[int]) -> None:
        """Record a use of cached ``blocks`` (a hit) with the eviction policy."""
        self.clock += 1
        self.meta = self.policy.touch(self.meta, np.asarray(blocks, np.int64), self.clock)

    def released(self, blocks: Sequence[int]) -> None:
        """The sequences holding these blocks ended: those the index holds were in use
        until now (the eviction policy's ``release``), in the given order: each counts
        as used a tick after the one before it."""
        held = np.asarray([int(b) for b in blocks if int(b) in self.entries], np.int64)
        if held.size:
            now = self.clock + 1 + np.arange(held.size)
            self.clock += held.size
            self.meta = self.policy.release(self.meta, held, now)

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], salt: str | None = None, *,
               start: int = 0) -> list[int]:
        """Record that ``blocks[i]`` holds full block i of ``tokens`` (a sequence's table,
        in order). Where another block already holds the same prefix (another sequence
        computed it too), that block stays the cached one and the chain continues from
        it; a block holding something else, or a key collision, stops the insertion.
        ``start``: blocks before it are known to be recorded already; the chain resumes
        from block ``start - 1``'s entry when the index holds that block (a block shared
        at the same position holds the same prefix), else it is hashed from the start.
        Returns the blocks newly indexed."""
        limit = min(len(tokens) // self.block_size, len(blocks))
        new, parents, prev = [], [], NO_BLOCK
        key, bs, first = None, self.block_size, 0
        if 0 < start <= limit:
            entry = self.entries.get(int(blocks[start - 1]))
            if entry is not None and entry.salt == salt:
                key, prev, first = entry.key, int(blocks[start - 1]), start
        for i in range(first, limit):
            block = int(blocks[i])
            block_tokens = tuple(map(int, tokens[i * bs: (i + 1) * bs]))
            parent_key, key = key, self.hash.fn(key, salt, block_tokens)
            owner = self.by_key.get(key)
            if owner is not None:
                if not self._same(self.entries[owner], block_tokens, salt, parent_key, prev):
                    break  # a collision: the key names another prefix
                prev = owner
                continue
            if block in self.entries:
                break  # the block is cached as another prefix
            self.by_key[key] = block
            self.entries[block] = Entry(key, block_tokens, salt, parent_key, prev)
            new.append(block)
            parents.append(prev)
            prev = block
        if new:
            self.clock += 1
            self.meta = self.policy.insert(self.meta, np.asarray(new), np.asarray(parents), self.clock)
        return new

    def _same(self, entry: Entry, tokens, salt, parent_key, parent: int) -> bool:
        """Whether ``entry`` holds this block of this prefix (see the module docstring)."""
        return (entry.tokens == tokens and entry.salt == salt and entry.parent_key == parent_key
                and (self.hash.collision_resistant or entry.parent == parent))

    def evict(self, unreferenced: np.ndarray, k: int) -> list[int]:
        """Drop up to ``k`` cached blocks, chosen by the eviction policy among those
        ``unreferenced`` (bool[num_blocks]) marks; returns them in eviction order."""
        candidates = self.cached() & np.asarray(unreferenced, bool)
        chosen = [int(b) for b in self.policy.choose(self.meta, candidates, k)]
        for block in chosen:
            del self.by_key[self.entries.pop(block).key]
        if chosen:
            self.meta = self.policy.forget(self.meta, np.asarray(chosen))
        return chosen

    def check(self, stored_tokens: Callable[[int], tuple[int, ...]] | None = None) -> None:
        """Every key names one block whose entry carries that key, and (with
        ``stored_tokens(block)``, what the pool holds) every entry's token ids match the
        stored ones. Raises AssertionError."""
        if len(self.by_key) != len(self.entries):
            raise AssertionError(f"{len(self.by_key)} keys for {len(self.entries)} entries")
        for key, block in self.by_key.items():
            entry = self.entries.get(block)
            if entry is None or entry.key != key:
                raise AssertionError(f"key of block {block} does not name its entry")
            if stored_tokens is not None and tuple(stored_tokens(block)) != entry.tokens:
                raise AssertionError(f"block {block} stores other tokens than its entry says")
