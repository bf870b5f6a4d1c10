"""The host view answers the scheduler's block questions from one snapshot: its answers
equal the jitted ops' and the effect of actually doing it, with blocks shared by forks."""

import dataclasses
import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import rule
from test_cache_stateful import BATCH, MAX_SEQS, MAX_TOKENS, BlockManagerMachine, pad, seq_id

from paged_jax import CacheConfig
from paged_jax.cache import (
    NO_BLOCK,
    HostView,
    Status,
    append_slots,
    blocks_needed,
    fork,
    host_view,
    init_state,
    num_free_blocks,
    open_sequences,
    raise_for_status,
    release,
    restore_rows,
    select_parents,
    snapshot,
)


def i32(*xs):
    return jnp.asarray(xs, jnp.int32)


def grown(state, lens: dict):
    """Open the rows of ``lens`` if needed and append that many tokens to each."""
    new = [s for s in lens if not bool(state.active[s])]
    if new:
        state, status = open_sequences(state, i32(*new))
        raise_for_status("open", new, status)
    state, out = append_slots(state, i32(*lens), i32(*lens.values()), max_tokens=max(lens.values()))
    raise_for_status("append", list(lens), out.status)
    return state


def forked(state, parents, children):
    state, status = fork(state, i32(*parents), i32(*children))
    raise_for_status("fork", children, status)
    return state


def freed_by_release(state, rows) -> int:
    new, status = release(state, i32(*rows))
    raise_for_status("release", rows, status)
    return int(num_free_blocks(new)) - int(num_free_blocks(state))


def beams():
    """A parent (row 0, 6 tokens at block size 4: one full block, one partly filled) and
    two forked children: all three share both blocks."""
    state = init_state(CacheConfig(16, 4, 8, 6))
    return forked(grown(state, {0: 6}), [0, 0], [1, 2])


def test_forked_beams_sharing_a_partial_block():
    state = beams()
    view = host_view(state)
    assert view.num_free == 14
    assert view.blocks_held([0]) == 2 and view.blocks_held([0, 1, 2]) == 2
    assert view.blocks_freed([0]) == 0 and view.blocks_freed([0, 1]) == 0
    assert view.blocks_freed([0, 1, 2]) == 2 == freed_by_release(state, [0, 1, 2])
    # One appender copies the shared block; of three, two copy and the last keeps it;
    # a row that appends 3 tokens also spills into a fresh block.
    for ids, n, expected in [
        ([0], [1], [1]),
        ([0, 1, 2], [1, 1, 1], [1, 1, 0]),
        ([0, 1, 2], [3, 1, 1], [2, 1, 0]),
        ([2, 0, 1, -1], [1, 0, 1, 5], [1, 0, 1, 0]),  # row 0 appends nothing: it still holds the block
    ]:
        assert view.blocks_needed(ids, n).tolist() == expected
        assert np.asarray(blocks_needed(state, i32(*ids), i32(*n))).tolist() == expected


def test_two_groups_sharing_a_prefix_block():
    """Rows 0 and 1 share block X, rows 2 and 3 share block Y, all four share prefix P."""
    state = init_state(CacheConfig(16, 4, 8, 6))
    state = forked(grown(state, {0: 4}), [0], [2])  # P, full
    state = grown(state, {0: 2, 2: 2})  # X for row 0, Y for row 2 (P is full: no copy)
    state = forked(state, [0, 2], [1, 3])
    view = host_view(state)
    cases = {(0, 1): (2, 1), (2, 3): (2, 1), (0, 2): (3, 0), (0, 1, 2, 3): (3, 3), (1,): (2, 0)}
    for rows, (held, freed) in cases.items():
        assert view.blocks_held(rows) == held, rows
        assert view.blocks_freed(rows) == freed == freed_by_release(state, rows), rows


def test_dead_padding_and_repeated_ids_hold_nothing_extra():
    view = host_view(beams())
    assert view.blocks_held([-1, 5, 99, -7]) == 0 and view.blocks_freed([5, -1]) == 0
    assert view.blocks_freed([0, 1, 2, 2, 0]) == 2 and view.blocks_held([1, 1]) == 2


