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
  allocations would take them (sorted where that order is not a list: ``random``).
- **Batched = sequential**: ``allocate`` of a batch hands out what successive one-block
  allocations would, in entry order; ``release`` of a batch leaves the pool as successive
  one-block releases in entry order would. (The ops rely on it: their batches are
  "as if the entries ran one after another".)
- ``host(num_blocks)`` / ``host_from(pool)``: the policy's **host counterpart**, a NumPy
  ``HostPool`` (``take()`` one block, ``give(block)`` one back, ``ordered()``,
  ``copy()``) that hands out exactly the ids the device would. The host model of the block
  manager (``host.py``: the scheduler's view and the test oracle) runs on it, so nothing on
  the host branches on a policy's name. A policy without one gets ``DeviceOnHost``: its own
  pure functions run one block at a time on the host CPU (exact, by the rule above; slow).

Cost of allocate/release is O(N) in the request size for every policy except
``lowest_id_first``, which says so.
"""

from __future__ import annotations

import functools
import heapq
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
    host_from: Callable[[Any], HostPool] | None = None  # device pool (host arrays) -> its HostPool

    def host(self, num_blocks: int) -> HostPool:
        """The host counterpart of ``init(num_blocks)``: a ``HostPool`` with every block free."""
        return self.host_pool(jax.device_get(self.init(num_blocks)))

    def host_pool(self, pool) -> HostPool:
        """The host counterpart of the device pool ``pool`` (its arrays fetched)."""
        if self.host_from is None:
            return DeviceOnHost(self, pool)
        return self.host_from(jax.device_get(pool))


# ---------------------------------------------------------------------------- host counterparts


class HostPool:
    """A policy's free pool on the host (NumPy): the same ids, in the same order, as the
    device's. ``take`` one block (the caller checks ``num_free`` first), ``give`` one back."""

    num_free: int

    def take(self) -> int:
        raise NotImplementedError

    def give(self, block: int) -> None:
        raise NotImplementedError

    def ordered(self) -> np.ndarray:
        """int32[num_free]: free ids in the order the next takes hand them out (sorted
        where that order is decided by draws: ``random``)."""
        raise NotImplementedError

    def copy(self) -> HostPool:
        raise NotImplementedError


class HostStack(HostPool):
    """``lifo``'s pool: ``stack[:num_free]``, top at ``num_free - 1``."""

    def __init__(self, stack: np.ndarray, num_free: int):
        self.stack, self.num_free = np.array(stack, np.int32), int(num_free)

    def take(self) -> int:
        self.num_free -= 1
        return int(self.stack[self.num_free])

    def give(self, block: int) -> None:
        self.stack[self.num_free] = block
        self.num_free += 1

    def ordered(self) -> np.ndarray:
        return self.stack[: self.num_free][::-1].copy()

    def copy(self) -> HostStack:
        return HostStack(self.stack, self.num_free)


class HostQueue(HostPool):
    """``fifo``'s pool: a ring buffer, free ids at ``[head, head + num_free)``."""

    def __init__(self, queue: np.ndarray, head: int, num_free: int):
        self.queue, self.head, self.num_free = np.array(queue, np.int32), int(head), int(num_free)

    def take(self) -> int:
        block = int(self.queue[self.head])
        self.head = (self.head + 1) % self.queue.shape[0]
        self.num_free -= 1
        return block

    def give(self, block: int) -> None:
        self.queue[(self.head + self.num_free) % self.queue.shape[0]] = block
        self.num_free += 1

    def ordered(self) -> np.ndarray:
        return self.queue[(self.head + np.arange(self.num_free)) % self.queue.shape[0]]

    def copy(self) -> HostQueue:
        return HostQueue(self.queue, self.head, self.num_free)


class HostLowest(HostPool):
    """``lowest_id_first``'s pool: a min-heap of the free ids."""

    def __init__(self, free):
        self.heap = sorted(int(b) for b in free)  # a sorted list is a valid heap

    @property
    def num_free(self) -> int:
        return len(self.heap)

    def take(self) -> int:
        return heapq.heappop(self.heap)

    def give(self, block: int) -> None:
        heapq.heappush(self.heap, int(block))

    def ordered(self) -> np.ndarray:
        return np.array(sorted(self.heap), np.int32)

    def copy(self) -> HostLowest:
        new = HostLowest(())
        new.heap = list(self.heap)
        return new


class DeviceOnHost(HostPool):
    """A policy without a NumPy counterpart: its own pure functions, one block at a time,
    on the host CPU (exact because batched = sequential; a jitted call per block)."""

    def __init__(self, policy: AllocationPolicy, pool):
        self.policy, self.pool = policy, pool

    @property
    def num_free(self) -> int:
        return int(self.policy.num_free(self.pool))

    def take(self) -> int:
        pool, ids, ok = _host_allocate(self.policy)(self.pool)
        assert bool(ok), "take() from an empty pool"
        self.pool = pool
        return int(ids[0])

    def give(self, block: int) -> None:
        self.pool = _host_release(self.policy)(self.pool, np.int32(block))

    def ordered(self) -> np.ndarray:
        return np.asarray(self.policy.free_blocks(self.pool), np.int32)

    def copy(self) -> DeviceOnHost:
        return DeviceOnHost(self.policy, self.pool)


def _on_cpu(fn):
    """``fn`` jitted and run on the host CPU (whatever the default device), results fetched."""
    jitted = jax.jit(fn)
    cpu = jax.devices("cpu")[0]

    def run(*args):
        with jax.default_device(cpu):
            return jax.device_get(jitted(*jax.device_put(args, cpu)))

    return run


@functools.cache
def _host_allocate(policy: AllocationPolicy):
    return _on_cpu(lambda pool: policy.allocate(pool, jnp.ones((1,), bool)))


@functools.cache
def _host_release(policy: AllocationPolicy):
    return _on_cpu(lambda pool, block: policy.release(pool, block[None], jnp.ones((1,), bool)))


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
        "lifo", _stack_init, _stack_pop, _stack_push, _num_free, _stack_free_blocks,
        host_from=lambda pool: HostStack(pool.stack, pool.num_free),
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

    return AllocationPolicy("fifo", init, allocate, release, _num_free, free_blocks,
                            host_from=lambda pool: HostQueue(pool.queue, pool.head, pool.num_free))


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

    return AllocationPolicy("lowest_id_first", init, allocate, release, _num_free, free_blocks,
                            host_from=lambda pool: HostLowest(np.flatnonzero(np.asarray(pool.is_free))))


# ---------------------------------------------------------------------------- random


def _mix(x, xp):
    """murmur3's 32-bit finaliser, elementwise over uint32 (NumPy or jax.numpy, same bits)."""
    x = x ^ (x >> xp.uint32(16))
    x = x * xp.uint32(0x85EBCA6B)
    x = x ^ (x >> xp.uint32(13))
    x = x * xp.uint32(0xC2B2AE35)
    return x ^ (x >> xp.uint32(16))


def _draw(seed: int, counter, xp):
    """uint32 draw number ``counter`` of a seeded stream (a counter-based hash: the host and
    the device compute the same bits)."""
    golden = xp.uint32(0x9E3779B9)
    return _mix(_mix(xp.asarray(counter, xp.uint32) * golden, xp) ^ xp.uint32(seed % 2**32), xp)


class RandomPool(NamedTuple):
    stack: jax.Array  # int32[num_blocks]; stack[:num_free] are free, kept in random order
    num_free: jax.Array  # int32[]
    releases: jax.Array  # uint32[]; blocks released so far: the next release's draw number


class HostRandom(HostPool):
    """``random(seed)``'s pool on the host: the same stack, draws and swaps."""

    def __init__(self, stack: np.ndarray, num_free: int, releases: int, seed: int):
        self.stack, self.num_free = np.array(stack, np.int32), int(num_free)
        self.releases, self.seed = int(releases), seed

    def take(self) -> int:
        self.num_free -= 1
        return int(self.stack[self.num_free])

    def give(self, block: int) -> None:
        place = int(_draw(self.seed, np.array([self.releases], np.uint32), np)[0]) % (self.num_free + 1)
        self.stack[self.num_free] = self.stack[place]
        self.stack[place] = block
        self.num_free += 1
        self.releases = (self.releases + 1) % 2**32

    def ordered(self) -> np.ndarray:
        return np.sort(self.stack[: self.num_free])

    def copy(self) -> HostRandom:
        return HostRandom(self.stack, self.num_free, self.releases, self.seed)


@functools.cache
def random(seed: int = 0) -> AllocationPolicy:
    """A random free block (a scattered-placement stress test).

    The free stack is kept shuffled: it starts as a random permutation, and each released
    block swaps places with a uniformly drawn position of the stack (its top included),
    whose block moves to the top. Allocation pops the top, so it hands out blocks from
    random places in the pool. The draws are a counter-based hash of (seed, blocks released
    so far), so releases are sequential by construction and the host counterpart
    (``HostRandom``) predicts every id. O(request) per allocation; a release loops over the
    blocks it frees (a while loop, no O(num_blocks) work after init).
    """

    def init(num_blocks):
        keys = _draw(seed, jnp.arange(num_blocks, dtype=jnp.uint32), jnp)
        stack = jnp.argsort(keys, stable=True).astype(jnp.int32)
        return RandomPool(stack, jnp.int32(num_blocks), jnp.uint32(num_blocks))

    def allocate(pool, want):
        popped, ids, ok = _stack_pop(StackPool(pool.stack, pool.num_free), want)
        return RandomPool(pool.stack, popped.num_free, pool.releases), ids, ok

    def release(pool, ids, mask):
        rank, total = _ranks(mask)
        m = ids.shape[0]
        # The released ids in entry order, compacted to the front.
        order = jnp.where(mask, rank, m)
        queue = jnp.zeros((m,), jnp.int32).at[order].set(ids, mode="drop")

        def push(carry):
            i, stack, num_free, releases = carry
            place = (_draw(seed, releases, jnp) % (num_free + 1).astype(jnp.uint32)).astype(jnp.int32)
            stack = stack.at[num_free].set(stack[place])
            stack = stack.at[place].set(queue[i])
            return i + 1, stack, num_free + 1, releases + jnp.uint32(1)

        _, stack, num_free, releases = jax.lax.while_loop(
            lambda c: c[0] < total, push, (jnp.int32(0), pool.stack, pool.num_free, pool.releases))
        return RandomPool(stack, num_free, releases)

    def free_blocks(pool):
        return np.sort(np.asarray(pool.stack)[: int(pool.num_free)])

    return AllocationPolicy(
        f"random({seed})", init, allocate, release, _num_free, free_blocks,
        host_from=lambda pool: HostRandom(pool.stack, pool.num_free, pool.releases, seed),
    )


POLICIES: dict[str, Callable[..., AllocationPolicy]] = {
    "lifo": lifo,
    "fifo": fifo,
    "lowest_id_first": lowest_id_first,
    "random": random,
}


def register_policy(name: str, factory: Callable[[], AllocationPolicy]) -> None:
    """Make ``factory()`` available as ``allocation_policy=name`` (``docs/EXTENDING.md``);
    the policy contract suite and the block-manager machine then run it."""
    POLICIES[name] = factory


def get_policy(name_or_policy: str | AllocationPolicy) -> AllocationPolicy:
    """A policy by name (``"random"`` uses seed 0), or the policy itself."""
    if isinstance(name_or_policy, AllocationPolicy):
        return name_or_policy
    if name_or_policy not in POLICIES:
        raise ValueError(
            f"allocation_policy={name_or_policy!r}: unknown; choose one of {sorted(POLICIES)}"
        )
    return POLICIES[name_or_policy]()
