"""First-call time vs model depth: does a deeper model cost more compile time?

    python -m experiments compile_time [--quick] [--out DIR] [--layers 2,8,16]

Each depth runs in fresh Python processes with the persistent compilation cache off, so
the figure is what a researcher pays the first time a model of that shape is used: the
first ``generate`` of 4 prompts x 4 tokens (greedy, hidden size 128; mostly compiling the
prefill and decode programs), and, reported beside it, building ``LLM`` (random weights)
before it. With the decoder's layers under one ``lax.scan`` the compiled programs hold one
layer body whatever the depth, so the time should barely grow with depth; an unrolled
Python loop over layers compiles every layer of every bucket shape.

Every depth is measured ``--repeats`` times (fresh processes, interleaved) and the median
reported: single runs on a shared 2-core machine vary by +-20%.

Headline: ``depth_ratio`` = median first-``generate`` seconds at the deepest model / at
the shallowest; ``first_call_ratio`` the same with ``LLM`` construction included.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from experiments.common import machine_info, write_json

_CHILD = r"""
import json, os, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
start = time.perf_counter()
import jax
jax.config.update("jax_enable_compilation_cache", False)
from paged_jax.engine import LLM, SamplingParams
from paged_jax.model import ModelConfig
imported = time.perf_counter()
layers = int(sys.argv[1])
config = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=layers,
                     num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=256)
llm = LLM(config, block_size=16, num_gpu_blocks=64, max_num_seqs=4, max_model_len=64)
built = time.perf_counter()
prompts = [[1 + i, 2, 3, 4, 5, 6, 7][: 3 + i] for i in range(4)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
done = time.perf_counter()
stats = llm.stats()
print(json.dumps({"layers": layers, "import_s": imported - start, "build_s": built - imported,
                  "generate_s": done - built, "first_call_s": done - imported,
                  "compiles": stats["compiles"], "compile_seconds": stats["compile_seconds"],
                  "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


def measure(layers: int) -> dict:
    """One fresh process: LLM construction + first generate at ``layers`` layers."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(layers)], capture_output=True, text=True, env=env,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments compile_time", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="depths 2 and 8 only")
    parser.add_argument("--out", default="out")
    parser.add_argument("--layers", default=None, help="comma-separated depths (default 2,8,16)")
    parser.add_argument("--repeats", type=int, default=None, help="fresh processes per depth (default 3; quick 1)")
    args = parser.parse_args(argv)
    depths = [int(x) for x in args.layers.split(",")] if args.layers else ([2, 8] if args.quick else [2, 8, 16])
    repeats = args.repeats or (1 if args.quick else 3)
    runs = {n: [] for n in depths}
    for _ in range(repeats):
        for n in depths:
            runs[n].append(measure(n))
    rows = []
    for n in depths:
        keys = ("build_s", "generate_s", "first_call_s", "compile_seconds")
        rows.append({"layers": n, "compiles": runs[n][0]["compiles"], "repeats": repeats,
                     **{k: float(np.median([r[k] for r in runs[n]])) for k in keys},
                     "generate_s_all": [r["generate_s"] for r in runs[n]]})
    print(f"{'layers':>6} {'generate s':>10} {'build s':>8} {'first call s':>12} {'compiles':>8} {'compile s':>9}"
          f"   (medians of {repeats})")
    for r in rows:
        print(f"{r['layers']:>6} {r['generate_s']:>10.2f} {r['build_s']:>8.2f} {r['first_call_s']:>12.2f} "
              f"{r['compiles']:>8} {r['compile_seconds']:>9.2f}")
    ratio = rows[-1]["generate_s"] / rows[0]["generate_s"]
    first_ratio = rows[-1]["first_call_s"] / rows[0]["first_call_s"]
    print(f"depth_ratio ({depths[-1]} / {depths[0]} layers, first generate) = {ratio:.2f}; "
          f"with LLM construction = {first_ratio:.2f}")
    result = {
        "study": "compile_time",
        "machine": machine_info(),
        "config": {"hidden_size": 128, "prompts": 4, "max_tokens": 4, "persistent_cache": False, "repeats": repeats},
        "rows": rows,
        "headline": {"depth_ratio": ratio, "first_call_ratio": first_ratio,
                     "shallow_generate_s": rows[0]["generate_s"], "deep_generate_s": rows[-1]["generate_s"]},
    }
    write_json(args.out, "compile_time", result)
    return result


if __name__ == "__main__":
    main()
