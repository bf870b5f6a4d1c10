"""Pure, jittable block-manager operations over a batch of sequences.

Every op takes a ``CacheState`` and a batch of sequence ids (``NO_SEQ`` entries are
padding and ignored) and returns the new state plus an ``int32[batch]`` status
(``Status``). A call is atomic: it applies only if every status is ``OK``; otherwise the
returned state is the input state, bit for bit. Nothing raises under jit; check the status
on the host (``raise_for_status``).

Batched = sequential. Every entry of a batch is validated against the state *before*
the call, then the valid batch is applied as if its entries ran one after another in
batch order. So ``open_sequences([2, 2])`` on a free row 2 is ``DUPLICATE_SEQ`` for both
entries (not OK and then ``ACTIVE_SEQ``), and ``fork`` cannot fork from a child made
earlier in the same call (that parent is not live before the call: ``INACTIVE_SEQ``).
What the order decides is which blocks go where: blocks are taken from the pool in
batch order; when several rows of one ``append_slots`` share a partly filled block, all
copy except the last, which keeps it if nobody else holds it; blocks freed together
enter the pool in the order their last reference goes. Each entry's status is its first
problem in this order: id (INVALID_SEQ_ID, INACTIVE_SEQ / ACTIVE_SEQ, DUPLICATE_SEQ; for
a pair of ids, the first id's problem, then the second's), count (BAD_NUM_TOKENS), table
(TABLE_FULL, BAD_TABLE); then, only when every entry passed those, the checks of the
batch as a whole (``restore_rows``' group) and NO_FREE_BLOCKS on the entries that need a
block. The pure-Python reference (``reference.py``) implements exactly this, and the
stateful tests compare the two.

The arguments are checked at the Python boundary (``_int32_args``), at trace time since
shapes and dtypes are static: a wrong rank or mismatched batch lengths raise
``ValueError``, a bool or non-integer dtype ``TypeError``, and concrete (non-traced)
values outside int32 ``ValueError``, so no input wraps, truncates or broadcasts into a
different request. No op's arithmetic overflows int32 for any int32 input.

Cost per call is O(batch x max_blocks_per_seq) (plus O(batch^2) small comparisons,
O(max_seqs) for duplicate detection and a sort of the touched entries where stated),
never O(num_blocks): every pool-sized array is only gathered from or scattered into at
the touched entries, so with the state donated XLA updates it in place. Scatters that
must not happen are sent out of bounds and dropped rather than selected with
``jnp.where`` over the whole array.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.cache.sentinels import NO_BLOCK, NO_SEQ, NO_SLOT
from paged_jax.cache.state import CacheState, Status
from paged_jax.config import blocks_for

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

# --------------------------------------------------------------------------- debug checks


def _concrete_int32(args) -> bool:
    """Every array argument is a concrete int32 ``jax.Array`` (None allowed): what a
    jitted op reads exactly as the op-by-op one does. Anything else (NumPy, lists, other
    dtypes, tracers) goes op by op, where the argument checks see concrete values."""
    leaves = jax.tree.leaves(args)
    return all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.dtype == jnp.int32
               for x in leaves)


def _eager_jit(op):
    """Called outside jit with concrete int32 arrays, ``op`` runs as one compiled program
    (cached per shape) instead of dispatching each primitive: a notebook or test calling
    the ops one at a time runs ~10x faster. Traced calls and other arguments are unchanged."""
    # An op's keyword-only parameters (max_tokens, max_local) are its static sizes.
    static = tuple(n for n, p in inspect.signature(op).parameters.items() if p.kind is p.KEYWORD_ONLY)
    jitted = jax.jit(op, static_argnames=static)

    @functools.wraps(op)
    def wrapper(state, *args, **kwargs):
        arrays = (args, {k: v for k, v in kwargs.items() if k not in static})
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state))
        if traced or not _concrete_int32(arrays):
            return op(state, *args, **kwargs)
        return jitted(state, *args, **kwargs)

    return wrapper


def _checked(op):
    """Run ``check_invariants`` on the new state when the input state has ``debug`` on:
    on the spot for concrete states, through a host callback when traced."""
    run = _eager_jit(op)

    @functools.wraps(op)
    def wrapper(state, *args, **kwargs):
        out = run(state, *args, **kwargs)
        if state.debug:
            from paged_jax.cache.invariants import check_invariants

            new_state = out[0]
            leaves, treedef = jax.tree.flatten(new_state)
            if any(isinstance(x, jax.core.Tracer) for x in leaves):
                jax.debug.callback(
                    lambda *xs: check_invariants(jax.tree.unflatten(treedef, xs), op=op.__name__),
                    *leaves,
                )
            else:
                check_invariants(new_state, op=op.__name__)
        return out

    return wrapper


# --------------------------------------------------------------------------- argument checks


def _as_int_array(op: str, name: str, value: Any):
    """``value`` as an array (a tracer stays a tracer), refusing non-integer dtypes."""
    if not isinstance(value, jax.Array | np.ndarray | np.generic):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(value)):
            value = jnp.asarray(value)  # a Python list of traced scalars (jit of a list)
        else:
            value = np.asarray(value)
            if value.size == 0 and value.dtype == np.float64:
                value = value.astype(np.int32)  # ``[]`` carries no dtype of its own
    dtype = np.dtype(value.dtype)
    if dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
        raise TypeError(
            f"{op}: {name} has dtype {dtype}; it must be an integer dtype such as int32 "
            "(a bool would be read as 0/1 and a float truncated)"
        )
    return value


def _int32_args(op: str, *specs: tuple[str, Any, int], xp=jnp) -> list:
    """Check an op's integer arguments and return them as int32 arrays (``xp`` arrays;
    tracers stay tracers).

    specs: ``(name, value, rank)`` per argument. Every argument of rank >= 1 has the
    batch as its first axis, so their first dimensions must agree. Raises TypeError for
    a non-integer dtype (or a traced dtype wider than int32, whose values cannot be
    checked under jit), ValueError for a wrong rank, mismatched batch lengths, or
    concrete values outside int32. Only static facts and concrete values are inspected:
    nothing is added to a trace.
    """
    arrays = [_as_int_array(op, name, value) for name, value, _ in specs]
    for (name, _, rank), a in zip(specs, arrays):
        if a.ndim != rank:
            raise ValueError(f"{op}: {name} has shape {tuple(a.shape)}; it must have rank {rank}")
    batched = [(name, a) for (name, _, rank), a in zip(specs, arrays) if rank >= 1]
    for name, a in batched[1:]:
        if a.shape[0] != batched[0][1].shape[0]:
            raise ValueError(
                f"{op}: {batched[0][0]} has shape {tuple(batched[0][1].shape)} but {name} has "
                f"shape {tuple(a.shape)}; their first dimension (the batch) must match"
            )
    out = []
    for (name, _, _), a in zip(specs, arrays):
        dtype = np.dtype(a.dtype)
        if not np.can_cast(dtype, np.int32, casting="safe"):
            if isinstance(a, jax.core.Tracer):
                raise TypeError(
                    f"{op}: {name} is traced with dtype {dtype}, whose values cannot be "
                    "checked under jit; pass int32"
                )
            host = np.asarray(a)
            if host.size and (host.min() < _INT32_MIN or host.max() > _INT32_MAX):
                bad = host[(host < _INT32_MIN) | (host > _INT32_MAX)].ravel()[:4].tolist()
                raise ValueError(f"{op}: {name} holds values outside int32, e.g. {bad}")
        out.append(a.astype(jnp.int32) if isinstance(a, jax.core.Tracer) else xp.asarray(a, dtype=xp.int32))
    return out


def _static_int(op: str, name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not lo <= value <= _INT32_MAX:
        raise ValueError(f"{op}: {name}={value!r}; it must be a static Python int in [{lo}, {_INT32_MAX}]")
    return int(value)


# --------------------------------------------------------------------------- helpers


def _id_status(
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


@_eager_jit
def num_free_blocks(state: CacheState) -> jax.Array:
    """int32[]: blocks the pool can hand out now."""
    return state.policy.num_free(state.pool)


class _AppendPlan(NamedTuple):
    """What an append of ``num_tokens`` to each row would do; int32/bool ``[B]`` arrays."""

    safe: Any  # int32[B] row ids, 0 where not real
    old_len: Any  # int32[B]
    old_blocks: Any  # int32[B] blocks held now
    grow: Any  # int32[B] fresh blocks the append adds (not counting a copy-on-write target)
    last_block: Any  # int32[B] block the first new token lands in if partly filled, else NO_BLOCK
    cow: Any  # bool[B] that block is shared: write into a private copy


def _plan_append(
    xp,
    *,
    block_size: int,
    seq_lens,
    block_tables,
    count_at: Callable,
    seq_ids,
    num_tokens,
    real,
) -> _AppendPlan:
    """The append arithmetic, once, over an array namespace: ``jax.numpy`` in the jitted
    ops, ``numpy`` in the host model (``host.py``, which must agree with them exactly).

    seq_lens: int32[S]; block_tables: int32[S, P]; seq_ids, num_tokens: int32[B];
    real: bool[B] (id in range). ``count_at(rows, cols) -> int[B]``: the ref count of the
    block at ``block_tables[rows, cols]`` (the device reads ``ref_counts``, the host view
    its per-entry copy). Negative counts plan as 0. O(B^2) compares, B is small.
    """
    bs = block_size
    safe = xp.where(real, seq_ids, 0)
    old_len = xp.where(real, seq_lens[safe], 0)
    n = xp.where(real, xp.maximum(num_tokens, 0), 0)
    rem = old_len % bs
    old_blocks = blocks_for(old_len, bs)
    # ceil((old_len + n) / bs) - old_blocks, without forming old_len + n (int32 overflow).
    grow = n // bs + blocks_for(rem + n % bs, bs) - (rem != 0)
    partial = real & (rem != 0) & (n > 0)
    col = xp.clip(old_len // bs, 0, block_tables.shape[1] - 1)
    last_block = xp.where(partial, block_tables[safe, col], NO_BLOCK)
    count = count_at(safe, col)
    shared = partial & (count > 1)
    # Several rows of this batch may share one partly filled block (forked beams). As if
    # they appended one after another: all copy except the last, which keeps the block
    # when no row outside the batch still holds it.
    same = shared[:, None] & shared[None, :] & (last_block[:, None] == last_block[None, :])
    members = same.sum(axis=1)
    later = xp.triu(same, k=1).any(axis=1)
    keeps = shared & ~later & (count == members)
    return _AppendPlan(
        safe.astype(xp.int32),
        old_len.astype(xp.int32),
        old_blocks.astype(xp.int32),
        grow.astype(xp.int32),
        last_block.astype(xp.int32),
        shared & ~keeps,
    )


def _device_plan(state: CacheState, seq_ids, num_tokens, real) -> _AppendPlan:
    n = state.num_blocks
    return _plan_append(
        jnp,
        block_size=state.block_size,
        seq_lens=state.seq_lens,
        block_tables=state.block_tables,
        count_at=lambda rows, cols: state.ref_counts[jnp.clip(state.block_tables[rows, cols], 0, n - 1)],
        seq_ids=seq_ids,
        num_tokens=num_tokens,
        real=real,
    )


@_eager_jit
def blocks_needed(state: CacheState, seq_ids: jax.Array, num_tokens: jax.Array) -> jax.Array:
    """int32[B]: blocks ``append_slots`` would take for these appends (new + copy-on-write).

    Assumes the batch is appended together in one call, as ``append_slots`` would.
    Exact for every int32 count (no overflow: at most 2**31 - 1). Padding and
    out-of-range ids need 0; a row that is not live counts as empty (what it will need
    once opened); a negative count needs 0.

    seq_ids, num_tokens: int32[B].
    """
    seq_ids, num_tokens = _int32_args("blocks_needed", ("seq_ids", seq_ids, 1), ("num_tokens", num_tokens, 1))
    real = (seq_ids >= 0) & (seq_ids < state.max_seqs)
    plan = _device_plan(state, seq_ids, num_tokens, real)
    return (plan.grow + plan.cow).astype(jnp.int32)


# --------------------------------------------------------------------------- ops


@_checked
def open_sequences(
    state: CacheState, seq_ids: jax.Array, prefix_blocks: jax.Array | None = None
) -> tuple[CacheState, jax.Array]:
    """Make free rows live: empty sequences, or sequences that start with cached blocks.

    seq_ids: int32[B] rows that must be inactive and distinct.
    prefix_blocks: optional int32[B, K], K <= max_blocks_per_seq (prefix caching): row i
      starts with the blocks ``prefix_blocks[i]`` names, in order, then ``NO_BLOCK``s, and
      holds ``k * block_size`` tokens for its k blocks; each named block gains a reference
      (no copy). Every named block must be cached, distinct within its row, and no block
      may follow a ``NO_BLOCK`` (else BAD_TABLE). Rows of one call may name the same block.
    Returns (state, status).
    """
    if prefix_blocks is None:
        (seq_ids,) = _int32_args("open_sequences", ("seq_ids", seq_ids, 1))
    else:
        seq_ids, prefix_blocks = _int32_args(
            "open_sequences", ("seq_ids", seq_ids, 1), ("prefix_blocks", prefix_blocks, 2)
        )
    status, real, safe = _id_status(state, seq_ids, want_active=False, unique=True)
    if prefix_blocks is None:
        apply = jnp.all(status == Status.OK)
        rows = _rows_or_drop(state, safe, real & apply)
        return state.replace(
            active=state.active.at[rows].set(True, mode="drop"),
            seq_lens=state.seq_lens.at[rows].set(0, mode="drop"),
        ), status
    k = _table_width(state, "open_sequences", "prefix_blocks", prefix_blocks)
    n = state.num_blocks
    named = prefix_blocks != NO_BLOCK
    count = named.sum(axis=1)
    in_order = jnp.arange(k)[None, :] < count[:, None]  # the named entries come first
    in_range = (prefix_blocks >= 0) & (prefix_blocks < n)
    cached = state.cached[jnp.clip(prefix_blocks, 0, n - 1)]
    row_bad = (jnp.any(named & ~(in_range & cached), axis=1) | jnp.any(named != in_order, axis=1)
               | _repeats(prefix_blocks, named))
    status = _first(status, Status.BAD_TABLE, real & row_bad)
    apply = jnp.all(status == Status.OK)
    do = real & apply
    rows = _rows_or_drop(state, safe, do)
    table = jnp.pad(jnp.where(named, prefix_blocks, NO_BLOCK), ((0, 0), (0, state.max_blocks_per_seq - k)),
                    constant_values=NO_BLOCK)
    ref_counts = state.ref_counts.at[_blocks_or_drop(state, prefix_blocks, do[:, None] & named)].add(
        1, mode="drop")
    return state.replace(
        block_tables=state.block_tables.at[rows].set(table, mode="drop"),
        active=state.active.at[rows].set(True, mode="drop"),
        seq_lens=state.seq_lens.at[rows].set(count * state.block_size, mode="drop"),
        ref_counts=ref_counts,
    ), status


def _table_width(state: CacheState, op: str, name: str, table) -> int:
    """A block-table argument's width, at most max_blocks_per_seq (else ValueError)."""
    if table.shape[1] > state.max_blocks_per_seq:
        raise ValueError(
            f"{op}: {name} has shape {tuple(table.shape)}; its width must be at most "
            f"max_blocks_per_seq={state.max_blocks_per_seq}"
        )
    return table.shape[1]


