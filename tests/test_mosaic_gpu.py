"""The Mosaic GPU kernel (``pallas_kernels.mosaic``) beyond the contract suite (which runs it
as "mosaic_gpu" against the oracle, in Mosaic GPU interpret mode on CPU): the pipeline over
many steps with split-K, its refusals, its shared-memory budget, and its lowering for
sm_90a without a GPU (``jax.export`` to CUDA: Mosaic GPU's layout inference and wgmma
checks run at lowering; the PTX compile happens when XLA compiles the program, on a GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention import dispatch, reference
from paged_jax.attention import mosaic as mosaic_impl
from paged_jax.kv import KVPages, quant

mosaic = pytest.importorskip("pallas_kernels.mosaic")
attention = pytest.importorskip("pallas_kernels.mosaic.attention")

S = jax.ShapeDtypeStruct


def _interpretable() -> str | None:
    try:
        mosaic.interpret_params()
    except ImportError as e:
        return str(e)
    return None


needs_interpreter = pytest.mark.skipif(_interpretable() is not None, reason=f"no interpreter: {_interpretable()}")


def long_case(dtype, *, b=3, hq=8, hkv=1, bs=16, p=20, d=64, seed=0):
    """Rows of 0, p * bs (5 steps of 64) and 150 tokens in a shuffled pool; free slots NaN."""
    rng = np.random.default_rng(seed)
    n = b * p + 2
    lengths = np.array([0, p * bs, 150][:b], np.int32)
    perm = rng.permutation(n)
    tables = perm[: b * p].reshape(b, p).astype(np.int32)
    k = rng.standard_normal((hkv, n, bs, d), np.float32)
    v = rng.standard_normal((hkv, n, bs, d), np.float32)
    owned = np.zeros((n, bs), bool)
    for i, length in enumerate(lengths):
        pos = np.arange(length)
        owned[tables[i, pos // bs], pos % bs] = True
        tables[i, -(-int(length) // bs):] = -1
    k[:, ~owned], v[:, ~owned] = np.nan, np.nan
    q = rng.standard_normal((b, 1, hq, d), np.float32)
    return (jnp.asarray(q, dtype), KVPages(jnp.asarray(k, dtype), jnp.asarray(v, dtype)), jnp.asarray(tables),
            jnp.asarray(lengths), jnp.asarray(np.minimum(lengths, 1).astype(np.int32)))


@pytest.mark.slow
@needs_interpreter
def test_pipeline_over_many_steps_with_split_k():
    """5 steps of 64 keys through a 3-deep ring, shared by 2 splits (ragged: one split of a
    row gets 3 steps, the other 2; a 150-token row ends inside a step; an empty row)."""
    q, pages, tables, lengths, q_lens = long_case(jnp.bfloat16)
    want = reference.paged_attention(q, pages, tables, lengths, q_lens)
    run = jax.jit(lambda *a: mosaic_impl.paged_attention(*a, num_stages=3, num_splits=2, interpret=True))
    out = run(q, pages, tables, lengths, q_lens)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=3e-2)
    assert not np.asarray(out[0], np.float32).any()


@pytest.mark.slow
@needs_interpreter
@pytest.mark.parametrize("stages,splits,bps", [(1, 1, 4), (2, 3, 8), (4, 1, 4)])
def test_pipeline_depths_fp32(stages, splits, bps):
    q, pages, tables, lengths, q_lens = long_case(jnp.float32, seed=stages)
    want = reference.paged_attention(q, pages, tables, lengths, q_lens)
    out = mosaic_impl.paged_attention(q, pages, tables, lengths, q_lens, num_stages=stages, num_splits=splits,
                                      blocks_per_step=bps, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_split_terms_keep_fp32_accuracy():
    """The bf16 terms of fp32 operands: products of terms i + j < 3 are fp32-accurate."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((64, 128)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((128, 64)), jnp.float32)
    ta, tb = attention.split_terms(a, 3), attention.split_terms(b, 3)
    assert all(t.dtype == jnp.bfloat16 for t in ta)
    got = sum(jnp.dot(ta[i], tb[j], preferred_element_type=jnp.float32) for i, j in attention._pairs(3, 3))
    want = jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)
    one = jnp.dot(ta[0], tb[0], preferred_element_type=jnp.float32)
    assert float(jnp.abs(got - want).max()) < 1e-4 < float(jnp.abs(one - want).max())


def test_refusals_name_what_is_supported():
    q = jnp.zeros((1, 1, 4, 64), jnp.float32)
    k = jnp.zeros((2, 4, 16, 64), jnp.int8)
    sc = jnp.zeros((2, 4, 64), jnp.uint16)
    bt, ln = jnp.zeros((1, 4), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="int8_channel"):
        mosaic.paged_attention(q, k, k, bt, ln, ln, k_scales=sc, v_scales=sc, per_channel_scales=True)
    with pytest.raises(ValueError, match="multiple of 64"):
        mosaic.paged_attention(q, k.astype(jnp.float32), k.astype(jnp.float32), bt, ln, ln, blocks_per_step=2)
    with pytest.raises(ValueError, match="227 KB"):
        big = jnp.zeros((2, 4, 16, 256), jnp.float32)
        mosaic.paged_attention(jnp.zeros((1, 1, 4, 256), jnp.float32), big, big, bt, ln, ln)
    with pytest.raises(ValueError, match="int8_channel"):  # through the registry, before any kernel
        dispatch.check_reads("mosaic_gpu", "int8_channel")
    assert mosaic_impl.READS_FORMATS == mosaic.READS_FORMATS
    assert all(quant.kv_format(f).quantized for f in mosaic.READS_FORMATS)


