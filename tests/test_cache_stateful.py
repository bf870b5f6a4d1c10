"""Hypothesis drives random op sequences through the jitted block manager and its host
model (``cache.HostBlockManager``: the oracle, and the engine's view), for every
registered policy (and one defined here without a host counterpart), comparing everything
observable after each step, the free pool's order included; check_invariants runs after
every step."""

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
    POLICIES,
    HostBlockManager,
    Status,
    append_slots,
    check_invariants,
    evict_cached,
    fork,
    get_policy,
    init_state,
    mark_cached,
    open_sequences,
    release,
    restore_rows,
    select_parents,
    truncate,
    unshare,
)
from paged_jax.cache import ops as cache_ops
from paged_jax.cache.policies import AllocationPolicy, DeviceOnHost, MaskPool, _ranks, lowest_id_first

BATCH = 4  # every op is called with this many entries, padded with -1: one trace per op
MAX_TOKENS = 5
MAX_SEQS = 6
MAX_LOCAL = 12  # restore_rows' static bound on the blocks of one swapped group


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
        restore=jax.jit(functools.partial(restore_rows, max_local=MAX_LOCAL)),
        unshare=jax.jit(unshare),
        mark=jax.jit(mark_cached),
        evict=jax.jit(evict_cached),
    )


# Mostly valid live-range ids, sometimes padding or out of range.
seq_id = st.one_of(
    st.integers(0, MAX_SEQS - 1), st.integers(0, MAX_SEQS - 1), st.just(-1), st.sampled_from([-3, MAX_SEQS, 99])
)
ids = st.lists(seq_id, min_size=1, max_size=BATCH)


def pad(values, fill=-1):
    return jnp.asarray(list(values) + [fill] * (BATCH - len(values)), jnp.int32)


class Oracle(HostBlockManager):
    """The host model with the set/dict views the rules below draw from."""

    @property
    def tables(self) -> dict[int, list[int]]:
        return {int(r): self._row(int(r)) for r in np.flatnonzero(self.active)}

    @property
    def cached_set(self) -> set[int]:
        return set(np.flatnonzero(self.cached).tolist())


