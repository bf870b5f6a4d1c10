"""The dispatcher: its table of implementations, "auto", registration, the measured CPU
rule for sub-fp32 pages, and the fallbacks and errors around the optional kernels."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention import blocked, dispatch, pallas, reference
from paged_jax.kv import KVPages

ON_GPU = jax.default_backend() == "gpu"


def _case(seed=0, *, d=8, bs=4, dtype=jnp.float32):
    """A small valid call (GQA 4:2, T = 3, head_dim ``d``), 4-D pages."""
    rng = np.random.default_rng(seed)
    n, p = 12, 4
    pages = KVPages(*(jnp.asarray(rng.standard_normal((2, n, bs, d)), dtype) for _ in range(2)))
    tables = jnp.asarray(rng.permutation(n)[:8].reshape(2, p), jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, d)), dtype)
    return q, pages, tables, jnp.array([6, 2 * bs + 3], jnp.int32), jnp.array([2, 3], jnp.int32)


def test_table_and_resolution():
    assert set(dispatch.IMPLS) >= {"reference", "xla", "pallas", "pallas_interpret"}
    assert dispatch.resolve_impl("auto") == ("pallas" if ON_GPU else "xla")
    for name in ("reference", "xla", "pallas", "pallas_interpret"):
        assert dispatch.resolve_impl(name) == name
    with pytest.raises(ValueError, match="impl='triton'"):
        dispatch.resolve_impl("triton")
    with pytest.raises(ValueError, match="impl='triton'"):
        dispatch.paged_attention(*_case(), impl="triton")


def test_each_name_runs_its_implementation():
    """ "reference" is the reference exactly; "xla" (and "auto" off the GPU) the blocked
    implementation exactly (fp32)."""
    case = _case(1)
    ref = reference.paged_attention(*case)
    np.testing.assert_array_equal(dispatch.paged_attention(*case, impl="reference"), ref)
    want = blocked.paged_attention(*case)
    for impl in ("xla",) if ON_GPU else ("xla", "auto"):
        np.testing.assert_array_equal(dispatch.paged_attention(*case, impl=impl), want)
    np.testing.assert_allclose(want, ref, rtol=1e-5, atol=1e-5)


def test_register_impl_injects_an_implementation(monkeypatch):
    monkeypatch.setattr(dispatch, "IMPLS", dict(dispatch.IMPLS))
    calls = []

    def doubled_reference(q, pages, block_tables, lengths, q_lens, *, layer=None, scale=None):
        calls.append((q.shape, layer, scale))
        return 2 * reference.paged_attention(
            q, pages, block_tables, lengths, q_lens, layer=layer, scale=scale
        )

    dispatch.register_impl("study", doubled_reference)
    case = _case(2)
    assert dispatch.resolve_impl("study") == "study"
    out = dispatch.paged_attention(*case, scale=0.5, impl="study")
    np.testing.assert_array_equal(out, 2 * reference.paged_attention(*case, scale=0.5))
    assert calls == [(case[0].shape, None, 0.5)]
    with pytest.raises(ValueError, match="automatic"):
        dispatch.register_impl("auto", doubled_reference)


def test_an_impl_that_knows_no_scales_is_refused_quantised_pages(monkeypatch):
    """A registered implementation reads quantised pages only if it says so: otherwise a
    clear error naming it and the format, never int8 bytes read as keys."""
    from paged_jax.kv import KVPages, quant

    monkeypatch.setattr(dispatch, "IMPLS", dict(dispatch.IMPLS))
    q, pages, tables, lengths, q_lens = _case(4)
    fmt = quant.kv_format("int8")
    (k, ks), (v, vs) = quant.quantize_blocks(fmt, pages.k), quant.quantize_blocks(fmt, pages.v)
    qpages = KVPages(k, v, ks, vs, kv_format="int8")
    dispatch.register_impl("naive", reference.paged_attention)
    with pytest.raises(ValueError, match=r"impl 'naive' cannot read kv_cache_dtype='int8'"):
        dispatch.paged_attention(q, qpages, tables, lengths, q_lens, impl="naive")
    with pytest.raises(ValueError, match="'naive' cannot read"):
        dispatch.check_reads("naive", "int8")
    dispatch.check_reads("naive", "bfloat16")  # unquantised pages: fine
    dispatch.register_impl("naive", reference.paged_attention, reads_quantized=True)
    out = dispatch.paged_attention(q, qpages, tables, lengths, q_lens, impl="naive")
    np.testing.assert_array_equal(out, reference.paged_attention(q, qpages, tables, lengths, q_lens))


def test_contract_errors_are_raised_whatever_the_impl(monkeypatch):
    """A call that breaks the contract raises, even under "auto" on GPU (no fallback)."""
    q, pages, tables, lengths, q_lens = _case(3)
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    for impl in ("auto", "xla", "reference", "pallas_interpret"):
        with pytest.raises(ValueError, match="layer"):
            dispatch.paged_attention(q, pages, tables, lengths, q_lens, layer=0, impl=impl)


def test_xla_is_the_length_aware_implementation_in_every_dtype():
    """"xla" runs the blocked loops for fp32 and bf16 pages alike (sub-fp32 pages are
    gathered as integers, so no whole-pool convert is hoisted out of the loops)."""
    case = _case(4, dtype=jnp.bfloat16)
    got = dispatch.paged_attention(*case, impl="xla")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(blocked.paged_attention(*case), np.float32))
    for dtype in (jnp.float32, jnp.bfloat16):
        text = jax.jit(dispatch.IMPLS["xla"].fn).lower(*_case(4, dtype=dtype)).as_text()
        assert "stablehlo.while" in text


def test_pallas_interpret_matches_the_reference():
    case = _case(5, d=64, bs=8)
    np.testing.assert_allclose(
        dispatch.paged_attention(*case, impl="pallas_interpret"),
        reference.paged_attention(*case),
        rtol=1e-5,
        atol=1e-5,
    )


def test_auto_on_gpu_falls_back_to_xla_when_the_kernel_refuses(monkeypatch):
    """head_dim 8 is not a shape the kernels tile: "auto" warns and uses xla; an explicit
    pallas request raises the kernel's error."""
    case = _case(6)
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    with pytest.warns(UserWarning, match="'auto'.*head_dim"):
        out = dispatch.paged_attention(*case, impl="auto")
    np.testing.assert_array_equal(out, blocked.paged_attention(*case))
    with pytest.raises(ValueError, match="head_dim"):
        dispatch.paged_attention(*case, impl="pallas_interpret")


def test_missing_kernels_are_a_clear_error_and_auto_falls_back(monkeypatch):
    pallas.kernels.cache_clear()
    monkeypatch.setitem(sys.modules, "pallas_kernels", None)  # makes the import fail
    try:
        with pytest.raises(ImportError, match="pallas_kernels.*impl='xla'"):
            dispatch.paged_attention(*_case(7, d=64, bs=8), impl="pallas_interpret")
        monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
        with pytest.warns(UserWarning, match="falls back to 'xla'"):
            assert dispatch.resolve_impl("auto") == "xla"
    finally:
        pallas.kernels.cache_clear()
