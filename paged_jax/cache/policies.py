"""Allocation policies: which free block a request gets, as swappable pure functions.

A policy is a NamedTuple of pure functions made by a factory (the optax pattern). It owns
the representation of the free pool; the ops never look inside it. Contract:

- ``init(num_blocks) -> pool``: every block free.
- ``allocate(pool, want) -> (pool, ids, ok)``: ``want: bool[N]`` asks for one block per
  True entry, in entry order. ``ids: int32[N]`` (``NO_BLOCK`` where not wanted). All or
  nothing: if the pool holds fewer than ``sum(want)`` blocks, ``ok`` is False, ``ids`` is
  meaningless and the returned pool equals the input.
- ``release(pool, ids, mask) -> pool``: return ``ids[mask]`` to the pool in entry order.
  Each id must be distinct and currently allocated (the ops guarantee it).
- ``num_free(pool) -> int32[]``.
- ``free_blocks(pool) -> np.ndarray`` (host only): free ids, in the order upcoming
  allocations would take them where the policy is deterministic, sorted where it is not
  (``deterministic=False``: the reference then follows the ids the device hands out).

Cost of allocate/release is O(N) in the request size for every policy except
``lowest_id_first``, which says so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.cache.sentinels import NO_BLOCK


class AllocationPolicy(NamedTuple):
    name: str
    init: Callable[[int], Any]
    allocate: Callable[[Any, jax.Array], tuple[Any, jax.Array, jax.Array]]
    release: Callable[[Any, jax.Array, jax.Array], Any]
    num_free: Callable[[Any], jax.Array]
    free_blocks: Callable[[Any], np.ndarray]
    deterministic: bool = True  # the reference manager can predict every id it hands out


def _ranks(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Position of each True entry among the True entries, and their count."""
    mask = mask.astype(jnp.int32)
    csum = jnp.cumsum(mask)
    return csum - mask, csum[-1] if mask.shape[0] else jnp.int32(0)


# ---------------------------------------------------------------------------- stack


class StackPool(NamedTuple):
    stack: jax.Array  # int32[num_blocks]; stack[:num_free] are free, top at num_free - 1
    num_free: jax.Array  # int32[]


def _stack_init(num_blocks: int) -> StackPool:
    # Block 0 on top, so a fresh pool hands out blocks in address order.
    return StackPool(jnp.arange(num_blocks - 1, -1, -1, dtype=jnp.int32), jnp.int32(num_blocks))


def _stack_pop(pool: StackPool, want: jax.Array):
    rank, total = _ranks(want)
    ok = total <= pool.num_free
    pos = jnp.clip(pool.num_free - 1 - rank, 0, pool.stack.shape[0] - 1)
    ids = jnp.where(want, pool.stack[pos], NO_BLOCK)
    return pool._replace(num_free=pool.num_free - jnp.where(ok, total, 0)), ids, ok


def _stack_push(pool: StackPool, ids: jax.Array, mask: jax.Array) -> StackPool:
    rank, total = _ranks(mask)
    n = pool.stack.shape[0]
    # Unmasked entries scatter out of bounds and are dropped: O(len(ids)), in place.
    pos = jnp.where(mask, pool.num_free + rank, n)
    return StackPool(pool.stack.at[pos].set(ids, mode="drop"), pool.num_free + total)


def _stack_free_blocks(pool: StackPool) -> np.ndarray:
    stack = np.asarray(pool.stack)
    return stack[: int(pool.num_free)][::-1].copy()


def _num_free(pool) -> jax.Array:
    return pool.num_free


@functools.cache
def lifo() -> AllocationPolicy:
    """Most recently freed block first (a stack): the block reused next is the one most
    recently touched, which is the best bet for locality.

    O(request) per call. The default policy.
    """
    return AllocationPolicy(
        "lifo", _stack_init, _stack_pop, _stack_push, _num_free, _stack_free_blocks
    )


# ---------------------------------------------------------------------------- queue


class QueuePool(NamedTuple):
    queue: jax.Array  # int32[num_blocks]; ring buffer, free ids at [head, head + num_free)
    head: jax.Array  # int32[]; next id to hand out
    num_free: jax.Array  # int32[]


@functools.cache
def fifo() -> AllocationPolicy:
    """Oldest freed block first (a ring-buffer queue): the order of vLLM's free queue.

    O(request) per call.
    """

    def init(num_blocks):
        return QueuePool(jnp.arange(num_blocks, dtype=jnp.int32), jnp.int32(0), jnp.int32(num_blocks))

    def allocate(pool, want):
        rank, total = _ranks(want)
        n = pool.queue.shape[0]
        ok = total <= pool.num_free
        ids = jnp.where(want, pool.queue[(pool.head + rank) % n], NO_BLOCK)
        taken = jnp.where(ok, total, 0)
        return QueuePool(pool.queue, (pool.head + taken) % n, pool.num_free - taken), ids, ok

    def release(pool, ids, mask):
        rank, total = _ranks(mask)
        n = pool.queue.shape[0]
        pos = jnp.where(mask, (pool.head + pool.num_free + rank) % n, n)
        return QueuePool(pool.queue.at[pos].set(ids, mode="drop"), pool.head, pool.num_free + total)

    def free_blocks(pool):
        queue, n = np.asarray(pool.queue), pool.queue.shape[0]
        return queue[(int(pool.head) + np.arange(int(pool.num_free))) % n]

    return AllocationPolicy("fifo", init, allocate, release, _num_free, free_blocks)


