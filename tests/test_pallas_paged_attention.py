"""Interpret-mode (CPU) tests of the Pallas kernels' own API against the one oracle.

What every implementation must do (GQA ratios, NaN in unowned slots, forks, layers, traced
layers, ...) is checked through ``paged_jax.attention.pallas`` in
``test_attention_contract.py``; this file covers what is the kernels' own: their raw-array
API, every supported dtype / head_dim / block_size, tuning parameters (blocks per step,
splits, row blocks), clamping, and their ValueError validation.  The oracle is
``paged_jax.attention.reference.paged_attention``.

Every case builds a fresh random pool whose physical blocks are handed out in a random
order, optionally shared between sequences (forks), and whose unreferenced slots -- free
blocks and the unwritten tail of each sequence's last block -- are poisoned with NaN, so
a kernel that reads anything the table does not name (or a slot past a length) fails.

Compilation dominates the runtime (~2 s per distinct interpret-mode kernel), so the
shapes are few and fixed per configuration; data, lengths and tables vary freely.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_jax.attention import reference
from paged_jax.kv import KVPages
from pallas_kernels.chunk import paged_attention_chunk

# Imported from the modules, not the package: a stale editable install can expose
# ``pallas_kernels`` as a namespace package when pytest does not put the repo on sys.path.
from pallas_kernels.common import default_num_splits
from pallas_kernels.decode import paged_attention_decode


@jax.jit
def _oracle_chunk(q, k_pages, v_pages, block_tables, lengths, q_lens, layer=None, scale=None):
    return reference.paged_attention(
        q, KVPages(k_pages, v_pages), block_tables, lengths, q_lens, layer=layer, scale=scale
    )


def _oracle_decode(q, k_pages, v_pages, block_tables, lengths, layer=None, scale=None):
    """Decode as a chunk of one query per row (none for rows of length 0)."""
    q_lens = (lengths > 0).astype(jnp.int32)
    return _oracle_chunk(q[:, None], k_pages, v_pages, block_tables, lengths, q_lens, layer, scale)[:, 0]


TOLERANCE = {
    jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=1e-5),
    jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2),
    jnp.dtype(jnp.float16): dict(atol=4e-3, rtol=4e-3),
}


@dataclasses.dataclass(frozen=True)
class Pool:
    k_pages: jax.Array  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array
    block_tables: jax.Array  # int32[batch, width]
    lengths: jax.Array  # int32[batch]


def make_pool(
    rng: np.random.Generator,
    lengths,
    *,
    width: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype,
    num_blocks: int | None = None,
    fork: bool = False,
    poison: bool = True,
    block0_free: bool = False,
) -> Pool:
    """Random pool + permuted block tables for the given lengths.

    fork: every odd row shares the full prefix blocks of the row before it (as after a
      copy-on-write fork) and owns only the rest.
    poison: every slot that no (row, position < length) names is NaN.
    block0_free: never hand out physical block 0 (where the kernel's clamped -1 ids point).
    """
    lengths = np.asarray(lengths, np.int32)
    batch = len(lengths)
    need = -(-lengths // block_size)
    assert need.max(initial=0) <= width
    if num_blocks is None:
        num_blocks = batch * width + 3  # a few blocks that are always free
    free = [int(i) for i in rng.permutation(num_blocks) if not (block0_free and i == 0)]
    table = np.full((batch, width), -1, np.int32)
    for b in range(batch):
        shared = 0
        if fork and b % 2 == 1:
            shared = min(lengths[b], lengths[b - 1]) // block_size  # full blocks only
            table[b, :shared] = table[b - 1, :shared]
        for j in range(shared, need[b]):
            table[b, j] = free.pop()
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k = rng.standard_normal(shape, np.float32)
    v = rng.standard_normal(shape, np.float32)
    if poison:
        named = np.zeros((num_blocks, block_size), bool)
        for b in range(batch):
            pos = np.arange(lengths[b])
            named[table[b, pos // block_size], pos % block_size] = True
        k[:, ~named] = np.nan
        v[:, ~named] = np.nan
    return Pool(jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(table), jnp.asarray(lengths))


def assert_close(out, ref, dtype):
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(out).all(), "kernel output has NaN/Inf"
    assert np.isfinite(ref).all(), "reference output has NaN/Inf"
    np.testing.assert_allclose(out, ref, **TOLERANCE[jnp.dtype(dtype)])


def interesting_lengths(rng, batch: int, width: int, block_size: int) -> np.ndarray:
    """0, 1, exact block multiples, the table's maximum, and random values."""
    cap = width * block_size
    fixed = [0, 1, block_size, 2 * block_size, cap, cap - 1, block_size + 1]
    rand = rng.integers(1, cap + 1, size=batch)
    out = np.array((fixed + list(rand))[:batch], np.int32)
    return rng.permutation(out)


# --------------------------------------------------------------------------- decode
# (dtype, head_dim, block_size, num_q_heads, num_kv_heads, blocks_per_step, num_splits)
# Together these cover every dtype, head_dim 64/128/256, block sizes 8..128, GQA 1/4/8,
# one and several splits, and one and several blocks per loop step.
DECODE_CONFIGS = [
    (jnp.float32, 64, 8, 2, 2, None, 1),  # GQA 1, default blocks_per_step (16 x 8)
    (jnp.float32, 64, 16, 8, 2, 2, 3),  # GQA 4, splits that do not divide anything
    (jnp.float32, 128, 32, 8, 1, 1, 2),  # GQA 8
    (jnp.bfloat16, 128, 16, 8, 2, 4, 1),
    (jnp.bfloat16, 128, 64, 16, 2, 1, 4),
    (jnp.float16, 256, 128, 4, 4, 1, 2),
    (jnp.bfloat16, 256, 8, 4, 1, 2, 1),
]
DECODE_BATCH = 7
DECODE_WIDTH = 5  # table columns: lengths up to 5 * block_size


def _decode_case(rng, dtype, head_dim, block_size, hq, hk, *, lengths=None, **kw):
    if lengths is None:
        lengths = interesting_lengths(rng, DECODE_BATCH, DECODE_WIDTH, block_size)
    pool = make_pool(
        rng,
        lengths,
        width=DECODE_WIDTH,
        block_size=block_size,
        num_kv_heads=hk,
        head_dim=head_dim,
        dtype=dtype,
        **kw,
    )
    q = jnp.asarray(rng.standard_normal((len(lengths), hq, head_dim)), dtype)
    return q, pool


def _run_decode(q, pool, **kw):
    return paged_attention_decode(
        q, pool.k_pages, pool.v_pages, pool.block_tables, pool.lengths, interpret=True, **kw
    )


def _reference_decode(q, pool, **kw):
    return _oracle_decode(q, pool.k_pages, pool.v_pages, pool.block_tables, pool.lengths, **kw)


@pytest.mark.parametrize("dtype,head_dim,block_size,hq,hk,bps,splits", DECODE_CONFIGS)
def test_decode_matches_reference(dtype, head_dim, block_size, hq, hk, bps, splits):
    rng = np.random.default_rng(hash((head_dim, block_size, hq, splits)) % 2**32)
    for fork in (False, True):  # same shapes: one compilation, two tables
        q, pool = _decode_case(rng, dtype, head_dim, block_size, hq, hk, fork=fork)
        out = _run_decode(q, pool, blocks_per_step=bps, num_splits=splits)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert_close(out, _reference_decode(q, pool), dtype)
        zero_rows = np.asarray(pool.lengths) == 0
        assert zero_rows.any()
        assert (np.asarray(out, np.float32)[zero_rows] == 0).all()


def test_decode_splits_and_steps_agree():
    """Every (blocks_per_step, num_splits) computes the same attention (fp32, tight)."""
    rng = np.random.default_rng(1)
    q, pool = _decode_case(rng, jnp.float32, 64, 16, 8, 2, fork=True)
    ref = _reference_decode(q, pool)
    for bps, splits in [(1, 1), (1, 5), (8, 2)]:
        assert_close(_run_decode(q, pool, blocks_per_step=bps, num_splits=splits), ref, jnp.float32)


def test_decode_forked_rows_equal_private_copies():
    """A row reading shared physical blocks equals the same row on private copies."""
    rng = np.random.default_rng(2)
    lengths = [70, 75, 16, 40, 0, 80, 33]  # rows 1, 3, 5 fork rows 0, 2, 4
    q, shared = _decode_case(
        rng, jnp.float32, 64, 16, 8, 2, lengths=lengths, fork=True, num_blocks=60, poison=False
    )
    table = np.asarray(shared.block_tables).copy()
    k = np.asarray(shared.k_pages).copy()
    v = np.asarray(shared.v_pages).copy()
    used = set(table[table >= 0].tolist())
    spare = [i for i in range(k.shape[1]) if i not in used]
    for b in range(1, len(lengths), 2):
        for j in range(table.shape[1]):
            if table[b, j] >= 0 and table[b, j] in table[b - 1]:
                new = spare.pop()
                k[:, new], v[:, new] = k[:, table[b, j]], v[:, table[b, j]]
                table[b, j] = new
    assert (table != np.asarray(shared.block_tables)).any()
    private = Pool(jnp.asarray(k), jnp.asarray(v), jnp.asarray(table), shared.lengths)
    np.testing.assert_allclose(
        _run_decode(q, shared, num_splits=2), _run_decode(q, private, num_splits=2), atol=1e-6, rtol=1e-6
    )


def test_decode_reads_only_named_blocks():
    """Garbage anywhere the table does not name (incl. block 0, the clamp target of -1)."""
    rng = np.random.default_rng(3)
    lengths = [1, 16, 17, 80, 0, 5, 64]
    q, pool = _decode_case(rng, jnp.float32, 64, 16, 8, 2, lengths=lengths, block0_free=True)
    assert np.isnan(np.asarray(pool.k_pages)[:, 0]).all()
    # Also poison with +-inf instead of NaN: 0 * inf must not appear either.
    k = jnp.where(jnp.isnan(pool.k_pages), jnp.inf, pool.k_pages)
    v = jnp.where(jnp.isnan(pool.v_pages), -jnp.inf, pool.v_pages)
    inf_pool = dataclasses.replace(pool, k_pages=k, v_pages=v)
    ref = _reference_decode(q, pool)
    for p in (pool, inf_pool):
        for splits in (1, 3):
            assert_close(_run_decode(q, p, num_splits=splits), ref, jnp.float32)


def test_decode_lengths_beyond_table_are_clamped():
    rng = np.random.default_rng(4)
    q, pool = _decode_case(rng, jnp.float32, 64, 16, 8, 2, poison=False, lengths=[80] * DECODE_BATCH)
    too_long = dataclasses.replace(pool, lengths=pool.lengths + 1000)
    np.testing.assert_allclose(_run_decode(q, too_long), _run_decode(q, pool), atol=1e-6)


def test_decode_scale():
    rng = np.random.default_rng(5)
    q, pool = _decode_case(rng, jnp.float32, 64, 16, 8, 2)
    assert_close(_run_decode(q, pool, scale=0.3), _reference_decode(q, pool, scale=0.3), jnp.float32)
    # The default is head_dim ** -0.5.
    assert_close(_run_decode(q, pool), _reference_decode(q, pool, scale=64**-0.5), jnp.float32)


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    seed=st.integers(0, 2**31 - 1),
    lengths=st.lists(st.integers(0, DECODE_WIDTH * 16), min_size=DECODE_BATCH, max_size=DECODE_BATCH),
    fork=st.booleans(),
)
def test_decode_random_tables_property(seed, lengths, fork):
    """Random lengths and permuted/forked tables: one compiled shape, many tables."""
    rng = np.random.default_rng(seed)
    q, pool = _decode_case(rng, jnp.float32, 64, 16, 8, 2, lengths=lengths, fork=fork)
    assert_close(
        _run_decode(q, pool, blocks_per_step=2, num_splits=3), _reference_decode(q, pool), jnp.float32
    )


