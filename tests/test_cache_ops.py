"""Targeted scenarios for the block-manager ops: growth, sharing and copy-on-write,
release, rejection, the argument checks at the boundary, the debug switch, and
restore_rows. Random sequences of ops against the reference live in
test_cache_stateful.py."""

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
    check_invariants,
    fork,
    init_state,
    num_free_blocks,
    open_sequences,
    raise_for_status,
    release,
    restore_rows,
    select_parents,
    set_debug_checks,
    truncate,
    unshare,
    with_debug_checks,
)
from paged_jax.cache import state as cache_state

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
    # Parent's private partial block returns (a partly filled block is freed like any
    # other); the shared full one stays.
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


def test_unshare_copies_every_shared_block_and_the_last_holder_keeps_it():
    state = with_tokens(new_state(), {0: 6})  # blocks [a, b], b partly filled
    state, _ = fork(state, i32(0, 0), i32(1, 2))  # three rows share a and b (counts 3)
    a, b = np.asarray(state.block_tables[0, :2]).tolist()
    state, out = jax.jit(unshare)(state, i32(1, 0, -1))  # padding is ignored
    assert (np.asarray(out.status) == 0).all()
    # Row 1 copies both (counts 3 -> 2), then row 0 copies both (2 -> 1): row 2 keeps them.
    src, dst = np.asarray(out.copy_src), np.asarray(out.copy_dst)
    pairs = [(int(x), int(y)) for x, y in zip(src, dst) if x >= 0]
    assert [x for x, _ in pairs] == [a, b, a, b] and len({y for _, y in pairs}) == 4
    assert np.asarray(state.block_tables[2, :2]).tolist() == [a, b]
    for row, copies in ((1, pairs[:2]), (0, pairs[2:])):
        assert np.asarray(state.block_tables[row, :2]).tolist() == [y for _, y in copies]
    assert (np.asarray(state.ref_counts)[[a, b] + [y for _, y in pairs]] == 1).all()
    assert int(num_free_blocks(state)) == 16 - 6
    check_invariants(state)
    # Nothing shared any more: a second call copies nothing.
    state, out = unshare(state, i32(0, 1, 2))
    assert (np.asarray(out.copy_src) == -1).all() and int(num_free_blocks(state)) == 10


def test_unshare_with_too_few_free_blocks_changes_nothing():
    state = with_tokens(new_state(num_blocks=4), {0: 6})
    state, _ = fork(state, i32(0, 0), i32(1, 2))  # 2 blocks held, 2 free; unsharing 1 and 2 needs 4
    before = jax.device_get(state)
    state, out = unshare(state, i32(1, 2))
    assert np.asarray(out.status).tolist() == [Status.NO_FREE_BLOCKS] * 2
    assert (np.asarray(out.copy_dst) == -1).all()
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state))):
        np.testing.assert_array_equal(x, y)


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


def corrupted(state):
    """``state`` with one ref count off by one: check_invariants rejects it."""
    return state.replace(ref_counts=state.ref_counts.at[state.block_tables[0, 0]].add(1))


def test_debug_switch_catches_a_corrupted_state_eagerly_and_under_jit():
    bad = with_debug_checks(corrupted(with_tokens(new_state(), {0: 6})), True)
    with pytest.raises(InvariantError, match="ref_counts"):
        append_slots(bad, i32(0), i32(1))
    with pytest.raises(Exception, match="ref_counts"):
        jax.block_until_ready(jax.jit(fork)(bad, i32(0), i32(1)))


def test_debug_flag_is_part_of_the_jit_key():
    """jit retraces exactly when the flag changes, and a traced function keeps checking
    (or not) whatever the process default does afterwards."""
    quiet = with_debug_checks(corrupted(with_tokens(new_state(), {0: 6})), False)
    traces = []

    def op(state, parents, children):
        traces.append(state.debug)
        return fork(state, parents, children)

    step = jax.jit(op)
    jax.block_until_ready(step(quiet, i32(0), i32(1)))  # no check: the corruption passes
    with pytest.raises(Exception, match="ref_counts"):
        jax.block_until_ready(step(with_debug_checks(quiet, True), i32(0), i32(1)))
    assert traces == [False, True]
    previous = set_debug_checks(True)
    try:
        jax.block_until_ready(step(quiet, i32(0), i32(1)))  # cached trace, still unchecked
        fork(quiet, i32(0), i32(1))  # eager: follows the state, not the default
    finally:
        set_debug_checks(previous)
    assert traces == [False, True]


