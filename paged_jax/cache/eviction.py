"""Eviction policies for cached-but-free blocks (prefix caching), as pure functions.

A block whose reference count reaches 0 may stay *cached*: its KV and its hash entry are
kept so that a later request with the same prefix reuses it. It is reclaimed only when the
pool of never-cached free blocks is empty, and then in the order an eviction policy
chooses. In the style of the allocation policies (``policies.py``): a cached factory
returns an ``EvictionPolicy`` of pure functions over an ``EvictionState`` of fixed-size
NumPy arrays (one entry per block), each returning a new state.

The metadata lives on the host, beside the prefix index: hashes and token ids are host
data, and the scheduler decides evictions while it plans a step, before the device runs
it, so no decision needs a device sync. The device only sees the outcome (blocks that
leave the cache return to its free pool).

- ``insert(state, blocks, parents, now)``: blocks became cached, each the child of
  ``parents[i]`` in the prefix tree (``NO_BLOCK`` for a first block).
- ``touch(state, blocks, now)``: cached blocks were used again (a prefix hit).
- ``release(state, blocks, now)``: the last sequence holding these cached blocks ended
  (they became cached-free): they were in use until ``now`` (an int, or one time per
  block), which counts as recent use (as in vLLM, whose free queue takes a block at the
  tail when its last holder goes), though not as another use.
- ``forget(state, blocks)``: blocks left the cache (evicted); their parents lose a
  child, their children become roots.
- ``choose(state, candidates, k)``: up to ``k`` distinct blocks to evict, in eviction
  order, all among ``candidates`` (bool[N]: cached and unreferenced). Pure: the caller
  then ``forget``s them.

Policies: ``lru`` (least recently used first: a hit or the end of the last sequence
holding it is a use; the default, as in vLLM and SGLang),
``fifo`` (oldest insertion first), ``lfu`` (fewest uses first, then least recent) and
``leaf_first`` (least recently used among blocks no other cached block descends from:
a block goes only after its descendants, so a shared system prompt outlives the
conversations built on it). Ties go to the lower block id, so every policy is
deterministic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from paged_jax.cache.sentinels import NO_BLOCK


class EvictionState(NamedTuple):
    """Per-block metadata; entries of blocks that are not cached are meaningless."""

    inserted: np.ndarray  # int64[N]: the time the block became cached
    last_used: np.ndarray  # int64[N]: the time it was last inserted or hit
    uses: np.ndarray  # int64[N]: 1 + its hits since it became cached
    parent: np.ndarray  # int32[N]: its parent block in the prefix tree, or NO_BLOCK
    children: np.ndarray  # int32[N]: cached blocks whose parent it is


class EvictionPolicy(NamedTuple):
    name: str
    init: Callable[[int], EvictionState]
    insert: Callable[[EvictionState, np.ndarray, np.ndarray, int], EvictionState]
    touch: Callable[[EvictionState, np.ndarray, int], EvictionState]
    release: Callable[[EvictionState, np.ndarray, int], EvictionState]
    forget: Callable[[EvictionState, np.ndarray], EvictionState]
    choose: Callable[[EvictionState, np.ndarray, int], np.ndarray]


def _init(num_blocks: int) -> EvictionState:
    zeros = np.zeros(num_blocks, np.int64)
    return EvictionState(zeros, zeros.copy(), zeros.copy(), np.full(num_blocks, NO_BLOCK, np.int32),
                         np.zeros(num_blocks, np.int32))


def _blocks(blocks) -> np.ndarray:
    return np.asarray(blocks, np.int64).reshape(-1)


def _insert(state: EvictionState, blocks, parents, now: int) -> EvictionState:
    blocks, parents = _blocks(blocks), _blocks(parents)
    if blocks.shape != parents.shape:
        raise ValueError(f"insert: {blocks.size} blocks but {parents.size} parents")
    inserted, last_used, uses = state.inserted.copy(), state.last_used.copy(), state.uses.copy()
    parent, children = state.parent.copy(), state.children.copy()
    inserted[blocks], last_used[blocks], uses[blocks], parent[blocks] = now, now, 1, parents
    np.add.at(children, parents[parents != NO_BLOCK], 1)
    return EvictionState(inserted, last_used, uses, parent, children)


def _touch(state: EvictionState, blocks, now: int) -> EvictionState:
    blocks = _blocks(blocks)
    last_used, uses = state.last_used.copy(), state.uses.copy()
    last_used[blocks] = now
    np.add.at(uses, blocks, 1)
    return state._replace(last_used=last_used, uses=uses)


def _release(state: EvictionState, blocks, now: int) -> EvictionState:
    last_used = state.last_used.copy()
    last_used[_blocks(blocks)] = now
    return state._replace(last_used=last_used)


def _forget(state: EvictionState, blocks) -> EvictionState:
    """Their parents lose a child; their children become roots (a block id may be reused,
    so no pointer to a forgotten block survives)."""
    blocks = _blocks(blocks)
    parent, children = state.parent.copy(), state.children.copy()
    gone = parent[blocks]
    np.subtract.at(children, gone[gone != NO_BLOCK], 1)
    parent[blocks] = NO_BLOCK
    parent[np.isin(parent, blocks)] = NO_BLOCK
    children[blocks] = 0
    return state._replace(parent=parent, children=children)


def _order_by(key: Callable[[EvictionState], tuple[np.ndarray, ...]]):
    """``choose`` that takes the first ``k`` candidates by ``key`` (primary key last, as
    for ``np.lexsort``; the block id breaks the remaining ties)."""

    def choose(state: EvictionState, candidates, k: int) -> np.ndarray:
        ids = np.flatnonzero(np.asarray(candidates, bool))
        order = np.lexsort((ids, *(a[ids] for a in key(state))))
        return ids[order[: max(int(k), 0)]].astype(np.int32)

    return choose


def _choose_leaves(state: EvictionState, candidates, k: int) -> np.ndarray:
    """Least recently used leaf first; evicting a leaf may make its parent a leaf, which
    then competes by its own last use."""
    candidates = np.asarray(candidates, bool).copy()
    children, chosen = state.children.copy(), []
    for _ in range(max(int(k), 0)):
        leaves = np.flatnonzero(candidates & (children == 0))
        if not leaves.size:
            break
        block = leaves[np.lexsort((leaves, state.last_used[leaves]))[0]]
        chosen.append(block)
        candidates[block] = False
        if state.parent[block] != NO_BLOCK:
            children[state.parent[block]] -= 1
    return np.asarray(chosen, np.int32)


def _policy(name: str, choose) -> EvictionPolicy:
    return EvictionPolicy(name, _init, _insert, _touch, _release, _forget, choose)


@functools.cache
def lru() -> EvictionPolicy:
    """Least recently used first (a hit or an insertion is a use). The default."""
    return _policy("lru", _order_by(lambda s: (s.last_used,)))


@functools.cache
def fifo() -> EvictionPolicy:
    """Oldest insertion first, however often the block was hit since."""
    return _policy("fifo", _order_by(lambda s: (s.inserted,)))


@functools.cache
def lfu() -> EvictionPolicy:
    """Fewest uses first; among equals, least recently used."""
    return _policy("lfu", _order_by(lambda s: (s.last_used, s.uses)))


@functools.cache
def leaf_first() -> EvictionPolicy:
    """Least recently used among the prefix tree's leaves: a block only after every
    cached block that descends from it."""
    return _policy("leaf_first", _choose_leaves)


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": lru, "fifo": fifo, "lfu": lfu, "leaf_first": leaf_first,
}


def register_eviction_policy(name: str, factory: Callable[[], EvictionPolicy]) -> None:
    """Make ``factory()`` available as ``eviction_policy=name`` (``docs/EXTENDING.md``)."""
    EVICTION_POLICIES[name] = factory


def get_eviction_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """The policy named ``policy`` (or ``policy`` itself); ValueError listing the names."""
    if isinstance(policy, EvictionPolicy):
        return policy
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"eviction_policy={policy!r}: unknown; choose one of {sorted(EVICTION_POLICIES)}")
    return EVICTION_POLICIES[policy]()
