"""Pure, jittable block-manager operations over a batch of sequences.

Every op takes a ``CacheState`` and a batch of sequence ids (``NO_SEQ`` entries are
padding and ignored) and returns the new state plus an ``int32[batch]`` status
(``Status``). A call is atomic: it applies only if every status is ``OK``; otherwise the
returned state is the input state, bit for bit. Nothing raises under jit; check the status
on the host (``raise_for_status``).

Cost per call is O(batch x max_blocks_per_seq) (plus O(batch^2) small comparisons and
O(max_seqs) for duplicate detection), never O(num_blocks): every pool-sized array is only
gathered from or scattered into at the touched entries, so with the state donated XLA
updates it in place. Scatters that must not happen are sent out of bounds and dropped
rather than selected with ``jnp.where`` over the whole array.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp

from paged_jax.cache.state import CacheState, Status

NO_BLOCK = CacheState.NO_BLOCK
NO_SEQ = CacheState.NO_SEQ
NO_SLOT = CacheState.NO_SLOT

# --------------------------------------------------------------------------- debug switch

_DEBUG = os.environ.get("PAGED_JAX_CHECK_INVARIANTS", "") not in ("", "0")


def set_debug_checks(enabled: bool) -> bool:
    """Run ``check_invariants`` after every op (seed M9). Returns the previous setting.

    Eager calls check on the spot; calls traced under jit check through a host callback,
    which syncs the device: a debugging aid, never for measurement.
    """
    global _DEBUG
    previous, _DEBUG = _DEBUG, bool(enabled)
    return previous


def debug_checks_enabled() -> bool:
    return _DEBUG


def _checked(op):
    @functools.wraps(op)
    def wrapper(state, *args, **kwargs):
        out = op(state, *args, **kwargs)
        if _DEBUG:
            from paged_jax.cache.invariants import check_invariants

            new_state = out[0] if isinstance(out, tuple) else out
            leaves = jax.tree.leaves(new_state)
            if any(isinstance(x, jax.core.Tracer) for x in leaves):
                treedef = jax.tree.structure(new_state)
                jax.debug.callback(
                    lambda *xs: check_invariants(jax.tree.unflatten(treedef, xs), op=op.__name__),
                    *leaves,
                )
            else:
                check_invariants(new_state, op=op.__name__)
        return out

    return wrapper


# --------------------------------------------------------------------------- helpers


def _validate_ids(
    state: CacheState, seq_ids: jax.Array, *, want_active: bool | None, unique: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (status int32[B], is_real bool[B], safe_ids int32[B] clipped for gathers)."""
    max_seqs = state.max_seqs
    pad = seq_ids == NO_SEQ
    in_range = (seq_ids >= 0) & (seq_ids < max_seqs)
    safe = jnp.where(in_range, seq_ids, 0)
    status = jnp.where(pad | in_range, Status.OK, Status.INVALID_SEQ_ID).astype(jnp.int32)
    live = state.active[safe]
    if want_active is True:
        status = jnp.where(in_range & ~live, Status.INACTIVE_SEQ, status)
    elif want_active is False:
        status = jnp.where(in_range & live, Status.ACTIVE_SEQ, status)
    if unique:
        hits = jnp.zeros((max_seqs,), jnp.int32).at[jnp.where(in_range, seq_ids, max_seqs)].add(
            1, mode="drop"
        )
        status = jnp.where(in_range & (hits[safe] > 1) & (status == Status.OK), Status.DUPLICATE_SEQ, status)
    return status, in_range, safe


def _first(status: jax.Array, code: Status, cond: jax.Array) -> jax.Array:
    """Set ``code`` where ``cond`` holds and no earlier error was recorded."""
    return jnp.where(cond & (status == Status.OK), jnp.int32(code), status)


def _rows_or_drop(state: CacheState, safe: jax.Array, mask: jax.Array) -> jax.Array:
    """Row index for table/length scatters: out of bounds (dropped) where not ``mask``."""
    return jnp.where(mask, safe, state.max_seqs)