def test_blocks_needed_matches_the_jitted_op_for_the_largest_count():
    state = beams()
    big = 2**31 - 1
    ids, n = i32(0, 3, 1, -1), i32(big, big, 1, big)
    host = host_view(state).blocks_needed(ids, n)
    assert host.dtype == np.int32 and host.tolist() == np.asarray(jax.jit(blocks_needed)(state, ids, n)).tolist()
    assert host[0] == -(-(6 + big) // 4) - 2 + 1  # grow plus a copy of the shared block


def test_snapshot_is_jittable_and_small():
    state = beams()
    snap = jax.jit(snapshot)(state)
    assert snap.block_tables.shape == snap.entry_counts.shape == (8, 6)
    assert all(x.size <= 8 * 6 for x in jax.tree.leaves(snap))  # nothing pool-sized
    assert np.asarray(snap.entry_counts)[0].tolist() == [3, 3, 0, 0, 0, 0]
    view = HostView.from_snapshot(snap, state.block_size)
    assert view.blocks_freed([0, 1, 2]) == 2


def test_the_view_is_read_only_and_checks_its_arguments():
    view = host_view(beams())
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.num_free = 3
    with pytest.raises(ValueError, match="read-only"):
        view.entry_counts[0, 0] = 1
    with pytest.raises(TypeError, match="HostView.blocks_needed: num_tokens has dtype float64"):
        view.blocks_needed([0], [1.0])
    with pytest.raises(ValueError, match=r"HostView.blocks_needed: seq_ids has shape \(2,\) but num_tokens"):
        view.blocks_needed([0, 1], [1])
    with pytest.raises(TypeError, match="HostView.blocks_freed: seq_ids has dtype bool"):
        view.blocks_freed([True])


def test_planned_views_equal_the_state_after_the_op():
    state = beams()
    view = host_view(state)
    new, _ = release(state, i32(0, 1))
    assert view.released([0, 1, -1]).same_as(host_view(new))  # row 2 keeps both blocks
    new, _ = open_sequences(state, i32(4, 5))
    assert view.opened([4, 5]).same_as(host_view(new))
    new, _ = fork(state, i32(2, 0), i32(6, 7))
    assert view.forked([2, 0], [6, 7]).same_as(host_view(new))
    # Beams re-chosen: row 1 takes row 0's place, row 5 (dead) becomes a copy of row 2,
    # and row 0 a copy of row 1 as it was before the call.
    new, status = select_parents(state, i32(1, 5, 0), i32(0, 2, 1))
    assert status.tolist() == [0, 0, 0]
    assert view.selected([1, 5, 0], [0, 2, 1]).same_as(host_view(new))
    # Swap the family out and back into other rows: the shared blocks stay shared.
    out = view.released([0, 1, 2])
    tables = [[0, 1, -1, -1, -1, -1]] * 3
    planned = out.restored([3, 4, 5, -1], [6, 6, 6, 0], tables + [[-1] * 6], 2)
    assert planned.num_free == 14 and planned.block_tables[3, :3].tolist() == [-2, -3, -1]
    assert planned.entry_counts[3:6, :2].tolist() == [[3, 3]] * 3
    assert planned.blocks_needed([3, 4, 5], [1, 1, 1]).tolist() == [1, 1, 0]
    new, _ = release(state, i32(0, 1, 2))
    new, ids, status = restore_rows(new, i32(3, 4, 5, -1), i32(6, 6, 6, 0), np.asarray(tables + [[-1] * 6]), 2,
                                    max_local=2)
    assert status.tolist() == [0] * 4
    assert with_real_ids(planned, ids).same_as(host_view(new))
    assert not planned.same_as(host_view(new))  # the stand-in ids are not the device's


# --------------------------------------------------------------------------- random states


@functools.cache
def jitted_snapshot():
    return jax.jit(snapshot)


def with_real_ids(view: HostView, ids) -> HostView:
    """``view`` with the stand-in ids of a restore (-2 - i for local id i) replaced by the
    blocks the device chose."""
    tables = view.block_tables
    if not len(ids):
        return view
    real = np.where(tables < NO_BLOCK, np.asarray(ids)[np.clip(-2 - tables, 0, None)], tables)
    return dataclasses.replace(view, block_tables=real)


def accepted(ref_status) -> bool:
    return all(x == Status.OK for x in ref_status)


class HostViewMachine(BlockManagerMachine):
    """The block-manager machine (forks, select_parents, copy-on-write, swaps: shared
    blocks), with the host view checked against the device: its answers on every append
    and release and on random questions, and its planned views after every accepted
    open, fork, release, select, restore and unshare."""

    def view(self) -> HostView:
        return HostView.from_snapshot(jitted_snapshot()(self.state), self.state.block_size)

    def _apply_append(self, s, nums):
        host = self.view().blocks_needed(pad(s), pad(nums, 0))
        device = self.ops["blocks_needed"](self.state, pad(s), pad(nums, 0))
        assert host.tolist() == np.asarray(device).tolist()
        super()._apply_append(s, nums)

    def _apply_release(self, s):
        before = self.view()
        ref_status = super()._apply_release(s)
        if accepted(ref_status):
            assert self.view().num_available - before.num_available == before.blocks_freed(s)
            assert before.released(s).same_as(self.view())
        return ref_status

    def _apply_open(self, s, prefix=None):
        planned = self.view().opened(s, prefix)
        ref_status = super()._apply_open(s, prefix)
        if accepted(ref_status):
            assert planned.same_as(self.view())
        return ref_status

    def _apply_mark(self, b):
        planned = self.view().marked(b)
        ref_status = super()._apply_mark(b)
        if accepted(ref_status):
            assert planned.same_as(self.view())
        return ref_status

    def _apply_evict(self, b):
        planned = self.view().evicted(b)
        ref_status = super()._apply_evict(b)
        if accepted(ref_status):
            assert planned.same_as(self.view())
        return ref_status

    def _apply_fork(self, parents, children):
        planned = self.view().forked(parents, children)
        ref_status = super()._apply_fork(parents, children)
        if accepted(ref_status):
            assert planned.same_as(self.view())
        return ref_status

    def _apply_select(self, s, parents):
        planned = self.view().selected(s, parents)
        ref_status = super()._apply_select(s, parents)
        if accepted(ref_status):
            assert planned.same_as(self.view())
        return ref_status

    def _apply_restore(self, targets, lens, tables, num_local):
        planned = self.view().restored(targets, lens, tables, num_local)
        ref_status, ids = super()._apply_restore(targets, lens, tables, num_local)
        if accepted(ref_status):
            assert with_real_ids(planned, ids).same_as(self.view())
        return ref_status, ids

    def _apply_unshare(self, s):
        before = self.view()
        ref_status, ids = super()._apply_unshare(s)
        if accepted(ref_status):
            assert with_real_ids(before.unshared(s), ids).same_as(self.view())
            assert before.num_free - before.unshared(s).num_free == len(ids)
        return ref_status, ids

    @rule(data=st.data())
    def ask(self, data):
        """Random questions, padding and junk included: counts up to the int32 limit."""
        view = self.view()
        ids = data.draw(st.lists(seq_id, min_size=BATCH, max_size=BATCH))
        counts = st.one_of(st.integers(-2, 2 * MAX_TOKENS), st.just(2**31 - 1))
        nums = data.draw(st.lists(counts, min_size=BATCH, max_size=BATCH))
        device = self.ops["blocks_needed"](self.state, pad(ids), pad(nums, 0))
        assert view.blocks_needed(ids, nums).tolist() == np.asarray(device).tolist()
        rows = data.draw(st.lists(st.sampled_from(range(MAX_SEQS)), max_size=BATCH, unique=True))
        live = [r for r in rows if r in self.ref.tables]
        assert view.blocks_held(rows) == len({b for r in live for b in self.ref.tables[r]})
        assert view.num_free == self.ref.num_free_blocks()
        assert view.num_cached_free == self.ref.num_cached_free()
        assert view.blocks_held(range(MAX_SEQS)) == self.shape[0] - view.num_available


@pytest.mark.parametrize("shape", [(9, 2, 5), (12, 4, 3)], ids=["bs2", "bs4"])
def test_host_view_matches_the_device_after_random_ops(shape):
    machine = type("HostViewMachine_lifo", (HostViewMachine,), {"policy_name": "lifo", "shape": shape})
    machine.TestCase.settings = settings(
        max_examples=20, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
    )
    machine.TestCase().runTest()