# ---------------------------------------------------------------------------- chunk
# (dtype, head_dim, block_size, num_q_heads, num_kv_heads, chunk, block_rows, bps, splits)
CHUNK_CONFIGS = [
    (jnp.float32, 64, 8, 2, 2, 5, None, None, 1),  # 5 rows -> one padded 16-row block
    (jnp.float32, 64, 16, 8, 2, 7, 16, 2, 3),  # 28 rows in two 16-row blocks, splits
    (jnp.bfloat16, 128, 32, 8, 1, 4, None, 1, 2),  # GQA 8: 32 rows
    (jnp.float16, 256, 128, 4, 4, 3, None, 1, 1),
    (jnp.bfloat16, 128, 64, 16, 4, 16, 32, None, 2),  # 64 rows, two row blocks
]
CHUNK_BATCH = 6
CHUNK_WIDTH = 4


def _chunk_case(rng, dtype, head_dim, block_size, hq, hk, chunk, *, lengths=None, q_lens=None, **kw):
    if lengths is None:
        cap = CHUNK_WIDTH * block_size
        lengths = rng.permutation(np.array([0, 1, block_size, cap, chunk, cap - 3], np.int32))
    lengths = np.asarray(lengths, np.int32)
    if q_lens is None:
        # 0, the whole chunk, the whole sequence (prefill from empty), and random counts.
        q_lens = np.minimum(rng.integers(0, chunk + 1, size=len(lengths)), lengths)
        q_lens[np.argmax(lengths)] = min(chunk, lengths.max())
        q_lens[lengths == chunk] = chunk
        q_lens[np.argmin(lengths + (lengths == 0) * 10**6)] = 0
    pool = make_pool(
        rng,
        lengths,
        width=CHUNK_WIDTH,
        block_size=block_size,
        num_kv_heads=hk,
        head_dim=head_dim,
        dtype=dtype,
        **kw,
    )
    q = jnp.asarray(rng.standard_normal((len(lengths), chunk, hq, head_dim)), dtype)
    return q, pool, jnp.asarray(q_lens, jnp.int32)