def _blocks_or_drop(state: CacheState, blocks: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.where(mask & (blocks != NO_BLOCK), blocks, state.num_blocks)


def _change_counts(
    state: CacheState, inc_blocks: jax.Array, inc: jax.Array, dec_blocks: jax.Array, dec: jax.Array
) -> tuple[jax.Array, object]:
    """Add one reference per ``inc`` entry and drop one per ``dec`` entry; blocks whose
    count reaches 0 return to the pool.

    inc_blocks: int32[Mi], dec_blocks: int32[Md] block ids (NO_BLOCK allowed), with bool
    masks of the same shapes. As if the increments were applied first and the decrements
    one after another: a block shared by several dropped rows returns to the pool once,
    when its last reference goes, so freed blocks enter the pool in the order of their
    last decrement entry.

    The entries (not the pool) are sorted by block so each block's net change is one
    segment sum, and ``ref_counts`` is written by a single scatter: no read-back between
    scatters, which would make XLA copy the pool-sized array. O((Mi + Md) log(Mi + Md)).
    """
    n, m_inc, m_dec = state.num_blocks, inc_blocks.shape[0], dec_blocks.shape[0]
    blocks = jnp.concatenate([_blocks_or_drop(state, inc_blocks, inc), _blocks_or_drop(state, dec_blocks, dec)])
    delta = jnp.concatenate([jnp.ones((m_inc,), jnp.int32), -jnp.ones((m_dec,), jnp.int32)])
    order = jnp.argsort(blocks, stable=True)  # within a block: increments, then decrements in entry order
    b, d = blocks[order], delta[order]
    m = b.shape[0]
    idx = jnp.arange(m, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((1,), bool), b[1:] != b[:-1]])
    ends = jnp.concatenate([b[1:] != b[:-1], jnp.ones((1,), bool)])
    first = jax.lax.cummax(jnp.where(starts, idx, 0))
    csum = jnp.cumsum(d)
    net = csum - csum[first] + d[first]  # segment sum, valid at each segment's end
    new_count = state.ref_counts[jnp.clip(b, 0, n - 1)] + net
    write = ends & (b < n)
    ref_counts = state.ref_counts.at[jnp.where(write, b, n)].set(new_count, mode="drop")
    # A count can only reach 0 through a decrement, so that segment ends on one.
    freed_at = jnp.where(write & (new_count == 0), order - m_inc, m_dec)
    freed = jnp.zeros((m_dec,), bool).at[freed_at].set(True, mode="drop")
    pool = state.policy.release(state.pool, dec_blocks, freed)
    return ref_counts, pool


# --------------------------------------------------------------------------- queries


def num_free_blocks(state: CacheState) -> jax.Array:
    """int32[]: blocks the pool can hand out now."""
    return state.policy.num_free(state.pool)


class _AppendPlan(NamedTuple):
    safe: jax.Array  # int32[B] row ids, clipped
    old_len: jax.Array  # int32[B]
    old_blocks: jax.Array  # int32[B] blocks held now
    new_blocks: jax.Array  # int32[B] blocks held after the append
    last_block: jax.Array  # int32[B] block the first new token lands in if partly filled, else NO_BLOCK
    cow: jax.Array  # bool[B] that block is shared: write into a private copy


