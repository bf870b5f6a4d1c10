"""The block manager: pure, jittable, no model knowledge.

Block tables map each sequence's logical blocks to physical ones; reference counts let
forked sequences share blocks (copy-on-write on append); an allocation policy owns the
free pool. Every op is a pure function returning a new state and a status array.
"""

# Prefix caching (host side): eviction policies and the index of cached blocks.
from paged_jax.cache.eviction import (
    EVICTION_POLICIES,
    EvictionPolicy,
    EvictionState,
    get_eviction_policy,
    register_eviction_policy,
)

# The host model (the scheduler's view and the test oracle), and the invariant checks.
from paged_jax.cache.host import HostBlockManager, PlanningError
from paged_jax.cache.invariants import InvariantError, check_invariants

# Operations: each returns (new state, ...) plus a status array; atomic.
from paged_jax.cache.ops import (
    AppendResult,
    UnshareResult,
    append_slots,
    blocks_needed,
    evict_cached,
    fork,
    mark_cached,
    num_cached_free,
    num_free_blocks,
    open_sequences,
    release,
    restore_rows,
    select_parents,
    truncate,
    unshare,
)

# Allocation policies: (init, allocate, release) pure functions made by factories.
from paged_jax.cache.policies import (
    POLICIES,
    AllocationPolicy,
    HostPool,
    fifo,
    get_policy,
    lifo,
    lowest_id_first,
    random,
    register_policy,
)

# The prefix index: chained block keys, salts, collision checks.
from paged_jax.cache.prefix import HASH_FUNCTIONS, HashFunction, PrefixIndex, block_keys, get_hash

# Sentinels, state, status codes and the debug switch.
from paged_jax.cache.sentinels import NO_BLOCK, NO_SEQ, NO_SLOT
from paged_jax.cache.state import (
    CacheOpError,
    CacheState,
    Status,
    init_state,
    raise_for_status,
    set_debug_checks,
    with_debug_checks,
)

__all__ = [
    "EVICTION_POLICIES", "EvictionPolicy", "EvictionState", "HASH_FUNCTIONS", "HashFunction", "PrefixIndex",
    "block_keys", "get_eviction_policy", "get_hash", "register_eviction_policy", "register_policy",
    "NO_BLOCK", "NO_SEQ", "NO_SLOT",
    "AllocationPolicy", "AppendResult", "CacheOpError", "CacheState", "HostBlockManager", "HostPool",
    "InvariantError", "POLICIES", "PlanningError", "Status", "append_slots", "blocks_needed", "check_invariants",
    "evict_cached", "mark_cached", "num_cached_free",
    "fifo", "fork", "get_policy", "init_state", "lifo",
    "lowest_id_first", "num_free_blocks", "open_sequences", "raise_for_status", "random",
    "release", "restore_rows", "select_parents", "set_debug_checks", "truncate",
    "unshare", "UnshareResult", "with_debug_checks",
]