def test_set_debug_checks_sets_the_default_for_new_states_only():
    previous = set_debug_checks(False)
    try:
        old = new_state()
        assert set_debug_checks(True) is False
        assert new_state().debug and not old.debug
        assert not init_state(CacheConfig(4, 4, 2, 2), debug=False).debug
        derived, _ = open_sequences(old, i32(0))
        assert not derived.debug  # ops carry the flag along
    finally:
        set_debug_checks(previous)


@pytest.mark.parametrize("value, on", [(None, False), ("", False), ("0", False), ("1", True), ("yes", True)])
def test_environment_variable_values(value, on):
    assert cache_state._env_flag(value) is on


def test_ops_accept_numpy_and_python_ids():
    state = with_tokens(new_state(), {0: 2})
    state, out = append_slots(state, np.array([0], np.int32), A([1], jnp.int32))
    assert out.status.tolist() == [0]
    state, status = open_sequences(state, [3, 4])  # Python ints
    assert status.tolist() == [0, 0]
    state, out = append_slots(state, np.array([3, 4], np.int64), np.array([1, 1], np.int16))  # in-range int64
    assert out.status.tolist() == [0, 0] and state.seq_lens[3:5].tolist() == [1, 1]
    state, status = jax.jit(release)(state, [3, 4])  # a list under jit: traced scalars
    assert status.tolist() == [0, 0] and not bool(state.active[3])


@pytest.mark.parametrize("batch", [1, 8])
def test_donated_state_is_updated_in_place(batch):
    """Flat cost in pool size needs XLA to update the donated pool-sized arrays in place:
    a read-back between two scatters, or a where() over the array, shows up as a copy."""
    import re

    n = 1 << 16
    state = with_debug_checks(new_state(num_blocks=n, max_seqs=16), False)  # the callback would hold the state alive
    ids = jnp.arange(batch, dtype=jnp.int32)
    ops = {
        "restore_rows": (
            functools.partial(restore_rows, max_local=batch),
            (ids, jnp.full((batch,), 4, jnp.int32), jnp.full((batch, 6), -1, jnp.int32).at[:, 0].set(ids), jnp.int32(batch)),
        ),
        "open": (open_sequences, (ids,)),
        "append": (functools.partial(append_slots, max_tokens=4), (ids, ids)),
        "fork": (fork, (ids, ids + 8)),
        "release": (release, (ids,)),
        "truncate": (truncate, (ids, ids)),
        "select_parents": (select_parents, (ids, ids)),
        "unshare": (unshare, (ids,)),
    }
    for name, (fn, args) in ops.items():
        hlo = jax.jit(fn, donate_argnums=0).lower(state, *args).compile().as_text()
        copies = re.findall(rf"= \w+\[{n}\]\{{0\}} copy\(", hlo)
        assert not copies, f"{name} copies a pool-sized array: {copies}"


# --------------------------------------------------------------------------- the boundary

BOUNDARY_OPS = {
    "open_sequences": (open_sequences, {}),
    "append_slots": (append_slots, dict(max_tokens=4)),
    "fork": (fork, {}),
    "release": (release, {}),
    "truncate": (truncate, {}),
    "select_parents": (select_parents, {}),
    "blocks_needed": (blocks_needed, {}),
    "restore_rows": (restore_rows, dict(max_local=4)),
}


def call(name, state, *args, jit=False):
    fn, kwargs = BOUNDARY_OPS[name]
    fn = functools.partial(fn, **kwargs)
    return jax.jit(fn)(state, *args) if jit else fn(state, *args)


ROW = jnp.full((1, 6), -1, jnp.int32)


