"""Speculative decoding over paged KV: tokens/s and target steps per output token vs
plain decoding, by proposal method, k and batch.

    python -m experiments speculative [--quick] [--out DIR]

The target is the throughput study's model (8 layers, hidden 512, vocab 8192, random
weights); every request is greedy, so each speculative run's outputs must equal the
plain run's token for token (checked and reported). Workloads:

- **repetitive** (where prompt lookup pays): prompts that repeat a 12-token phrase three
  times; the random model's greedy continuations fall into cycles, which an n-gram
  lookup predicts. Method "ngram" for k in 1..8 at batch 1 (k in 2, 4 at batch 8 and 32).
- **draft = target** (acceptance 1: every proposal is the target's argmax): the pure
  cost of the machinery, a draft as large as the target; and a **smaller draft**
  (2 layers, hidden 256, same vocabulary, random: it rarely agrees with the target, so
  it measures the overhead of a cheap draft that does not help). k = 4, batch 1 and 8.

Tokens per second exclude compilation (every run is repeated after a warm-up of the
same shapes). ``verify_step_cost_k4`` = median time of a batch-1 step that ran one k = 4
verification over the median plain decode step (same run, same machine).
Headlines: ``ngram_speedup_batch1`` (k = 4), ``best_ngram_speedup_batch1`` (and its k),
``verify_step_cost_k4``, ``draft_self_speedup_batch1``.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from experiments.common import machine_info, write_json
from experiments.throughput import study_model

MAX_MODEL_LEN = 512
PHRASE, REPEATS = 12, 3
FULL = dict(max_tokens=128, batches=(1, 8, 32), ks_batch1=(1, 2, 3, 4, 5, 6, 7, 8), ks=(2, 4), draft_batches=(1, 8))
QUICK = dict(max_tokens=24, batches=(1,), ks_batch1=(2, 4), ks=(), draft_batches=(1,))


def small_draft(config):
    return config.replace(num_layers=2, hidden_size=256, intermediate_size=768, num_heads=4, num_kv_heads=2,
                          head_dim=64)


def prompts(config, n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, config.vocab_size, PHRASE).tolist() * REPEATS for _ in range(n)]


def run(config, batch: int, max_tokens: int, spec: dict | None) -> dict:
    """One engine, one warm-up generate and one measured generate of ``batch`` requests."""
    from paged_jax.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    max_model_len = 16 * -(-(PHRASE * REPEATS + max_tokens + 1) // 16)
    llm = LLM(config, num_gpu_blocks=batch * max_model_len // 16, max_num_seqs=batch, max_model_len=max_model_len,
              speculative_config=spec)
    llm.generate(prompts(config, batch, seed=1), params, use_tqdm=False)  # compile every shape
    llm.reset_stats()
    outs = llm.generate(prompts(config, batch), params, use_tqdm=False)
    s = llm.stats()
    timeline = llm.engine.stats.timeline
    ends = np.array([r.end_seconds for r in timeline])
    seconds = np.diff(np.concatenate([[0.0], ends]))
    decode = [t for t, r in zip(seconds, timeline) if not r.prefilled and not r.compile_seconds
              and r.speculated == 0]
    verify = [t for t, r in zip(seconds, timeline) if not r.prefilled and not r.compile_seconds
              and r.speculated == r.batch]
    return {
        "batch": batch,
        "method": None if spec is None else spec["method"],
        "k": 0 if spec is None else spec["num_speculative_tokens"],
        "tokens": [o.outputs[0].token_ids for o in outs],
        "generated_tokens": s["generated_tokens"],
        "steps": s["steps"],
        "steps_per_output_token": s["steps"] * batch / max(s["generated_tokens"], 1),
        "tokens_per_s": s["tokens_per_s_excl_compile"],
        "acceptance_rate": s["spec_acceptance_rate"],
        "mean_tokens_per_round": s["spec_mean_tokens_per_round"],
        "spec_rounds": s["spec_rounds"],
        "median_decode_step_s": float(np.median(decode)) if decode else None,
        "median_verify_step_s": float(np.median(verify)) if verify else None,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments speculative", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 1, k = 2 and 4, 24 tokens")
    parser.add_argument("--out", default="out")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    config = study_model(MAX_MODEL_LEN)
    plans = []
    for b in cfg["batches"]:
        plans.append((b, None))
        for k in cfg["ks_batch1"] if b == 1 else cfg["ks"]:
            plans.append((b, {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}))
    for b in cfg["draft_batches"]:
        plans.append((b, {"method": "draft_model", "model": config, "label": "self", "num_speculative_tokens": 4}))
        plans.append((b, {"method": "draft_model", "model": small_draft(config), "label": "small",
                          "num_speculative_tokens": 4}))
    try:
        from tqdm.auto import tqdm
    except ImportError:  # optional extra
        def tqdm(x, **_):
            return x
    print(f"speculative study, {'quick' if args.quick else 'FULL'}: {cfg['max_tokens']} greedy tokens per request, "
          f"prompts repeat a {PHRASE}-token phrase {REPEATS}x")
    rows = []
    for batch, spec in tqdm(plans, desc="runs", unit="run"):
        engine_spec = None if spec is None else {k: v for k, v in spec.items() if k != "label"}
        row = run(config, batch, cfg["max_tokens"], engine_spec)
        if spec is not None and "label" in spec:
            row["method"] = f"draft_model:{spec['label']}"
        rows.append(row)
    plain = {r["batch"]: r for r in rows if r["method"] is None}
    for r in rows:
        base = plain[r["batch"]]
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["outputs_identical"] = r["tokens"] == base["tokens"]
    print("\n| batch | method | k | tokens/s | speedup | steps / output token | acceptance | tokens / round | "
          "identical |\n|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['method'] or 'plain'} | {r['k']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | "
              f"{r['steps_per_output_token']:.2f} | {r['acceptance_rate']:.3f} | {r['mean_tokens_per_round']:.2f} | "
              f"{r['outputs_identical']} |")
    b1 = [r for r in rows if r["batch"] == 1 and r["method"] == "ngram"]
    k4 = next(r for r in b1 if r["k"] == 4)
    best = max(b1, key=lambda r: r["speedup"])
    verify_cost = k4["median_verify_step_s"] / plain[1]["median_decode_step_s"] if k4["median_verify_step_s"] else None
    draft_self = next(r for r in rows if r["batch"] == 1 and r["method"] == "draft_model:self")
    headline = {
        "ngram_speedup_batch1": k4["speedup"],
        "best_ngram_speedup_batch1": best["speedup"],
        "best_ngram_k_batch1": best["k"],
        "verify_step_cost_k4": verify_cost,
        "draft_self_speedup_batch1": draft_self["speedup"],
        "all_outputs_identical": all(r["outputs_identical"] for r in rows),
    }
    print("headline:", {k: round(v, 3) if isinstance(v, float) else v for k, v in headline.items()})
    for r in rows:
        del r["tokens"]
    result = {"study": "speculative", "machine": machine_info(), "quick": args.quick,
              "config": {"model": {"num_layers": config.num_layers, "hidden_size": config.hidden_size,
                                   "vocab_size": config.vocab_size},
                         "max_tokens": cfg["max_tokens"], "phrase": PHRASE, "repeats": REPEATS},
              "rows": rows, "headline": headline}
    write_json(args.out, "speculative", result)
    plot(os.path.join(args.out, "speculative.png"), rows)
    return result


def plot(path: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for batch in sorted({r["batch"] for r in rows}):
        ngram = sorted((r for r in rows if r["batch"] == batch and r["method"] == "ngram"), key=lambda r: r["k"])
        if ngram:
            ax1.plot([r["k"] for r in ngram], [r["speedup"] for r in ngram], marker="o", label=f"batch {batch}")
            ax2.plot([r["k"] for r in ngram], [r["steps_per_output_token"] for r in ngram], marker="o",
                     label=f"batch {batch}")
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set(xlabel="k (proposed tokens)", ylabel="tokens/s over plain decoding", title="n-gram speculation")
    ax2.set(xlabel="k (proposed tokens)", ylabel="target steps per output token", title="steps saved")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
