"""Targeted scenarios for the block-manager ops (seed M4, M6, §7). Random sequences of
ops against the reference live in test_cache_stateful.py."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import CacheConfig
from paged_jax.cache import (
    CacheOpError,
    InvariantError,
    Status,
    append_slots,
    blocks_needed,
    fork,
    init_state,
    num_free_blocks,
    open_sequences,
    raise_for_status,
    release,
    select_parents,
    set_debug_checks,
    truncate,
)

A = jnp.asarray


def i32(*xs):
    return jnp.asarray(xs, jnp.int32)


def new_state(num_blocks=16, block_size=4, max_seqs=8, max_blocks_per_seq=6, policy="lifo"):
    return init_state(CacheConfig(num_blocks, block_size, max_seqs, max_blocks_per_seq), policy)


def with_tokens(state, lens: dict):
    seqs = list(lens)
    state, status = open_sequences(state, i32(*seqs))
    raise_for_status("open", seqs, status)
    max_tokens = max(lens.values())
    state, out = append_slots(state, i32(*seqs), i32(*lens.values()), max_tokens=max_tokens)
    raise_for_status("append", seqs, out.status)
    return state


def assert_unchanged(before, after):
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)


def test_blocks_taken_only_when_last_is_full():
    state = with_tokens(new_state(), {0: 4})
    assert int(num_free_blocks(state)) == 15
    state, out = append_slots(state, i32(0), i32(1))
    assert int(num_free_blocks(state)) == 14  # the first block was full
    state, out2 = append_slots(state, i32(0), i32(1))
    assert int(num_free_blocks(state)) == 14  # room in the second block
    row = np.asarray(state.block_tables[0])
    assert out.slot_mapping.tolist() == [[row[1] * 4 + 0]]
    assert out2.slot_mapping.tolist() == [[row[1] * 4 + 1]]
    assert int(state.seq_lens[0]) == 6


def test_slot_mapping_covers_a_multi_block_chunk():
    state = with_tokens(new_state(), {3: 3})
    state, out = append_slots(state, i32(3, -1), i32(6, 0), max_tokens=8)
    row = np.asarray(state.block_tables[3])
    expected = [row[p // 4] * 4 + p % 4 for p in range(3, 9)] + [-1, -1]
    assert out.slot_mapping[0].tolist() == expected
    assert out.slot_mapping[1].tolist() == [-1] * 8  # padding entry
    assert (np.asarray(out.status) == 0).all()


def test_fork_counts_several_children_of_one_parent():
    state = with_tokens(new_state(), {0: 6})
    state, status = fork(state, i32(0, 0, 0), i32(1, 2, 3))
    assert (np.asarray(status) == 0).all()
    row = np.asarray(state.block_tables[0])[:2]
    assert np.asarray(state.ref_counts)[row].tolist() == [4, 4]
    for child in (1, 2, 3):
        assert np.asarray(state.block_tables[child]).tolist() == np.asarray(state.block_tables[0]).tolist()
        assert int(state.seq_lens[child]) == 6


def test_copy_on_write_of_shared_partial_block_and_last_sharer_keeps_it():
    state = with_tokens(new_state(), {0: 6})
    state, _ = fork(state, i32(0, 0, 0), i32(1, 2, 3))
    shared_last = int(state.block_tables[0, 1])
    state, out = append_slots(state, i32(0, 1, 2, 3), i32(1, 1, 1, 1))
    src, dst = np.asarray(out.copy_src), np.asarray(out.copy_dst)
    # Three copy, the last sharer writes in place: no block is copied needlessly.
    assert src.tolist() == [shared_last] * 3 + [-1]
    assert dst[3] == -1 and len(set(dst[:3].tolist())) == 3
    assert int(state.block_tables[3, 1]) == shared_last
    assert int(state.ref_counts[shared_last]) == 1
    assert int(state.ref_counts[state.block_tables[0, 0]]) == 4  # full prefix block still shared
    # Each new token lands in its own row's private block.
    for i, seq in enumerate((0, 1, 2, 3)):
        assert out.slot_mapping[i, 0] == int(state.block_tables[seq, 1]) * 4 + 2


def test_copy_on_write_when_a_sharer_outside_the_batch_remains():
    state = with_tokens(new_state(), {0: 5})
    state, _ = fork(state, i32(0), i32(1))
    state, out = append_slots(state, i32(1), i32(2), max_tokens=2)
    assert int(out.copy_src[0]) == int(state.block_tables[0, 1])
    assert int(out.copy_dst[0]) == int(state.block_tables[1, 1])


def test_no_copy_when_appending_after_a_full_shared_block():
    state = with_tokens(new_state(), {0: 8})
    state, _ = fork(state, i32(0), i32(1))
    state, out = append_slots(state, i32(0, 1), i32(1, 1))
    assert (np.asarray(out.copy_src) == -1).all()
    assert int(state.ref_counts[state.block_tables[0, 1]]) == 2


def test_release_keeps_shared_blocks_and_frees_the_partial_last_one():
    state = with_tokens(new_state(), {0: 6})
    state, _ = fork(state, i32(0), i32(1))
    state, _ = append_slots(state, i32(1), i32(1))  # child copies the partial block
    free = int(num_free_blocks(state))
    state, status = release(state, i32(0))
    assert (np.asarray(status) == 0).all()
    # Parent's private partial block returns (seed §7.1); the shared full one stays.
    assert int(num_free_blocks(state)) == free + 1
    assert int(state.ref_counts[state.block_tables[1, 0]]) == 1
    state, _ = release(state, i32(1))
    assert int(num_free_blocks(state)) == 16
    assert not np.asarray(state.active).any()


def test_release_family_in_one_call_frees_each_block_once():
    state = with_tokens(new_state(), {0: 7})
    state, _ = fork(state, i32(0, 0), i32(1, 2))
    state, status = release(state, i32(2, 0, 1))
    assert (np.asarray(status) == 0).all() and int(num_free_blocks(state)) == 16


def test_select_parents_beam_step():
    state = with_tokens(new_state(), {0: 6, 1: 3})
    state, _ = fork(state, i32(0, 1), i32(2, 3))
    b1_row = np.asarray(state.block_tables[1]).tolist()
    # Beams 0..3 all continue from old beam 0 except beam 3 from old beam 2.
    state, status = select_parents(state, i32(0, 1, 2, 3), i32(0, 0, 0, 2))
    assert (np.asarray(status) == 0).all()
    row0 = np.asarray(state.block_tables[0])
    for s in range(4):
        assert np.asarray(state.block_tables[s]).tolist() == row0.tolist()
        assert int(state.seq_lens[s]) == 6
    assert np.asarray(state.ref_counts)[row0[:2]].tolist() == [4, 4]
    # Old beam 1's only block (shared with old beam 3) is kept by nobody: back to the pool.
    assert int(state.ref_counts[b1_row[0]]) == 0
    assert int(num_free_blocks(state)) == 14


def test_select_parents_revives_a_dead_row():
    state = with_tokens(new_state(), {0: 5})
    state, status = select_parents(state, i32(4), i32(0))
    assert (np.asarray(status) == 0).all() and bool(state.active[4])
    assert int(state.ref_counts[state.block_tables[0, 0]]) == 2


def test_truncate_releases_blocks_past_the_new_end():
    state = with_tokens(new_state(), {0: 9})
    state, status = truncate(state, i32(0), i32(4))
    assert (np.asarray(status) == 0).all()
    assert int(state.seq_lens[0]) == 4 and int(num_free_blocks(state)) == 15
    assert np.asarray(state.block_tables[0, 1:]).tolist() == [-1] * 5


def test_exhaustion_is_a_status_and_changes_nothing():
    state = with_tokens(new_state(num_blocks=4), {0: 8, 1: 3})
    before = state
    state, out = append_slots(state, i32(0, 1), i32(4, 8), max_tokens=8)
    assert out.status.tolist() == [Status.NO_FREE_BLOCKS, Status.NO_FREE_BLOCKS]
    assert (np.asarray(out.slot_mapping) == -1).all() and (np.asarray(out.copy_src) == -1).all()
    assert_unchanged(before, state)
    with pytest.raises(CacheOpError, match="seq 0: NO_FREE_BLOCKS"):
        raise_for_status("append_slots", [0, 1], out.status)


@pytest.mark.parametrize(
    "op, args, expected",
    [
        ("append", (i32(9), i32(1)), [Status.INVALID_SEQ_ID]),
        ("append", (i32(-2), i32(1)), [Status.INVALID_SEQ_ID]),
        ("append", (i32(5), i32(1)), [Status.INACTIVE_SEQ]),
        ("append", (i32(0, 0), i32(1, 1)), [Status.DUPLICATE_SEQ] * 2),
        ("append", (i32(0), i32(2)), [Status.BAD_NUM_TOKENS]),
        ("append", (i32(0), i32(-1)), [Status.BAD_NUM_TOKENS]),
        ("append_many", (i32(0), i32(16)), [Status.TABLE_FULL]),
        ("release", (i32(5),), [Status.INACTIVE_SEQ]),
        ("release", (i32(0, 0),), [Status.DUPLICATE_SEQ] * 2),
        ("fork", (i32(0), i32(1)), [Status.ACTIVE_SEQ]),
        ("fork", (i32(5), i32(6)), [Status.INACTIVE_SEQ]),
        ("fork", (i32(0), i32(-1)), [Status.INVALID_SEQ_ID]),
        ("open", (i32(1),), [Status.ACTIVE_SEQ]),
        ("truncate", (i32(0), i32(10)), [Status.BAD_NUM_TOKENS]),
        ("select", (i32(2), i32(6)), [Status.INACTIVE_SEQ]),
    ],
)
def test_bad_input_is_a_status_and_changes_nothing(op, args, expected):
    state = with_tokens(new_state(max_blocks_per_seq=4), {0: 3, 1: 2})
    fn = {
        "append": functools.partial(append_slots, max_tokens=1),
        "append_many": functools.partial(append_slots, max_tokens=16),
        "release": release,
        "fork": fork,
        "open": open_sequences,
        "truncate": truncate,
        "select": select_parents,
    }[op]
    new, out = fn(state, *args)
    status = out.status if hasattr(out, "status") else out
    assert status.tolist() == expected
    assert_unchanged(state, new)


def test_one_bad_entry_rejects_the_whole_batch():
    state = with_tokens(new_state(), {0: 3, 1: 2})
    new, out = append_slots(state, i32(0, 7), i32(1, 1))
    assert out.status.tolist() == [Status.OK, Status.INACTIVE_SEQ]
    assert_unchanged(state, new)


def test_blocks_needed_counts_new_and_copy_on_write():
    state = with_tokens(new_state(), {0: 6, 1: 8})
    state, _ = fork(state, i32(0), i32(2))
    needed = blocks_needed(state, i32(0, 1, 2, -1), i32(1, 1, 7, 0))
    # Row 0 copies the block it shares with row 2; row 1's last block is full; row 2,
    # appended after row 0 copied away, keeps the shared block and grows 6+7=13 -> 4 blocks.
    assert needed.tolist() == [1, 1, 2, 0]


def test_one_trace_per_shape_over_a_long_run():
    state = with_tokens(new_state(num_blocks=64, max_blocks_per_seq=16), {0: 1, 1: 1, 2: 1})
    traced = chex.assert_max_traces(append_slots, n=1)
    step = jax.jit(functools.partial(traced, max_tokens=1), donate_argnums=0)
    ids = i32(0, 1, 2, -1)
    for _ in range(40):
        state, out = step(state, ids, i32(1, 1, 1, 0))
        assert (np.asarray(out.status) == 0).all()
    assert state.seq_lens[:3].tolist() == [41, 41, 41]


def test_debug_switch_catches_a_corrupted_state_eagerly_and_under_jit():
    state = with_tokens(new_state(), {0: 6})
    bad = state.replace(ref_counts=state.ref_counts.at[state.block_tables[0, 0]].add(1))
    previous = set_debug_checks(True)
    try:
        with pytest.raises(InvariantError, match="ref_counts"):
            append_slots(bad, i32(0), i32(1))
        with pytest.raises(Exception, match="ref_counts"):
            jax.block_until_ready(jax.jit(fork)(bad, i32(0), i32(1)))
    finally:
        set_debug_checks(previous)


def test_ops_accept_numpy_and_python_ids():
    state = with_tokens(new_state(), {0: 2})
    state, out = append_slots(state, np.array([0], np.int32), A([1], jnp.int32))
    assert out.status.tolist() == [0]


@pytest.mark.parametrize("batch", [1, 8])
def test_donated_state_is_updated_in_place(batch):
    """Flat cost in pool size needs XLA to update the donated pool-sized arrays in place:
    a read-back between two scatters, or a where() over the array, shows up as a copy."""
    import re

    n = 1 << 16
    state = new_state(num_blocks=n, max_seqs=16)
    ids = jnp.arange(batch, dtype=jnp.int32)
    ops = {
        "open": (open_sequences, (ids,)),
        "append": (functools.partial(append_slots, max_tokens=4), (ids, ids)),
        "fork": (fork, (ids, ids + 8)),
        "release": (release, (ids,)),
        "truncate": (truncate, (ids, ids)),
        "select_parents": (select_parents, (ids, ids)),
    }
    previous = set_debug_checks(False)  # the debug callback would hold the state alive
    try:
        for name, (fn, args) in ops.items():
            hlo = jax.jit(fn, donate_argnums=0).lower(state, *args).compile().as_text()
            copies = re.findall(rf"= \w+\[{n}\]\{{0\}} copy\(", hlo)
            assert not copies, f"{name} copies a pool-sized array: {copies}"
    finally:
        set_debug_checks(previous)