@functools.cache
def boundary_state():
    """Rows 0 and 1 live (3 and 2 tokens). Shared by the boundary tests, which raise
    before any op runs; states are immutable, so sharing one is safe."""
    return with_tokens(new_state(), {0: 3, 1: 2})


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "name, args, message",
    [
        # The fuzz's case: the child used to broadcast, both forks landed in row 2 and a block leaked.
        ("fork", (i32(0, 1), i32(2)), r"fork: parent_ids has shape \(2,\) but child_ids has shape \(1,\)"),
        ("append_slots", (i32(0, 1), i32(1)), r"append_slots: seq_ids has shape \(2,\) but num_tokens has shape \(1,\)"),
        ("truncate", (i32(0), i32(1, 1)), r"truncate: seq_ids has shape \(1,\) but new_lens has shape \(2,\)"),
        ("select_parents", (i32(0, 1), i32(0)), r"select_parents: seq_ids has shape \(2,\) but parent_ids"),
        ("blocks_needed", (i32(0), i32(1, 2, 3)), r"blocks_needed: seq_ids has shape \(1,\) but num_tokens"),
        ("restore_rows", (i32(4), i32(1, 1), ROW, 1), r"restore_rows: seq_ids has shape \(1,\) but seq_lens"),
        ("restore_rows", (i32(4, 5), i32(1, 1), ROW, 1), r"restore_rows: seq_ids has shape \(2,\) but local_tables has shape \(2?1, 6\)"),
        ("open_sequences", (jnp.zeros((2, 2), jnp.int32),), r"open_sequences: seq_ids has shape \(2, 2\); it must have rank 1"),
        ("release", (jnp.int32(0),), r"release: seq_ids has shape \(\); it must have rank 1"),
        ("append_slots", (i32(0), jnp.ones((1, 1), jnp.int32)), r"append_slots: num_tokens has shape \(1, 1\)"),
        ("restore_rows", (i32(4), i32(1), i32(0), 1), r"restore_rows: local_tables has shape \(1,\); it must have rank 2"),
        ("restore_rows", (i32(4), i32(1), ROW, i32(1)), r"restore_rows: num_local has shape \(1,\); it must have rank 0"),
        ("restore_rows", (i32(4), i32(1), jnp.full((1, 7), -1, jnp.int32), 1), r"width must be at most max_blocks_per_seq=6"),
    ],
)
def test_wrong_rank_or_batch_length_is_a_value_error_naming_the_shapes(name, args, message, jit):
    state = boundary_state()
    with pytest.raises(ValueError, match=message):
        call(name, state, *args, jit=jit)


# (op, arguments, index of the argument to spoil, its name)
DTYPE_CASES = [
    ("open_sequences", (i32(3),), 0, "seq_ids"),
    ("append_slots", (i32(0), i32(1)), 0, "seq_ids"),
    ("append_slots", (i32(0), i32(1)), 1, "num_tokens"),
    ("fork", (i32(0), i32(3)), 0, "parent_ids"),
    ("fork", (i32(0), i32(3)), 1, "child_ids"),
    ("release", (i32(0),), 0, "seq_ids"),
    ("truncate", (i32(0), i32(1)), 1, "new_lens"),
    ("select_parents", (i32(3), i32(0)), 0, "seq_ids"),
    ("select_parents", (i32(3), i32(0)), 1, "parent_ids"),
    ("blocks_needed", (i32(0), i32(1)), 1, "num_tokens"),
    ("restore_rows", (i32(4), i32(1), ROW.at[0, 0].set(0), jnp.int32(1)), 0, "seq_ids"),
    ("restore_rows", (i32(4), i32(1), ROW.at[0, 0].set(0), jnp.int32(1)), 1, "seq_lens"),
    ("restore_rows", (i32(4), i32(1), ROW.at[0, 0].set(0), jnp.int32(1)), 2, "local_tables"),
    ("restore_rows", (i32(4), i32(1), ROW.at[0, 0].set(0), jnp.int32(1)), 3, "num_local"),
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", [jnp.float32, bool])
@pytest.mark.parametrize("name, args, which, arg_name", DTYPE_CASES, ids=[f"{c[0]}-{c[3]}" for c in DTYPE_CASES])
def test_bool_or_float_argument_is_a_type_error_naming_it(name, args, which, arg_name, dtype, jit):
    state = boundary_state()
    args = list(args)
    args[which] = args[which].astype(dtype)
    dtype_name = np.dtype(dtype).name
    with pytest.raises(TypeError, match=rf"{name}: {arg_name} has dtype {dtype_name}"):
        call(name, state, *args, jit=jit)


def test_float_counts_are_refused_not_truncated():
    """A float count used to be truncated (with a warning) and could make slot ids below -1."""
    state = boundary_state()
    with pytest.raises(TypeError, match="num_tokens has dtype float64"):
        append_slots(state, [0], [1.7])
    with pytest.raises(TypeError, match="num_tokens has dtype float32"):
        append_slots(state, i32(0), np.array([-0.5], np.float32))


def test_true_is_not_row_one():
    state = boundary_state()
    with pytest.raises(TypeError, match="seq_ids has dtype bool"):
        release(state, [True])
    with pytest.raises(TypeError, match="seq_ids has dtype bool"):
        release(state, np.array([True]))


@pytest.mark.parametrize("name, args", [
    ("release", (np.array([2**32 + 1], np.int64),)),  # would wrap to row 1
    ("append_slots", (i32(0), np.array([2**32], np.int64))),  # would wrap to 0 tokens
    ("open_sequences", ([-(2**31) - 1],)),
    ("truncate", (i32(0), np.array([2**31], np.uint64))),
])
def test_concrete_values_outside_int32_are_a_value_error(name, args):
    state = boundary_state()
    with pytest.raises(ValueError, match="holds values outside int32"):
        call(name, state, *args)


def test_traced_ids_wider_than_int32_are_refused():
    """Under jit the values cannot be checked, so a dtype that could hold a wrapped id is refused."""
    state = boundary_state()
    with pytest.raises(TypeError, match="release: seq_ids is traced with dtype uint32"):
        jax.jit(release)(state, jnp.array([0], jnp.uint32))


@pytest.mark.parametrize("max_tokens", [0, True, 2**31, 1.5])
def test_max_tokens_must_be_a_positive_int(max_tokens):
    state = boundary_state()
    with pytest.raises(ValueError, match="append_slots: max_tokens="):
        append_slots(state, i32(0), i32(1), max_tokens=max_tokens)


def exact_blocks_needed(length, n, bs, cow):
    return -(-(length + n) // bs) - -(-length // bs) + cow  # Python ints: no overflow


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 4])
def test_blocks_needed_is_exact_for_the_largest_int32_count(block_size):
    """It used to overflow: 2**31 - 1 tokens gave -536870913 blocks."""
    big = 2**31 - 1
    state = with_tokens(new_state(block_size=block_size), {0: 6, 1: 4, 2: 1})
    state, _ = fork(state, i32(2), i32(3))  # rows 2 and 3 share a partly filled block (bs 4)
    for fn in (blocks_needed, jax.jit(blocks_needed)):
        got = fn(state, i32(0, 1, 2, 4), i32(big, big, big, big)).tolist()
        cow = 1 if block_size > 1 else 0
        lens = [6, 4, 1, 0]
        assert got == [exact_blocks_needed(n, big, block_size, c) for n, c in zip(lens, [0, 0, cow, 0])]
        assert min(got) > 0


