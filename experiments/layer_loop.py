"""Layer loop: one ``lax.scan`` over stacked weights against an unrolled loop over per-layer
weight arrays (``LLM(layer_loop=...)``), on a SmolLM2-135M-shaped model (random weights).

    python -m experiments layer_loop [--quick] [--out DIR] [--rows 1,2,8,64] [--dtypes float32,bfloat16]

Why: under the scan each step slices every stacked weight per layer, and XLA:CPU
materialises each slice (a kLoop ``dynamic-slice`` fusion before each dot), so a step
copies all its weights before reading them; per-layer arrays are read where they lie, at
the price of a compiled program holding every layer (docs/results/notes/serving.md).

For each dtype and row count: the jitted decode step (``StepFns.decode``) at ``rows`` rows
holding ``--context`` tokens, scan and unrolled timed in turn within each round (noise falls
on both alike), min over rounds of the mean over ``--reps`` calls; each one's first call
(trace + compile + run, the persistent compilation cache off). Headline: unrolled / scan
step time per dtype and row count, and the first calls' ratio. Writes DIR/layer_loop.json.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from experiments.common import machine_info, print_headline, write_json
from experiments.step_profile import _Decode, model_config

LOOPS = ("scan", "unrolled")


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m experiments layer_loop", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a 4-layer model, rows 1 and 8, float32 only")
    p.add_argument("--out", default="out")
    p.add_argument("--rows", default=None, help="comma-separated row counts (default 1,2,8,64)")
    p.add_argument("--dtypes", default=None, help="comma-separated (default float32,bfloat16)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--reps", type=int, default=None, help="calls per timing (default 5, quick 2)")
    p.add_argument("--rounds", type=int, default=None, help="timings per loop, alternating (default 5, quick 2)")
    args = p.parse_args(argv)
    args.rows = [int(r) for r in (args.rows or ("1,8" if args.quick else "1,2,8,64")).split(",")]
    args.dtypes = (args.dtypes or ("float32" if args.quick else "float32,bfloat16")).split(",")
    args.reps = args.reps or (2 if args.quick else 5)
    args.rounds = args.rounds or (2 if args.quick else 5)
    return args


def _first_call(step) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(step())
    return time.perf_counter() - t0


def compare(cfg, params_by_loop: dict, rows: int, context: int, reps: int, rounds: int) -> dict:
    """Scan and unrolled decode steps at ``rows`` rows: first call s, min / median ms per call."""
    steps = {loop: _Decode(cfg, p, rows, context) for loop, p in params_by_loop.items()}
    first = {loop: _first_call(step) for loop, step in steps.items()}
    per_call = {loop: [] for loop in steps}
    for _ in range(rounds):
        for loop, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                out = step()
            jax.block_until_ready(out)
            per_call[loop].append((time.perf_counter() - t0) / reps)
    row = {"rows": rows}
    for loop in steps:
        row[f"{loop}_ms"] = min(per_call[loop]) * 1e3
        row[f"{loop}_median_ms"] = float(np.median(per_call[loop])) * 1e3
        row[f"{loop}_first_call_s"] = first[loop]
    row["unrolled_over_scan"] = row["unrolled_ms"] / row["scan_ms"]
    return row


def main(argv=None) -> dict:
    args = _parse(argv)
    cache_was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # first calls compile
    try:
        results, headline = _run(args)
    finally:
        jax.config.update("jax_enable_compilation_cache", cache_was)
    print_headline(headline)
    result = {"study": "layer_loop", "machine": machine_info(),
              "config": {"quick": args.quick, "layers": model_config(args.quick, "float32").num_layers,
                         "context": args.context, "rows": args.rows, "reps": args.reps, "rounds": args.rounds},
              "by_dtype": results, "headline": headline}
    write_json(args.out, "layer_loop", result)
    return result


def _run(args) -> tuple[dict, dict]:
    from paged_jax.model import init_params
    from paged_jax.model.llama import pack_params, unstack_layers

    results, headline = {}, {}
    for dtype in args.dtypes:
        cfg = model_config(args.quick, dtype)
        packed = pack_params(init_params(cfg, 0)[1])
        params = {"scan": packed, "unrolled": unstack_layers(packed, cfg.jnp_dtype)}
        print(f"{dtype}, {cfg.num_layers} layers, context {args.context}:", flush=True)
        rows = []
        for r in args.rows:
            row = compare(cfg, params, r, args.context, args.reps, args.rounds)
            rows.append(row)
            print(f"  {r:>3} rows: scan {row['scan_ms']:7.1f} ms, unrolled {row['unrolled_ms']:7.1f} ms "
                  f"({row['unrolled_over_scan']:.2f}x); first call {row['scan_first_call_s']:.1f} vs "
                  f"{row['unrolled_first_call_s']:.1f} s", flush=True)
            headline[f"{dtype}_unrolled_over_scan_{r}_rows"] = round(row["unrolled_over_scan"], 3)
        first = sum(r["unrolled_first_call_s"] for r in rows) / sum(r["scan_first_call_s"] for r in rows)
        headline[f"{dtype}_first_call_unrolled_over_scan"] = round(first, 2)
        results[dtype] = rows
    return results, headline


if __name__ == "__main__":
    main()
