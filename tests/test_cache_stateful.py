"""Hypothesis drives random op sequences through the jitted block manager and the
pure-Python reference, for every policy, comparing everything observable after each step.
check_invariants runs after every op (conftest turns the debug switch on)."""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from paged_jax import CacheConfig
from paged_jax.cache import (
    Status,
    append_slots,
    check_invariants,
    fork,
    get_policy,
    init_state,
    open_sequences,
    release,
    select_parents,
    set_debug_checks,
    truncate,
)
from paged_jax.cache import ops as cache_ops
from paged_jax.cache.reference import ReferenceBlockManager

BATCH = 4  # every op is called with this many entries, padded with -1: one trace per op
MAX_TOKENS = 5
MAX_SEQS = 6


@functools.cache
def jitted():
    return dict(
        open=jax.jit(open_sequences),
        append=jax.jit(functools.partial(append_slots, max_tokens=MAX_TOKENS)),
        fork=jax.jit(fork),
        release=jax.jit(release),
        truncate=jax.jit(truncate),
        select=jax.jit(select_parents),
        blocks_needed=jax.jit(cache_ops.blocks_needed),
    )


# Mostly valid live-range ids, sometimes padding or out of range.
seq_id = st.one_of(
    st.integers(0, MAX_SEQS - 1), st.integers(0, MAX_SEQS - 1), st.just(-1), st.sampled_from([-3, MAX_SEQS, 99])
)
ids = st.lists(seq_id, min_size=1, max_size=BATCH)


def pad(values, fill=-1):
    return jnp.asarray(list(values) + [fill] * (BATCH - len(values)), jnp.int32)