class BlockManagerMachine(RuleBasedStateMachine):
    policy_name = "lifo"  # a name, or an AllocationPolicy
    shape = (9, 2, 5)  # (num_blocks, block_size, max_blocks_per_seq): fixed, so one trace per op

    @initialize()
    def setup(self):
        num_blocks, block_size, max_blocks_per_seq = self.shape
        config = CacheConfig(num_blocks, block_size, MAX_SEQS, max_blocks_per_seq)
        self.policy = get_policy(self.policy_name)
        # The machine's @invariant runs check_invariants after every step itself; tracing
        # the ops without the debug callback keeps their compiles cheap.
        self.state = init_state(config, self.policy, debug=False)
        self.ref = Oracle(config, self.policy)
        self.ops = jitted()

    def _step(self, before, after, status, ref_status):
        ref_status = np.asarray(ref_status).tolist()
        assert np.asarray(status)[: len(ref_status)].tolist() == ref_status
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
        self._apply_open(self._ids(data, live=False))

    def _apply_open(self, s, prefix=None):
        """open_sequences, on chains of cached blocks when ``prefix`` (one row per id) is given."""
        if prefix is None:
            new, status = self.ops["open"](self.state, pad(s))
        else:
            width = self.shape[2]
            rows = list(prefix) + [[-1] * width] * (BATCH - len(prefix))
            new, status = self.ops["open"](self.state, pad(s), jnp.asarray(rows, jnp.int32))
        ref_status = self.ref.open_sequences(s, prefix).tolist()
        self._step(self.state, new, status, ref_status)
        return ref_status

    def _apply_mark(self, b):
        new, status = self.ops["mark"](self.state, pad(b))
        ref_status = self.ref.mark_cached(b)
        self._step(self.state, new, status, ref_status)
        return ref_status

    def _apply_evict(self, b):
        new, status = self.ops["evict"](self.state, pad(b))
        ref_status = self.ref.evict_cached(b)
        self._step(self.state, new, status, ref_status)
        return ref_status

    # Prefix caching: mark referenced blocks cached, open rows on chains of cached
    # blocks, evict cached blocks no row names. Mostly sensible, sometimes not.
    def _block_ids(self, data, candidates):
        if data.draw(st.integers(0, 7)) == 0 or not candidates:
            return data.draw(st.lists(st.integers(-2, self.shape[0]), min_size=1, max_size=BATCH))
        picked = data.draw(st.permutations(sorted(candidates)))[: data.draw(st.integers(1, BATCH))]
        return data.draw(st.permutations(list(picked) + [-1] * data.draw(st.integers(0, BATCH - len(picked)))))

    @rule(data=st.data())
    def mark(self, data):
        referenced = {b for b in range(self.shape[0]) if self.ref.ref_counts[b] >= 1} - self.ref.cached_set
        self._apply_mark(self._block_ids(data, referenced))

    @rule(data=st.data())
    def evict(self, data):
        cached = self.ref.cached_set
        if cached and data.draw(st.booleans()):  # a cached block's rows end: it becomes cached-free
            block = data.draw(st.sampled_from(sorted(cached)))
            tables = self.ref.tables
            holders = [r for r in sorted(tables) if block in tables[r]][:BATCH]
            if holders:
                self._apply_release(holders)
        cached = self.ref.cached_set
        idle = {b for b in cached if self.ref.ref_counts[b] == 1}
        self._apply_evict(self._block_ids(data, idle if data.draw(st.integers(0, 3)) else cached))

    @rule(data=st.data())
    def cache_lifecycle(self, data):
        """A prefix-cache life: a live row's blocks are marked cached, the row ends, some
        of its blocks are evicted, and a new row opens on the rest (a hit)."""
        if not self.ref.tables:
            return
        row = data.draw(st.sampled_from(sorted(self.ref.tables)))
        blocks = [b for b in self.ref.tables[row] if b not in self.ref.cached_set][:BATCH]
        if blocks:
            self._apply_mark(blocks)
        chain = list(self.ref.tables[row])
        self._apply_release([row])
        idle = [b for b in chain if b in self.ref.cached_set and self.ref.ref_counts[b] == 1]
        gone = data.draw(st.permutations(idle))[: data.draw(st.integers(0, min(len(idle), BATCH)))]
        if gone:
            self._apply_evict(gone)
        kept = []
        for b in chain:  # the hit: the chain up to its first evicted block
            if b not in self.ref.cached_set:
                break
            kept.append(b)
        assert self._apply_open([row], [kept + [-1] * (self.shape[2] - len(kept))]) == [Status.OK]

    @rule(data=st.data())
    def open_on_cached_blocks(self, data):
        """Open free rows on chains of cached blocks (a prefix-cache hit), then grow them
        a little: appending right after the hit copies nothing (the blocks are full),
        but a cached block is never written in place."""
        s = self._ids(data, live=False)
        width = self.shape[2]
        cached = sorted(self.ref.cached_set)
        rows = []
        for _ in s:
            if data.draw(st.integers(0, 7)) == 0:  # arbitrary entries: BAD_TABLE paths
                row = data.draw(st.lists(st.integers(-1, self.shape[0]), min_size=width, max_size=width))
            else:
                k = data.draw(st.integers(0, min(len(cached), width)))
                chain = data.draw(st.permutations(cached))[:k] if cached else []
                row = list(chain) + [-1] * (width - len(chain))
            rows.append(row)
        self._apply_open(s, rows)
        live = [x for x in s if x in self.ref.tables]
        if live and data.draw(st.booleans()):
            self._apply_append(live, data.draw(st.lists(st.integers(0, 3), min_size=len(live), max_size=len(live))))

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
        ref_need = self.ref.blocks_needed(s, nums).tolist()
        ref_status, ref_slots, ref_copies = self.ref.append_slots(s, nums, max_tokens=MAX_TOKENS)
        self._step(self.state, new, out.status, ref_status)
        assert np.asarray(needed)[: len(s)].tolist() == ref_need
        assert np.asarray(out.slot_mapping)[: len(s)].tolist() == ref_slots.tolist()
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
        ref_status = self.ref.fork(parents, children).tolist()
        self._step(self.state, new, status, ref_status)
        return ref_status

    @rule(data=st.data())
    def release(self, data):
        self._apply_release(self._ids(data, live=True))

    def _apply_release(self, s):
        new, status = self.ops["release"](self.state, pad(s))
        ref_status = self.ref.release(s).tolist()
        self._step(self.state, new, status, ref_status)
        return ref_status

    @rule(data=st.data())
    def truncate(self, data):
        s = self._ids(data, live=True)
        held = {r: int(self.ref.seq_lens[r]) for r in self.ref.tables}
        lens = [data.draw(st.integers(-1, held.get(x, 12) + 1)) for x in s]
        new, status = self.ops["truncate"](self.state, pad(s), pad(lens, 0))
        self._step(self.state, new, status, self.ref.truncate(s, lens))

    @rule(data=st.data())
    def select(self, data):
        s = self._ids(data, live=None)
        parents = self._ids(data, live=True, k=len(s))
        parents = [p if c != -1 else -1 for p, c in zip(parents, s)]
        self._apply_select(s, parents)

    def _apply_select(self, s, parents):
        new, status = self.ops["select"](self.state, pad(s), pad(parents))
        ref_status = self.ref.select_parents(s, parents).tolist()
        self._step(self.state, new, status, ref_status)
        return ref_status

    @rule(data=st.data())
    def unshare(self, data):
        self._apply_unshare(self._ids(data, live=True))

    def _apply_unshare(self, s):
        new, out = self.ops["unshare"](self.state, pad(s))
        src, dst = np.asarray(out.copy_src), np.asarray(out.copy_dst)
        ref_status, ref_copies = self.ref.unshare(s)
        self._step(self.state, new, out.status, ref_status)
        assert [(int(a), int(b)) for a, b in zip(src, dst) if a >= 0] == ref_copies
        assert ((src >= 0) == (dst >= 0)).all()
        return ref_status, [int(b) for b in dst if b >= 0]

    @rule(data=st.data())
    def fork_and_append_together(self, data):
        """Beam-like: fork a live row into free rows, then append to the whole family in
        one call, so copy-on-write of a shared partly filled block is exercised, including
        the last sharer keeping the block; sometimes release the family together."""
        live = sorted(self.ref.tables)
        free = [s for s in range(MAX_SEQS) if s not in live]
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

    @rule(data=st.data())
    def swap_out_and_restore(self, data):
        """Swap a group of live rows out (read their tables, release them) and back in
        with restore_rows, the blocks they share numbered as local ids; usually into the
        same rows, sometimes into other free rows; sometimes with a damaged table. The
        group is usually a row and its kin (rows sharing a block with it), often forked
        just before (and grown a little) so that it shares blocks. Starts a sequence if
        none is live."""
        if not self.ref.tables:  # start a sequence, so that there is something to swap
            seed = data.draw(st.integers(0, MAX_SEQS - 1))
            self._apply_open([seed])
            self._apply_append([seed], [data.draw(st.integers(1, MAX_TOKENS))])
        seed = data.draw(st.sampled_from(sorted(self.ref.tables)))
        free = [s for s in range(MAX_SEQS) if s not in self.ref.tables]
        if free and data.draw(st.booleans()):
            children = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=min(2, len(free)), unique=True))
            self._apply_fork([seed] * len(children), children)
            family = [seed] + children
            self._apply_append(family, data.draw(st.lists(st.integers(0, 2), min_size=len(family), max_size=len(family))))
        tables = self.ref.tables
        live = sorted(tables)
        if data.draw(st.integers(0, 3)):
            kin = [s for s in live if s != seed and set(tables[s]) & set(tables[seed])]
            group = [seed] + data.draw(st.permutations(kin))[: BATCH - 1]
        else:
            group = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=BATCH, unique=True))
        self._swap_group(data, data.draw(st.permutations(group)))

    def _swap_group(self, data, group):
        lens = [int(self.ref.seq_lens[s]) for s in group]
        local_of: dict[int, int] = {}
        width = self.shape[2]
        tables, held = [], self.ref.tables
        for s in group:
            row = [local_of.setdefault(b, len(local_of)) for b in held[s]]
            tables.append(row + [-1] * (width - len(row)))
        num_local = len(local_of)
        self._apply_release(group)
        free = [s for s in range(MAX_SEQS) if s not in self.ref.tables]
        targets = group if data.draw(st.integers(0, 3)) else data.draw(st.permutations(free))[: len(group)]
        if data.draw(st.integers(0, 3)) == 0:  # damage: a rejection path, compared with the reference
            kind = data.draw(st.sampled_from(["entry", "num_local", "length", "repeat"]))
            i = data.draw(st.integers(0, len(group) - 1))
            if kind == "entry":
                tables[i][data.draw(st.integers(0, width - 1))] = data.draw(st.integers(-2, num_local + 1))
            elif kind == "num_local":
                num_local += data.draw(st.sampled_from([-1, 1]))
            elif kind == "length":
                lens[i] = data.draw(st.sampled_from([-1, width * self.shape[1] + 1, lens[i] + self.shape[1]]))
            elif lens[i] > self.shape[1]:  # repeat a row's first block later in the row
                tables[i][1] = tables[i][0]
        rows = len(targets)
        self._apply_restore(list(targets), lens[:rows], tables[:rows], num_local)

    def _apply_restore(self, targets, lens, tables, num_local):
        """restore_rows on the device and the reference, padded to BATCH rows."""
        width = self.shape[2]
        ids = list(targets) + [-1] * (BATCH - len(targets))
        lens = list(lens) + [0] * (BATCH - len(targets))
        tables = list(tables) + [[-1] * width] * (BATCH - len(targets))
        new, ids_, status = self.ops["restore"](
            self.state, pad(ids), pad(lens), jnp.asarray(tables, jnp.int32), jnp.int32(num_local)
        )
        ref_status, ref_ids = self.ref.restore_rows(ids, lens, tables, num_local, max_local=MAX_LOCAL)
        self._step(self.state, new, status, ref_status)
        assert np.asarray(ids_).tolist() == ref_ids.tolist()
        return ref_status, ref_ids

    @invariant()
    def matches_reference(self):
        if not hasattr(self, "state"):
            return
        check_invariants(self.state)
        assert self.ref.mismatch(self.state) is None, self.ref.mismatch(self.state)
        # The host model built from the device state equals the one that ran the ops.
        assert HostBlockManager.from_state(self.state).mismatch(self.state) is None


