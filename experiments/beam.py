"""Beam search: the KV memory sharing saves, and what a beam step costs.

    python -m experiments beam [--quick] [--out DIR]

1. **Memory by width** (claim C6; the vLLM paper's beam-search saving of 37.6-55.2% on
   Alpaca): Alpaca-like and ShareGPT-like requests (``paged_jax.workloads``, EOS ignored,
   each request's sampled output length as ``max_tokens``) through
   ``LLM.beam_search`` at widths 2, 4 and 8, all in one batch with a roomy pool. Beams
   share the prompt and whatever history they have in common (copy-on-write), and the
   study measures physical blocks against the same beams with every block private
   (``experiments/lib/sharing.py``).
2. **Shared-prefix sweep** (C6's second half: savings above 30% once the shared prefix
   is over 15% of the decode length): width 4, a fixed decode length, prompts (the
   prefix every beam shares) from 5% to 100% of it.
3. **Throughput at equal KV budget**: width 4 on the Alpaca-like requests, the pool
   half what the beams would hold unshared, with sharing vs ``share_blocks=False``
   (every fork and beam selection a full copy of its blocks): tokens/s and batch.
4. **Step cost**: a beam step (top-K candidates per row brought back with the step, the
   host-side selection of the next beams, one ``select_parents`` for the batch) against a
   greedy step at the same batch (the same model, lengths and rows): median steady step
   time of each.

Headlines: ``beam4_memory_saving`` (Alpaca-like, width 4, time-averaged),
``beam_step_overhead`` (beam step time / greedy step time at equal batch) and
``beam4_throughput_vs_unshared`` (tokens/s with sharing / without, equal budget). Writes
DIR/beam.json and DIR/beam.png.
"""

from __future__ import annotations

import argparse

import numpy as np

from experiments.common import machine_info, print_headline, pyplot, write_json
from experiments.lib import models, sharing, timing

WIDTHS = (2, 4, 8)
QUICK_WIDTHS = (2, 4)
PREFIX_FRACTIONS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
QUICK_PREFIX_FRACTIONS = (0.05, 0.15, 0.5)



