"""The runner owns the step: one device fetch per engine step, and the group-aware block
counting the scheduler does on the host model of the block manager (hand-made shared tables)."""

import contextlib

import jax
import numpy as np
import pytest
from engine_fakes import VOCAB, fake_backend
from jax._src import array as jax_array

from paged_jax import CacheConfig
from paged_jax.cache import NO_BLOCK, HostBlockManager
from paged_jax.cache.policies import HostStack
from paged_jax.engine import LLM, SamplingParams
from paged_jax.engine.accounting import PagedAccounting
from paged_jax.engine.config import SchedulerConfig
from paged_jax.engine.interface import SchedulerOutput
from paged_jax.engine.scheduler import Scheduler
from paged_jax.engine.sequence import Sequence, SequenceGroup

BS = 4


@contextlib.contextmanager
def count_fetches():
    """Counts ``jax.device_get`` calls that move device arrays, and fails on any other
    device-to-host read (``np.asarray``, ``int()``, ... of an unfetched array)."""
    fetches, stray = [], []
    device_get, value = jax.device_get, jax_array.ArrayImpl._value
    inside = [False]

    def spy_get(tree):
        if any(isinstance(x, jax.Array) for x in jax.tree.leaves(tree)):
            fetches.append(1)
        inside[0] = True
        try:
            return device_get(tree)
        finally:
            inside[0] = False

    def spy_value(self):
        if not inside[0] and self._npy_value is None:
            stray.append(self.shape)
        return value.fget(self)

    jax.device_get = spy_get
    jax_array.ArrayImpl._value = property(spy_value)
    try:
        yield fetches, stray
    finally:
        jax.device_get = device_get
        jax_array.ArrayImpl._value = value


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, rng.integers(2, 30)).tolist() for _ in range(n)]


@pytest.mark.parametrize("mode", ["recompute", "swap", "speculative"])
def test_one_device_fetch_per_engine_step(mode):
    """Admissions, finishes, preemptions, swaps, speculative rounds (verification and
    rollback) and the step itself: one fetch a step."""
    spec = {"method": "ngram", "num_speculative_tokens": 3} if mode == "speculative" else None
    llm = LLM(fake_backend(BS), block_size=BS, num_gpu_blocks=26, max_model_len=48, max_num_seqs=4,
              max_num_batched_tokens=16, preemption_mode="recompute" if spec else mode, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=12)
    prompts = _prompts(12)
    if spec:  # phrases that repeat, so prompt lookup proposes
        prompts = [(p[:3] * 8)[: len(p) + 3] for p in prompts]
    llm.add_requests(prompts, params)
    engine = llm.engine
    engine.step()  # compile outside the count (compiles do not fetch, but keep it simple)
    per_step = []
    while engine.has_unfinished():
        with count_fetches() as (fetches, stray):
            engine.step()
        assert not stray, f"implicit device-to-host reads inside a step: {stray}"
        per_step.append(len(fetches))
    with count_fetches() as (fetches, stray):
        engine.flush()
    assert per_step and set(per_step) == {1}, per_step
    assert len(fetches) == 1 and not stray
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert llm.inspect().num_free == 26
    if spec:
        assert stats["spec_rounds"] > 0


# ----------------------------------------------------------------------------- group-aware accounting


class _StubKV:
    """Just what the scheduler reads: a hand-made host model and a swap pool's capacity."""

    class _Pool:
        def __init__(self, free):
            self.free = free

        def can_store(self, n):
            return n <= self.free

    def __init__(self, blocks, swap_free=100):
        self.blocks = blocks
        self.prefix_cache = None
        self.swap_pool = self._Pool(swap_free)


def _view(tables, lens, num_free):
    """A host model holding ``tables`` (rows of block ids) and ``num_free`` more free blocks."""
    tables = np.asarray(tables, np.int32)
    named = tables[tables != NO_BLOCK]
    n = int(named.max()) + 1 + num_free
    view = HostBlockManager(CacheConfig(n, BS, max_seqs=4, max_blocks_per_seq=tables.shape[1]))
    view.block_tables[: len(tables)] = tables
    view.seq_lens[: len(lens)] = lens
    view.active[: len(lens)] = np.asarray(lens) > 0
    view.ref_counts[:] = np.bincount(named, minlength=n)
    free = [b for b in range(n) if view.ref_counts[b] == 0][::-1]
    view.pool = HostStack(np.asarray(free + [0] * (n - len(free)), np.int32), len(free))
    return view


