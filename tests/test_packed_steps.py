"""The packed layout of the model step (``paged_jax.steps``: tokens int32[N], every row's new
tokens one after another) against the padded one and the no-cache forward.

Random batches mix decode rows (one token), prefill chunks of every length and padding
rows, over a fragmented pool, several rounds in a row (each round's rows continue the
sequences of the last): the packed step's logits at each row's last token equal the padded
step's and the dense forward's, its logits at every position (``all_logits``) equal the
padded ones, and the block manager and the pages it leaves equal the padded step's, bit for
bit. A packed call is as atomic as a padded one. The buckets' packing helpers are checked
beside.
"""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from paged_jax import buckets
from paged_jax.cache import Status, init_state, open_sequences, raise_for_status
from paged_jax.config import CacheConfig
from paged_jax.model import ModelConfig, dense_forward, init_params
from paged_jax.steps import init_pages_for, make_model_step, packed_rows

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position_embeddings=128)
POOL = CacheConfig(num_blocks=64, block_size=4, max_seqs=6, max_blocks_per_seq=12)
ROWS, WIDTH = 8, 32  # the packed call's shape; the padded call is [ROWS, WIDTH] too


@functools.cache
def _params():
    return init_params(CFG, seed=1)


@functools.cache
def _step(impl: str):
    step = make_model_step(CFG, impl)
    run = jax.jit(lambda p, s, pg, t, i, n: step(p, s, pg, t, i, n))
    every = jax.jit(lambda p, s, pg, t, i, n: step(p, s, pg, t, i, n, all_logits=True))
    return run, every


@functools.cache
def _dense():
    graphdef, _ = _params()
    return jax.jit(lambda params, tokens: dense_forward(graphdef, params, tokens))


def _fresh(order_seed: int):
    """A pool whose free list is shuffled (blocks of a row land anywhere), rows opened."""
    state = init_state(POOL, "random")
    state, status = open_sequences(state, jnp.arange(POOL.max_seqs, dtype=jnp.int32))
    raise_for_status("open", list(range(POOL.max_seqs)), status)
    return state, init_pages_for(CFG, POOL)


rounds = st.lists(  # per round: for each of the 6 rows, how many tokens it feeds (0: skipped)
    st.lists(st.sampled_from([0, 0, 1, 1, 1, 2, 3, 5, 8, 13]), min_size=POOL.max_seqs, max_size=POOL.max_seqs),
    min_size=1, max_size=3)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=rounds, seed=st.integers(0, 2**16), impl=st.sampled_from(["auto", "xla"]))