@pytest.mark.slow
def test_huge_counts_are_bad_num_tokens_and_never_wrap():
    big = 2**31 - 1
    state = with_tokens(new_state(), {0: 6})
    for max_tokens in (1, 64):
        new, out = append_slots(state, i32(0), i32(big), max_tokens=max_tokens)
        assert out.status.tolist() == [Status.BAD_NUM_TOKENS]
        assert (np.asarray(out.slot_mapping) == -1).all()
        assert_unchanged(state, new)
    new, status = truncate(state, i32(0), i32(big))
    assert status.tolist() == [Status.BAD_NUM_TOKENS]
    assert_unchanged(state, new)


def test_a_batch_is_validated_against_the_state_before_the_call():
    state = new_state()
    new, status = open_sequences(state, i32(2, 2))
    assert status.tolist() == [Status.DUPLICATE_SEQ] * 2  # not OK, then ACTIVE_SEQ
    assert_unchanged(state, new)
    state = with_tokens(state, {0: 3})
    new, status = fork(state, i32(0, 1), i32(1, 2))  # row 1 is not live before the call
    assert status.tolist() == [Status.OK, Status.INACTIVE_SEQ]
    assert_unchanged(state, new)


# --------------------------------------------------------------------------- restore_rows


def test_restore_rows_rebuilds_shared_blocks_with_their_counts():
    """Two rows share a full prefix block and a partly filled last block (a forked pair);
    a third shares only the prefix."""
    state = with_tokens(new_state(), {5: 3})  # something else holds a block already
    free = int(num_free_blocks(state))
    tables = -np.ones((4, 6), np.int32)
    tables[0, :2] = [0, 1]
    tables[1, :2] = [0, 1]
    tables[2, :2] = [0, 2]
    state, ids, status = restore_rows(state, i32(0, 1, 2, -1), i32(6, 6, 5, 0), tables, jnp.int32(3), max_local=4)
    assert status.tolist() == [0, 0, 0, 0]
    ids = np.asarray(ids)
    assert ids[3] == -1 and len(set(ids[:3].tolist())) == 3
    assert int(num_free_blocks(state)) == free - 3
    assert np.asarray(state.ref_counts)[ids[:3]].tolist() == [3, 2, 1]
    assert state.block_tables[0].tolist() == [ids[0], ids[1], -1, -1, -1, -1]
    assert state.block_tables[1].tolist() == state.block_tables[0].tolist()
    assert state.block_tables[2, :2].tolist() == [ids[0], ids[2]]
    assert state.seq_lens[:3].tolist() == [6, 6, 5] and state.active[:3].all()
    # Sharing behaves as after a fork: the pair copies its shared partial block, the
    # third row writes into its own.
    state, out = append_slots(state, i32(0, 2), i32(1, 1))
    assert out.copy_src.tolist() == [ids[1], -1]
    state, _ = release(state, i32(0, 1, 2, 5))
    assert int(num_free_blocks(state)) == 16


