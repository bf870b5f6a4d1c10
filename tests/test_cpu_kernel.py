"""The native XLA:CPU paged-attention kernel (``attention/cpu_kernel``): built here, equal to
the reference on fresh random calls of many shapes, in every page dtype it reads, inside jit
and a layer scan, never reading masked memory; and its failure modes. The contract suite
(``test_attention_contract.py``) runs it on every contract case too, as a registry entry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention import cpu_kernel, dispatch, reference
from paged_jax.kv import KVPages, init_pages

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernel runs on the CPU backend")


def test_it_builds_wherever_there_is_a_compiler():
    if cpu_kernel._compiler() is None:
        pytest.skip("no C++ compiler on this machine: 'auto' uses 'xla' (tested in test_attention_dispatch)")
    assert cpu_kernel.missing() is None
    assert list(cpu_kernel.cache_dir().glob("paged_attention_cpu-*.so"))
    assert dispatch.resolve_impl("auto") == "cpu"


def test_no_compiler_is_a_clear_reason(monkeypatch):
    monkeypatch.setattr(cpu_kernel.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpu_kernel._library.__wrapped__()


needs_kernel = pytest.mark.skipif(cpu_kernel.missing() is not None, reason=str(cpu_kernel.missing()))


def _random_call(rng, *, layers=None, dtype=jnp.float32, poison=True):
    """A random valid call: GQA/MHA/MQA, T in 1..6, block sizes 1..32, tables with -1 past
    a row's blocks, lengths 0..P*bs, and NaN everywhere no row's keys live (when ``poison``)."""
    d = int(rng.choice([8, 16, 64, 128]))
    hkv = int(rng.choice([1, 2, 3]))
    hq = hkv * int(rng.choice([1, 2, 3, 4]))
    bs = int(rng.choice([1, 4, 16, 32]))
    b, t, p = int(rng.integers(1, 6)), int(rng.integers(1, 7)), int(rng.integers(1, 6))
    n = b * p + int(rng.integers(1, 4))
    lengths = rng.integers(0, p * bs + 1, b)
    lengths[rng.integers(b)] = p * bs  # one full row
    q_lens = np.minimum(rng.integers(0, t + 1, b), lengths)
    blocks = rng.permutation(n)
    tables = np.full((b, p), -1, np.int32)
    lead = () if layers is None else (layers,)
    k = rng.standard_normal((*lead, hkv, n, bs, d)).astype(np.float32)
    v = rng.standard_normal((*lead, hkv, n, bs, d)).astype(np.float32)
    live = np.zeros((n, bs), bool)
    for r in range(b):
        used = -(-int(lengths[r]) // bs)
        tables[r, :used] = blocks[r * p: r * p + used]
        for j in range(used):
            live[tables[r, j], : min(bs, lengths[r] - j * bs)] = True
    if poison:
        k[..., ~live, :] = np.nan
        v[..., ~live, :] = np.inf
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    pages = KVPages(jnp.asarray(k, dtype), jnp.asarray(v, dtype))
    return (jnp.asarray(q, dtype), pages, jnp.asarray(tables), jnp.asarray(lengths, jnp.int32),
            jnp.asarray(q_lens, jnp.int32))


@needs_kernel
@pytest.mark.parametrize("seed", range(24))
def test_equals_the_reference_on_random_calls(seed):
    rng = np.random.default_rng(1000 + seed)
    layers = None if seed % 3 == 0 else int(rng.integers(1, 4))
    q, pages, tables, lengths, q_lens = _random_call(rng, layers=layers)
    for layer in [None] if layers is None else range(layers):
        got = cpu_kernel.paged_attention(q, pages, tables, lengths, q_lens, layer=layer, scale=0.3 if seed % 2 else None)
        want = reference.paged_attention(q, pages, tables, lengths, q_lens, layer=layer, scale=0.3 if seed % 2 else None)
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
        dead = np.arange(q.shape[1])[None, :] >= np.asarray(q_lens)[:, None]
        assert (np.asarray(got)[dead] == 0).all()


@needs_kernel
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sixteen_bit_pages_as_floats_and_as_stored_bits(dtype):
    """bf16 / fp16 pages (as the engine stores them on the CPU: uint16 bits, ``bits_of``; or
    as floats) give the reference's result on the same values, in q's dtype."""
    rng = np.random.default_rng(7)
    q, pages, tables, lengths, q_lens = _random_call(rng, layers=2, dtype=jnp.dtype(dtype), poison=False)
    stored = init_pages(2, *pages.k.shape[1:], dtype)
    assert stored.bits_of == dtype
    stored = KVPages(stored.stored(pages.k), stored.stored(pages.v), bits_of=dtype)
    want = reference.paged_attention(q.astype(jnp.float32), KVPages(pages.k.astype(jnp.float32),
                                     pages.v.astype(jnp.float32)), tables, lengths, q_lens, layer=1)
    for p in (pages, stored):
        got = cpu_kernel.paged_attention(q, p, tables, lengths, q_lens, layer=1)
        assert got.dtype == q.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want.astype(q.dtype), np.float32),
                                   rtol=2e-2, atol=2e-2)


@needs_kernel
def test_in_a_jitted_layer_scan_with_a_traced_layer():
    """As the model calls it: the pool whole, the layer a traced scalar (clamped), one trace."""
    rng = np.random.default_rng(3)
    q, pages, tables, lengths, q_lens = _random_call(rng, layers=3)
    traces = []

    @jax.jit
    def every_layer(q, pages):
        traces.append(1)

        def body(carry, layer):
            return carry, cpu_kernel.paged_attention(q, pages, tables, lengths, q_lens, layer=layer)

        return jax.lax.scan(body, 0, jnp.arange(-1, 5))[1]

    got = every_layer(q, pages)
    got = every_layer(q, pages)
    assert len(traces) == 1
    for i, layer in enumerate(range(-1, 5)):  # -1 and 3, 4 clamp to layers 0 and 2
        want = reference.paged_attention(q, pages, tables, lengths, q_lens, layer=min(max(layer, 0), 2))
        np.testing.assert_allclose(got[i], want, rtol=2e-5, atol=2e-6)


@needs_kernel
def test_refuses_quantised_pages_and_lengths_past_the_table():
    from paged_jax.kv import quant

    rng = np.random.default_rng(5)
    q, pages, tables, lengths, q_lens = _random_call(rng, poison=False)
    fmt = quant.kv_format("int8")
    (k, ks), (v, vs) = quant.quantize_blocks(fmt, pages.k), quant.quantize_blocks(fmt, pages.v)
    with pytest.raises(ValueError, match="quantised"):
        cpu_kernel.paged_attention(q, KVPages(k, v, ks, vs, kv_format="int8"), tables, lengths, q_lens)
    too_long = lengths.at[0].set(tables.shape[1] * pages.k.shape[-2] + 1)
    with pytest.raises(Exception, match="exceeds the block table"):  # a runtime error, not a wild read
        jax.block_until_ready(cpu_kernel.paged_attention(q, pages, tables, too_long, q_lens))


def _packed(q, q_lens, rng):
    """``q [B, T, Hq, D]``'s real queries packed one row after another with random gaps:
    ``(packed [N, Hq, D], starts int32[B], positions [(row, t)] per packed index or None)``."""
    parts, starts, where, at = [], [], [], 0
    for row, n in enumerate(np.asarray(q_lens)):
        gap = int(rng.integers(0, 3))
        parts += [np.zeros((gap, *q.shape[2:]), np.float32), np.asarray(q[row, :n], np.float32)]
        where += [None] * gap + [(row, t) for t in range(n)]
        starts.append(at + gap)
        at += gap + int(n)
    packed = jnp.asarray(np.concatenate(parts + [np.zeros((1, *q.shape[2:]), np.float32)]), q.dtype)
    return packed, jnp.asarray(starts, jnp.int32), where + [None]


@needs_kernel
@pytest.mark.parametrize("seed", range(16))
def test_ragged_equals_the_padded_reference_on_random_calls(seed):
    """The packed form (long chunks split into several tasks, decode rows, gaps, a tail)
    against the padded reference; head dims 64 / 128 take the unrolled paths, others not."""
    rng = np.random.default_rng(2000 + seed)
    q, pages, tables, lengths, q_lens = _random_call(rng, layers=2)
    if seed % 4 == 0:  # a long chunk (more than one task of queries) at the end of a long row
        bs, p = pages.k.shape[-2], tables.shape[1]
        t = min(p * bs, 70)
        q = jnp.asarray(rng.standard_normal((q.shape[0], t, *q.shape[2:])), q.dtype)
        q_lens = q_lens.at[0].set(min(int(lengths[0]), t))
    packed, starts, where = _packed(q, q_lens, rng)
    got = np.asarray(cpu_kernel.ragged_paged_attention(packed, pages, tables, lengths, starts, q_lens, layer=1))
    want = np.asarray(reference.paged_attention(q, pages, tables, lengths, q_lens, layer=1))
    assert np.isfinite(got).all()
    for i, w in enumerate(where):
        if w is None:
            assert not got[i].any()
        else:
            np.testing.assert_allclose(got[i], want[w], rtol=2e-5, atol=2e-6)


@needs_kernel
def test_ragged_refuses_spans_out_of_order_or_past_q():
    rng = np.random.default_rng(9)
    q, pages, tables, lengths, q_lens = _random_call(rng, poison=False)
    lengths = jnp.full_like(lengths, 4)
    q_lens = jnp.full_like(q_lens, 2).at[0].set(3)
    n = int(q_lens.sum()) + 1
    packed = jnp.zeros((n, *q.shape[2:]), q.dtype)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens)[:-1].astype(jnp.int32)])
    jax.block_until_ready(cpu_kernel.ragged_paged_attention(packed, pages, tables, lengths, starts, q_lens))
    if q.shape[0] > 1:
        overlap = starts.at[1].set(1)
        with pytest.raises(Exception, match="in order, without overlap"):
            jax.block_until_ready(cpu_kernel.ragged_paged_attention(packed, pages, tables, lengths, overlap, q_lens))
    past = starts.at[-1].set(n - 1)
    with pytest.raises(Exception, match="in order, without overlap"):
        jax.block_until_ready(cpu_kernel.ragged_paged_attention(packed, pages, tables, lengths, past, q_lens))
