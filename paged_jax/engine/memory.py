"""How big the KV pool is when the caller does not say: vLLM's sizing, without profiling.

On an accelerator that reports its memory (``Device.memory_stats()``: GPUs, TPUs) the
pool gets ``gpu_memory_utilization`` of the device's memory minus what is already in use
and the weights still to be loaded (``weight_bytes``: the pool is sized from the config,
before any weight is read); the remaining ``1 -
gpu_memory_utilization`` is the margin for activations, which vLLM measures with a dummy
forward pass and we do not. On the CPU the budget is fixed:
``PAGED_JAX_CPU_KVCACHE_SPACE`` GiB (default 4), as vLLM's ``VLLM_CPU_KVCACHE_SPACE``.

Either way the pool never exceeds what the engine could use: ``max_num_seqs`` sequences
of ``max_model_len`` tokens.
"""

from __future__ import annotations

import os

import jax

CPU_ENV = "PAGED_JAX_CPU_KVCACHE_SPACE"
DEFAULT_CPU_GIB = 4.0


def check_utilization(gpu_memory_utilization) -> float:
    u = gpu_memory_utilization
    if isinstance(u, bool) or not isinstance(u, int | float) or not 0 < u <= 1:
        raise ValueError(f"gpu_memory_utilization={u!r}: must be a fraction in (0, 1]")
    return float(u)


def weight_bytes(model_spec) -> int:
    """Bytes the weights of an ``EngineConfig``'s model part will take once loaded (with
    its draft's); 0 for a ``ModelBackend``, whose weights are already in memory."""
    if model_spec.backend is not None:
        return 0
    specs = [model_spec] + ([model_spec.draft] if model_spec.draft is not None else [])
    return sum(s.architecture.num_params * s.architecture.jnp_dtype.itemsize for s in specs)


def kv_budget_bytes(gpu_memory_utilization: float, device=None, weight_bytes: int = 0) -> tuple[int, str]:
    """(bytes the KV pool may take, how that was decided) on ``device`` (default: the
    first device), ``weight_bytes`` still to be loaded there."""
    device = device or jax.devices()[0]
    stats = None
    try:
        stats = device.memory_stats()
    except (AttributeError, NotImplementedError, RuntimeError):
        pass
    if stats and stats.get("bytes_limit"):
        limit, used = int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
        budget = int(gpu_memory_utilization * limit) - used - weight_bytes
        return max(budget, 0), (f"gpu_memory_utilization={gpu_memory_utilization} of {limit / 2**30:.1f} GiB "
                                f"on {device.device_kind}, {used / 2**30:.2f} GiB already in use, "
                                f"{weight_bytes / 2**30:.2f} GiB of weights to load")
    raw = os.environ.get(CPU_ENV)
    try:
        gib = DEFAULT_CPU_GIB if raw is None else float(raw)
    except ValueError:
        raise ValueError(f"{CPU_ENV}={raw!r}: expected GiB as a number") from None
    if not gib > 0:
        raise ValueError(f"{CPU_ENV}={raw!r}: must be > 0 GiB")
    return int(gib * 2**30), f"{CPU_ENV}={gib:g} GiB ({device.platform}: no memory statistics)"