def device_allocated_ids(before, after, ids_, nums, copy_dst):
    """Ids the device handed out, in allocation order (for the random policy's oracle)."""
    bs = before.block_size
    lens, table = np.asarray(before.seq_lens), np.asarray(after.block_tables)
    out = []
    for i, (s, n) in enumerate(zip(ids_, nums)):
        if not 0 <= s < MAX_SEQS or n <= 0:
            continue
        if int(copy_dst[i]) >= 0:
            out.append(int(copy_dst[i]))
        old, new = -(-int(lens[s]) // bs), -(-(int(lens[s]) + n) // bs)
        out.extend(int(b) for b in table[s, old:new])
    return out


class BlockManagerMachine(RuleBasedStateMachine):
    policy_name = "lifo"
    shape = (9, 2, 5)  # (num_blocks, block_size, max_blocks_per_seq): fixed, so one trace per op

    @initialize()
    def setup(self):
        num_blocks, block_size, max_blocks_per_seq = self.shape
        config = CacheConfig(num_blocks, block_size, MAX_SEQS, max_blocks_per_seq)
        self.policy = get_policy(self.policy_name)
        self.state = init_state(config, self.policy)
        self.ref = ReferenceBlockManager(num_blocks, block_size, MAX_SEQS, max_blocks_per_seq, self.policy_name)
        self.ops = jitted()

    def _step(self, before, after, status, ref_status):
        assert np.asarray(status)[: len(ref_status)].tolist() == [int(s) for s in ref_status]
        assert (np.asarray(status)[len(ref_status):] == Status.OK).all()  # padding is always OK
        if any(s != Status.OK for s in ref_status):
            # Rejected: the state is exactly what it was.
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
                np.testing.assert_array_equal(a, b)
        self.state = after

    # Ids are mostly sensible (live rows for append/release, free rows for open/fork
    # children), so most calls apply and states get deep; sometimes arbitrary, so every
    # rejection path is exercised too.
    def _ids(self, data, *, live: bool | None, k=None):
        if data.draw(st.integers(0, 9)) == 0:
            return data.draw(ids if k is None else st.lists(seq_id, min_size=k, max_size=k))
        if live is None:
            candidates = list(range(MAX_SEQS))
        else:
            candidates = [s for s in range(MAX_SEQS) if (s in self.ref.tables) == live]
        size = k if k is not None else data.draw(st.integers(1, BATCH))
        if live is None or k is None:
            picked = data.draw(st.permutations(candidates))[:size] if candidates else []
        else:
            picked = data.draw(st.lists(st.sampled_from(candidates), min_size=k, max_size=k)) if candidates else []
        picked = list(picked) + [-1] * (size - len(picked))
        return data.draw(st.permutations(picked)) if picked else [-1]

    @rule(data=st.data())
    def open(self, data):
        s = self._ids(data, live=False)
        new, status = self.ops["open"](self.state, pad(s))
        self._step(self.state, new, status, self.ref.open_sequences(s))

    @rule(data=st.data())
    def append(self, data):
        s = self._ids(data, live=True)
        sane = data.draw(st.integers(0, 9)) > 0
        counts = st.integers(0, MAX_TOKENS) if sane else st.integers(-1, MAX_TOKENS + 1)
        nums = data.draw(st.lists(counts, min_size=len(s), max_size=len(s)))
        self._apply_append(s, nums)

    def _apply_append(self, s, nums):
        needed = self.ops["blocks_needed"](self.state, pad(s), pad(nums, 0))
        new, out = self.ops["append"](self.state, pad(s), pad(nums, 0))
        device_ids = None
        if not self.policy.deterministic:
            device_ids = device_allocated_ids(self.state, new, s, nums, out.copy_dst)
        ref_need = self.ref.blocks_needed(s, nums)
        ref_status, ref_slots, ref_copies = self.ref.append_slots(s, nums, MAX_TOKENS, device_ids)
        self._step(self.state, new, out.status, ref_status)
        if all(x == Status.OK for x in ref_status):
            assert np.asarray(needed)[: len(s)].tolist() == ref_need
        assert np.asarray(out.slot_mapping)[: len(s)].tolist() == ref_slots
        src, dst = np.asarray(out.copy_src), np.asarray(out.copy_dst)
        assert [(int(a), int(b)) for a, b in zip(src, dst) if a >= 0] == ref_copies
        assert ((src >= 0) == (dst >= 0)).all()

    @rule(data=st.data())
    def fork(self, data):
        children = self._ids(data, live=False)
        parents = self._ids(data, live=True, k=len(children))
        parents = [p if c != -1 else -1 for p, c in zip(parents, children)]
        self._apply_fork(parents, children)

    def _apply_fork(self, parents, children):
        new, status = self.ops["fork"](self.state, pad(parents), pad(children))
        self._step(self.state, new, status, self.ref.fork(parents, children))

    @rule(data=st.data())
    def release(self, data):
        self._apply_release(self._ids(data, live=True))

    def _apply_release(self, s):
        new, status = self.ops["release"](self.state, pad(s))
        self._step(self.state, new, status, self.ref.release(s))

    @rule(data=st.data())
    def truncate(self, data):
        s = self._ids(data, live=True)
        lens = [data.draw(st.integers(-1, self.ref.lens.get(x, 12) + 1)) for x in s]
        new, status = self.ops["truncate"](self.state, pad(s), pad(lens, 0))
        self._step(self.state, new, status, self.ref.truncate(s, lens))

    @rule(data=st.data())
    def select(self, data):
        s = self._ids(data, live=None)
        parents = self._ids(data, live=True, k=len(s))
        parents = [p if c != -1 else -1 for p, c in zip(parents, s)]
        new, status = self.ops["select"](self.state, pad(s), pad(parents))
        self._step(self.state, new, status, self.ref.select_parents(s, parents))

    @rule(data=st.data())
    def fork_and_append_together(self, data):
        """Beam-like: fork a live row into free rows, then append to the whole family in
        one call, so copy-on-write of a shared partly filled block is exercised, including
        the last sharer keeping the block; sometimes release the family together."""
        live = sorted(self.ref.tables)
        free = [s for s in range(MAX_SEQS) if s not in self.ref.tables]
        if not live or not free:
            return
        parent = data.draw(st.sampled_from(live))
        children = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=min(BATCH - 1, len(free)), unique=True))
        self._apply_fork([parent] * len(children), children)
        family = data.draw(st.permutations([parent] + children))
        nums = data.draw(st.lists(st.integers(0, 3), min_size=len(family), max_size=len(family)))
        self._apply_append(family, nums)
        if data.draw(st.booleans()):
            self._apply_release(data.draw(st.permutations(family)))

    @invariant()
    def matches_reference(self):
        if not hasattr(self, "state"):
            return
        check_invariants(self.state)
        tables, lens, counts, free = self.ref.snapshot()
        np.testing.assert_array_equal(self.state.block_tables, tables)
        np.testing.assert_array_equal(self.state.seq_lens, lens)
        np.testing.assert_array_equal(self.state.active, [s in self.ref.tables for s in range(MAX_SEQS)])
        np.testing.assert_array_equal(self.state.ref_counts, counts)
        np.testing.assert_array_equal(self.policy.free_blocks(self.state.pool), free)


@pytest.mark.parametrize("shape", [(9, 2, 5), (12, 4, 3)], ids=["bs2", "bs4"])
@pytest.mark.parametrize("policy_name", ["lifo", "fifo", "lowest_id_first", "random"])
def test_block_manager_matches_reference(policy_name, shape):
    # The machine's @invariant runs check_invariants after every step itself; tracing the
    # ops without the debug callback keeps their compiles cheap.
    set_debug_checks(False)
    machine = type(f"Machine_{policy_name}", (BlockManagerMachine,), {"policy_name": policy_name, "shape": shape})
    machine.TestCase.settings = settings(
        max_examples=30,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=False,
    )
    machine.TestCase().runTest()
