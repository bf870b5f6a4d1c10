"""check_invariants names the broken invariant and the offenders for every kind of damage."""

import re

import jax.numpy as jnp
import pytest

from paged_jax import CacheConfig
from paged_jax.cache import InvariantError, check_invariants, fork, init_state, open_sequences
from paged_jax.cache import append_slots as append


def healthy(policy="lifo"):
    state = init_state(CacheConfig(num_blocks=12, block_size=4, max_seqs=4, max_blocks_per_seq=4), policy)
    state, _ = open_sequences(state, jnp.array([0], jnp.int32))
    state, _ = append(state, jnp.array([0], jnp.int32), jnp.array([6], jnp.int32), max_tokens=6)
    state, _ = fork(state, jnp.array([0], jnp.int32), jnp.array([1], jnp.int32))
    return state


@pytest.mark.parametrize("policy", ["lifo", "fifo", "lowest_id_first", "random"])
def test_healthy_state_passes(policy):
    check_invariants(healthy(policy))


def corrupt(kind):
    s = healthy()
    b0 = int(s.block_tables[0, 0])
    if kind == "count":
        return s.replace(ref_counts=s.ref_counts.at[b0].set(1)), "ref_counts[b] == table entries"
    if kind == "leak":
        # A referenced block loses its only references but never reaches the pool.
        s = s.replace(block_tables=s.block_tables.at[0, 1].set(-1).at[1, 1].set(-1), seq_lens=s.seq_lens.at[0].set(4).at[1].set(4))
        b1 = int(healthy().block_tables[0, 1])
        return s.replace(ref_counts=s.ref_counts.at[b1].set(0)), "leak"
    if kind == "both":
        pool = s.pool._replace(stack=s.pool.stack.at[int(s.pool.num_free)].set(b0), num_free=s.pool.num_free + 1)
        return s.replace(pool=pool), "both free and referenced"
    if kind == "duplicate":
        top = int(s.pool.num_free) - 1
        pool = s.pool._replace(stack=s.pool.stack.at[top].set(s.pool.stack[top - 1]))
        return s.replace(pool=pool), "no duplicate in the free pool"
    if kind == "length":
        return s.replace(seq_lens=s.seq_lens.at[0].set(9)), "lengths consistent with table rows"
    if kind == "past_end":
        return s.replace(seq_lens=s.seq_lens.at[0].set(3), ref_counts=s.ref_counts), "lengths consistent with table rows"
    if kind == "dead_row":
        return s.replace(active=s.active.at[1].set(False)), "inactive rows are empty"
    if kind == "num_free":
        return s.replace(pool=s.pool._replace(num_free=s.pool.num_free - 1)), "leak"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["count", "leak", "both", "duplicate", "length", "past_end", "dead_row", "num_free"])
def test_damage_is_named(kind):
    state, name = corrupt(kind)
    with pytest.raises(InvariantError, match=re.escape(name)) as err:
        check_invariants(state, op="append_slots")
    assert "after append_slots" in str(err.value) and "offenders" in str(err.value)