def _repeats(tables: jax.Array, named: jax.Array) -> jax.Array:
    """bool[B]: a row names one block twice among its ``named`` entries (it would hold
    it twice). Each row's named entries are sorted (the others get distinct negative
    keys) and neighbours compared: O(B x P log P)."""
    cols = jnp.arange(tables.shape[1], dtype=jnp.int32)
    keyed = jnp.sort(jnp.where(named, tables, -1 - cols[None, :]), axis=1)
    return jnp.any(keyed[:, 1:] == keyed[:, :-1], axis=1)


def _block_status(state: CacheState, block_ids: jax.Array, ok: Callable) -> tuple[jax.Array, jax.Array]:
    """(status int32[M], real bool[M]) for a batch of block ids: NO_BLOCK is padding;
    BAD_BLOCK for an id out of range, repeated in the batch, or failing ``ok(counts,
    cached) -> bool[M]`` (the op's precondition). O(M log M): a sort finds repeats."""
    n = state.num_blocks
    pad = block_ids == NO_BLOCK
    in_range = (block_ids >= 0) & (block_ids < n)
    safe = jnp.clip(block_ids, 0, n - 1)
    keyed = jnp.where(in_range, block_ids, -1 - jnp.arange(block_ids.shape[0]))
    order = jnp.argsort(keyed)
    k = keyed[order]
    dup_sorted = jnp.concatenate([k[1:] == k[:-1], jnp.zeros((1,), bool)]) | jnp.concatenate(
        [jnp.zeros((1,), bool), k[1:] == k[:-1]])
    dup = jnp.zeros_like(dup_sorted).at[order].set(dup_sorted)
    good = in_range & ~dup & ok(state.ref_counts[safe], state.cached[safe])
    status = jnp.where(pad | good, Status.OK, Status.BAD_BLOCK).astype(jnp.int32)
    return status, in_range