def test_packed_equals_padded_and_dense(plan, seed, impl):
    rng = np.random.default_rng(seed)
    _, params = _params()
    run, every = _step(impl)
    packed_state, packed_pages = _fresh(seed)
    padded_state, padded_pages = _fresh(seed)
    held = {r: [] for r in range(POOL.max_seqs)}
    for counts in plan:
        rows = [r for r, n in enumerate(counts) if n]
        rng.shuffle(rows)  # rows in any order within the call
        chunks = [list(rng.integers(0, CFG.vocab_size, counts[r])) for r in rows]
        if not rows or sum(map(len, chunks)) > WIDTH:
            continue
        pb = buckets.pack_batch(rows, chunks, rows=ROWS, width=WIDTH)
        db = buckets.pad_batch(rows, chunks, shape=(ROWS, max(map(len, chunks))))
        wants_every = bool(rng.integers(2))
        fn = every if wants_every else run
        lp, packed_state, packed_pages, sp = fn(params, packed_state, packed_pages, pb.tokens, pb.seq_ids,
                                                pb.num_tokens)
        ld, padded_state, padded_pages, sd = fn(params, padded_state, padded_pages, db.tokens, db.seq_ids,
                                                db.num_tokens)
        raise_for_status("packed", pb.seq_ids, sp)
        raise_for_status("padded", db.seq_ids, sd)
        for r, c in zip(rows, chunks):
            held[r] += c
        lp, ld = np.asarray(lp), np.asarray(ld)
        if wants_every:  # [N, V] packed vs [B, T, V] padded, at every fed position
            for i, (start, c) in enumerate(zip(pb.starts, chunks)):
                np.testing.assert_allclose(lp[start: start + len(c)], ld[i, : len(c)], rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_allclose(lp[: len(rows)], ld[: len(rows)], rtol=1e-5, atol=1e-5)
            dense = np.zeros((len(rows), 64), np.int32)
            for i, r in enumerate(rows):
                dense[i, : len(held[r])] = held[r]
            want = np.asarray(_dense()(params, dense))
            for i, r in enumerate(rows):
                np.testing.assert_allclose(lp[i], want[i, len(held[r]) - 1], rtol=1e-4, atol=1e-4)
        # the same block ids and lengths, the same KV (to rounding: matmul shapes differ)
        for a, b in zip(jax.tree.leaves(padded_state), jax.tree.leaves(packed_state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_allclose(np.asarray(packed_pages.k), np.asarray(padded_pages.k), rtol=1e-5, atol=1e-5)


def test_a_packed_call_is_atomic():
    _, params = _params()
    run, _ = _step("auto")
    state, pages = _fresh(0)
    pb = buckets.pack_batch([0, 1], [[1, 2, 3], [4, 5]], rows=ROWS, width=WIDTH)
    _, state, pages, status = run(params, state, pages, pb.tokens, pb.seq_ids, pb.num_tokens)
    raise_for_status("packed", pb.seq_ids, status)
    before = jax.device_get((state, pages))

    def unchanged():
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get((state, pages)))):
            np.testing.assert_array_equal(a, b)

    # a bad token in the second row: that row says so, and nothing of either row is applied
    pb = buckets.pack_batch([0, 1], [[7, 8], [9, CFG.vocab_size]], rows=ROWS, width=WIDTH)
    _, state, pages, status = run(params, state, pages, pb.tokens, pb.seq_ids, pb.num_tokens)
    assert list(np.asarray(status)[:2]) == [Status.OK, Status.INVALID_TOKEN]
    unchanged()
    # a row that was never opened (closed first), beside a good one
    pb = buckets.pack_batch([1, 9 % POOL.max_seqs], [[1], [2, 3]], rows=ROWS, width=WIDTH)
    state = state.replace(active=state.active.at[9 % POOL.max_seqs].set(False))
    before = jax.device_get((state, pages))
    _, state, pages, status = run(params, state, pages, pb.tokens, pb.seq_ids, pb.num_tokens)
    assert list(np.asarray(status)[:2]) == [Status.OK, Status.INACTIVE_SEQ]
    unchanged()


def test_packed_rows_and_the_packing_helpers():
    starts, row, offset, valid = packed_rows(jnp.asarray([2, 0, 3, 0], jnp.int32), 8)
    assert list(np.asarray(starts)) == [0, 2, 2, 5]
    assert list(np.asarray(row)[:5]) == [0, 0, 2, 2, 2] and list(np.asarray(offset)[:5]) == [0, 1, 0, 1, 2]
    assert list(np.asarray(valid)) == [True] * 5 + [False] * 3

    assert buckets.packed_width(8, 8) == 8 and buckets.packed_width(3, 8) == 8  # a decode step: the rows
    assert buckets.packed_width(9, 8) == 16 and buckets.packed_width(100, 64) == 128
    assert buckets.packed_width(5, 4) == 16  # never narrower than MIN_PREFILL_WIDTH past the rows
    shapes = buckets.packed_shapes((8, 16, 24), 100)
    assert shapes == [(8, 8), (8, 16), (8, 32), (8, 64), (8, 128), (16, 16), (16, 32), (16, 64), (16, 128),
                      (24, 24), (24, 32), (24, 64), (24, 128)]
    # every width packed_width picks for a budget of 100 tokens is among the warm-up shapes
    for rows in (8, 16, 24):
        for total in range(1, 101):
            assert (rows, buckets.packed_width(total, rows)) in shapes

    batch = buckets.pack_batch([3, 1], [[5, 6, 7], [8]], rows=4, width=8)
    assert list(batch.tokens) == [5, 6, 7, 8, 0, 0, 0, 0] and list(batch.seq_ids) == [3, 1, -1, -1]
    assert list(batch.num_tokens) == [3, 1, 0, 0] and list(batch.starts) == [0, 3]
    with pytest.raises(ValueError, match="do not fit 4 rows x 3 tokens"):
        buckets.pack_batch([3, 1], [[5, 6, 7], [8]], rows=4, width=3)
    with pytest.raises(ValueError, match="packed call"):
        buckets.packed_width(3, 0)