def _run_chunk(q, pool, q_lens, **kw):
    return paged_attention_chunk(
        q, pool.k_pages, pool.v_pages, pool.block_tables, pool.lengths, q_lens, interpret=True, **kw
    )


def _reference_chunk(q, pool, q_lens, **kw):
    return _oracle_chunk(q, pool.k_pages, pool.v_pages, pool.block_tables, pool.lengths, q_lens, **kw)


@pytest.mark.parametrize("dtype,head_dim,block_size,hq,hk,chunk,block_rows,bps,splits", CHUNK_CONFIGS)
def test_chunk_matches_reference(dtype, head_dim, block_size, hq, hk, chunk, block_rows, bps, splits):
    rng = np.random.default_rng(hash((head_dim, block_size, hq, chunk)) % 2**32)
    for fork in (False, True):
        q, pool, q_lens = _chunk_case(rng, dtype, head_dim, block_size, hq, hk, chunk, fork=fork)
        out = _run_chunk(q, pool, q_lens, block_rows=block_rows, blocks_per_step=bps, num_splits=splits)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert_close(out, _reference_chunk(q, pool, q_lens), dtype)
        # Rows past q_lens (and every row of a length-0 sequence) are exactly 0.
        invalid = np.arange(chunk)[None, :] >= np.asarray(q_lens)[:, None]
        assert invalid.any()
        assert (np.asarray(out, np.float32)[invalid] == 0).all()


