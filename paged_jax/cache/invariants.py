"""Host-side invariant checker: slow, exhaustive, for tests and debugging."""

from __future__ import annotations

import numpy as np

from paged_jax.cache.sentinels import NO_BLOCK
from paged_jax.cache.state import CacheState
from paged_jax.config import blocks_for


class InvariantError(AssertionError):
    """A broken block-manager invariant; the message names it and the offenders."""


def _fail(op: str | None, name: str, detail: str, offenders) -> None:
    offenders = [int(x) for x in np.asarray(offenders).ravel()[:10]]
    where = f" after {op}" if op else ""
    raise InvariantError(f"invariant '{name}' broken{where}: {detail}; offenders: {offenders}")


def check_invariants(state: CacheState, *, op: str | None = None) -> None:
    """Raise ``InvariantError`` unless ``state`` is consistent.

    Checks: the free pool holds no duplicate and no out-of-range id; every block is
    exactly one of free (count 0, in the pool), referenced (named by a table) or
    cached-free (cached, named by none); ref_counts[b] == number of table entries naming
    b, plus 1 if b is cached; live rows hold exactly
    ceil(len / block_size) blocks, then NO_BLOCK; a row never names a block twice;
    dead rows are empty.
    """
    tables = np.asarray(state.block_tables)
    lens = np.asarray(state.seq_lens)
    active = np.asarray(state.active)
    counts = np.asarray(state.ref_counts)
    cached = np.asarray(state.cached)
    n, bs = counts.shape[0], state.block_size
    max_seqs, width = tables.shape

    free = np.asarray(state.policy.free_blocks(state.pool))
    if int(state.policy.num_free(state.pool)) != free.size:
        _fail(op, "num_free matches the pool", f"num_free={int(state.policy.num_free(state.pool))}, pool holds {free.size}", [])
    bad = free[(free < 0) | (free >= n)]
    if bad.size:
        _fail(op, "free ids in range", f"pool holds ids outside [0, {n})", bad)
    uniq, hits = np.unique(free, return_counts=True)
    if (hits > 1).any():
        _fail(op, "no duplicate in the free pool", "ids appear more than once", uniq[hits > 1])
    if (counts < 0).any():
        _fail(op, "ref counts >= 0", "negative counts", np.flatnonzero(counts < 0))

    is_free = np.zeros(n, bool)
    is_free[free] = True
    both = np.flatnonzero(is_free & (counts > 0))
    if both.size:
        _fail(op, "no block both free and referenced", "free blocks with count > 0", both)
    neither = np.flatnonzero(~is_free & (counts == 0))
    if neither.size:
        _fail(op, "no block neither free nor referenced (leak)", "count 0 but not in the pool", neither)
    if int((counts > 0).sum()) + free.size != n:
        _fail(op, "allocated + free == num_blocks", f"{int((counts > 0).sum())} + {free.size} != {n}", [])
    both = np.flatnonzero(is_free & cached)
    if both.size:
        _fail(op, "no block both free and cached", "cached blocks in the pool", both)

    dead = np.flatnonzero(~active & ((lens != 0) | (tables != NO_BLOCK).any(axis=1)))
    if dead.size:
        _fail(op, "inactive rows are empty", "inactive rows with a length or blocks", dead)
    if (lens < 0).any() or (lens > width * bs).any():
        _fail(op, "0 <= length <= max_blocks_per_seq * block_size", "bad lengths", np.flatnonzero((lens < 0) | (lens > width * bs)))
    need = blocks_for(lens, bs)
    held = np.arange(width)[None, :] < need[:, None]
    wrong = np.flatnonzero(active & ((held & ((tables < 0) | (tables >= n))).any(axis=1)))
    if wrong.size:
        _fail(op, "lengths consistent with table rows", "a needed entry is NO_BLOCK or out of range", wrong)
    wrong = np.flatnonzero((~held & (tables != NO_BLOCK)).any(axis=1))
    if wrong.size:
        _fail(op, "lengths consistent with table rows", "entries past the length name a block", wrong)

    named = tables[held]
    for row in np.flatnonzero(active):
        ids = tables[row, : need[row]]
        if np.unique(ids).size != ids.size:
            _fail(op, "a row never names a block twice", f"seq {row} repeats a block", [row])
    expected = np.bincount(named, minlength=n) if named.size else np.zeros(n, np.int64)
    expected = expected + cached
    off = np.flatnonzero(expected != counts)
    if off.size:
        _fail(op, "ref_counts[b] == table entries naming b (+1 if cached)",
              f"counts {counts[off][:10].tolist()} vs entries {expected[off][:10].tolist()}", off)
