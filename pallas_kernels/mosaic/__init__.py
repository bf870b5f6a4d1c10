"""Mosaic GPU (Hopper, sm_90a) Pallas kernels: paged attention for decode and chunks.

``attention.paged_attention`` is the raw-array kernel (its module doc gives the design);
``paged_jax.attention.mosaic`` puts it behind the attention contract as ``"mosaic_gpu"``.
It runs on an sm_90 GPU, and on CPU in Mosaic GPU interpret mode (``interpret=True``).
"""

from pallas_kernels.mosaic.attention import (
    READS_FORMATS,
    Plan,
    check_plan,
    interpret_params,
    lowering_text,
    paged_attention,
    reset_interpreter,
    smem_bytes,
)

__all__ = ["READS_FORMATS", "Plan", "check_plan", "interpret_params", "lowering_text", "paged_attention",
           "reset_interpreter", "smem_bytes"]
