"""What a new user waits for: the first ``generate`` in a fresh process, cold and warm.

    python -m experiments first_call [--quick] [--out DIR] [--source DIR] [--repeats N]
                                     [--model DIR] [--layer-loop auto|scan|unrolled]

The workload is the issue's: 32 prompts x 32 tokens (half greedy, half sampled at
temperature 0.8) on the tiny Llama fixture (or ``--model``), through ``LLM`` with its
defaults (``--layer-loop`` aside: the unrolled loop's compile is the one to watch on a
deep model). Every run is a fresh Python process:

- ``off``: the persistent compilation cache disabled (``PAGED_JAX_COMPILATION_CACHE=0``):
  everything compiles;
- ``cold``: the cache on, in an empty directory (compiles, and writes the cache);
- ``warm``: a second process on that directory (reads the programs back).

``--source DIR`` runs the same children against another checkout's ``paged_jax`` (a
``git worktree`` of an older commit): the before/after of a change in one table.

Headline: ``warm_first_generate_s``, ``cold_first_generate_s``, ``off_first_generate_s``
(medians), ``warm_over_off`` and ``programs_compiled`` (the trace count of a cold call).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from experiments.common import machine_info, shown_path, write_json

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "llama")

_CHILD = r"""
import json, os, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
start = time.perf_counter()
import jax
if os.environ.get("PAGED_JAX_COMPILATION_CACHE") == "0":
    jax.config.update("jax_enable_compilation_cache", False)
from paged_jax.engine import LLM, SamplingParams
imported = time.perf_counter()
prompts, max_tokens = int(sys.argv[2]), int(sys.argv[3])
rng = __import__("numpy").random.default_rng(0)
batch = [rng.integers(1, 200, int(rng.integers(4, 24))).tolist() for _ in range(prompts)]
loop = {} if sys.argv[4] == "auto" else {"layer_loop": sys.argv[4]}  # an older --source has no "auto"
llm = LLM(sys.argv[1], num_gpu_blocks=512, max_num_seqs=64, **loop)
built = time.perf_counter()
params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=max_tokens, ignore_eos=True, seed=i)
          for i in range(prompts)]
outs = llm.generate(batch, params, use_tqdm=False)
done = time.perf_counter()
stats = llm.stats()
print(json.dumps({"layer_loop": getattr(llm.config.model, "layer_loop", "scan"), "import_s": imported - start,
                  "build_s": built - imported, "generate_s": done - built,
                  "compiles": stats["compiles"], "compile_seconds": stats["compile_seconds"],
                  "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}))
"""


def measure(cache: str, source: str | None, prompts: int, max_tokens: int, model: str = FIXTURE,
            layer_loop: str = "auto") -> dict:
    """One fresh process with ``PAGED_JAX_COMPILATION_CACHE=cache`` ("0": off)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PAGED_JAX_COMPILATION_CACHE=cache)
    env.pop("XLA_FLAGS", None)  # a user's process, not the test suite's -O0
    if source:
        env["PYTHONPATH"] = os.path.abspath(source) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _CHILD, model, str(prompts), str(max_tokens), layer_loop],
                         capture_output=True, text=True, env=env, check=True, cwd=source or None)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments first_call", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 prompts x 4 tokens, one repeat")
    parser.add_argument("--out", default="out")
    parser.add_argument("--source", default=None, help="run against another checkout's paged_jax")
    parser.add_argument("--repeats", type=int, default=None, help="processes per mode (default 3; quick 1)")
    parser.add_argument("--model", default=FIXTURE, help="checkpoint directory (default: the tiny fixture)")
    parser.add_argument("--layer-loop", default="auto", choices=("auto", "scan", "unrolled"))
    args = parser.parse_args(argv)
    prompts, max_tokens = (4, 4) if args.quick else (32, 32)
    repeats = args.repeats or (1 if args.quick else 3)
    runs: dict[str, list[dict]] = {"off": [], "cold": [], "warm": []}
    for _ in range(repeats):
        child = dict(model=os.path.abspath(os.path.expanduser(args.model)), layer_loop=args.layer_loop)
        runs["off"].append(measure("0", args.source, prompts, max_tokens, **child))
        with tempfile.TemporaryDirectory() as cache:
            runs["cold"].append(measure(cache, args.source, prompts, max_tokens, **child))
            runs["warm"].append(measure(cache, args.source, prompts, max_tokens, **child))
    rows = []
    print(f"{'mode':>5} {'generate s':>10} {'build s':>8} {'import s':>8} {'compiles':>8} {'compile s':>9}"
          f"   (medians of {repeats}; {prompts} prompts x {max_tokens} tokens)")
    for mode, rs in runs.items():
        med = {k: float(np.median([r[k] for r in rs])) for k in ("generate_s", "build_s", "import_s",
                                                                   "compile_seconds")}
        rows.append({"mode": mode, "compiles": rs[0]["compiles"], **med, "generate_s_all": [r["generate_s"] for r in rs]})
        print(f"{mode:>5} {med['generate_s']:>10.2f} {med['build_s']:>8.2f} {med['import_s']:>8.2f} "
              f"{rs[0]['compiles']:>8} {med['compile_seconds']:>9.2f}")
    by = {r["mode"]: r for r in rows}
    headline = {
        "warm_first_generate_s": by["warm"]["generate_s"],
        "cold_first_generate_s": by["cold"]["generate_s"],
        "off_first_generate_s": by["off"]["generate_s"],
        "warm_over_off": by["warm"]["generate_s"] / by["off"]["generate_s"],
        "programs_compiled": by["off"]["compiles"],
    }
    print(f"warm first generate {headline['warm_first_generate_s']:.2f} s = {headline['warm_over_off']:.2f}x "
          f"the uncached {headline['off_first_generate_s']:.2f} s; {headline['programs_compiled']} programs")
    result = {
        "study": "first_call",
        "machine": machine_info(),
        "config": {"fixture": shown_path(args.model), "prompts": prompts, "max_tokens": max_tokens,
                   "repeats": repeats, "source": args.source, "layer_loop": args.layer_loop,
                   "layer_loop_resolved": runs["off"][0]["layer_loop"]},
        "rows": rows,
        "headline": headline,
    }
    write_json(args.out, "first_call", result)
    return result


if __name__ == "__main__":
    main()
