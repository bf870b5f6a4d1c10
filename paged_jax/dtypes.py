"""The floating-point dtypes paged_jax computes and stores in, by name: one table.

Parameters, activations and unquantised KV pages are float32, bfloat16 or float16. Names
accepted anywhere a dtype is configured: the canonical names, the short aliases
(``"fp32"``, ``"bf16"``, ``"fp16"``), a ``jnp``/``np`` dtype or scalar type. Checkpoints
declare theirs with safetensors tags (``SAFETENSORS_TAGS``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import jax.numpy as jnp

logger = logging.getLogger("paged_jax")

FLOAT_DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# safetensors dtype tag -> our name; any other tag is not a float we load.
SAFETENSORS_TAGS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def dtype_name(dtype: Any) -> str:
    """Canonical name ("float32", "bfloat16" or "float16") of ``dtype``; ValueError otherwise."""
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype, dtype)
    else:
        try:
            name = jnp.dtype(dtype).name
        except TypeError:
            name = None
    if name not in FLOAT_DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(FLOAT_DTYPES)} (or fp32, bf16, fp16)")
    return name


def float_dtype(dtype: Any) -> jnp.dtype:
    """The ``jnp.dtype`` of ``dtype`` (see ``dtype_name`` for what is accepted)."""
    return jnp.dtype(FLOAT_DTYPES[dtype_name(dtype)])


# --------------------------------------------------------------------------- dtype="auto"


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU has native bf16 dot instructions (AVX512-BF16 or AMX-BF16), read
    from ``/proc/cpuinfo`` (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def auto_compute_dtype(checkpoint_dtype: Any, platform: str, *, cpu_bf16: bool | None = None) -> tuple[str, str]:
    """The compute (and weight, and KV) dtype ``dtype="auto"`` picks for a checkpoint
    stored in ``checkpoint_dtype`` on ``platform`` (``jax.default_backend()``: "cpu",
    "gpu", "tpu", ...): ``(dtype name, why)``.

    - float32 checkpoints stay float32 everywhere (no silent downcast; vLLM casts them
      to bf16 on GPUs; pass ``dtype="bfloat16"`` for that).
    - GPU/TPU: the checkpoint's dtype (bf16 and f16 are native there).
    - CPU with bf16 dot instructions (``cpu_has_bf16``; ``cpu_bf16`` overrides): bf16
      stays bf16. Measured on the 2-core AVX512-BF16 EPYC (2026-12-03, under contention
      from other jobs, CPU time per step): a SmolLM2-135M-shaped decode step at 64 rows
      took 321 ms in bf16 vs 524 ms in fp32 (bf16 dots accumulate in f32 there; KV and
      layer weights move as integer bits: ``kv.pages``, ``model.llama.pack_params``).
    - CPU without them: bf16 -> float32 (XLA:CPU then emulates bf16 dots by converting
      the operands to f32 first, i.e. fp32 work plus the converts). Measured on a 2-core
      EPYC without AVX-512 (2026-12-04, the peers study, forced ``dtype``): 101 tok/s in
      bf16 vs 104 in fp32, so fp32 costs nothing there and is exact. On the AVX512-BF16
      EPYC that evening: 246 vs 199 tok/s (bf16 1.2x).
    - CPU, float16: -> float32. XLA:CPU has no f16 dot: the same step took 475 ms in
      f16 vs 524 in f32 (within noise) but the tied LM head ``[64, 576] x [576, 49152]``
      270 ms vs 112 ms, and f32 is exact for f16 weights; the price is 2x weight and KV
      memory.
    """
    name = dtype_name(checkpoint_dtype)
    if name == "float32":
        return name, "float32 checkpoint"
    if platform != "cpu":
        return name, f"{name} is native on {platform}"
    if name == "float16":
        return "float32", "XLA:CPU has no float16 dot (float32 is as fast and exact for float16 weights)"
    has_bf16 = cpu_has_bf16() if cpu_bf16 is None else cpu_bf16
    if has_bf16:
        return name, "this CPU has bf16 dot instructions (bf16 steps measured ~1.6x faster than float32)"
    return "float32", "this CPU has no bf16 dot instructions (XLA:CPU would convert to float32 first)"