def test_chunk_is_causal_decode_at_each_position():
    """Query t of a chunk == decode attention over the first (its position + 1) tokens."""
    rng = np.random.default_rng(6)
    chunk = 7
    lengths = np.array([60, 7, 16, 33, 80, 1, 9], np.int32)  # DECODE_BATCH rows
    q_lens = np.minimum(np.array([7, 7, 3, 0, 5, 1, 2], np.int32), lengths)
    # The decode shapes (width, heads, head_dim) so that the decode kernel is reused.
    pool = make_pool(
        rng, lengths, width=DECODE_WIDTH, block_size=16, num_kv_heads=2, head_dim=64, dtype=jnp.float32
    )
    q = jnp.asarray(rng.standard_normal((len(lengths), chunk, 8, 64)), jnp.float32)
    out = np.asarray(_run_chunk(q, pool, jnp.asarray(q_lens), block_rows=16, num_splits=2))
    for t in range(chunk):
        valid = t < q_lens
        prefix = np.where(valid, lengths - q_lens + t + 1, 0).astype(np.int32)
        dec = _run_decode(q[:, t], dataclasses.replace(pool, lengths=jnp.asarray(prefix)))
        np.testing.assert_allclose(out[:, t], np.asarray(dec), atol=2e-5, rtol=1e-5)


