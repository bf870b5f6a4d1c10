"""The sampler's cost per step: ``engine.sampling.sample`` against the full-sort sampler it
replaced, on a vocabulary-sized batch of logits.

    python -m experiments sampler [--quick] [--out DIR] [--rows 8,32,64] [--vocab 49152]

Why: XLA:CPU sorts [32, 49152] f32 logits in ~600 ms, six times a SmolLM2-135M decode
step, and the sampler used to sort every row of any batch holding one sampled request.
``_keep_mask`` now decides each row's min-p/top-k/top-p set from ``lax.top_k``
candidates, elementwise where nothing ranks, and by binary searches over the values for
the rest; ``draw`` picks by inverse CDF in two levels.

Cases (every row alike): greedy; temperature 0.8 alone; top-k 50; top-p 0.9 and min-p 0.05
on peaked, language-model-like logits (sorted logits fall as ``-1.2 log(rank)``, shuffled:
top-p 0.9 keeps ~60 tokens);
top-p 0.95 on flat logits (standard normal: the nucleus holds thousands of tokens, past the
candidates, so the binary searches run). Per case and row count: ``sample`` (min over
``--rounds`` of the mean of ``--reps`` calls) against the baseline, the same draw over a
kept set found by a stable sort of every row (the old sampler's ranking), timed in turn,
the two kept sets compared (they must be equal), and the share of rows drawing the same
token (the same ``draw``: 1 unless a boundary moved by rounding). Headline: ms per call at 32 rows and
sort / ``sample`` per case. Writes DIR/sampler.json.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import machine_info, print_headline, write_json

# name -> (temperature, top_k, top_p, min_p, logits kind)
CASES = {
    "greedy": (0.0, -1, 1.0, 0.0, "peaked"),
    "temperature": (0.8, -1, 1.0, 0.0, "peaked"),
    "top_k_50": (0.8, 50, 1.0, 0.0, "peaked"),
    "top_p_0.9": (0.8, -1, 0.9, 0.0, "peaked"),
    "min_p_0.05": (0.8, -1, 1.0, 0.05, "peaked"),
    "top_p_0.95_flat": (1.0, -1, 0.95, 0.0, "flat"),
}


def logits(kind: str, rows: int, vocab: int, seed: int = 0) -> np.ndarray:
    """f32[rows, vocab]: "peaked" (a language model's shape: sorted logits ``-1.2 log(rank)``
    plus a little noise, in a random order per row) or "flat" (standard normal)."""
    rng = np.random.default_rng(seed)
    if kind == "flat":
        return rng.standard_normal((rows, vocab)).astype(np.float32)
    ranked = -1.2 * np.log1p(np.arange(vocab)) + 0.05 * rng.standard_normal((rows, vocab))
    return np.stack([row[rng.permutation(vocab)] for row in ranked]).astype(np.float32)


def sorted_keep(scaled, top_k, top_p, min_p):
    """bool[N, V]: the kept set by a stable sort of every row (the replaced sampler's way):
    min-p, top-k, then top-p over the sorted, renormalised distribution."""
    vocab = scaled.shape[-1]
    ids = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), scaled.shape)
    neg, order = jax.lax.sort_key_val(-scaled, ids, dimension=-1)
    keep = jnp.arange(vocab) < jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)[:, None]
    keep &= neg[:, :1] - neg >= jnp.log(min_p)[:, None]
    probs = jax.nn.softmax(jnp.where(keep, -neg, -jnp.inf), axis=-1)
    keep &= ((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]) | (top_p >= 1)[:, None]
    return jnp.zeros_like(keep).at[jnp.arange(scaled.shape[0])[:, None], order].set(keep)


def _sort_sampler(x, temperature, top_k, top_p, min_p, seeds, steps):
    """The baseline's tokens: greedy rows the argmax; if any row samples, every row's kept
    set by ``sorted_keep`` and the same ``draw`` (the sort skipped when all are greedy, as
    the replaced sampler did)."""
    from paged_jax.engine.sampling import argmax_last, draw

    def sampled():
        scaled = x / jnp.maximum(temperature, 1e-6)[:, None]
        keep = sorted_keep(scaled, top_k, top_p, min_p)
        weights = jnp.where(keep, jnp.exp(scaled - scaled.max(axis=-1, keepdims=True)), 0.0)
        return jnp.where(temperature == 0, argmax_last(x), draw(weights, seeds, steps))

    return jax.lax.cond(jnp.all(temperature == 0), lambda: argmax_last(x), sampled)


def _kept_sets(x, temperature, top_k, top_p, min_p):
    """(``_keep_mask``'s, ``sorted_keep``'s) kept sets of the tempered logits."""
    from paged_jax.engine.sampling import _keep_mask

    scaled = x / jnp.maximum(temperature, 1e-6)[:, None]
    return _keep_mask(scaled, top_k, top_p, min_p), sorted_keep(scaled, top_k, top_p, min_p)


def _time(fn, args, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) / reps * 1e3


def compare(case: str, rows: int, vocab: int, reps: int, rounds: int) -> dict:
    """``sample`` and the sort baseline on one case: ms per call (min over rounds, timed in
    turn), and whether their kept sets agree."""
    temperature, top_k, top_p, min_p, kind = CASES[case]
    x = jnp.asarray(logits(kind, rows, vocab))
    args = (x, jnp.full(rows, temperature, jnp.float32), jnp.full(rows, top_k, jnp.int32),
            jnp.full(rows, top_p, jnp.float32), jnp.full(rows, min_p, jnp.float32),
            jnp.arange(rows, dtype=jnp.uint32), jnp.zeros(rows, jnp.int32))
    from paged_jax.engine.sampling import sample

    time_sampler = jax.jit(lambda x, t, k, p, m, s, st: sample(x, t, k, p, s, st, min_p=m)[0])
    time_baseline = jax.jit(_sort_sampler)
    keep, keep_ref = (np.asarray(k) for k in jax.jit(_kept_sets)(*args[:5]))
    agree = bool(np.array_equal(keep, keep_ref))
    same_tokens = float(np.mean(np.asarray(time_sampler(*args)) == np.asarray(time_baseline(*args))))
    for fn in (time_sampler, time_baseline):
        jax.block_until_ready(fn(*args))
    ours, sort = [], []
    for _ in range(rounds):
        ours.append(_time(time_sampler, args, reps))
        sort.append(_time(time_baseline, args, reps))
    kept = int(keep.sum(axis=-1).max())
    return {"case": case, "rows": rows, "sample_ms": min(ours), "sort_ms": min(sort),
            "sort_over_sample": min(sort) / min(ours), "kept_sets_equal": agree, "same_tokens": same_tokens,
            "max_kept": kept}


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m experiments sampler", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a 4096-token vocabulary, 8 and 32 rows, one round")
    p.add_argument("--out", default="out")
    p.add_argument("--rows", default=None, help="comma-separated row counts (default 8,32,64)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 49152, SmolLM2's)")
    p.add_argument("--reps", type=int, default=None, help="calls per timing (default 3, quick 1)")
    p.add_argument("--rounds", type=int, default=None, help="timings per sampler, in turn (default 3, quick 1)")
    args = p.parse_args(argv)
    args.rows = [int(r) for r in (args.rows or ("8,32" if args.quick else "8,32,64")).split(",")]
    args.vocab = args.vocab or (4096 if args.quick else 49152)
    args.reps = args.reps or (1 if args.quick else 3)
    args.rounds = args.rounds or (1 if args.quick else 3)
    return args


def main(argv=None) -> dict:
    args = _parse(argv)
    results, headline = [], {}
    print(f"sampler, vocabulary {args.vocab}: ms per call (sample vs full sort)")
    for rows in args.rows:
        for case in CASES:
            r = compare(case, rows, args.vocab, args.reps, args.rounds)
            results.append(r)
            print(f"  {rows:>3} rows {case:>16}: sample {r['sample_ms']:7.1f} ms, sort {r['sort_ms']:7.1f} ms "
                  f"({r['sort_over_sample']:5.1f}x); kept sets equal: {r['kept_sets_equal']}, "
                  f"up to {r['max_kept']} kept", flush=True)
    at = 32 if 32 in args.rows else args.rows[-1]
    for r in results:
        if r["rows"] == at:
            headline[f"{r['case']}_sample_ms_{at}_rows"] = round(r["sample_ms"], 2)
            headline[f"{r['case']}_sort_over_sample_{at}_rows"] = round(r["sort_over_sample"], 2)
    headline["kept_sets_equal"] = all(r["kept_sets_equal"] for r in results)
    print_headline(headline)
    result = {"study": "sampler", "machine": machine_info(),
              "config": {"quick": args.quick, "vocab": args.vocab, "rows": args.rows, "reps": args.reps,
                         "rounds": args.rounds, "cases": {k: dict(zip(("temperature", "top_k", "top_p", "min_p",
                                                                        "logits"), v)) for k, v in CASES.items()}},
              "rows": results, "headline": headline}
    write_json(args.out, "sampler", result)
    return result


if __name__ == "__main__":
    main()