def memory_by_width(name: str, requests, make_engine, widths=WIDTHS) -> list[dict]:
    from paged_jax.engine import BeamSearchParams

    rows = []
    for width in widths:
        llm = make_engine()
        params = [BeamSearchParams(beam_width=width, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
        llm.generate([list(r.prompt_token_ids) for r in requests], params, use_tqdm=False)
        rows.append({"workload": name, "beam_width": width, **sharing.memory_of(llm)})
    return rows


def sweep_requests(decode_len: int, num_requests: int, fractions=PREFIX_FRACTIONS) -> dict[float, list]:
    """Per shared-prefix fraction, requests whose prompt is that fraction of ``decode_len``."""
    from paged_jax import workloads

    return {f: workloads.fixed_length(num_requests, prompt_len=max(1, round(f * decode_len)), output_len=decode_len,
                                      vocab_size=models.VOCAB, seed=1) for f in fractions}


def prefix_sweep(streams: dict[float, list], make_engine, width: int = 4) -> list[dict]:
    from paged_jax.engine import BeamSearchParams

    rows = []
    for fraction, reqs in streams.items():
        llm = make_engine()
        llm.generate([list(r.prompt_token_ids) for r in reqs],
                     [BeamSearchParams(beam_width=width, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs],
                     use_tqdm=False)
        rows.append({"prefix_fraction": fraction, "prompt_len": len(reqs[0].prompt_token_ids),
                     "decode_len": reqs[0].max_tokens, **sharing.memory_of(llm)})
    return rows


def step_overhead(num_requests: int, width: int, prompt_len: int, decode_len: int, repeats: int) -> dict:
    """Beam step vs greedy step at the same batch (``num_requests * width`` rows), on the
    throughput study's weight-dominated model: the same prompts (each repeated ``width``
    times for greedy), lengths and rows. The two alternate ``repeats`` times after a
    compiling run each, so machine noise falls on both; each side's figure is the median
    of its decode steps (prefill steps excluded)."""
    from paged_jax import workloads
    from paged_jax.config import blocks_for
    from paged_jax.engine import LLM, BeamSearchParams, SamplingParams

    batch = num_requests * width
    max_model_len = prompt_len + decode_len
    model = models.llama_33m(max_model_len)
    engine = dict(block_size=sharing.BLOCK_SIZE, num_gpu_blocks=batch * blocks_for(max_model_len, sharing.BLOCK_SIZE),
                  max_num_seqs=batch, max_model_len=max_model_len, max_num_batched_tokens=max(512, batch),
                  attention_impl="xla")
    reqs = workloads.fixed_length(num_requests, prompt_len=prompt_len, output_len=decode_len,
                                  vocab_size=model.vocab_size, seed=2)
    prompts = [list(r.prompt_token_ids) for r in reqs]
    runs = {
        "beam": (LLM(model, **engine), prompts,
                 BeamSearchParams(beam_width=width, max_tokens=decode_len, ignore_eos=True)),
        "greedy": (LLM(model, **engine), [p for p in prompts for _ in range(width)],
                   SamplingParams(temperature=0, max_tokens=decode_len, ignore_eos=True)),
    }
    times = {k: [] for k in runs}
    for rep in range(repeats + 1):  # run 0 compiles every shape
        for kind, (llm, ps, params) in runs.items():
            llm.reset_stats()
            llm.generate(ps, params, use_tqdm=False)
            if rep:
                times[kind] += timing.decode_step_seconds(llm, batch)
    beam_s, greedy_s = float(np.median(times["beam"])), float(np.median(times["greedy"]))
    return {"batch": batch, "beam_width": width, "prompt_len": prompt_len, "decode_len": decode_len,
            "repeats": repeats, "steps_measured": {k: len(v) for k, v in times.items()},
            "beam_step_ms": beam_s * 1e3, "greedy_step_ms": greedy_s * 1e3, "overhead": beam_s / greedy_s}


def sharing_throughput(requests, width: int, budget_fraction: float, repeats: int, small_model: bool = False) -> dict:
    """Beam-search tokens/s with sharing vs the same search without it
    (``share_blocks=False``: every fork and selection a full copy) under one KV budget,
    ``budget_fraction`` of the blocks the beams would hold, all private, at full length;
    on the throughput study's model (``small_model``: the memory runs' 2-layer one, for
    quick runs). The engines alternate ``repeats`` times after a compiling run each; the
    figure is the median tokens/s (compile excluded)."""
    from paged_jax.config import blocks_for
    from paged_jax.engine import LLM, BeamSearchParams

    bs = sharing.BLOCK_SIZE
    max_model_len = sharing.engine_len(requests)
    demand = sum(width * blocks_for(len(r.prompt_token_ids) + r.max_tokens, bs) for r in requests)
    # At least one whole search unshared, at full length: every request can run alone.
    blocks = max(int(np.ceil(budget_fraction * demand)), width * (max_model_len // bs))
    rows = len(requests) * width
    model = (models.memory_model if small_model else models.llama_33m)(max_model_len)
    prompts = [list(r.prompt_token_ids) for r in requests]
    params = [BeamSearchParams(beam_width=width, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    engines = {share: LLM(model, block_size=bs, num_gpu_blocks=blocks, max_num_seqs=rows,
                          max_model_len=max_model_len, max_num_batched_tokens=max(512, rows),
                          attention_impl="xla", share_blocks=share) for share in (True, False)}
    speed, stats, outputs = {True: [], False: []}, {}, {}
    for rep in range(repeats + 1):  # run 0 compiles every shape
        for share, llm in engines.items():
            llm.reset_stats()
            outputs[share] = [[s.tokens for s in o.sequences] for o in llm.generate(prompts, params, use_tqdm=False)]
            stats[share] = llm.stats()
            if rep:
                speed[share].append(stats[share]["tokens_per_s_excl_compile"])
    shared, private = float(np.median(speed[True])), float(np.median(speed[False]))
    return {
        "beam_width": width, "num_requests": len(requests), "kv_blocks": blocks, "budget_fraction": budget_fraction,
        "tokens_per_s_shared": shared, "tokens_per_s_unshared": private, "ratio": shared / private,
        "mean_batch_shared": stats[True]["mean_running_batch"], "mean_batch_unshared": stats[False]["mean_running_batch"],
        "preemptions_shared": stats[True]["num_preemptions"], "preemptions_unshared": stats[False]["num_preemptions"],
        "outputs_identical": outputs[True] == outputs[False], "repeats": repeats,
    }


def claims(result: dict) -> list[dict]:
    """C6's verdict from a saved run (``experiments.report``)."""
    sweep = sorted(result["prefix_sweep"], key=lambda r: r["prefix_fraction"])
    at = {round(r["prefix_fraction"], 2): r["saving"] for r in sweep}
    above = [r for r in sweep if r["prefix_fraction"] >= 0.15]
    smallest = sweep[0]
    return [{
        "claim": "C6",
        "seed": "width 4 with 200 shared tokens saves 3x that prefix; > 30% saved once the prefix passes 15% "
                "of the decode length",
        "ours": (f"width 4: {min(r['saving'] for r in above):.0%}-{max(r['saving'] for r in above):.0%} saved "
                 f"for prefixes of 15-100% of the decode length ({at.get(0.15, float('nan')):.0%} at 15%); "
                 f"already {smallest['saving']:.0%} at {smallest['prefix_fraction']:.0%}"),
        "verdict": "reproduced",
        "why": ("Beams share the prompt's blocks (W - 1 copies of it saved, the seed's 3x at width 4) and their "
                "common history, so the saving passes 30% past a 15% prefix as claimed; it does not need the "
                f"prefix at all: beams that diverge late share their early tokens, {smallest['saving']:.0%} saved "
                f"with a {smallest['prompt_len']}-token prompt."),
    }]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments beam", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter requests")
    parser.add_argument("--out", default="out")
    args = parser.parse_args(argv)
    quick = args.quick
    num_requests, contexts, streams = sharing.study_streams(quick)
    widths = QUICK_WIDTHS if quick else WIDTHS
    print(f"beam study, {'quick' if quick else 'FULL'}: {num_requests} requests per workload, "
          f"lengths scaled to {contexts}")
    sweep_streams = sweep_requests(decode_len=32 if quick else 64, num_requests=2 if quick else 8,
                                   fractions=QUICK_PREFIX_FRACTIONS if quick else PREFIX_FRACTIONS)
    make_engine = sharing.engines(sharing.engine_len(*streams.values(), *sweep_streams.values()),
                                  max_num_seqs=num_requests * max(widths))
    by_width = []
    for name, requests in streams.items():
        by_width += memory_by_width(name, requests, make_engine, widths)
    print(f"\n{'workload':>14} {'width':>5} {'mean phys':>9} {'mean unsh':>9} {'saving':>7} {'peak saving':>11}")
    for r in by_width:
        print(f"{r['workload']:>14} {r['beam_width']:>5} {r['mean_physical_blocks']:>9.1f} "
              f"{r['mean_unshared_blocks']:>9.1f} {r['saving']:>7.3f} {r['peak_saving']:>11.3f}")
    sweep = prefix_sweep(sweep_streams, make_engine)
    print(f"\n{'prefix / decode':>15} {'prompt':>6} {'saving':>7}   (width 4)")
    for r in sweep:
        print(f"{r['prefix_fraction']:>15.2f} {r['prompt_len']:>6} {r['saving']:>7.3f}")
    cost = step_overhead(num_requests=2 if quick else 4, width=4, prompt_len=32, decode_len=16 if quick else 32,
                         repeats=1 if quick else 3)
    print(f"\nbeam step {cost['beam_step_ms']:.1f} ms vs greedy {cost['greedy_step_ms']:.1f} ms at batch "
          f"{cost['batch']}: overhead {cost['overhead']:.2f}")
    budget = sharing_throughput(streams["alpaca_like"], width=4, budget_fraction=0.5, repeats=1 if quick else 3,
                                small_model=quick)
    print(f"\nbeam search (width 4, alpaca_like) at {budget['kv_blocks']} KV blocks (half the unshared demand): "
          f"{budget['tokens_per_s_shared']:.1f} tokens/s shared vs {budget['tokens_per_s_unshared']:.1f} every fork "
          f"a full copy = {budget['ratio']:.2f}x (mean batch {budget['mean_batch_shared']:.1f} vs "
          f"{budget['mean_batch_unshared']:.1f}; outputs identical: {budget['outputs_identical']})")
    alpaca4 = next(r for r in by_width if r["workload"] == "alpaca_like" and r["beam_width"] == 4)
    over15 = [r for r in sweep if r["prefix_fraction"] > 0.15]
    headline = {
        "beam4_memory_saving": alpaca4["saving"],
        "beam_step_overhead": cost["overhead"],
        "min_saving_prefix_over_15pct": min(r["saving"] for r in over15),
        "beam4_throughput_vs_unshared": budget["ratio"],
    }
    print_headline(headline)
    result = {"study": "beam", "machine": machine_info(), "quick": quick, "length_contexts": contexts,
              "num_requests": num_requests, "memory_by_width": by_width, "prefix_sweep": sweep,
              "step_cost": cost, "equal_budget": budget, "headline": headline}
    write_json(args.out, "beam", result)
    _plot(args.out, by_width, sweep)
    return result


def _plot(out_dir: str, by_width: list[dict], sweep: list[dict]) -> None:
    import os

    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    for name in ("alpaca_like", "sharegpt_like"):
        rows = [r for r in by_width if r["workload"] == name]
        a.plot([r["beam_width"] for r in rows], [r["saving"] for r in rows], "o-", label=name)
    a.set_xlabel("beam width")
    a.set_ylabel("KV memory saved by sharing")
    a.legend()
    b.plot([r["prefix_fraction"] for r in sweep], [r["saving"] for r in sweep], "o-")
    b.axvline(0.15, color="gray", ls=":")
    b.axhline(0.30, color="gray", ls=":")
    b.set_xlabel("shared prefix / decode length (width 4)")
    b.set_ylabel("saving")
    fig.tight_layout()
    path = os.path.join(out_dir, "beam.png")
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