@_checked
def mark_cached(state: CacheState, block_ids: jax.Array) -> tuple[CacheState, jax.Array]:
    """Prefix caching: the prefix cache takes a reference to each block (now full and
    never written again; an append into it copies it first, as into any shared block).
    When the last table entry naming it goes, the block stays out of the pool,
    cached-free, until ``evict_cached``.

    block_ids: int32[M] referenced (count >= 1), uncached, distinct blocks; NO_BLOCK is
    padding. Returns (state, status int32[M]): BAD_BLOCK where an id breaks that.
    """
    (block_ids,) = _int32_args("mark_cached", ("block_ids", block_ids, 1))
    status, real = _block_status(state, block_ids, lambda counts, cached: (counts >= 1) & ~cached)
    do = real & jnp.all(status == Status.OK)
    dst = _blocks_or_drop(state, block_ids, do)
    return state.replace(
        ref_counts=state.ref_counts.at[dst].add(1, mode="drop"),
        cached=state.cached.at[dst].set(True, mode="drop"),
    ), status


@_checked
def evict_cached(state: CacheState, block_ids: jax.Array) -> tuple[CacheState, jax.Array]:
    """Prefix caching: drop the cache's reference to cached-free blocks (named by no
    table), which return to the pool in batch order.

    block_ids: int32[M] cached, unreferenced (count exactly 1: the cache's), distinct
    blocks; NO_BLOCK is padding. A block any sequence still names is never evicted:
    BAD_BLOCK, as for an id out of range, uncached or repeated. Returns (state, status
    int32[M]).
    """
    (block_ids,) = _int32_args("evict_cached", ("block_ids", block_ids, 1))
    status, real = _block_status(state, block_ids, lambda counts, cached: cached & (counts == 1))
    do = real & jnp.all(status == Status.OK)
    none = jnp.zeros((0,), jnp.int32)
    ref_counts, pool = _change_counts(state, none, none.astype(bool), block_ids, do)
    return state.replace(
        ref_counts=ref_counts,
        pool=pool,
        cached=state.cached.at[_blocks_or_drop(state, block_ids, do)].set(False, mode="drop"),
    ), status


