"""First-call time vs model depth: does a deeper model cost more compile time?

    python -m experiments compile_time [--quick] [--out DIR] [--layers 2,8,16]

Each depth runs in a fresh Python process with the persistent compilation cache off, so
the figure is what a researcher pays the first time a model of that shape is used:
building ``LLM`` (random weights) and the first ``generate`` of 4 prompts x 4 tokens
(greedy), hidden size 128. With the decoder's layers under one ``lax.scan`` the compiled
programs hold one layer body whatever the depth, so the time should barely grow with
depth; an unrolled Python loop over layers compiles every layer of every bucket shape.

Headline: ``depth_ratio`` = first-call seconds at the deepest model / at the shallowest.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

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
    args = parser.parse_args(argv)
    depths = [int(x) for x in args.layers.split(",")] if args.layers else ([2, 8] if args.quick else [2, 8, 16])
    rows = [measure(n) for n in depths]
    print(f"{'layers':>6} {'first call s':>12} {'build s':>8} {'generate s':>10} {'compiles':>8} {'compile s':>9}")
    for r in rows:
        print(f"{r['layers']:>6} {r['first_call_s']:>12.2f} {r['build_s']:>8.2f} {r['generate_s']:>10.2f} "
              f"{r['compiles']:>8} {r['compile_seconds']:>9.2f}")
    ratio = rows[-1]["first_call_s"] / rows[0]["first_call_s"]
    print(f"depth_ratio ({depths[-1]} / {depths[0]} layers) = {ratio:.2f}")
    result = {
        "study": "compile_time",
        "machine": machine_info(),
        "config": {"hidden_size": 128, "prompts": 4, "max_tokens": 4, "persistent_cache": False},
        "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
        "headline": {"depth_ratio": ratio, "shallow_first_call_s": rows[0]["first_call_s"],
                     "deep_first_call_s": rows[-1]["first_call_s"]},
    }
    write_json(args.out, "compile_time", result)
    return result


if __name__ == "__main__":
    main()