def run_machine(policy, shape, max_examples=20):
    name = policy if isinstance(policy, str) else policy.name
    machine = type(f"Machine_{name}", (BlockManagerMachine,), {"policy_name": policy, "shape": shape})
    machine.TestCase.settings = settings(
        max_examples=max_examples,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=False,
    )
    machine.TestCase().runTest()


@pytest.mark.parametrize("shape", [pytest.param((9, 2, 5), id="bs2", marks=pytest.mark.slow), pytest.param((12, 4, 3), id="bs4")])  # bs2: full suite only
@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_block_manager_matches_its_host_model(policy_name, shape):
    run_machine(policy_name, shape)


@functools.cache
def highest_id_first() -> AllocationPolicy:
    """A policy of the test's own: the highest free id first, over the address-order
    bitmap, with no host counterpart: the host model runs its own functions one block at a
    time (``DeviceOnHost``), which predicts it exactly because batched = sequential."""
    base = lowest_id_first()

    def allocate(pool, want):
        n = pool.is_free.shape[0]
        rank, total = _ranks(want)
        ok = total <= pool.num_free
        highest = n - 1 - jnp.nonzero(pool.is_free[::-1], size=want.shape[0], fill_value=n)[0]
        ids = jnp.where(want, highest[rank], -1).astype(jnp.int32)
        is_free = pool.is_free.at[jnp.where(want & ok, ids, n)].set(False, mode="drop")
        return MaskPool(is_free, pool.num_free - jnp.where(ok, total, 0)), ids, ok

    return base._replace(name="highest_id_first", allocate=allocate, host_from=None)


def test_a_policy_without_a_host_counterpart_is_predicted_by_its_own_functions():
    assert isinstance(highest_id_first().host(8), DeviceOnHost)
    run_machine(highest_id_first(), (9, 2, 5), max_examples=10)