@_eager_jit
def num_cached_free(state: CacheState) -> jax.Array:
    """int32[]: cached blocks no table names (reclaimable by ``evict_cached``). O(num_blocks),
    a reduction."""
    return jnp.sum(state.cached & (state.ref_counts == 1), dtype=jnp.int32)


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
    """Grow each sequence by ``num_tokens`` tokens.

    A new block is taken only when the last one is full. If the partly filled last block
    is shared (ref count > 1) the sequence gets a private copy first: its id pair is
    returned in ``copy_src``/``copy_dst`` and the KV store must copy it before writing.
    Blocks are taken from the pool in batch order, copy-on-write target first, then new
    blocks in logical order.

    Args:
      seq_ids: int32[B] live, distinct rows (NO_SEQ = padding).
      num_tokens: int32[B] in [0, max_tokens] (else BAD_NUM_TOKENS).
      max_tokens: static bound on num_tokens in [1, 2**31 - 1]; sizes the slot mapping.
    """
    seq_ids, num_tokens = _int32_args("append_slots", ("seq_ids", seq_ids, 1), ("num_tokens", num_tokens, 1))
    max_tokens = _static_int("append_slots", "max_tokens", max_tokens, 1)
    bs = state.block_size
    status, real, safe = _id_status(state, seq_ids, want_active=True, unique=True)
    status = _first(status, Status.BAD_NUM_TOKENS, real & ((num_tokens < 0) | (num_tokens > max_tokens)))
    plan = _device_plan(state, seq_ids, num_tokens, real)
    status = _first(status, Status.TABLE_FULL, real & (plan.grow > state.max_blocks_per_seq - plan.old_blocks))
    valid = jnp.all(status == Status.OK)

    k_new = blocks_for(max_tokens, bs)  # fresh blocks one append can need (see _plan_append)
    cols = jnp.arange(k_new, dtype=jnp.int32)
    want_new = cols[None, :] < plan.grow[:, None]
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

    # Slot of every new token, read through the updated row. Positions past a row's
    # count are clamped to its end so that nothing is formed beyond the table's reach.
    t = jnp.arange(max_tokens, dtype=jnp.int32)
    pos = plan.old_len[:, None] + jnp.minimum(t[None, :], n[:, None])
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
    """Children share their parents' blocks: table row and length are copied and every
    referenced block's count goes up once per child.

    parent_ids: int32[B] live rows (may repeat: several children of one parent).
    child_ids: int32[B] inactive, distinct rows. A padding pair is (NO_SEQ, NO_SEQ).
    Returns (state, status); status reports the pair's first problem.
    """
    parent_ids, child_ids = _int32_args("fork", ("parent_ids", parent_ids, 1), ("child_ids", child_ids, 1))
    p_status, p_real, p_safe = _id_status(state, parent_ids, want_active=True, unique=False)
    c_status, c_real, c_safe = _id_status(state, child_ids, want_active=False, unique=True)
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
    filled one included, return to the pool in (batch, logical) order.

    seq_ids: int32[B] live, distinct rows. Returns (state, status). Sorts the B x
    max_blocks_per_seq touched entries (see ``_change_counts``).
    """
    (seq_ids,) = _int32_args("release", ("seq_ids", seq_ids, 1))
    return _shrink(state, seq_ids, jnp.zeros_like(seq_ids), deactivate=True)


@_checked
def truncate(state: CacheState, seq_ids: jax.Array, new_lens: jax.Array) -> tuple[CacheState, jax.Array]:
    """Shorten sequences to ``new_lens`` tokens, releasing blocks past the new end (for
    rolling back rejected speculative tokens). Rows stay live.

    seq_ids: int32[B] live, distinct rows. new_lens: int32[B] in [0, current length]
    (else BAD_NUM_TOKENS). Returns (state, status).
    """
    seq_ids, new_lens = _int32_args("truncate", ("seq_ids", seq_ids, 1), ("new_lens", new_lens, 1))
    return _shrink(state, seq_ids, new_lens, deactivate=False)


def _shrink(state, seq_ids, new_lens, *, deactivate):
    status, real, safe = _id_status(state, seq_ids, want_active=True, unique=True)
    old_len = state.seq_lens[safe]
    status = _first(status, Status.BAD_NUM_TOKENS, real & ((new_lens < 0) | (new_lens > old_len)))
    apply = jnp.all(status == Status.OK)
    do = real & apply
    rows = state.block_tables[safe]  # [B, max_blocks_per_seq]
    keep = jnp.arange(state.max_blocks_per_seq)[None, :] < blocks_for(new_lens, state.block_size)[:, None]
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
    seq_ids, parent_ids = _int32_args("select_parents", ("seq_ids", seq_ids, 1), ("parent_ids", parent_ids, 1))
    d_status, d_real, d_safe = _id_status(state, seq_ids, want_active=None, unique=True)
    p_status, p_real, p_safe = _id_status(state, parent_ids, want_active=True, unique=False)
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


class UnshareResult(NamedTuple):
    """The copies an ``unshare`` call asks of the KV store, and its status."""

    copy_src: jax.Array  # int32[B * P]; shared block to copy, NO_BLOCK where none
    copy_dst: jax.Array  # int32[B * P]; its fresh private copy, NO_BLOCK where none
    status: jax.Array  # int32[B]; Status per sequence


@_checked
def unshare(state: CacheState, seq_ids: jax.Array) -> tuple[CacheState, UnshareResult]:
    """Give rows private copies of the blocks they share: sharing undone (the baseline
    that measures what copy-on-write saves: every fork a full copy).

    As if the rows went one after another in batch order, each in logical order: a block
    still counted more than once is replaced by a fresh block (its count moves to the
    copy). So a block that only named rows share keeps one holder, the last. Fresh blocks
    come from the pool in that order, all or nothing; the KV store must then copy
    ``copy_src[i] -> copy_dst[i]``.

    seq_ids: int32[B] live, distinct rows (NO_SEQ = padding). Returns (state,
    ``UnshareResult``); NO_FREE_BLOCKS on the rows that would copy when the pool is short.
    O(B x P log(B x P)) to rank each block's holders.
    """
    (seq_ids,) = _int32_args("unshare", ("seq_ids", seq_ids, 1))
    status, real, safe = _id_status(state, seq_ids, want_active=True, unique=True)
    valid = jnp.all(status == Status.OK)
    n = state.num_blocks
    rows = state.block_tables[safe]  # [B, P]
    flat = rows.reshape(-1)
    held = (real[:, None] & (rows >= 0) & (rows < n)).reshape(-1)
    # Rank each entry among the batch's entries naming the same block, in batch order.
    key = jnp.where(held, flat, n)
    order = jnp.argsort(key, stable=True)
    k = key[order]
    idx = jnp.arange(k.shape[0], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((1,), bool), k[1:] != k[:-1]])
    rank = jnp.zeros_like(idx).at[order].set(idx - jax.lax.cummax(jnp.where(starts, idx, 0)))
    count = state.ref_counts[jnp.clip(flat, 0, n - 1)]
    want = held & (rank < count - 1) & valid
    pool, ids, ok = state.policy.allocate(state.pool, want)
    status = _first(status, Status.NO_FREE_BLOCKS, ~ok & want.reshape(rows.shape).any(axis=1))
    done = want & ok
    # One scatter: each copy's count +1, its source's -1 (never to 0: a holder remains).
    touched = jnp.concatenate([jnp.where(done, ids, n), jnp.where(done, flat, n)])
    delta = jnp.concatenate([jnp.ones_like(ids), -jnp.ones_like(flat)])
    ref_counts = state.ref_counts.at[touched].add(delta, mode="drop")
    dst = _rows_or_drop(state, safe, real & valid & ok)
    tables = state.block_tables.at[dst].set(jnp.where(done, ids, flat).reshape(rows.shape), mode="drop")
    result = UnshareResult(jnp.where(done, flat, NO_BLOCK), jnp.where(done, ids, NO_BLOCK), status)
    return state.replace(block_tables=tables, ref_counts=ref_counts, pool=pool), result


@_checked
def restore_rows(
    state: CacheState,
    seq_ids: jax.Array,
    seq_lens: jax.Array,
    local_tables: jax.Array,
    num_local: jax.Array,
    *,
    max_local: int,
) -> tuple[CacheState, jax.Array, jax.Array]:
    """Rebuild a group of rows whose blocks may be shared among them (swap-in of forked
    beams): fresh blocks for the group, the sharing inside the group preserved.

    The rows' tables name ``num_local`` "local" blocks by index ``0 .. num_local - 1``;
    several rows may name the same local block. The op takes ``num_local`` fresh blocks
    from the pool (all or nothing, in local-id order), maps local id ``i`` to ``ids[i]``,
    writes each row's table and length, makes the rows live, and gives each new block a
    ref count equal to the number of entries naming it. The caller then writes the
    saved data of local block ``i`` into physical block ``ids[i]``.

    Args:
      seq_ids: int32[B] inactive, distinct rows (NO_SEQ = padding: its length and table
        are ignored).
      seq_lens: int32[B] in [0, P * block_size] (else BAD_NUM_TOKENS).
      local_tables: int32[B, P], P <= max_blocks_per_seq: a row's first
        ceil(len / block_size) entries are distinct local ids in [0, num_local), the
        rest NO_BLOCK (else BAD_TABLE).
      num_local: int32[] in [0, max_local]; every local id below it must be named by some
        row, or its block would leak. A defect of the group as a whole (num_local out of
        range, or a local id no row names) is checked once every entry passed its own
        checks, and is then BAD_TABLE on every entry, padding included, since no single
        row is at fault.
      max_local: static M >= 1; sizes ``ids``.

    Returns (state, ids int32[M] (local id -> physical block; NO_BLOCK past num_local
    or when rejected), status int32[B]). NO_FREE_BLOCKS (on the rows that hold a block)
    when the pool has fewer than num_local free blocks. Cost O(B x P log P + M): each
    row's entries are sorted to find a repeat; pool-sized arrays are touched at M
    entries.
    """
    op = "restore_rows"
    seq_ids, seq_lens, local_tables, num_local = _int32_args(
        op, ("seq_ids", seq_ids, 1), ("seq_lens", seq_lens, 1), ("local_tables", local_tables, 2),
        ("num_local", num_local, 0),
    )
    m = _static_int(op, "max_local", max_local, 1)
    p = _table_width(state, op, "local_tables", local_tables)
    bs = state.block_size
    status, real, safe = _id_status(state, seq_ids, want_active=False, unique=True)
    status = _first(status, Status.BAD_NUM_TOKENS, real & ((seq_lens < 0) | (seq_lens > p * bs)))

    need = blocks_for(jnp.clip(seq_lens, 0, p * bs), bs)  # [B]
    cols = jnp.arange(p, dtype=jnp.int32)
    held = cols[None, :] < need[:, None]  # [B, P]
    named = (local_tables >= 0) & (local_tables < num_local)
    row_bad = jnp.any(held & ~named, axis=1) | jnp.any(~held & (local_tables != NO_BLOCK), axis=1)
    row_bad = row_bad | _repeats(local_tables, held & named)
    status = _first(status, Status.BAD_TABLE, real & row_bad)

    local = jnp.arange(m, dtype=jnp.int32)
    entry = real[:, None] & held & (local_tables >= 0) & (local_tables < m)
    counts = jnp.zeros((m,), jnp.int32).at[jnp.where(entry, local_tables, m)].add(1, mode="drop")
    wanted = local < num_local
    group_bad = (num_local < 0) | (num_local > m) | jnp.any(wanted & (counts == 0))
    # Checked only once every row passed its own checks: a rejected row's entries
    # would otherwise show up again as unnamed local ids on the rows that are fine.
    status = _first(status, Status.BAD_TABLE, group_bad & jnp.all(status == Status.OK))
    valid = jnp.all(status == Status.OK)

    pool, ids, ok = state.policy.allocate(state.pool, wanted & valid)
    status = _first(status, Status.NO_FREE_BLOCKS, ~ok & real & (need > 0))
    apply = valid & ok
    ids = jnp.where(wanted & apply, ids, NO_BLOCK).astype(jnp.int32)

    do = real & apply
    phys = jnp.where(held, ids[jnp.clip(local_tables, 0, m - 1)], NO_BLOCK)
    phys = jnp.pad(phys, ((0, 0), (0, state.max_blocks_per_seq - p)), constant_values=NO_BLOCK)
    dst = _rows_or_drop(state, safe, do)
    # The new blocks were free (count 0), so setting their counts is adding them.
    ref_counts = state.ref_counts.at[jnp.where(wanted & apply, ids, state.num_blocks)].set(counts, mode="drop")
    new_state = state.replace(
        block_tables=state.block_tables.at[dst].set(phys, mode="drop"),
        seq_lens=state.seq_lens.at[dst].set(seq_lens, mode="drop"),
        active=state.active.at[dst].set(True, mode="drop"),
        ref_counts=ref_counts,
        pool=pool,
    )
    return new_state, ids, status