def test_restore_rows_with_a_narrow_table_and_an_empty_row():
    state = new_state()
    state, ids, status = restore_rows(state, i32(1, 2), i32(5, 0), [[0, 1], [-1, -1]], 2, max_local=2)
    assert status.tolist() == [0, 0]
    assert state.block_tables[1].tolist() == np.asarray(ids).tolist() + [-1] * 4
    assert bool(state.active[2]) and int(state.seq_lens[2]) == 0


GOOD = [[0, 1, -1], [0, 2, -1]]  # rows of length 6 and 5 at block size 4


@pytest.mark.parametrize(
    "seq_ids, lens, tables, num_local, expected",
    [
        ((1, 2), (6, 5), [[1, 3, -1], [0, 2, -1]], 3, [Status.BAD_TABLE, Status.OK]),  # id >= num_local
        ((1, 2), (6, 5), [[0, -1, -1], [0, 2, -1]], 3, [Status.BAD_TABLE, Status.OK]),  # NO_BLOCK inside (1 then unnamed)
        ((1, 2), (6, 5), [[0, 1, 2], [0, 2, -1]], 3, [Status.BAD_TABLE, Status.OK]),  # a block past the length
        ((1, 2), (6, 5), [[0, 0, -1], [1, 2, -1]], 3, [Status.BAD_TABLE, Status.OK]),  # a local id twice in one row
        ((1, 2, -1), (6, 5, 0), GOOD + [[-1] * 3], 4, [Status.BAD_TABLE] * 3),  # local id 3 named by nobody
        ((1, 2), (6, 5), GOOD, 5, [Status.BAD_TABLE] * 2),  # num_local > max_local
        ((1, 2), (6, 5), GOOD, -1, [Status.BAD_TABLE] * 2),  # negative num_local
        ((1, 2), (13, 5), GOOD, 3, [Status.BAD_NUM_TOKENS, Status.OK]),  # longer than the table's 3 blocks
        ((1, 2), (-1, 5), GOOD, 3, [Status.BAD_NUM_TOKENS, Status.OK]),  # (1 then unnamed)
        ((0, 2), (6, 5), GOOD, 3, [Status.ACTIVE_SEQ, Status.OK]),
        ((2, 2), (6, 5), GOOD, 3, [Status.DUPLICATE_SEQ] * 2),
        ((9, 2), (6, 5), GOOD, 3, [Status.INVALID_SEQ_ID, Status.OK]),
    ],
)
def test_restore_rows_rejects_malformed_groups_and_changes_nothing(seq_ids, lens, tables, num_local, expected):
    state = with_tokens(new_state(), {0: 3})
    new, ids, status = restore_rows(state, i32(*seq_ids), i32(*lens), np.asarray(tables, np.int32), num_local, max_local=4)
    assert status.tolist() == expected
    assert (np.asarray(ids) == -1).all()
    assert_unchanged(state, new)


def test_restore_rows_is_all_or_nothing_on_a_short_pool():
    state = with_tokens(new_state(num_blocks=4), {0: 9})  # 3 of 4 blocks held
    new, ids, status = restore_rows(state, i32(1, 2), i32(6, 0), [[0, 1, -1], [-1, -1, -1]], 2, max_local=2)
    assert status.tolist() == [Status.NO_FREE_BLOCKS, Status.OK]  # the empty row needs nothing
    assert (np.asarray(ids) == -1).all()
    assert_unchanged(state, new)
