"""The dispatcher: its table of implementations, "auto", registration, the measured CPU
rule for sub-fp32 pages, and the fallbacks and errors around the optional kernels."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention import blocked, cpu_kernel, dispatch, pallas, reference
from paged_jax.kv import KVPages

ON_GPU = jax.default_backend() == "gpu"
# "auto" off the GPU: the native CPU kernel where it builds, else the plain-XLA loops
AUTO_HERE = "pallas" if ON_GPU else ("cpu" if jax.default_backend() == "cpu" and cpu_kernel.missing() is None else "xla")


def _case(seed=0, *, d=8, bs=4, dtype=jnp.float32):
    """A small valid call (GQA 4:2, T = 3, head_dim ``d``), 4-D pages."""
    rng = np.random.default_rng(seed)
    n, p = 12, 4
    pages = KVPages(*(jnp.asarray(rng.standard_normal((2, n, bs, d)), dtype) for _ in range(2)))
    tables = jnp.asarray(rng.permutation(n)[:8].reshape(2, p), jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, d)), dtype)
    return q, pages, tables, jnp.array([6, 2 * bs + 3], jnp.int32), jnp.array([2, 3], jnp.int32)


def test_table_and_resolution():
    assert set(dispatch.IMPLS) >= {"reference", "xla", "cpu", "pallas", "pallas_interpret"}
    assert dispatch.resolve_impl("auto") == AUTO_HERE
    for name in ("reference", "xla", "pallas", "pallas_interpret"):
        assert dispatch.resolve_impl(name) == name
    with pytest.raises(ValueError, match="impl='triton'"):
        dispatch.resolve_impl("triton")
    with pytest.raises(ValueError, match="impl='triton'"):
        dispatch.paged_attention(*_case(), impl="triton")


def test_each_name_runs_its_implementation():
    """ "reference" is the reference exactly; "xla" the blocked implementation exactly, and
    "auto" what it resolves to exactly (fp32)."""
    case = _case(1)
    ref = reference.paged_attention(*case)
    np.testing.assert_array_equal(dispatch.paged_attention(*case, impl="reference"), ref)
    want = blocked.paged_attention(*case)
    np.testing.assert_array_equal(dispatch.paged_attention(*case, impl="xla"), want)
    np.testing.assert_allclose(want, ref, rtol=1e-5, atol=1e-5)
    if not ON_GPU:
        auto = dispatch.IMPLS[AUTO_HERE].fn(*case)
        np.testing.assert_array_equal(dispatch.paged_attention(*case, impl="auto"), auto)
        np.testing.assert_allclose(auto, ref, rtol=1e-5, atol=1e-5)


def test_auto_picks_an_entry_that_reads_the_pages(monkeypatch):
    """"auto" never picks an entry that cannot read the pages' format: on the CPU quantised
    pages go to "xla" (the native kernel reads float pages only), and ``check_reads`` agrees."""
    from paged_jax.kv import quant

    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(dispatch, "IMPLS", dict(dispatch.IMPLS))
    dispatch.register(dispatch.dataclasses.replace(dispatch.IMPLS["cpu"], available=lambda: None))
    assert dispatch.resolve_impl("auto") == "cpu"
    assert dispatch.resolve_impl("auto", "bfloat16") == "cpu"
    for fmt in ("int8", "int8_channel", "fp8_e4m3"):
        assert dispatch.resolve_impl("auto", fmt) == "xla"
        dispatch.check_reads("auto", fmt)  # no error: "auto" reads them through "xla"
    with pytest.raises(ValueError, match="'cpu' cannot read kv_cache_dtype='int8'"):
        dispatch.check_reads("cpu", "int8")
    q, pages, tables, lengths, q_lens = _case(8)
    k, ks = quant.quantize_blocks(quant.kv_format("int8"), pages.k)
    v, vs = quant.quantize_blocks(quant.kv_format("int8"), pages.v)
    qpages = KVPages(k, v, ks, vs, kv_format="int8")
    np.testing.assert_array_equal(dispatch.paged_attention(q, qpages, tables, lengths, q_lens, impl="auto"),
                                  blocked.paged_attention(q, qpages, tables, lengths, q_lens))


def test_auto_on_cpu_falls_back_to_xla_without_the_native_kernel(monkeypatch):
    """No compiler (or a failed build): "auto" warns with the reason and uses "xla"; asking
    for "cpu" by name raises it."""
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(dispatch, "IMPLS", dict(dispatch.IMPLS))
    why = "the native CPU kernel is unavailable: no C++ compiler found"
    dispatch.register(dispatch.dataclasses.replace(dispatch.IMPLS["cpu"], available=lambda: why))
    with pytest.warns(UserWarning, match="falls back to 'xla'.*no C\\+\\+ compiler"):
        assert dispatch.resolve_impl("auto") == "xla"
    assert "no C++ compiler" in dispatch.tiling_problem("cpu", head_dim=64, block_size=16, num_heads=4,
                                                        num_kv_heads=2)


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