def _group(rid, slots, lens, admitted):
    params = SamplingParams(temperature=0, max_tokens=32)
    seqs = [Sequence(rid, 0, (1,) * 5, params, seed=0, max_tokens=32, completion=i) for i in range(len(slots))]
    for seq, slot, n in zip(seqs, slots, lens, strict=True):
        seq.slot, seq.num_computed, seq.row_live = slot, n, True
        seq.output_token_ids = [1] * (n - 5 + 1)  # one pending token each: decoding
    group = SequenceGroup(rid, 0, (1,) * 5, params, seqs, admitted_at=admitted)
    return group


def _scheduler(view, mode="recompute", swap_free=100):
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=BS, preemption_mode=mode)
    sched = Scheduler(cfg, _StubKV(view, swap_free), PagedAccounting(32, BS, watermark=0.0),
                      swapping=mode == "swap")
    sched._free_slots = [3]
    return sched


# Rows 0 and 1 are two completions of request "a" forked from one prompt: they share
# block 0 (full) and block 1 (partly filled); row 1 already holds a private block 2 for
# its third block. Row 2 is request "b", whose block 3 is shared with nobody.
SHARED = [[0, 1, NO_BLOCK], [0, 1, 2], [3, 4, NO_BLOCK]]


def test_victim_sees_shared_blocks_counted_once_and_preemption_frees_only_private_ones():
    view = _view(SHARED, [6, 9, 8], num_free=0)  # the pool is full: someone must go
    a, b = _group("a", [0, 1], [6, 9], admitted=2), _group("b", [2], [8], admitted=1)
    sched = _scheduler(view)
    sched.running = [b, a]
    infos = []
    sched.config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=BS,
                                   victim_policy=lambda running: infos.extend(running) or 1)
    step = sched.schedule()
    assert sorted((i.request_id, i.num_blocks, i.num_seqs) for i in infos) == [("a", 3, 2), ("b", 2, 1)]
    # "a" (3 distinct blocks, all its own) is preempted whole: both rows released at once.
    assert sorted(step.release) == [0, 1] and sched.waiting[0] is a
    assert all(s.num_computed == 0 and s.slot is None for s in a.seqs)
    # "b" decodes into the 3 blocks "a" freed: its append needs a new block (8 tokens = 2 full).
    assert [r.seq.slot for r in step.rows] == [2]
    assert sched.kv.blocks.released([0, 1]).num_free == 3


def test_appends_into_a_shared_partial_block_count_copy_on_write():
    tables = [[0, 1, NO_BLOCK], [0, 1, NO_BLOCK], [2, NO_BLOCK, NO_BLOCK]]
    view = _view(tables, [6, 6, 3], num_free=2)
    # Rows 0 and 1 share the partly filled block 1 (count 2): appending to both takes one
    # private copy (the other keeps the block), so 1 block; row 2 fits in its own block.
    assert view.blocks_needed([0, 1, 2], [1, 1, 1]).tolist() == [1, 0, 0]
    a = _group("a", [0, 1], [6, 6], admitted=1)
    b = _group("b", [2], [3], admitted=2)
    sched = _scheduler(view)
    sched.running = [a, b]
    step = sched.schedule()
    assert not step.release and len(step.rows) == 3  # fits: nobody preempted
    # No free block: the copy cannot be made. The most recent request ("b") goes, which
    # frees its private block 2, and then "a"'s copy fits.
    tight = _scheduler(_view(tables, [6, 6, 3], num_free=0))
    tight.running = [a, b]
    step = tight.schedule()
    assert step.release == [2] and [r.seq.slot for r in step.rows] == [0, 1]


def test_swap_out_of_a_group_stores_each_shared_block_once():
    view = _view(SHARED, [6, 9, 8], num_free=0)
    a, b = _group("a", [0, 1], [6, 9], admitted=2), _group("b", [2], [8], admitted=1)
    # The host pool has room for 3 blocks: enough for "a"'s distinct blocks, not for 5 entries.
    sched = _scheduler(view, mode="swap", swap_free=3)
    sched.running = [b, a]
    step = sched.schedule()
    assert step.swap_out == [[0, 1]] and sched.swapped[0] is a and not step.release
    assert sched.counters.blocks_swapped_out == 3 and sched.counters.swap_fallbacks == 0
    # Too small a host pool: the group is recomputed instead.
    fallback = _scheduler(view, mode="swap", swap_free=2)
    a, b = _group("a", [0, 1], [6, 9], admitted=2), _group("b", [2], [8], admitted=1)
    fallback.running = [b, a]
    step = fallback.schedule()
    assert sorted(step.release) == [0, 1] and fallback.counters.swap_fallbacks == 1


def test_plan_is_empty_until_something_is_planned():
    assert SchedulerOutput().empty and not SchedulerOutput(release=[1]).empty
