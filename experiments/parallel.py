"""Parallel sampling (``n > 1``): the KV memory sharing the prompt saves, and throughput.

    python -m experiments parallel [--quick] [--out DIR]

Alpaca-like and ShareGPT-like requests (``paged_jax.workloads``, EOS ignored) with
``SamplingParams(n=k, temperature=1)`` for k = 2, 4, 8, all in one batch with a roomy
pool. Each request's prompt is prefilled once and forked k ways: its full blocks are
shared, its partly filled last block copied on first write, and every completion's
output is its own. The vLLM paper reports 6.1-9.8% saved on Alpaca-like lengths: the
prompt is short next to k outputs. Memory as in ``experiments/lib/sharing.py``; throughput is
output tokens per second (compile excluded), median of alternating repeats, against n = 1
with the same number of sequences (every completion its own request, prompts prefilled k
times).

Headline: ``n4_memory_saving`` (Alpaca-like, n = 4, time-averaged). Writes
DIR/parallel.json and DIR/parallel.png.
"""

from __future__ import annotations

import argparse

import numpy as np

from experiments.common import machine_info, print_headline, pyplot, write_json
from experiments.lib import sharing

NS = (2, 4, 8)
QUICK_NS = (2, 4)


def run(name: str, requests, make_engine, ns=NS, repeats: int = 3) -> list[dict]:
    from paged_jax.engine import SamplingParams

    prompts = [list(r.prompt_token_ids) for r in requests]
    rows = []
    for n in ns:
        shared_llm = make_engine()
        shared_params = [SamplingParams(n=n, temperature=1.0, seed=i, max_tokens=r.max_tokens, ignore_eos=True)
                         for i, r in enumerate(requests)]
        alone_llm = make_engine()
        alone_params = [SamplingParams(temperature=1.0, seed=i * n + j, max_tokens=r.max_tokens, ignore_eos=True)
                        for i, r in enumerate(requests) for j in range(n)]
        copies = [p for p in prompts for _ in range(n)]
        runs = {"shared": (shared_llm, prompts, shared_params), "separate": (alone_llm, copies, alone_params)}
        speed, memory = {k: [] for k in runs}, {}
        for rep in range(repeats + 1):  # run 0 compiles; the two then alternate, sharing the noise
            for kind, (llm, ps, params) in runs.items():
                llm.reset_stats()
                llm.generate(ps, params, use_tqdm=False)
                memory[kind] = sharing.memory_of(llm)
                if rep:
                    speed[kind].append(memory[kind]["tokens_per_s"])
        shared_tps, separate_tps = float(np.median(speed["shared"])), float(np.median(speed["separate"]))
        rows.append({"workload": name, "n": n, **memory["shared"],
                     "tokens_per_s": shared_tps, "repeats": repeats,
                     "separate_requests_tokens_per_s": separate_tps,
                     "separate_requests_mean_physical_blocks": memory["separate"]["mean_physical_blocks"],
                     "throughput_ratio_vs_separate": shared_tps / separate_tps})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments parallel", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter requests")
    parser.add_argument("--out", default="out")
    args = parser.parse_args(argv)
    quick = args.quick
    num_requests, contexts, streams = sharing.study_streams(quick)
    ns = QUICK_NS if quick else NS
    print(f"parallel-sampling study, {'quick' if quick else 'FULL'}: {num_requests} requests per workload, "
          f"lengths scaled to {contexts}")
    make_engine = sharing.engines(sharing.engine_len(*streams.values()), max_num_seqs=num_requests * max(ns))
    rows = []
    for name, requests in streams.items():
        rows += run(name, requests, make_engine, ns, repeats=1 if quick else 3)
    print(f"\n{'workload':>14} {'n':>3} {'mean phys':>9} {'mean unsh':>9} {'saving':>7} {'tok/s':>7} "
          f"{'vs separate':>11}")
    for r in rows:
        print(f"{r['workload']:>14} {r['n']:>3} {r['mean_physical_blocks']:>9.1f} {r['mean_unshared_blocks']:>9.1f} "
              f"{r['saving']:>7.3f} {r['tokens_per_s']:>7.1f} {r['throughput_ratio_vs_separate']:>11.2f}")
    n4 = next(r for r in rows if r["workload"] == "alpaca_like" and r["n"] == 4)
    headline = {"n4_memory_saving": n4["saving"], "n4_throughput_vs_separate": n4["throughput_ratio_vs_separate"]}
    print_headline(headline)
    result = {"study": "parallel", "machine": machine_info(), "quick": quick, "length_contexts": contexts,
              "num_requests": num_requests, "rows": rows, "headline": headline}
    write_json(args.out, "parallel", result)
    _plot(args.out, rows)
    return result


def _plot(out_dir: str, rows: list[dict]) -> None:
    import os

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    for name in ("alpaca_like", "sharegpt_like"):
        sel = [r for r in rows if r["workload"] == name]
        ax.plot([r["n"] for r in sel], [r["saving"] for r in sel], "o-", label=name)
    ax.set_xlabel("completions per prompt (n)")
    ax.set_ylabel("KV memory saved by sharing")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "parallel.png")
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
