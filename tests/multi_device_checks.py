"""Tensor and data parallelism on 8 simulated CPU devices, in one process (compiling is the
cost, so every check shares the engines and programs of the others).

Run by ``tests/test_multi_device.py`` in a subprocess (the suite's processes keep one
device): ``python tests/multi_device_checks.py OUT.json``. Sets its own XLA_FLAGS before
JAX loads; writes what it measured as JSON, which the test asserts on.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from parallel_workload import (  # noqa: E402
    ENGINE,
    GRID,
    LLAMA,
    PRESSURE,
    QWEN2,
    engines,
    kv_bytes,
    use_suite_cache,
    workload,
)

use_suite_cache(ROOT)

from paged_jax import LLM  # noqa: E402
from paged_jax.cache import check_invariants  # noqa: E402
from paged_jax.parallel import hlo  # noqa: E402


def decode_hlo(rep) -> str:
    """The optimised HLO of one replica's decode step (8 rows) as the runner compiles it."""
    runner = rep.runner
    rows = 8
    sampling = runner.inputs.sampling([], rows)
    tokens = np.zeros((rows, 1), np.int32)
    ids = np.full(rows, -1, np.int32)
    lowered = runner._step.lower(runner.params, runner.cache_state, runner.pages, tokens, ids,
                                 np.zeros(rows, np.int32), sampling, None, num_top=0, prompt_top=0)
    return lowered.compile().as_text()


def pool_copies(text: str, pages) -> list[str]:
    """Copies or converts of a whole page leaf (one device's shard) in ``text``."""
    shapes = {tuple(x.addressable_shards[0].data.shape) for x in jax.tree.leaves(pages)}
    return hlo.copies(text, "|".join(re.escape("[" + ",".join(map(str, s)) + "]") for s in shapes))


