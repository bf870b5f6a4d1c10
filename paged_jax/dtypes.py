"""The floating-point dtypes paged_jax computes and stores in, by name: one table.

Parameters, activations and unquantised KV pages are float32, bfloat16 or float16. Names
accepted anywhere a dtype is configured: the canonical names, the short aliases
(``"fp32"``, ``"bf16"``, ``"fp16"``), a ``jnp``/``np`` dtype or scalar type. Checkpoints
declare theirs with safetensors tags (``SAFETENSORS_TAGS``).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

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
