"""Every Triton-backend kernel compiled for sm_80 (A100) and sm_90a (H100) without a GPU:
no spills, <= 255 registers, shared memory within the arch's limit (163 KB / 227 KB).

``pallas_kernels.offline``: export for CUDA -> the Triton custom call's TTIR -> make_ttir
-> cubin with the ``triton`` package (pinned in the test extra), registers and spills from
``ptxas -v``. The grid (``offline.grid``) is real models' shapes at the kernels' default
tuning for each arch: head_dim 64/128, block 16/32/64, GQA 1/4/8, bf16/fp32, decode and
16-query chunks, int8 / int8_channel / fp8_e4m3 pages. A representative subset runs
unmarked; the whole grid is slow. Compiles are cached per session (and by Triton on disk).
"""

from __future__ import annotations

import pytest

from pallas_kernels import offline

pytestmark = pytest.mark.skipif(offline.missing() is not None, reason=str(offline.missing()))

QUICK = set(offline.grid(full=False))
CASES = [pytest.param(cfg, arch, id=f"{cfg.name}-sm{arch}", marks=[] if cfg in QUICK else [pytest.mark.slow])
         for cfg in offline.grid(full=True) for arch in offline.ARCHS if offline.applies(cfg, arch)]


@pytest.mark.parametrize("cfg,arch", CASES)
def test_kernel_fits_the_arch(cfg, arch):
    kernels = offline.check(cfg, arch)
    assert kernels, "no Triton kernel in the lowered program"
    for k in kernels:
        assert not k.problems(), f"{k.name} on sm_{arch}: {', '.join(k.problems())}"
        assert 0 < k.registers <= offline.MAX_REGISTERS


def test_the_check_can_fail():
    """The tuning that spilled before the per-arch defaults (the chunk kernel with 4 warps
    at head_dim 128, 64 rows x 128 keys) is reported as spilling: the check sees spills."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.chunk import paged_attention_chunk

    S = jax.ShapeDtypeStruct
    pages = S((2, 512, 16, 128), jnp.bfloat16)
    args = (S((2, 16, 16, 128), jnp.bfloat16), pages, pages, S((2, 128), jnp.int32), S((2,), jnp.int32),
            S((2,), jnp.int32))
    [k] = offline.resources(paged_attention_chunk, *args, arch=80, block_rows=64, blocks_per_step=8, num_warps=4)
    assert k.spills and k.problems()
