"""Eviction policies compared on one trace: prefix-cache hit rate vs pool size.

    python -m experiments eviction [--quick] [--out DIR]

The trace arrives in waves (one ``generate`` call each): every request is either a new
question (16-48 tokens) behind one of ``num_prefixes`` shared prefixes (system prompts
or documents of 48-160 tokens, picked with Zipf-distributed popularity: a few hot, a
long cold tail), or, with probability ``followup``, the next turn of an earlier request
of the trace (its prompt, its answer and a new message). Outputs are greedy (EOS
ignored), so every run sees the same trace whatever it caches. The trace goes through
every eviction policy (``paged_jax.cache.EVICTION_POLICIES``) at several pool sizes,
given as fractions of the trace's distinct full blocks (its working set, had nothing to
be evicted); the figure is the hit rate (prompt tokens found cached / looked up).

Headline: each policy's mean hit rate over the pool sizes, and ``best_policy``. Writes
DIR/eviction.json and DIR/eviction.png (hit rate vs pool size, one line per policy).
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

import numpy as np

from experiments.common import machine_info, print_headline, pyplot, write_json
from experiments.lib import models, sharing

POOL_FRACTIONS = (0.15, 0.25, 0.4, 0.6, 1.0)
QUICK_POOL_FRACTIONS = (0.25, 1.0)
FULL_TRACE = dict(num_waves=12, per_wave=16, num_prefixes=24)
QUICK_TRACE = dict(num_waves=4, per_wave=8, num_prefixes=8)


class Trace(NamedTuple):
    prefixes: list[list[int]]
    # Per wave, per request: (prefix index, earlier request index or -1, message, answer length).
    waves: list[list[tuple[int, int, list[int], int]]]


def make_trace(num_waves: int, per_wave: int, num_prefixes: int, followup: float, seed: int = 0,
               zipf: float = 1.2) -> Trace:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, models.VOCAB, int(rng.integers(48, 161))).tolist() for _ in range(num_prefixes)]
    weights = 1.0 / np.arange(1, num_prefixes + 1) ** zipf
    weights /= weights.sum()
    waves, seen = [], 0
    for _ in range(num_waves):
        wave = []
        for _ in range(per_wave):
            earlier = int(rng.integers(seen)) if seen and rng.random() < followup else -1
            prefix = int(rng.choice(num_prefixes, p=weights))
            message = rng.integers(0, models.VOCAB, int(rng.integers(16, 49))).tolist()
            wave.append((prefix, earlier, message, int(rng.integers(16, 33))))
        waves.append(wave)
        seen += per_wave
    return Trace(prefixes, waves)


def _prompts(trace: Trace, wave, history: list[list[int]]) -> list[list[int]]:
    return [(history[earlier] if earlier >= 0 else trace.prefixes[prefix]) + message
            for prefix, earlier, message, _ in wave]


def run(trace: Trace, policy: str, num_blocks: int, max_model_len: int, max_num_seqs: int) -> dict:
    """The whole trace through one engine; the hit rate and counters."""
    from paged_jax.engine import LLM, SamplingParams

    llm = LLM(models.memory_model(max_model_len), block_size=sharing.BLOCK_SIZE, num_gpu_blocks=num_blocks,
              max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_num_batched_tokens=1024,
              attention_impl="xla", enable_prefix_caching=True, eviction_policy=policy)
    history: list[list[int]] = []  # per request so far: prompt + answer
    for wave in trace.waves:
        prompts = _prompts(trace, wave, history)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for *_, n in wave]
        for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
            history.append(prompt + out.outputs[0].token_ids)
    s = llm.stats()
    return {"policy": policy, "num_blocks": num_blocks, "hit_rate": s["prefix_cache_hit_rate"],
            "hit_tokens": s["prefix_cache_hit_tokens"], "query_tokens": s["prefix_cache_query_tokens"],
            "evictions": s["prefix_cache_evictions"], "preemptions": s["num_preemptions"],
            "prefill_tokens": s["prefill_tokens"]}


def working_set(trace: Trace) -> tuple[int, int]:
    """(distinct full blocks the trace's prompts and answers fill, its longest sequence),
    from lengths alone (EOS is ignored, so answers are ``max_tokens`` long; random ids
    never repeat a block): each used prefix's full blocks once, plus each request's
    full blocks past its base (prefix or earlier request) history."""
    bs = sharing.BLOCK_SIZE
    totals, used, blocks = [], set(), 0
    for wave in trace.waves:
        for prefix, earlier, message, answer in wave:
            base = totals[earlier] if earlier >= 0 else len(trace.prefixes[prefix])
            if earlier < 0:
                used.add(prefix)
            totals.append(base + len(message) + answer)
            blocks += totals[-1] // bs - base // bs
    blocks += sum(len(trace.prefixes[p]) // bs for p in used)
    return blocks, max(totals)


def plot(path: str, rows: list[dict], working: int) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for policy in sorted({r["policy"] for r in rows}):
        mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["num_blocks"])
        ax.plot([r["num_blocks"] / working for r in mine], [r["hit_rate"] for r in mine], "o-", label=policy)
    ax.set_xlabel("pool size / trace working set")
    ax.set_ylabel("prefix-cache hit rate")
    ax.set_title("one trace, every eviction policy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    import os

    from paged_jax.cache import EVICTION_POLICIES
    from paged_jax.config import blocks_for

    parser = argparse.ArgumentParser(prog="python -m experiments eviction", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a shorter trace, two pool sizes")
    parser.add_argument("--out", default="out")
    args = parser.parse_args(argv)
    quick = args.quick
    trace = make_trace(**(QUICK_TRACE if quick else FULL_TRACE), followup=0.4)
    fractions = QUICK_POOL_FRACTIONS if quick else POOL_FRACTIONS
    working, longest = working_set(trace)
    bs = sharing.BLOCK_SIZE
    max_model_len = bs * blocks_for(longest, bs)
    max_num_seqs = 8
    floor = max_num_seqs * blocks_for(max_model_len, bs) // 2  # room for a wave to run at all
    sizes = sorted({max(int(f * working), floor) for f in fractions})
    print(f"eviction study, {'quick' if quick else 'FULL'}: {sum(map(len, trace.waves))} requests in "
          f"{len(trace.waves)} waves, {len(trace.prefixes)} Zipf prefixes, working set {working} blocks; pools {sizes}")
    rows = [run(trace, policy, n, max_model_len, max_num_seqs) for n in sizes for policy in sorted(EVICTION_POLICIES)]
    print(f"\n{'pool':>5} {'/ working':>9} " + " ".join(f"{p:>10}" for p in sorted(EVICTION_POLICIES)))
    for n in sizes:
        rates = {r["policy"]: r["hit_rate"] for r in rows if r["num_blocks"] == n}
        print(f"{n:>5} {n / working:>9.2f} " + " ".join(f"{rates[p]:>10.3f}" for p in sorted(EVICTION_POLICIES)))
    means = {p: float(np.mean([r["hit_rate"] for r in rows if r["policy"] == p])) for p in sorted(EVICTION_POLICIES)}
    constrained = [n for n in sizes if n < working]
    headline = {f"{p}_mean_hit_rate": v for p, v in means.items()}
    headline["best_policy"] = max(means, key=means.get)
    if constrained:
        tight = min(constrained)
        headline["hit_rate_spread_at_smallest_pool"] = float(
            np.ptp([r["hit_rate"] for r in rows if r["num_blocks"] == tight]))
    print_headline(headline)
    result = {"study": "eviction", "machine": machine_info(), "quick": quick, "block_size": bs,
              "num_requests": sum(map(len, trace.waves)), "num_prefixes": len(trace.prefixes),
              "working_set_blocks": working, "pool_sizes": sizes, "runs": rows, "headline": headline}
    write_json(args.out, "eviction", result)
    plot(os.path.join(args.out, "eviction.png"), rows, working)
    return result


if __name__ == "__main__":
    main()
