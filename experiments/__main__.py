"""python -m experiments <study> [--quick] [--out DIR]

Studies (each a module with main(argv) that prints a table and writes DIR/<study>.json):
  allocator     block-manager cost per call vs pool size, every policy
  decode_step   paged vs contiguous decode step; block-management share of a step
  throughput    paged vs static KV allocation under one memory budget (claim C8, docs/SEED.md)
  compile_time  first-call time vs model depth (layers under one scan)
  first_call    a fresh process's first generate: compilation cache off, cold, warm
  beam          beam search: KV memory saved by sharing (claim C6), prefix sweep, step cost
  parallel      parallel sampling (n > 1): KV memory saved by sharing the prompt, throughput
  prefix        prefix caching behind a shared system prompt: prefill saved, TTFT, tokens/s
  multiturn     5-turn conversations keeping their history (claim C5): blocks stored, prefill
  eviction      eviction policies on one trace: prefix-cache hit rate vs pool size
  quantized     quantised KV pages (M10): capacity per byte budget, accuracy, tokens/s
  speculative   speculative decoding (n-gram, draft model): tokens/s and steps saved vs k, batch
  kernel_bench  Pallas paged attention on a GPU (interpret-mode smoke with --quick on CPU)
  demo          the headline study in quick mode (what `make demo` runs)
  all           every CPU study
"""

from __future__ import annotations

import importlib
import sys

STUDIES = ["allocator", "decode_step", "throughput", "compile_time", "first_call", "beam", "parallel", "prefix", "multiturn",
           "eviction", "quantized", "speculative", "kernel_bench"]
DEMO = "throughput"  # the headline study
CPU_STUDIES = ["allocator", "decode_step", "throughput", "compile_time", "first_call", "beam", "parallel", "prefix", "multiturn",
               "eviction", "quantized", "speculative"]


def _run(name: str, argv: list[str]):
    module = importlib.import_module(f"experiments.{name}")
    return module.main(argv)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    name, rest = argv[0], argv[1:]
    if name == "demo":
        _run(DEMO, rest)
    elif name == "all":
        for study in CPU_STUDIES:
            _run(study, rest)
    elif name in STUDIES:
        _run(name, rest)
    else:
        sys.exit(f"unknown study {name!r}; choose one of {STUDIES + ['demo', 'all']}")


if __name__ == "__main__":
    main()