def test_shared_memory_fits_hopper_at_the_default_tiling():
    """At the default tiling every supported shape fits 227 KB, except these (refused by
    name): fp32/fp16/quantised pages at head_dim 256, and at 128 with blocks of 128."""
    refused = []
    for d in attention.SUPPORTED_HEAD_DIMS:
        for kv in ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn"):
            quantized = kv in ("int8", "float8_e4m3fn")
            for bs in attention.SUPPORTED_BLOCK_SIZES:
                for qd in ("bfloat16", "float32") if quantized else (kv,):
                    fields = dict(q_dtype=qd, kv_dtype=kv, head_dim=d, block_size=bs,
                                  blocks_per_step=attention.default_blocks_per_step(bs), num_splits=1, group=8,
                                  quantized=quantized)
                    plan = attention.Plan(**fields, num_stages=attention.default_num_stages(**fields))
                    if plan.smem_bytes() > attention.SMEM_LIMIT:
                        refused.append((d, kv, bs))
                        with pytest.raises(ValueError, match="227 KB"):
                            attention.check_plan(plan)
                    elif d <= 128:
                        assert plan.stages >= 2, (d, kv, bs)  # copies in flight behind the compute
    assert {(d, kv) for d, kv, _ in refused} <= {(256, kv) for kv in ("float32", "float16", "int8", "float8_e4m3fn")} | {
        (128, kv) for kv in ("float32", "float16", "int8", "float8_e4m3fn")}
    assert all(bs == 128 for d, _, bs in refused if d == 128)
    assert not any(kv == "bfloat16" for _, kv, _ in refused)


LOWERINGS = {  # name: (q dtype, page dtype, T, Hq, Hkv, D, bs, quantised, tuning)
    "bf16-decode-gqa8-d128-bs16": ("bfloat16", "bfloat16", 1, 8, 1, 128, 16, False, {}),
    "bf16-decode-split2-stages3": ("bfloat16", "bfloat16", 1, 8, 2, 128, 32, False,
                                   dict(num_splits=2, num_stages=3)),
    "fp32-decode-d128": ("float32", "float32", 1, 4, 1, 128, 16, False, {}),
    "fp16-chunk8-d64": ("float16", "float16", 8, 4, 1, 64, 64, False, {}),
    "int8-bf16q-decode": ("bfloat16", "int8", 1, 8, 1, 128, 16, True, {}),
    "fp8-fp32q-chunk4": ("float32", "float8_e4m3fn", 4, 8, 2, 64, 32, True, dict(num_splits=2)),
    "bf16-d256-bs128": ("bfloat16", "bfloat16", 1, 1, 1, 256, 128, False, {}),
}
QUICK_LOWERINGS = ("bf16-decode-gqa8-d128-bs16", "int8-bf16q-decode")


def _lowering_problem() -> str | None:
    try:
        jax.export.export(jax.jit(lambda x: x), platforms=["cuda"])(S((1,), jnp.float32))
    except Exception as e:  # this jax cannot lower for CUDA here
        return f"jax.export cannot target cuda here: {e}"
    return None


@pytest.mark.skipif(_lowering_problem() is not None, reason=str(_lowering_problem()))
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in QUICK_LOWERINGS else [pytest.mark.slow])
                                  for n in LOWERINGS])
def test_lowers_for_sm90_without_a_gpu(name):
    """The GPU form (wgmma, TMA gathers into swizzled tiles, barriers, layouts) lowers to a
    Mosaic GPU custom call for CUDA. Without a device Mosaic GPU lowers for sm_90a."""
    qd, kvd, t, hq, hkv, d, bs, quantized, tuning = LOWERINGS[name]
    b, n, width = 2, 40, 12
    pages = S((2, hkv, n, bs, d), jnp.dtype(kvd))
    args = [S((b, t, hq, d), jnp.dtype(qd)), pages, pages, S((b, width), jnp.int32), S((b,), jnp.int32),
            S((b,), jnp.int32)]
    kw = dict(tuning)
    if quantized:
        kw.update(k_scales=S((2, hkv, n, bs), jnp.uint16), v_scales=S((2, hkv, n, bs), jnp.uint16))
    fn = lambda q, k, v, bt, ln, ql, layer, **scales: mosaic.paged_attention(  # noqa: E731
        q, k, v, bt, ln, ql, layer=layer, **scales, **tuning)
    scales = {k: kw[k] for k in ("k_scales", "v_scales") if k in kw}
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args, S((), jnp.int32), **scales)
    text = exported.mlir_module()
    assert "mosaic_gpu" in text  # the kernel is a Mosaic GPU custom call, not Triton
    assert "__gpu$xla.gpu.triton" not in text


def test_without_the_triton_backend_everything_else_imports():
    """jax after the Triton backend's removal (deprecated in 0.11), simulated by blocking its
    import: pallas_kernels imports and says why its Triton kernels are absent, "pallas"
    reports them unavailable, the Mosaic kernel and the GPU scripts still import."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['jax.experimental.pallas.triton'] = None\n"
        "import pallas_kernels; assert pallas_kernels.TRITON_ERROR is not None\n"
        "assert not hasattr(pallas_kernels, 'paged_attention_decode')\n"
        "from pallas_kernels import mosaic; assert mosaic.paged_attention\n"
        "from paged_jax.attention import dispatch\n"
        "why = dispatch.IMPLS['pallas'].available(); assert why and 'mosaic_gpu' in why, why\n"
        "assert dispatch.IMPLS['mosaic_gpu'].available() is None\n"
        "import experiments.gpu, experiments.kernel_check\n"
        "from experiments import kernel_bench; assert kernel_bench.TRITON_MISSING\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
