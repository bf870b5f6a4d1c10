"""The whole block-manager state as one frozen pytree of fixed-size arrays.

Every physical block is exactly one of: free (ref count 0, in the policy's pool),
referenced (named by table entries), or cached-free (prefix caching: kept for reuse, named
by no table). A cached block holds one reference of its own, so its count never reaches
0 while it is cached and it stays out of the pool until it is evicted.
"""

from __future__ import annotations

import enum
import os
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from paged_jax.cache import sentinels
from paged_jax.cache.policies import AllocationPolicy, get_policy
from paged_jax.config import CacheConfig


@struct.dataclass
class CacheState:
    """Block tables, lengths, ref counts and the free pool.

    ``pool`` is owned by the allocation policy (see ``policies.py``); nothing outside the
    policy looks inside it.

    The static fields are part of the treedef, not traced: a state that differs in any
    of them is a different type to ``jax.jit``, which therefore retraces exactly when one
    changes. ``debug`` is one of them because it changes what the ops trace (a host
    callback running ``check_invariants`` after each op).
    """

    block_tables: jax.Array  # int32[max_seqs, max_blocks_per_seq]; NO_BLOCK past the end
    seq_lens: jax.Array  # int32[max_seqs]; tokens held; 0 for inactive rows
    active: jax.Array  # bool[max_seqs]; row is a live sequence
    ref_counts: jax.Array  # int32[num_blocks]; table entries naming each block, +1 if cached
    cached: jax.Array  # bool[num_blocks]; held by the prefix cache (immutable, reusable)
    pool: Any  # policy-defined pytree of fixed-size arrays holding the free blocks
    # Static (part of the treedef, not traced): changing one means a new state type.
    block_size: int = struct.field(pytree_node=False, default=16)
    policy: AllocationPolicy = struct.field(pytree_node=False, default=None)
    debug: bool = struct.field(pytree_node=False, default=False)  # check invariants after each op

    NO_BLOCK: ClassVar[int] = sentinels.NO_BLOCK
    NO_SEQ: ClassVar[int] = sentinels.NO_SEQ
    NO_SLOT: ClassVar[int] = sentinels.NO_SLOT

    @property
    def num_blocks(self) -> int:
        return self.ref_counts.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]


# --------------------------------------------------------------------------- debug switch


def _env_flag(value: str | None) -> bool:
    """Whether an environment variable's value turns a switch on (unset, "" and "0" do not)."""
    return value not in (None, "", "0")


_DEBUG_DEFAULT = _env_flag(os.environ.get("PAGED_JAX_CHECK_INVARIANTS"))


def set_debug_checks(enabled: bool) -> bool:
    """Set the process default for ``init_state(..., debug=None)``; returns the previous one.

    Only states made afterwards are affected: an existing state keeps its own ``debug``
    field, so what a jitted function already traced for it never changes behind its
    back (use ``with_debug_checks`` to switch a given state). The initial default is
    on when the environment variable ``PAGED_JAX_CHECK_INVARIANTS`` is set to anything
    but "" or "0".
    """
    global _DEBUG_DEFAULT
    previous, _DEBUG_DEFAULT = _DEBUG_DEFAULT, bool(enabled)
    return previous


def with_debug_checks(state: CacheState, enabled: bool) -> CacheState:
    """``state`` with invariant checks after every op on (or off).

    With ``debug`` on, eager op calls run ``check_invariants`` on the spot; calls traced
    under jit check through ``jax.debug.callback``, which syncs with the device: a
    debugging aid, never for measurement. The arrays are shared, not copied.
    """
    return state.replace(debug=bool(enabled))


def init_state(
    config: CacheConfig, policy: AllocationPolicy | str = "lifo", *, debug: bool | None = None
) -> CacheState:
    """A state with no live sequence and every block free in ``policy``'s pool.

    debug: check invariants after every op on this state and the states derived from
      it (see ``with_debug_checks``); None takes the process default
      (``set_debug_checks``).
    """
    policy = get_policy(policy)
    return CacheState(
        block_tables=jnp.full(
            (config.max_seqs, config.max_blocks_per_seq), sentinels.NO_BLOCK, jnp.int32
        ),
        seq_lens=jnp.zeros((config.max_seqs,), jnp.int32),
        active=jnp.zeros((config.max_seqs,), bool),
        ref_counts=jnp.zeros((config.num_blocks,), jnp.int32),
        cached=jnp.zeros((config.num_blocks,), bool),
        pool=policy.init(config.num_blocks),
        block_size=config.block_size,
        policy=policy,
        debug=_DEBUG_DEFAULT if debug is None else bool(debug),
    )


class Status(enum.IntEnum):
    """Per-sequence result of an operation. A call applies only if every entry is OK."""

    OK = 0
    NO_FREE_BLOCKS = 1  # the pool cannot supply every block the call needs
    INVALID_SEQ_ID = 2  # id outside [0, max_seqs) (and not the NO_SEQ padding id)
    INACTIVE_SEQ = 3  # the op needs a live sequence and this row is not one
    ACTIVE_SEQ = 4  # the op needs a free row (open, fork child, restore) and this row is live
    TABLE_FULL = 5  # the row would need more than max_blocks_per_seq blocks
    DUPLICATE_SEQ = 6  # the same row appears twice where each must be unique
    BAD_NUM_TOKENS = 7  # negative, above the call's static maximum, or a bad new length
    BAD_TABLE = 8  # restore_rows: a malformed local block table; open_sequences: a bad prefix
    BAD_BLOCK = 9  # mark_cached / evict_cached: a block id out of range, repeated, or in the wrong state
    INVALID_TOKEN = 64  # set by the model steps (paged_jax.steps): a token id outside the vocabulary


class CacheOpError(RuntimeError):
    """Raised on the host by ``raise_for_status`` when an op was rejected."""


def raise_for_status(op: str, seq_ids, status) -> None:
    """Host-side check of an op's status array; raises naming every failing sequence."""
    import numpy as np

    status = np.asarray(status)
    bad = np.flatnonzero(status != Status.OK)
    if bad.size:
        seq_ids = np.asarray(seq_ids)
        parts = [f"seq {int(seq_ids[i])}: {Status(int(status[i])).name}" for i in bad[:8]]
        more = f" (+{bad.size - 8} more)" if bad.size > 8 else ""
        raise CacheOpError(f"{op} rejected, state unchanged: " + "; ".join(parts) + more)