# ---------------------------------------------------------------------------- address order


class MaskPool(NamedTuple):
    is_free: jax.Array  # bool[num_blocks]
    num_free: jax.Array  # int32[]


@functools.cache
def lowest_id_first() -> AllocationPolicy:
    """Lowest free block id first (address order, as a bitmap allocator would).

    Costs O(num_blocks) per allocation: finding the lowest free ids scans the whole
    bitmap. It is here as the compact-placement baseline, not for the hot path.
    """

    def init(num_blocks):
        return MaskPool(jnp.ones((num_blocks,), bool), jnp.int32(num_blocks))

    def allocate(pool, want):
        rank, total = _ranks(want)
        n = pool.is_free.shape[0]
        ok = total <= pool.num_free
        lowest = jnp.nonzero(pool.is_free, size=want.shape[0], fill_value=n)[0]
        ids = jnp.where(want, lowest[rank], NO_BLOCK).astype(jnp.int32)
        drop = jnp.where(want & ok, ids, n)
        is_free = pool.is_free.at[drop].set(False, mode="drop")
        return MaskPool(is_free, pool.num_free - jnp.where(ok, total, 0)), ids, ok

    def release(pool, ids, mask):
        n = pool.is_free.shape[0]
        is_free = pool.is_free.at[jnp.where(mask, ids, n)].set(True, mode="drop")
        return MaskPool(is_free, pool.num_free + mask.sum(dtype=jnp.int32))

    def free_blocks(pool):
        return np.flatnonzero(np.asarray(pool.is_free)).astype(np.int32)

    return AllocationPolicy("lowest_id_first", init, allocate, release, _num_free, free_blocks)


# ---------------------------------------------------------------------------- random


class RandomPool(NamedTuple):
    stack: jax.Array  # int32[num_blocks]; stack[:num_free] are free, kept in random order
    num_free: jax.Array  # int32[]
    key: jax.Array  # uint32[2]; raw PRNG key, advanced once per release that frees blocks


@functools.cache
def random(seed: int = 0) -> AllocationPolicy:
    """A random free block (a scattered-placement stress test).

    The free stack is kept shuffled: it starts as a random permutation, and each released
    block swaps places with a uniformly random free block, which moves to the top.
    Allocation pops the top, so it hands out blocks from random places in the pool.
    (Two releases in one call that draw the same place: the second goes on top instead,
    so the order is close to, not exactly, uniform.) O(request log request) per release,
    O(request) per allocation; never O(num_blocks) after init.
    """

    def init(num_blocks):
        key = jax.random.PRNGKey(seed)
        key, sub = jax.random.split(key)
        stack = jax.random.permutation(sub, num_blocks).astype(jnp.int32)
        return RandomPool(stack, jnp.int32(num_blocks), key)

    def allocate(pool, want):
        popped, ids, ok = _stack_pop(StackPool(pool.stack, pool.num_free), want)
        return RandomPool(pool.stack, popped.num_free, pool.key), ids, ok

    def release(pool, ids, mask):
        n, m = pool.stack.shape[0], ids.shape[0]
        rank, total = _ranks(mask)
        key, sub = jax.random.split(pool.key)
        place = jax.random.randint(sub, (m,), 0, jnp.maximum(pool.num_free, 1))
        can = mask & (pool.num_free > 0)
        # Later entries that drew an already-drawn place go on top instead (sort, not m^2).
        keyed = jnp.where(can, place, n)
        order = jnp.argsort(keyed, stable=True)
        ranked = keyed[order]
        repeat = jnp.concatenate([jnp.zeros((1,), bool), ranked[1:] == ranked[:-1]]) & (ranked < n)
        swap = can & ~jnp.zeros((m,), bool).at[order].set(repeat)
        displaced = pool.stack[place]
        top = pool.num_free + rank
        dst = jnp.concatenate([jnp.where(swap, place, jnp.where(mask, top, n)), jnp.where(swap, top, n)])
        stack = pool.stack.at[dst].set(jnp.concatenate([ids, displaced]), mode="drop")
        key = jnp.where(total > 0, key, pool.key)
        return RandomPool(stack, pool.num_free + total, key)

    def free_blocks(pool):
        return np.sort(np.asarray(pool.stack)[: int(pool.num_free)])

    return AllocationPolicy(
        f"random({seed})", init, allocate, release, _num_free, free_blocks, deterministic=False
    )


POLICIES: dict[str, Callable[..., AllocationPolicy]] = {
    "lifo": lifo,
    "fifo": fifo,
    "lowest_id_first": lowest_id_first,
    "random": random,
}


def get_policy(name_or_policy: str | AllocationPolicy) -> AllocationPolicy:
    """A policy by name (``"random"`` uses seed 0), or the policy itself."""
    if isinstance(name_or_policy, AllocationPolicy):
        return name_or_policy
    if name_or_policy not in POLICIES:
        raise ValueError(
            f"allocation_policy={name_or_policy!r}: unknown; choose one of {sorted(POLICIES)}"
        )
    return POLICIES[name_or_policy]()
