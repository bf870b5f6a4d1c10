"""The block manager: pure, jittable, no model knowledge (seed M1, M2, M4, M6, M9)."""

# State and its sentinels.
# Checks.
from paged_jax.cache.invariants import InvariantError, check_invariants

# Operations: each returns (new state, ...) plus a status array; atomic.
from paged_jax.cache.ops import (
    AppendResult,
    append_slots,
    blocks_needed,
    debug_checks_enabled,
    fork,
    num_free_blocks,
    open_sequences,
    release,
    select_parents,
    set_debug_checks,
    truncate,
)

# Allocation policies: (init, allocate, release) pure functions made by factories.
from paged_jax.cache.policies import (
    POLICIES,
    AllocationPolicy,
    fifo,
    get_policy,
    lifo,
    lowest_id_first,
    random,
)
from paged_jax.cache.state import CacheOpError, CacheState, Status, init_state, raise_for_status

__all__ = [
    "AllocationPolicy", "AppendResult", "CacheOpError", "CacheState", "InvariantError",
    "POLICIES", "Status", "append_slots", "blocks_needed", "check_invariants",
    "debug_checks_enabled", "fifo", "fork", "get_policy", "init_state", "lifo",
    "lowest_id_first", "num_free_blocks", "open_sequences", "raise_for_status", "random",
    "release", "select_parents", "set_debug_checks", "truncate",
]
