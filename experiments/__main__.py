"""python -m experiments <study> [--quick] [--out DIR]

Claims of the seed (docs/SEED.md), one study each (docs/RESULTS.md has the verdicts):
  memory            C1, C2: static vs paged KV memory on ShareGPT-/Alpaca-like workloads
  worked_example    C3: the seed's 8 x 500-token worked example, replayed on the block manager
  block_size        C4, C7: block sizes 1..256: fragmentation, table bytes, step time, throughput
  multiturn         C5: 5-turn conversations keeping their history: blocks stored, prefill
  beam              C6: beam search: KV memory saved by sharing, prefix sweep, step cost
  throughput        C8: paged vs static KV allocation under one memory budget
  allocation_order  C9: batched vs sequential allocation; block adjacency per policy
  table_growth      C10: what static-shape tables cost instead of growth: recompiles, bytes
  small_kv          C11: when paging does not pay: tiny KV, 10-token prompts
  preemption        M5: recompute vs swap cost vs sequence length and pool pressure

Mechanisms and everything else:
  allocator     block-manager cost per call vs pool size, every policy
  decode_step   paged vs contiguous decode step; block-management share of a step
  compile_time  first-call time vs model depth (layers under one scan)
  first_call    a fresh process's first generate: compilation cache off, cold, warm
  parallel      parallel sampling (n > 1): KV memory saved by sharing the prompt, throughput
  prefix        prefix caching behind a shared system prompt: prefill saved, TTFT, tokens/s
  eviction      eviction policies on one trace: prefix-cache hit rate vs pool size
  quantized     quantised KV pages (M10): capacity per byte budget, accuracy, tokens/s
  speculative   speculative decoding (n-gram, draft model): tokens/s and steps saved vs k, batch
  serving       the OpenAI server under gamma arrivals: TTFT/TPOT/ITL/E2E, latency vs rate, vs vLLM
  serving_timeline  one request's path through the server, phase by phase (timestamps in every process)
  scaling       tensor/data parallelism on simulated devices: KV per device, max batch, collectives
  kernel_bench  Pallas paged attention on a GPU (interpret-mode smoke with --quick on CPU)
  kernel_resources  registers/spills/shared memory of every Triton kernel on sm_80/sm_90a, compiled offline
  gpu           everything worth measuring on a GPU, in one run (a smoke with --quick on CPU)

Beside other engines (side venvs, a real checkpoint; not in `all` nor the report):
  peers         paged_jax vs vLLM vs transformers: tokens/s, TTFT/TPOT, memory, greedy agreement
  step_profile  where a decode step's time goes: FLOPs, bytes, matmul peak per dtype, host share
  layer_loop    the layers under one scan vs unrolled over per-layer weights: step time, compile
  sampler       the sampler per step vs the full-sort sampler it replaced: ms per call, kept sets

Tools:
  sweep         an ablation grid over any LLM keyword: a tidy table (CSV + JSON) and plots
  report        docs/RESULTS.md from the studies' JSON (--out DIR: where the JSON is)
  demo          the claims' headline table in quick mode (what `make demo` runs)
  all           every CPU study, then the report
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import time

# Every CPU study, in the order `all` runs them (claims first).
CPU_STUDIES = [
    "memory", "worked_example", "block_size", "multiturn", "beam", "throughput", "allocation_order",
    "table_growth", "small_kv", "preemption",
    "allocator", "decode_step", "compile_time", "first_call", "parallel", "prefix", "eviction", "quantized",
    "speculative", "scaling", "serving",
]
GPU_STUDIES = ["kernel_bench", "gpu", "kernel_resources"]  # the last needs triton, not a GPU
TOOLS = ["sweep", "report", "demo", "all"]
STUDIES = CPU_STUDIES + GPU_STUDIES
PEER_STUDIES = ["peers", "step_profile", "layer_loop", "sampler"]  # run alone: they need side venvs or minutes of a real model
DIAGNOSTICS = ["serving_timeline"]  # run alone: not a claim, not in `all` nor the report


def _run(name: str, argv: list[str]):
    module = importlib.import_module(f"experiments.{name}")
    return module.main(argv)


def _run_all(rest: list[str]) -> None:
    """Every CPU study, each in a fresh process (one process compiling every study's
    programs exhausted XLA:CPU's JIT memory; a fresh process is also what a figure
    means), then the report. A study that fails is reported and the others still run."""
    failed, seconds = [], {}
    for study in CPU_STUDIES:
        start = time.perf_counter()
        code = subprocess.call([sys.executable, "-m", "experiments", study, *rest])
        seconds[study] = time.perf_counter() - start
        if code:
            failed.append(study)
    _run("report", [a for a in rest if a != "--quick"])
    print("study seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    print(f"all: {sum(seconds.values()):.0f} s")
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    name, rest = argv[0], argv[1:]
    if name == "all":
        _run_all(rest)
    elif name in STUDIES or name in PEER_STUDIES or name in DIAGNOSTICS or name in ("sweep", "report", "demo"):
        _run(name, rest)
    else:
        sys.exit(f"unknown study {name!r}; choose one of {STUDIES + PEER_STUDIES + DIAGNOSTICS + TOOLS}")


if __name__ == "__main__":
    main()
