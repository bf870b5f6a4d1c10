"""The host model answers the scheduler's block questions (held, freed, needed, and the
what-ifs: the model after an op): its answers equal the jitted ops' and the effect of
actually doing it, with blocks shared by forks; a planning copy never runs out."""

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
    HostBlockManager,
    PlanningError,
    Status,
    append_slots,
    blocks_needed,
    fork,
    init_state,
    num_free_blocks,
    open_sequences,
    raise_for_status,
    release,
    restore_rows,
    select_parents,
)


def host_view(state) -> HostBlockManager:
    return HostBlockManager.from_state(state)


def same(model: HostBlockManager, state) -> bool:
    why = model.mismatch(state)
    assert why is None, why
    return True


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


def test_entry_counts_and_the_argument_checks():
    view = host_view(beams())
    assert view.entry_counts([0])[0].tolist() == [3, 3, 0, 0, 0, 0]
    with pytest.raises(TypeError, match="blocks_needed: num_tokens has dtype float64"):
        view.blocks_needed([0], [1.0])
    with pytest.raises(ValueError, match=r"blocks_needed: seq_ids has shape \(2,\) but num_tokens"):
        view.blocks_needed([0, 1], [1])
    with pytest.raises(TypeError, match="release: seq_ids has dtype bool"):
        view.release([True])


def test_planned_views_equal_the_state_after_the_op():
    state = beams()
    view = host_view(state)
    new, _ = release(state, i32(0, 1))
    assert same(view.released([0, 1, -1]), new)  # row 2 keeps both blocks
    new, _ = open_sequences(state, i32(4, 5))
    assert same(view.opened([4, 5]), new)
    new, _ = fork(state, i32(2, 0), i32(6, 7))
    assert same(view.forked([2, 0], [6, 7]), new)
    # Beams re-chosen: row 1 takes row 0's place, row 5 (dead) becomes a copy of row 2,
    # and row 0 a copy of row 1 as it was before the call.
    new, status = select_parents(state, i32(1, 5, 0), i32(0, 2, 1))
    assert status.tolist() == [0, 0, 0]
    assert same(view.selected([1, 5, 0], [0, 2, 1]), new)
    # Swap the family out and back into other rows: the shared blocks stay shared, and the
    # planned restore predicts the very blocks the device takes.
    out = view.released([0, 1, 2])
    tables = [[0, 1, -1, -1, -1, -1]] * 3
    planned = out.restored([3, 4, 5, -1], [6, 6, 6, 0], tables + [[-1] * 6], 2)
    assert planned.num_free == 14 and planned.entry_counts([3, 4, 5])[:, :2].tolist() == [[3, 3]] * 3
    assert planned.blocks_needed([3, 4, 5], [1, 1, 1]).tolist() == [1, 1, 0]
    new, _ = release(state, i32(0, 1, 2))
    new, ids, status = restore_rows(new, i32(3, 4, 5, -1), i32(6, 6, 6, 0), np.asarray(tables + [[-1] * 6]), 2,
                                    max_local=2)
    assert status.tolist() == [0] * 4
    assert same(planned, new)
    assert view.num_free == 14  # what-ifs leave the model they ask unchanged


def test_a_planning_copy_overdraws_instead_of_failing_and_a_plan_that_cannot_apply_raises():
    """Swap-ins are planned before the step's evictions: a what-if may take more blocks than
    the pool holds now (virtual blocks past the pool), counted as a negative free count.
    The model itself refuses, as the device would."""
    state = init_state(CacheConfig(4, 4, 4, 4))
    view = host_view(grown(state, {0: 12}))  # 3 of 4 blocks held
    assert view.num_free == 1
    planned = view.restored([1, -1], [12, 0], [[0, 1, 2, -1], [-1] * 4], 3)
    assert planned.num_free == -2 and planned.blocks_held([1]) == 3
    assert planned.released([1]).num_free == 1  # the virtual blocks go away first
    status, _ = view.copy().restore_rows([1], [12], [[0, 1, 2, -1]], 3, max_local=3)
    assert status.tolist() == [Status.NO_FREE_BLOCKS]
    with pytest.raises(PlanningError, match="open_sequences"):
        view.opened([0])  # row 0 is live


# --------------------------------------------------------------------------- random states


def accepted(ref_status) -> bool:
    return all(x == Status.OK for x in np.asarray(ref_status).tolist())


class HostModelMachine(BlockManagerMachine):
    """The block-manager machine (forks, select_parents, copy-on-write, swaps: shared
    blocks), with the host model's planning answers checked against the device: its answers
    on every append and release and on random questions, and its what-ifs after every
    accepted open, mark, evict, fork, release, select, restore and unshare."""

    def view(self) -> HostBlockManager:
        return HostBlockManager.from_state(self.state)

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
            assert same(before.released(s), self.state)
        return ref_status

    def _planned(self, what_if, apply):
        """Apply the op; if the device accepted it, the what-if equals the new state."""
        try:
            planned = what_if()
        except PlanningError:
            planned = None
        out = apply()
        if accepted(out[0] if isinstance(out, tuple) else out):
            assert planned is not None and same(planned, self.state)
        return out

    def _apply_open(self, s, prefix=None):
        return self._planned(lambda: self.view().opened(s, prefix), lambda: super(HostModelMachine, self)._apply_open(s, prefix))

    def _apply_mark(self, b):
        return self._planned(lambda: self.view().marked(b), lambda: super(HostModelMachine, self)._apply_mark(b))

    def _apply_evict(self, b):
        return self._planned(lambda: self.view().evicted(b), lambda: super(HostModelMachine, self)._apply_evict(b))

    def _apply_fork(self, parents, children):
        return self._planned(lambda: self.view().forked(parents, children),
                             lambda: super(HostModelMachine, self)._apply_fork(parents, children))

    def _apply_select(self, s, parents):
        return self._planned(lambda: self.view().selected(s, parents),
                             lambda: super(HostModelMachine, self)._apply_select(s, parents))

    def _apply_restore(self, targets, lens, tables, num_local):
        return self._planned(lambda: self.view().restored(targets, lens, tables, num_local),
                             lambda: super(HostModelMachine, self)._apply_restore(targets, lens, tables, num_local))

    def _apply_unshare(self, s):
        return self._planned(lambda: self.view().unshared(s), lambda: super(HostModelMachine, self)._apply_unshare(s))

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
        tables = self.ref.tables
        live = [r for r in rows if r in tables]
        assert view.blocks_held(rows) == len({b for r in live for b in tables[r]})
        assert view.num_free == int(num_free_blocks(self.state))
        assert view.blocks_held(range(MAX_SEQS)) == self.shape[0] - view.num_available


@pytest.mark.parametrize("shape", [pytest.param((9, 2, 5), id="bs2", marks=pytest.mark.slow), pytest.param((12, 4, 3), id="bs4")])  # bs2: full suite only
def test_host_model_answers_match_the_device_after_random_ops(shape):
    machine = type("HostModelMachine_lifo", (HostModelMachine,), {"policy_name": "lifo", "shape": shape})
    machine.TestCase.settings = settings(
        max_examples=20, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
    )
    machine.TestCase().runTest()