def test_chunk_reads_only_named_blocks_and_clamps_q_lens():
    rng = np.random.default_rng(7)
    lengths = np.array([3, 64, 17, 0, 5, 40], np.int32)
    q, pool, q_lens = _chunk_case(
        rng, jnp.float32, 64, 16, 8, 2, 7, lengths=lengths, q_lens=np.array([3, 7, 7, 0, 2, 7], np.int32)
    )
    ref = _reference_chunk(q, pool, q_lens)
    assert_close(
        _run_chunk(q, pool, q_lens, block_rows=16, blocks_per_step=2, num_splits=3), ref, jnp.float32
    )
    # q_lens larger than the chunk or than the sequence mean "all of them".
    big = jnp.asarray([100, 100, 100, 5, 100, 100], jnp.int32)
    assert_close(
        _run_chunk(q, pool, big, block_rows=16, blocks_per_step=2, num_splits=3),
        _reference_chunk(q, pool, jnp.minimum(jnp.minimum(big, 7), pool.lengths)),
        jnp.float32,
    )


# ------------------------------------------------------------- layer-stacked pages
NUM_LAYERS = 3


def stack_layers(rng, pool: Pool, num_layers: int = NUM_LAYERS) -> tuple[jax.Array, jax.Array]:
    """[num_layers, *pool page shape] pages: fresh random data in every layer, NaN in the
    same unowned slots as ``pool`` (all layers share one block table)."""
    poisoned = np.isnan(np.asarray(pool.k_pages, np.float32))
    dtype = pool.k_pages.dtype

    def layers():
        x = rng.standard_normal((num_layers, *pool.k_pages.shape), np.float32)
        x[:, poisoned] = np.nan
        return jnp.asarray(x, dtype)

    return layers(), layers()


def test_decode_layer_reads_the_named_layer_of_stacked_pages():
    """5-D pages + an int or a traced layer == 4-D pages[layer] (fp32, tight), with splits;
    the layers really differ."""
    rng = np.random.default_rng(8)
    q, pool = _decode_case(rng, jnp.float32, 64, 16, 8, 2, fork=True)
    k5, v5 = stack_layers(rng, pool)
    tuning = dict(blocks_per_step=2, num_splits=3)
    traced = jax.jit(
        lambda q, k, v, bt, lengths, layer: paged_attention_decode(
            q, k, v, bt, lengths, layer=layer, interpret=True, **tuning
        )
    )
    outs = []
    for layer in (0, NUM_LAYERS - 1):
        layer_pool = dataclasses.replace(pool, k_pages=k5[layer], v_pages=v5[layer])
        want = _run_decode(q, layer_pool, **tuning)
        out = paged_attention_decode(
            q, k5, v5, pool.block_tables, pool.lengths, layer=layer, interpret=True, **tuning
        )
        assert out.shape == q.shape and out.dtype == q.dtype
        np.testing.assert_allclose(out, want, atol=1e-6, rtol=1e-6)
        out_traced = traced(q, k5, v5, pool.block_tables, pool.lengths, jnp.int32(layer))
        np.testing.assert_allclose(out_traced, want, atol=1e-6, rtol=1e-6)
        assert_close(out, _reference_decode(q, layer_pool), jnp.float32)
        outs.append(np.asarray(out))
    nonempty = np.asarray(pool.lengths) > 0
    assert not np.allclose(outs[0][nonempty], outs[1][nonempty])
    # A traced layer out of range is clamped (as XLA clamps a dynamic index).
    np.testing.assert_array_equal(
        traced(q, k5, v5, pool.block_tables, pool.lengths, jnp.int32(7)),
        traced(q, k5, v5, pool.block_tables, pool.lengths, jnp.int32(NUM_LAYERS - 1)),
    )


def test_chunk_layer_reads_the_named_layer_of_stacked_pages():
    rng = np.random.default_rng(9)
    q, pool, q_lens = _chunk_case(rng, jnp.float32, 64, 16, 8, 2, 7, fork=True)
    k5, v5 = stack_layers(rng, pool)
    tuning = dict(block_rows=16, blocks_per_step=2, num_splits=3)
    traced = jax.jit(
        lambda q, k, v, bt, lengths, q_lens, layer: paged_attention_chunk(
            q, k, v, bt, lengths, q_lens, layer=layer, interpret=True, **tuning
        )
    )
    outs = []
    for layer in (0, NUM_LAYERS - 1):
        layer_pool = dataclasses.replace(pool, k_pages=k5[layer], v_pages=v5[layer])
        want = _run_chunk(q, layer_pool, q_lens, **tuning)
        out = paged_attention_chunk(
            q, k5, v5, pool.block_tables, pool.lengths, q_lens, layer=layer, interpret=True, **tuning
        )
        assert out.shape == q.shape and out.dtype == q.dtype
        np.testing.assert_allclose(out, want, atol=1e-6, rtol=1e-6)
        out_traced = traced(q, k5, v5, pool.block_tables, pool.lengths, q_lens, jnp.int32(layer))
        np.testing.assert_allclose(out_traced, want, atol=1e-6, rtol=1e-6)
        assert_close(out, _reference_chunk(q, layer_pool, q_lens), jnp.float32)
        outs.append(np.asarray(out))
    valid = np.arange(q.shape[1])[None, :] < np.asarray(q_lens)[:, None]
    assert not np.allclose(outs[0][valid], outs[1][valid])


