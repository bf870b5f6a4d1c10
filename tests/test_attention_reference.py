"""Plain-XLA paged attention against a loop-by-loop NumPy oracle; dispatch."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention import (
    dense_causal_attention,
    paged_attention,
    paged_attention_chunk,
    paged_chunk_attention,
    paged_decode_attention,
    resolve_impl,
)

N, BS, D, P = 12, 4, 8, 4  # pool blocks, block size, head dim, table columns


def _oracle(q, k_seq, v_seq, length, q_len, scale):
    """One sequence, loop by loop. q: [T, Hq, D]; k_seq, v_seq: [S, Hkv, D]."""
    t_max, hq, _ = q.shape
    group = hq // k_seq.shape[1]
    out = np.zeros(q.shape, np.float64)
    for t in range(q_len):
        pos = length - q_len + t
        for h in range(hq):
            keys = k_seq[: pos + 1, h // group].astype(np.float64)
            vals = v_seq[: pos + 1, h // group].astype(np.float64)
            s = keys @ q[t, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ vals
    return out


def _case(seed, hq, hkv, lengths, q_lens, t_max, bs=BS, d=D):
    """Random pages, a shuffled block table per row, NaN in every slot no row owns."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    k_pages = rng.standard_normal((hkv, N, bs, d)).astype(np.float32)
    v_pages = rng.standard_normal((hkv, N, bs, d)).astype(np.float32)
    perm = rng.permutation(N)
    tables = np.full((b, P), -1, np.int32)
    owned = np.zeros((N, bs), bool)
    used = 0
    for i, n in enumerate(lengths):
        nb = -(-n // bs)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        for j in range(n):
            owned[tables[i, j // bs], j % bs] = True
    k_pages[:, ~owned] = np.nan  # unowned blocks and the stale tail of last blocks
    v_pages[:, ~owned] = np.nan
    q = rng.standard_normal((b, t_max, hq, d)).astype(np.float32)
    return q, k_pages, v_pages, tables, np.array(lengths, np.int32), np.array(q_lens, np.int32)


def _seq(pages, table, n):
    return np.stack([pages[:, table[j // BS], j % BS] for j in range(n)]) if n else np.zeros((0,) + (pages.shape[0], D))


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_chunk_attention_matches_oracle(hq, hkv):
    lengths, q_lens = [5, 16, 0, 9], [3, 4, 0, 1]
    q, kp, vp, tables, lens, qls = _case(0, hq, hkv, lengths, q_lens, t_max=4)
    out = np.asarray(jax.jit(paged_chunk_attention)(q, kp, vp, tables, lens, qls))
    assert np.isfinite(out).all()
    for b in range(len(lengths)):
        want = _oracle(q[b], _seq(kp, tables[b], lengths[b]).reshape(-1, hkv, D) if lengths[b] else None,
                       _seq(vp, tables[b], lengths[b]).reshape(-1, hkv, D) if lengths[b] else None,
                       lengths[b], q_lens[b], D**-0.5) if lengths[b] else np.zeros(q[b].shape)
        np.testing.assert_allclose(out[b], want, rtol=1e-5, atol=1e-5)
        assert not out[b, q_lens[b]:].any()  # rows past q_len are exactly 0


def test_decode_attention_matches_oracle_and_zero_length_is_zero():
    lengths = [1, 7, 0, 16]
    q, kp, vp, tables, lens, _ = _case(1, 4, 2, lengths, [1, 1, 0, 1], t_max=1)
    out = np.asarray(paged_decode_attention(q[:, 0], kp, vp, tables, lens, scale=0.3))
    assert np.isfinite(out).all()
    assert not out[2].any()
    for b in (0, 1, 3):
        want = _oracle(q[b], _seq(kp, tables[b], lengths[b]), _seq(vp, tables[b], lengths[b]), lengths[b], 1, 0.3)
        np.testing.assert_allclose(out[b], want[0], rtol=1e-5, atol=1e-5)


def test_dense_equals_paged_on_contiguous_layout():
    rng = np.random.default_rng(3)
    b, s, hq, hkv = 2, 8, 4, 2
    k = rng.standard_normal((b, s, hkv, D)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, D)).astype(np.float32)
    q = rng.standard_normal((b, 3, hq, D)).astype(np.float32)
    dense = dense_causal_attention(q, k, v)  # queries at positions 5, 6, 7
    # The same keys laid out block by block: row b owns blocks [2b, 2b+1].
    kp = k.reshape(b, 2, BS, hkv, D).transpose(3, 0, 1, 2, 4).reshape(hkv, 2 * b, BS, D)
    vp = v.reshape(b, 2, BS, hkv, D).transpose(3, 0, 1, 2, 4).reshape(hkv, 2 * b, BS, D)
    tables = np.array([[0, 1], [2, 3]], np.int32)
    paged = paged_chunk_attention(q, kp, vp, tables, np.array([8, 8]), np.array([3, 3]))
    np.testing.assert_allclose(np.asarray(dense), np.asarray(paged), rtol=1e-6, atol=1e-6)


def test_bf16_inputs_close_to_fp32():
    q, kp, vp, tables, lens, qls = _case(4, 4, 2, [6, 11], [2, 3], t_max=3)
    kp, vp = np.nan_to_num(kp), np.nan_to_num(vp)
    ref = paged_chunk_attention(q, kp, vp, tables, lens, qls)
    low = paged_chunk_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, kp, vp)), tables, lens, qls)
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(low, np.float32), np.asarray(ref), atol=3e-2)


def test_dispatch_xla_auto_and_reference():
    """"reference" is the reference exactly; "xla" (and "auto" off the GPU) agree with it."""
    q, kp, vp, tables, lens, qls = _case(5, 4, 2, [6, 11], [2, 3], t_max=3)
    assert resolve_impl("auto") == ("pallas" if jax.default_backend() == "gpu" else "xla")
    ref = paged_chunk_attention(q, kp, vp, tables, lens, qls)
    ref_dec = paged_decode_attention(q[:, 0], kp, vp, tables, lens)
    out = paged_attention_chunk(q, kp, vp, tables, lens, qls, impl="reference")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    dec = paged_attention(q[:, 0], kp, vp, tables, lens, impl="reference")
    np.testing.assert_array_equal(np.asarray(dec), np.asarray(ref_dec))
    for impl in ("xla", "auto") if jax.default_backend() != "gpu" else ("xla",):
        out = paged_attention_chunk(q, kp, vp, tables, lens, qls, impl=impl)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
        dec = paged_attention(q[:, 0], kp, vp, tables, lens, impl=impl)
        np.testing.assert_allclose(np.asarray(dec), np.asarray(ref_dec), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="impl='triton'"):
        paged_attention(q[:, 0], kp, vp, tables, lens, impl="triton")


def test_dispatch_none_is_a_zero_cost_ablation():
    """"none" returns zeros of q's shape and dtype and reads no page: in the compiled
    program nothing touches the pages (a study times everything but attention)."""
    q, kp, vp, tables, lens, qls = _case(8, 4, 2, [6, 11], [2, 3], t_max=3)
    out = paged_attention_chunk(q, kp, vp, tables, lens, qls, impl="none")
    assert out.shape == q.shape and out.dtype == q.dtype and not np.asarray(out).any()
    dec = paged_attention(q[:, 0], kp, vp, tables, lens, impl="none")
    assert dec.shape == q[:, 0].shape and not np.asarray(dec).any()
    hlo = jax.jit(lambda q, k, v: paged_attention(q, k, v, tables, lens, impl="none")).lower(
        q[:, 0], kp, vp).as_text()
    assert "gather" not in hlo and "dot" not in hlo


def _pallas_available() -> bool:
    try:
        module = importlib.import_module("pallas_kernels")
    except ImportError:
        return False
    return hasattr(module, "paged_attention") and hasattr(module, "paged_attention_chunk")


def test_dispatch_pallas_interpret_or_clear_error():
    """Interpret-mode kernels agree with the reference; without them the error says so.

    Shapes the kernels support (head_dim 64, block_size 8).
    """
    q, kp, vp, tables, lens, qls = _case(6, 4, 2, [6, 27, 0], [2, 3, 0], t_max=4, bs=8, d=64)
    kp, vp = np.nan_to_num(kp), np.nan_to_num(vp)
    if not _pallas_available():
        with pytest.raises(ImportError, match="impl='xla'"):
            paged_attention(q[:, 0], kp, vp, tables, lens, impl="pallas_interpret")
        return
    out = paged_attention(q[:, 0], kp, vp, tables, lens, impl="pallas_interpret")
    ref = paged_decode_attention(q[:, 0], kp, vp, tables, lens)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-4)
    out = paged_attention_chunk(q, kp, vp, tables, lens, qls, impl="pallas_interpret")
    ref = paged_chunk_attention(q, kp, vp, tables, lens, qls)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-4)


def test_auto_on_gpu_falls_back_to_xla_when_the_kernel_refuses(monkeypatch):
    """head_dim 8 is not a shape the kernels tile: "auto" warns and uses xla; an explicit
    pallas request raises the kernel's error."""
    from paged_jax.attention import dispatch

    q, kp, vp, tables, lens, qls = _case(7, 4, 2, [6, 11], [2, 3], t_max=3)
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    with pytest.warns(UserWarning, match="'auto'"):
        out = paged_attention_chunk(q, kp, vp, tables, lens, qls, impl="auto")
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(paged_chunk_attention(q, kp, vp, tables, lens, qls)), rtol=1e-5, atol=1e-5
    )
    if _pallas_available():
        with pytest.raises(ValueError, match="head_dim"):
            paged_attention(q[:, 0], kp, vp, tables, lens, impl="pallas_interpret")
