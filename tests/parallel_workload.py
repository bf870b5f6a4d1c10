"""The workload and engine shapes the multi-device checks share (``multi_device_checks.py``,
``multi_process_worker.py``): a module without side effects, so each script sets its own
devices before JAX starts."""

from __future__ import annotations

import os

import jax
import numpy as np

from paged_jax import SamplingParams

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
LLAMA = os.path.join(FIXTURES, "llama")  # 4 query heads, 2 kv heads: t = 4 replicates each kv head twice
QWEN2 = os.path.join(FIXTURES, "qwen2")  # 4 query heads, 4 kv heads: t = 4 splits them
# Shapes chosen so an engine compiles few programs: every prompt fits one prefill call
# (4 rows x 32), decode is one bucket (8 rows); the pool holds the whole workload.
ENGINE = dict(dtype="float32", block_size=16, num_gpu_blocks=32, max_num_seqs=8, max_model_len=64,
              max_num_batched_tokens=128, attention_impl="xla")
# The pressure run: a pool of 9 blocks for ~20 blocks of demand, swapping, prefix caching.
PRESSURE = dict(ENGINE, num_gpu_blocks=9, preemption_mode="swap", enable_prefix_caching=True)
GRID = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)]  # (t, d); (1, 1) is also the one-device run


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Six greedy requests (two sharing their first block: a prefix-cache hit) and two
    sampled ones (own seeds), every prompt at most 18 tokens."""
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 256, 16).tolist()
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 14, 3, 9)] + [shared + [1, 2], shared + [3]]
    prompts += [rng.integers(0, 256, 11).tolist() for _ in range(2)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 6
    params += [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, seed=s) for s in (1, 2)]
    return prompts, params


def use_suite_cache(root: str) -> None:
    """The suite's persistent compilation cache (tests/conftest.py's ``.jax_cache``), so a
    rerun reads the programs back; ``MULTI_DEVICE_CACHE=<dir>`` another, ``=0`` none."""
    path = os.environ.get("MULTI_DEVICE_CACHE", os.path.join(root, ".jax_cache"))
    if path == "0":
        jax.config.update("jax_enable_compilation_cache", False)
    else:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def engines(llm) -> list:
    return llm.engines


def kv_bytes(llm) -> dict:
    """Per-device bytes of the KV pages (every device of every replica) and the pool's total."""
    out = {"total": 0, "per_device": []}
    for rep in engines(llm):
        pages = rep.runner.pages
        out["total"] += sum(x.nbytes for x in jax.tree.leaves(pages))
        for device in {s.device for x in jax.tree.leaves(pages) for s in x.addressable_shards}:
            out["per_device"].append(sum(s.data.nbytes for x in jax.tree.leaves(pages) for s in x.addressable_shards
                                         if s.device == device))
    return out