# ----------------------------------------------------------------------------- misc
def test_default_num_splits_fills_the_gpu():
    assert default_num_splits(1, 4, 512) == 1  # short context: never split
    assert default_num_splits(256, 4, 32768) == 1  # 1024 programs already
    s = default_num_splits(1, 4, 32768)
    assert 4 * s >= 100 and s <= 64
    assert default_num_splits(8, 4, 4096) == 4  # 32 programs x 4, 1024 tokens each


S = jax.ShapeDtypeStruct
GOOD = dict(
    q=S((2, 8, 64), jnp.float32),
    k=S((2, 10, 16, 64), jnp.float32),
    bt=S((2, 4), jnp.int32),
    lengths=S((2,), jnp.int32),
)


def _decode_eval(q=GOOD["q"], k=GOOD["k"], v=None, bt=GOOD["bt"], lengths=GOOD["lengths"], **kw):
    v = k if v is None else v
    if isinstance(kw.get("layer"), jax.ShapeDtypeStruct):  # a traced layer
        layer = kw.pop("layer")
        return jax.eval_shape(
            lambda *a: paged_attention_decode(*a[:-1], layer=a[-1], interpret=True, **kw),
            q,
            k,
            v,
            bt,
            lengths,
            layer,
        )
    return jax.eval_shape(lambda *a: paged_attention_decode(*a, interpret=True, **kw), q, k, v, bt, lengths)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(q=S((2, 8, 96), jnp.float32), k=S((2, 10, 16, 96), jnp.float32)), "head_dim"),
        (dict(q=S((2, 8, 32), jnp.float32), k=S((2, 10, 16, 32), jnp.float32)), "head_dim"),
        (dict(k=S((2, 10, 16, 128), jnp.float32)), "head_dim"),
        (dict(k=S((2, 10, 4, 64), jnp.float32)), "block_size"),
        (dict(k=S((2, 10, 256, 64), jnp.float32)), "block_size"),
        (dict(k=S((2, 10, 24, 64), jnp.float32)), "block_size"),
        (dict(k=S((3, 10, 16, 64), jnp.float32)), "multiple"),
        (dict(q=S((2, 8, 64), jnp.int8), k=S((2, 10, 16, 64), jnp.int8)), "dtype"),
        (dict(v=S((2, 10, 16, 64), jnp.bfloat16)), "dtype"),
        (dict(v=S((2, 11, 16, 64), jnp.float32)), "same shape"),
        (dict(k=S((10, 16, 64), jnp.float32)), "num_kv_heads"),
        (dict(bt=S((3, 4), jnp.int32)), "block_tables"),
        (dict(bt=S((2, 4), jnp.int16)), "int32"),
        (dict(lengths=S((2,), jnp.float32)), "lengths"),
        (dict(lengths=S((3,), jnp.int32)), "lengths"),
        (dict(blocks_per_step=3), "power of two"),
        (dict(blocks_per_step=32), "tokens per step"),
        (dict(k=S((2, 10, 8, 64), jnp.float32), blocks_per_step=1), "tokens per step"),
        (dict(num_splits=0), "num_splits"),
        (dict(num_warps=3), "num_warps"),
        (dict(q=S((2, 256, 64), jnp.float32), k=S((2, 10, 16, 64), jnp.float32)), "kv head"),
        # layer-stacked pages: rank and layer must agree, layer in [0, num_layers)
        (dict(k=S((3, 2, 10, 16, 64), jnp.float32)), "5-D .*pass layer=i"),
        (dict(layer=0), "layer=0 needs 5-D pages"),
        (dict(k=S((3, 2, 10, 16, 64), jnp.float32), layer=3), r"out of range \[0, 3\)"),
        (dict(k=S((3, 2, 10, 16, 64), jnp.float32), layer=-1), "out of range"),
        (dict(k=S((3, 2, 10, 16, 64), jnp.float32), layer=1.0), "layer must be an int"),
        (dict(k=S((3, 2, 10, 16, 64), jnp.float32), layer=True), "layer must be an int"),
        (dict(k=S((3, 2, 10, 16, 64), jnp.float32), layer="1"), "layer must be an int"),
        (dict(k=S((3, 2, 10, 16, 64), jnp.float32), layer=S((), jnp.float32)), "layer must be an int"),
        (dict(k=S((3, 2, 10, 16, 64), jnp.float32), layer=S((2,), jnp.int32)), "layer must be an int"),
        (dict(layer=S((), jnp.int32)), "needs 5-D pages"),
        (dict(k=S((1, 3, 2, 10, 16, 64), jnp.float32), layer=0), "needs 5-D pages"),
        (
            dict(k=S((3, 2, 10, 16, 64), jnp.float32), v=S((2, 10, 16, 64), jnp.float32), layer=0),
            "same shape",
        ),
        (dict(k=S((3, 2, 10, 16, 96), jnp.float32), layer=0), "head_dim"),
        (dict(k=S((3, 2, 10, 8, 64), jnp.float32), layer=0, blocks_per_step=1), "tokens per step"),
    ],
)
def test_decode_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _decode_eval(**kwargs)