def _plan_append(state: CacheState, seq_ids: jax.Array, num_tokens: jax.Array, real: jax.Array) -> _AppendPlan:
    bs = state.block_size
    safe = jnp.where(real, seq_ids, 0)
    old_len = jnp.where(real, state.seq_lens[safe], 0)
    n = jnp.where(real, jnp.maximum(num_tokens, 0), 0)
    old_blocks = (old_len + bs - 1) // bs
    new_blocks = (old_len + n + bs - 1) // bs
    partial = real & (old_len % bs != 0) & (n > 0)
    col = jnp.clip(old_len // bs, 0, state.max_blocks_per_seq - 1)
    last_block = jnp.where(partial, state.block_tables[safe, col], NO_BLOCK)
    count = state.ref_counts[jnp.clip(last_block, 0, state.num_blocks - 1)]
    shared = partial & (count > 1)
    # Several rows of this batch may share one partly filled block (forked beams). As if
    # they appended one after another: all copy except the last, which keeps the block
    # when no row outside the batch still holds it. O(B^2) compares, B is small.
    same = shared[:, None] & shared[None, :] & (last_block[:, None] == last_block[None, :])
    members = same.sum(axis=1)
    later = jnp.triu(same, k=1).any(axis=1)
    keeps = shared & ~later & (count == members)
    return _AppendPlan(safe, old_len, old_blocks, new_blocks, last_block, shared & ~keeps)


def blocks_needed(state: CacheState, seq_ids: jax.Array, num_tokens: jax.Array) -> jax.Array:
    """int32[B]: blocks ``append_slots`` would take for these appends (new + copy-on-write).

    Assumes the batch is appended together in one call, as ``append_slots`` would.
    """
    real = (seq_ids >= 0) & (seq_ids < state.max_seqs)
    plan = _plan_append(state, seq_ids, num_tokens, real)
    return (plan.new_blocks - plan.old_blocks + plan.cow).astype(jnp.int32)


# --------------------------------------------------------------------------- ops


@_checked
def open_sequences(state: CacheState, seq_ids: jax.Array) -> tuple[CacheState, jax.Array]:
    """Make free rows live, empty sequences (length 0, no block yet).

    seq_ids: int32[B] rows that must be inactive and distinct. Returns (state, status).
    """
    status, real, safe = _validate_ids(state, seq_ids, want_active=False, unique=True)
    apply = jnp.all(status == Status.OK)
    rows = _rows_or_drop(state, safe, real & apply)
    return state.replace(
        active=state.active.at[rows].set(True, mode="drop"),
        seq_lens=state.seq_lens.at[rows].set(0, mode="drop"),
    ), status


class AppendResult(NamedTuple):
    """What the KV store and attention need from an ``append_slots`` call."""

    slot_mapping: jax.Array  # int32[B, max_tokens]; block * block_size + offset; NO_SLOT for padding
    copy_src: jax.Array  # int32[B]; shared block to copy from (copy-on-write), NO_BLOCK if none
    copy_dst: jax.Array  # int32[B]; its private replacement, NO_BLOCK if none
    status: jax.Array  # int32[B]; Status per sequence


@_checked
def append_slots(
    state: CacheState, seq_ids: jax.Array, num_tokens: jax.Array, *, max_tokens: int = 1
) -> tuple[CacheState, AppendResult]:
    """Grow each sequence by ``num_tokens`` tokens (seed M4, M6).

    A new block is taken only when the last one is full. If the partly filled last block
    is shared (ref count > 1) the sequence gets a private copy first: its id pair is
    returned in ``copy_src``/``copy_dst`` and the KV store must copy it before writing.
    Blocks are taken from the pool in batch order, copy-on-write target first, then new
    blocks in logical order.

    Args:
      seq_ids: int32[B] live, distinct rows (NO_SEQ = padding).
      num_tokens: int32[B] in [0, max_tokens].
      max_tokens: static bound on num_tokens; sizes the slot mapping.
    """
    bs = state.block_size
    status, real, safe = _validate_ids(state, seq_ids, want_active=True, unique=True)
    status = _first(status, Status.BAD_NUM_TOKENS, real & ((num_tokens < 0) | (num_tokens > max_tokens)))
    plan = _plan_append(state, seq_ids, num_tokens, real)
    status = _first(status, Status.TABLE_FULL, real & (plan.new_blocks > state.max_blocks_per_seq))
    valid = jnp.all(status == Status.OK)

    k_new = -(-max_tokens // bs)  # fresh blocks one append can need (see _plan_append)
    cols = jnp.arange(k_new, dtype=jnp.int32)
    want_new = cols[None, :] < (plan.new_blocks - plan.old_blocks)[:, None]
    want = jnp.concatenate([plan.cow[:, None], want_new], axis=1) & valid  # [B, 1 + k_new]
    pool, ids, ok = state.policy.allocate(state.pool, want.reshape(-1))
    ids = ids.reshape(want.shape)
    status = _first(status, Status.NO_FREE_BLOCKS, ~ok & want.any(axis=1))
    apply = valid & ok

    # Table: the copy replaces the shared block in place; fresh blocks extend the row.
    rows = jnp.broadcast_to(_rows_or_drop(state, safe, real & apply)[:, None], want.shape)
    tcols = jnp.concatenate([(plan.old_len // bs)[:, None], plan.old_blocks[:, None] + cols[None, :]], axis=1)
    rows = jnp.where(want, rows, state.max_seqs)
    block_tables = state.block_tables.at[rows, tcols].set(ids, mode="drop")

    taken = jnp.where(want & apply, ids, state.num_blocks)
    ref_counts = state.ref_counts.at[taken].add(1, mode="drop")
    copied = plan.cow & apply
    ref_counts = ref_counts.at[_blocks_or_drop(state, plan.last_block, copied)].add(-1, mode="drop")

    n = jnp.where(real & apply, num_tokens, 0)
    seq_lens = state.seq_lens.at[_rows_or_drop(state, safe, real & apply)].add(n, mode="drop")

    # Slot of every new token, read through the updated row.
    t = jnp.arange(max_tokens, dtype=jnp.int32)
    pos = plan.old_len[:, None] + t[None, :]
    has_token = t[None, :] < n[:, None]
    phys = block_tables[safe[:, None], jnp.clip(pos // bs, 0, state.max_blocks_per_seq - 1)]
    slot_mapping = jnp.where(has_token, phys * bs + pos % bs, NO_SLOT)

    new_state = state.replace(block_tables=block_tables, seq_lens=seq_lens, ref_counts=ref_counts, pool=pool)
    result = AppendResult(
        slot_mapping=slot_mapping.astype(jnp.int32),
        copy_src=jnp.where(copied, plan.last_block, NO_BLOCK),
        copy_dst=jnp.where(copied, ids[:, 0], NO_BLOCK),
        status=status,
    )
    return new_state, result


@_checked
def fork(state: CacheState, parent_ids: jax.Array, child_ids: jax.Array) -> tuple[CacheState, jax.Array]:
    """Children share their parents' blocks (seed M6): table row and length are copied
    and every referenced block's count goes up once per child.

    parent_ids: int32[B] live rows (may repeat: several children of one parent).
    child_ids: int32[B] inactive, distinct rows. A padding pair is (NO_SEQ, NO_SEQ).
    Returns (state, status); status reports the pair's first problem.
    """
    p_status, p_real, p_safe = _validate_ids(state, parent_ids, want_active=True, unique=False)
    c_status, c_real, c_safe = _validate_ids(state, child_ids, want_active=False, unique=True)
    status = jnp.where(p_status != Status.OK, p_status, c_status)
    status = _first(status, Status.INVALID_SEQ_ID, p_real != c_real)  # half-padded pair
    apply = jnp.all(status == Status.OK)
    do = p_real & c_real & apply
    rows = state.block_tables[p_safe]  # [B, max_blocks_per_seq]
    ref_counts = state.ref_counts.at[_blocks_or_drop(state, rows, do[:, None])].add(1, mode="drop")
    dst = _rows_or_drop(state, c_safe, do)
    return state.replace(
        block_tables=state.block_tables.at[dst].set(rows, mode="drop"),
        seq_lens=state.seq_lens.at[dst].set(state.seq_lens[p_safe], mode="drop"),
        active=state.active.at[dst].set(True, mode="drop"),
        ref_counts=ref_counts,
    ), status


@_checked
def release(state: CacheState, seq_ids: jax.Array) -> tuple[CacheState, jax.Array]:
    """End sequences: every block loses a reference; blocks that reach 0, the last partly
    filled one included (seed §7.1), return to the pool in (batch, logical) order.

    seq_ids: int32[B] live, distinct rows. Returns (state, status).
    """
    return _shrink(state, seq_ids, jnp.zeros_like(seq_ids), deactivate=True)


@_checked
def truncate(state: CacheState, seq_ids: jax.Array, new_lens: jax.Array) -> tuple[CacheState, jax.Array]:
    """Shorten sequences to ``new_lens`` tokens, releasing blocks past the new end (for
    rolling back rejected speculative tokens). Rows stay live.

    seq_ids: int32[B] live, distinct rows. new_lens: int32[B] in [0, current length].
    """
    return _shrink(state, seq_ids, new_lens, deactivate=False)


def _shrink(state, seq_ids, new_lens, *, deactivate):
    bs = state.block_size
    status, real, safe = _validate_ids(state, seq_ids, want_active=True, unique=True)
    old_len = state.seq_lens[safe]
    status = _first(status, Status.BAD_NUM_TOKENS, real & ((new_lens < 0) | (new_lens > old_len)))
    apply = jnp.all(status == Status.OK)
    do = real & apply
    rows = state.block_tables[safe]  # [B, max_blocks_per_seq]
    keep = jnp.arange(state.max_blocks_per_seq)[None, :] < ((new_lens + bs - 1) // bs)[:, None]
    drop = do[:, None] & ~keep & (rows != NO_BLOCK)
    none = jnp.zeros((0,), jnp.int32)
    ref_counts, pool = _change_counts(state, none, none.astype(bool), rows.reshape(-1), drop.reshape(-1))
    dst = _rows_or_drop(state, safe, do)
    new = state.replace(
        block_tables=state.block_tables.at[dst].set(jnp.where(keep, rows, NO_BLOCK), mode="drop"),
        seq_lens=state.seq_lens.at[dst].set(new_lens, mode="drop"),
        ref_counts=ref_counts,
        pool=pool,
    )
    if deactivate:
        new = new.replace(active=new.active.at[dst].set(False, mode="drop"))
    return new, status


@_checked
def select_parents(
    state: CacheState, seq_ids: jax.Array, parent_ids: jax.Array
) -> tuple[CacheState, jax.Array]:
    """Rebuild rows from chosen parent rows in one call (a beam-search step).

    Row ``seq_ids[i]`` becomes a copy of the *old* row ``parent_ids[i]`` (table and length).
    Counts change by the net difference (new references up, overwritten ones down) and
    blocks no row keeps return to the pool. Rows not named keep what they have.

    seq_ids: int32[B] distinct rows, live or not (a dead row becomes live).
    parent_ids: int32[B] live rows (may repeat). Returns (state, status).
    """
    d_status, d_real, d_safe = _validate_ids(state, seq_ids, want_active=None, unique=True)
    p_status, p_real, p_safe = _validate_ids(state, parent_ids, want_active=True, unique=False)
    status = jnp.where(d_status != Status.OK, d_status, p_status)
    status = _first(status, Status.INVALID_SEQ_ID, d_real != p_real)
    apply = jnp.all(status == Status.OK)
    do = d_real & p_real & apply
    new_rows = state.block_tables[p_safe]
    old_rows = state.block_tables[d_safe]
    inc = jnp.broadcast_to(do[:, None], new_rows.shape) & (new_rows != NO_BLOCK)
    dec = (do & state.active[d_safe])[:, None] & (old_rows != NO_BLOCK)
    ref_counts, pool = _change_counts(state, new_rows.reshape(-1), inc.reshape(-1), old_rows.reshape(-1), dec.reshape(-1))
    dst = _rows_or_drop(state, d_safe, do)
    return state.replace(
        block_tables=state.block_tables.at[dst].set(new_rows, mode="drop"),
        seq_lens=state.seq_lens.at[dst].set(state.seq_lens[p_safe], mode="drop"),
        active=state.active.at[dst].set(True, mode="drop"),
        ref_counts=ref_counts,
        pool=pool,
    ), status