def run_grid(out: dict) -> None:
    prompts, params = workload()
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    reference = None
    for t, d in GRID:
        start = time.perf_counter()
        kwargs = dict(ENGINE)
        llm = LLM(LLAMA, **kwargs) if (t, d) == (1, 1) else LLM(LLAMA, tensor_parallel_size=t, data_parallel_size=d,
                                                                 **kwargs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        if reference is None:
            reference = tokens
        stats = llm.stats()
        invariants = []
        for rep in engines(llm):
            check_invariants(rep.runner.cache_state, op=f"after generate, t={t} d={d}")
            rep.check()  # the host's view of the block manager equals the device's
            invariants.append(rep.inspect().num_available == llm.num_gpu_blocks)
        out["grid"].append({
            "t": t, "d": d, "replicas": llm.data_parallel_size, "seconds": time.perf_counter() - start,
            "greedy_equal": [tokens[i] == reference[i] for i in greedy],
            "sampled_equal": [tokens[i] == reference[i] for i in range(len(tokens)) if i not in greedy],
            "preemptions": stats["num_preemptions"], "invariants": invariants, "compiles": stats["compiles"],
            "kv": kv_bytes(llm), "replica_requests": [len(r.stats.request_blocks) for r in engines(llm)],
        })
        out["reference_tokens"] = reference
        if d == 1 and t > 1:
            hlo_start = time.perf_counter()
            text = decode_hlo(llm.engine)
            print(f"decode HLO t={t}: {time.perf_counter() - hlo_start:.1f} s", flush=True)
            out["hlo"][str(t)] = {"summary": hlo.summary(text), "pool_copies": pool_copies(text, llm.engine.runner.pages),
                                  "layers": 2}
        print(f"t={t} d={d}: {time.perf_counter() - start:.1f} s", flush=True)


def stream(llm, prompts, params, fetches: list | None = None) -> tuple[list, int, list]:
    """Run requests step by step, every replica's invariants (``LLMEngine.check``: the
    block manager's, and the device agreeing with the host) checked after every step.
    ``fetches``: gets the ``jax.device_get`` calls each step made. Returns the tokens,
    the steps and each request's replica."""
    ids = [llm.add_request({"prompt_token_ids": p}, sp) for p, sp in zip(prompts, params, strict=True)]
    owners = [llm.router.owner.get(i, 0) for i in ids]
    finished, steps = {}, 0
    device_get = jax.device_get
    while llm.has_unfinished_requests():
        calls = []
        jax.device_get = lambda tree: (  # counts calls that move device arrays (test_engine_runner's rule)
            calls.append(1) if any(isinstance(x, jax.Array) for x in jax.tree.leaves(tree)) else None,
            device_get(tree))[1]
        try:
            outs = llm.step()
        finally:
            jax.device_get = device_get
        if fetches is not None:
            fetches.append(len(calls))
        for o in outs:
            if o.finished:
                finished[o.request_id] = o.outputs[0].token_ids
        for rep in engines(llm):
            rep.check()
        steps += 1
    return [finished[i] for i in ids], steps, owners


def run_streaming(out: dict) -> None:
    """t = 2, d = 2 on an explicit mesh, requests assigned least-loaded, stepped by hand
    (``stream``); then t = 2 under pressure: swap preemption and prefix caching."""
    from jax.sharding import Mesh

    prompts, params = workload()
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    llm = LLM(LLAMA, mesh=mesh, data_parallel_policy="least_loaded", **ENGINE)
    tokens, steps, owners = stream(llm, prompts, params)
    out["streaming"] = {"steps": steps, "equal": [a == b for a, b in zip(tokens, out["reference_tokens"], strict=True)],
                        "owners": owners}
    start = time.perf_counter()
    llm = LLM(LLAMA, tensor_parallel_size=2, **PRESSURE)
    fetches = []
    tokens, steps, _ = stream(llm, prompts, params, fetches)
    stats = llm.stats()
    out["pressure"] = {"steps": steps, "equal": [a == b for a, b in zip(tokens, out["reference_tokens"], strict=True)],
                       "swap_outs": stats["swap_outs"], "prefix_hit_tokens": stats["prefix_cache_hit_tokens"],
                       "fetches_per_step": fetches, "seconds": time.perf_counter() - start}


def run_kv_split(out: dict) -> None:
    """Per-device KV bytes with the kv heads split (qwen2, 4 kv heads) at equal blocks."""
    rows = {}
    for t in (1, 2, 4):
        llm = LLM(QWEN2, **ENGINE) if t == 1 else LLM(QWEN2, tensor_parallel_size=t, **ENGINE)
        rows[str(t)] = kv_bytes(llm)
    out["kv_split"] = rows


def run_pallas(out: dict) -> None:
    """The Pallas kernels (interpret mode) per shard: a prefill chunk and a decode step of
    a head_dim-64 model at t = 2 against the one-device XLA step."""
    import jax.numpy as jnp

    from paged_jax.cache import init_state, open_sequences
    from paged_jax.config import CacheConfig
    from paged_jax.model import ModelConfig, init_params
    from paged_jax.parallel import make_mesh
    from paged_jax.parallel.backend import shard_model, sharded_init
    from paged_jax.parallel.sharding import replicate
    from paged_jax.steps import init_pages_for, make_model_step

    cfg = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=2, head_dim=64, max_position_embeddings=128)
    cc = CacheConfig(num_blocks=8, block_size=16, max_seqs=2, max_blocks_per_seq=4)
    _, params = init_params(cfg, 0)
    mesh = make_mesh(2, 1)
    scfg, sparams, sstep = shard_model(cfg, params, mesh, "pallas_interpret")
    pages = sharded_init(lambda n: init_pages_for(scfg, cc), mesh)(cc.num_blocks)
    state = replicate(open_sequences(init_state(cc, debug=False), jnp.arange(2, dtype=jnp.int32))[0], mesh)
    ref_state = open_sequences(init_state(cc, debug=False), jnp.arange(2, dtype=jnp.int32))[0]
    ref_pages = init_pages_for(cfg, cc)
    ref_step = jax.jit(make_model_step(cfg, "xla"))
    step = jax.jit(sstep)
    tokens = np.random.default_rng(1).integers(0, 64, (2, 16)).astype(np.int32)
    ids, diffs = np.arange(2, dtype=np.int32), []
    for chunk in (tokens, tokens[:, :1]):  # a prefill chunk (chunk kernel), then a decode (decode kernel)
        n = np.full(2, chunk.shape[1], np.int32)
        logits, state, pages, status = step(sparams, state, pages, chunk, ids, n)
        ref, ref_state, ref_pages, _ = ref_step(params, ref_state, ref_pages, chunk, ids, n)
        diffs.append(float(jnp.abs(logits - ref).max()))
    out["pallas"] = {"max_abs_diff": diffs, "status": np.asarray(status).tolist()}


def main() -> None:
    path = sys.argv[1]
    out = {"devices": jax.device_count(), "grid": [], "hlo": {}}
    start = time.perf_counter()
    for part in (run_grid, run_streaming, run_kv_split, run_pallas):
        part(out)
        print(f"{part.__name__} done at {time.perf_counter() - start:.1f} s", flush=True)
    out["seconds"] = time.perf_counter() - start
    with open(path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
