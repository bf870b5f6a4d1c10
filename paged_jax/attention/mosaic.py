"""The Mosaic GPU kernel (``pallas_kernels.mosaic``) behind the attention contract: "mosaic_gpu".

It runs on a Hopper (sm_90) GPU, and anywhere else in Mosaic GPU interpret mode (CPU; slow,
for tests). It reads float pages and per-token quantised pages (int8, fp8_e4m3); decode
(T = 1) and chunks (T > 1) are one kernel. ``pallas_kernels`` is imported on first use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.attention import contract

READS_FORMATS = ("int8", "fp8_e4m3")  # = pallas_kernels.mosaic.READS_FORMATS (checked by a test)


def _module():
    try:
        from pallas_kernels import mosaic
    except ImportError as e:
        raise ImportError(f"attention impl 'mosaic_gpu' needs pallas_kernels.mosaic ({e}); use impl='xla'") from e
    return mosaic


def missing() -> str | None:
    """Why "mosaic_gpu" cannot run in this process (None if it can): on a GPU it needs
    sm_90 (wgmma is Hopper's); elsewhere it needs Mosaic GPU interpret mode."""
    try:
        mosaic = _module()
        if jax.default_backend() != "gpu":
            mosaic.interpret_params()
            return None
    except ImportError as e:
        return str(e)
    cc = str(getattr(jax.devices()[0], "compute_capability", "?"))
    if not cc.startswith("9."):
        return f"needs a Hopper GPU (sm_90, warpgroup MMA); this one has compute capability {cc}"
    return None


def tiling_problem(*, head_dim: int, block_size: int, num_heads: int, num_kv_heads: int) -> str | None:
    from pallas_kernels.mosaic import attention

    return contract.kernel_tiling_problem(attention, head_dim=head_dim, block_size=block_size,
                                          num_heads=num_heads, num_kv_heads=num_kv_heads)


def paged_attention(
    q: jax.Array,
    pages,
    block_tables: jax.Array,
    lengths: jax.Array,
    q_lens: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    scale: float | None = None,
    interpret: bool | None = None,
    **tuning,
) -> jax.Array:
    """The contract (``contract``: q [B, T, Hq, D], pages leaves [L, Hkv, N, bs, D] with
    ``layer`` or [Hkv, N, bs, D], int32 block_tables [B, P], lengths and q_lens [B]) by the
    Mosaic GPU kernel -> [B, T, Hq, D] in q.dtype.

    ``interpret``: None runs interpret mode off the GPU. ``tuning``: ``blocks_per_step``,
    ``num_splits``, ``num_stages`` of ``pallas_kernels.mosaic.paged_attention``.
    Raises ValueError for what the kernel does not take (int8_channel pages, head_dim 256
    with fp32 pages: shared memory), ImportError without ``pallas_kernels``.
    """
    contract.check(q, pages, block_tables, lengths, q_lens, layer)
    mosaic = _module()
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return mosaic.paged_attention(
        q, pages.k, pages.v, jnp.asarray(block_tables, jnp.int32), jnp.asarray(lengths, jnp.int32),
        jnp.asarray(q_lens, jnp.int32), layer=layer, scale=scale, k_scales=pages.k_scale, v_scales=pages.v_scale,
        per_channel_scales=pages.format.per_channel, interpret=interpret, **tuning)