def test_decode_valid_shapes_pass_validation():
    assert _decode_eval().shape == (2, 8, 64)
    k5 = S((3, 2, 10, 16, 64), jnp.float32)
    for layer in (0, 2):
        assert _decode_eval(k=k5, layer=layer).shape == (2, 8, 64)
    # A numpy integer is an int too, and a traced int32 scalar is a layer.
    assert _decode_eval(k=S((4, 2, 10, 16, 64), jnp.float32), layer=np.int32(1)).shape == (2, 8, 64)
    assert _decode_eval(k=k5, layer=S((), jnp.int32)).shape == (2, 8, 64)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(q=S((2, 8, 64), jnp.float32)), "chunk"),
        (dict(block_rows=8), "block_rows"),
        (dict(block_rows=48), "block_rows"),
        (dict(q_lens=S((2,), jnp.int16)), "q_lens"),
        (dict(q_lens=S((1,), jnp.int32)), "q_lens"),
        (dict(q=S((2, 3, 8, 128), jnp.float32)), "head_dim"),
        (dict(k=S((3, 2, 10, 16, 64), jnp.float32)), "pass layer=i"),
        (dict(layer=1), "needs 5-D pages"),
        (dict(k=S((3, 2, 10, 16, 64), jnp.float32), layer=3), "out of range"),
        (dict(k=S((3, 2, 10, 16, 64), jnp.float32), layer=0.0), "layer must be an int"),
        (dict(k=S((3, 2, 10, 16, 64), jnp.float32), layer=2, block_rows=8), "block_rows"),
    ],
)
def test_chunk_value_errors(kwargs, match):
    args = dict(
        q=S((2, 3, 8, 64), jnp.float32),
        k=GOOD["k"],
        bt=GOOD["bt"],
        lengths=GOOD["lengths"],
        q_lens=S((2,), jnp.int32),
    )
    tuning = {n: kwargs.pop(n) for n in list(kwargs) if n not in args}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(
            lambda q, k, bt, lengths, q_lens: paged_attention_chunk(
                q, k, k, bt, lengths, q_lens, interpret=True, **tuning
            ),
            args["q"],
            args["k"],
            args["bt"],
            args["lengths"],
            args["q_lens"],
        )


def test_chunk_stacked_pages_pass_validation():
    out = jax.eval_shape(
        lambda *a: paged_attention_chunk(*a, layer=2, interpret=True),
        S((2, 3, 8, 64), jnp.float32),
        S((3, 2, 10, 16, 64), jnp.float32),
        S((3, 2, 10, 16, 64), jnp.float32),
        GOOD["bt"],
        GOOD["lengths"],
        S((2,), jnp.int32),
    )
    assert out.shape == (2, 3, 8, 64)
