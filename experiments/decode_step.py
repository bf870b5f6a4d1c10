"""Decode-step cost of the paged cache on CPU: paged vs contiguous, and block management.

    python -m experiments decode_step [--quick] [--out DIR]

For a small Llama-shaped model with random weights, at several batch sizes, every row
holding ``--context`` tokens:

- ``paged``: the full jitted ``StepFns.decode`` (append_slots, copy-on-write copies, K/V
  writes through the slot mapping, paged attention through the block tables, LM head);
- ``contiguous``: the same model and weights with a contiguous ``[L, B, max_len]`` KV
  cache (no block tables, no allocation); attention reads the same ``max_len`` keys per
  row, so the two differ only by paging;
- ``block_mgmt``: ``append_slots`` + ``copy_blocks`` of the same batch, jitted alone with
  the state and pages donated, as in the step.

``block_mgmt_share = block_mgmt / paged`` and ``paged_over_contiguous = paged /
contiguous``; the headline is taken at batch 64 (the largest batch run, if 64 is not).
Timing: mean over back-to-back calls after a warm-up, best of several rounds.

A long decode run (sequences joining, growing and leaving; the batch padded to
power-of-two buckets) counts how often the decode step is traced, against the number of
buckets it used (target: once per bucket).

Writes ``DIR/decode_step.json`` and prints a table. ``--quick`` finishes in well under a
minute on 2 CPU cores. Importable: ``main(argv) -> int``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import machine_info, write_json
from experiments.lib import models, steps
from paged_jax.buckets import bucket, pad_decode
from paged_jax.cache import init_state, open_sequences, raise_for_status, release
from paged_jax.config import CacheConfig, blocks_for
from paged_jax.model import init_contiguous_kv, init_params
from paged_jax.steps import init_pages_for, make_step_fns


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m experiments decode_step", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer batch sizes and repetitions (< 60 s)")
    p.add_argument("--out", default="out", help="output directory (default: out)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    p.add_argument("--context", type=int, default=None, help="tokens held by every row before timing")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policy", default="lifo")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _time(fn: Callable[[], object], reps: int, rounds: int) -> float:
    """Best-of-rounds mean seconds per call of ``fn`` (which returns what to block on)."""
    jax.block_until_ready(fn())  # warm-up (compile outside the timed region)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def _measure_batch(batch, *, cfg, params, fns, cc, policy, context, reps, rounds, rng, contiguous_step):
    ids = jnp.arange(batch, dtype=jnp.int32)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, batch), jnp.int32)
    base_state = steps.filled_state(cc, policy, batch, context)
    key = jax.random.PRNGKey(batch)
    pages0 = init_pages_for(cfg, cc)
    pages0 = pages0.replace(
        k=0.1 * jax.random.normal(key, pages0.k.shape, pages0.dtype),
        v=0.1 * jax.random.normal(jax.random.fold_in(key, 1), pages0.v.shape, pages0.dtype),
    )

    # Full paged decode step; state and pages are donated and threaded through.
    box = {"state": steps.copy_tree(base_state), "pages": steps.copy_tree(pages0)}

    def paged_call():
        logits, box["state"], box["pages"], status = fns.decode(params, box["state"], box["pages"], tokens, ids)
        return logits

    t_paged = _time(paged_call, reps, rounds)
    status = np.asarray(fns.decode(params, box["state"], box["pages"], tokens, ids)[3])
    if (status != 0).any():
        raise RuntimeError(f"decode rejected during timing (status {status}); raise the pool size")

    # Block management alone: the same append_slots + copy_blocks, same donation.
    box = {"state": steps.copy_tree(base_state), "pages": pages0}
    mgmt = steps.mgmt_fn()
    ones = jnp.ones((batch,), jnp.int32)

    def mgmt_call():
        box["state"], box["pages"], slots = mgmt(box["state"], box["pages"], ids, ones)
        return slots

    t_mgmt = _time(mgmt_call, reps, rounds)

    # Contiguous cache: the same weights, a [L, B, max_len] cache holding `context` tokens.
    kv = init_contiguous_kv(cfg, batch, cc.max_tokens_per_seq)
    kv = kv._replace(k=kv.k + 0.1, v=kv.v + 0.1)
    cbox = {"kv": kv, "lengths": jnp.full((batch,), context, jnp.int32)}

    def contiguous_call():
        logits, cbox["kv"], cbox["lengths"] = contiguous_step(params, cbox["kv"], tokens, cbox["lengths"])
        return logits

    t_contig = _time(contiguous_call, reps, rounds)
    return {
        "batch": batch,
        "context": context,
        "paged_ms": 1e3 * t_paged,
        "contiguous_ms": 1e3 * t_contig,
        "block_mgmt_ms": 1e3 * t_mgmt,
        "block_mgmt_share": t_mgmt / t_paged,
        "paged_over_contiguous": t_paged / t_contig,
    }


def _compile_run(fns, params, cfg, cc, policy, num_steps, max_batch, rng, traces):
    """Decode-only run: sequences join (empty, first token decoded), grow and leave.

    Live count wanders in (max_batch/4, max_batch], so buckets max_batch/2 and max_batch
    are used (and max_batch/4 at most). Returns what the trace counter saw.
    """
    before = len(traces)
    state = init_state(cc, policy)
    pages = init_pages_for(cfg, cc)
    live: list[int] = []
    free = list(range(cc.max_seqs))
    lo, hi = max_batch // 4 + 1, max_batch
    buckets_used = set()
    want = hi
    for step in range(num_steps):
        if step % 8 == 0:
            want = int(rng.integers(lo, hi + 1))
        while len(live) > want or (live and state.seq_lens[live[0]] >= cc.max_tokens_per_seq - 1):
            sid = live.pop(0)
            state, status = release(state, jnp.array([sid], jnp.int32))
            free.append(sid)
        while len(live) < want:
            sid = free.pop(0)
            state, status = open_sequences(state, jnp.array([sid], jnp.int32))
            live.append(sid)
        tokens, seq_ids = pad_decode(live, rng.integers(0, cfg.vocab_size, len(live)))
        buckets_used.add(len(seq_ids))
        _, state, pages, status = fns.decode(params, state, pages, tokens, seq_ids)
        raise_for_status("decode", seq_ids, status)
    new = traces[before:]
    return {
        "steps": num_steps,
        "batch_range": [lo, hi],
        "buckets_used": sorted(buckets_used),
        "decode_traces_total": sum(1 for name, _ in traces if name == "decode"),
        "decode_traces_during_run": sum(1 for name, _ in new if name == "decode"),
        "traced_shapes": sorted({shape[0] for name, shape in traces if name == "decode"}),
        "at_most_once_per_bucket": len([n for n, _ in traces if n == "decode"])
        == len({s for n, s in traces if n == "decode"}),
    }


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    batch_sizes = args.batch_sizes or ([32, 64] if args.quick else [1, 8, 16, 32, 64, 128])
    batch_sizes = sorted({bucket(b) for b in batch_sizes})  # the shapes a real engine uses
    context = args.context or (128 if args.quick else 512)
    reps, rounds = (10, 2) if args.quick else (30, 3)
    run_steps = 48 if args.quick else 300
    bs = args.block_size
    max_batch = max(batch_sizes)
    # Room for the timed steps of the largest batch (warm-up + rounds * reps, twice).
    extra = 2 * (1 + rounds * reps) + 8
    per_seq = blocks_for(context + extra, bs)
    cc = CacheConfig(num_blocks=max_batch * per_seq + 8, block_size=bs, max_seqs=max_batch, max_blocks_per_seq=per_seq)
    cfg = models.DECODE_STEP_MODEL
    rng = np.random.default_rng(args.seed)
    t_start = time.perf_counter()

    _, params = init_params(cfg, seed=args.seed)
    traces: list[tuple[str, tuple]] = []
    fns = make_step_fns(cfg, attention_impl="xla", on_trace=lambda name, shape: traces.append((name, shape)))
    contiguous_step = steps.make_contiguous_decode(cfg)

    rows = []
    for b in batch_sizes:
        rows.append(_measure_batch(
            b, cfg=cfg, params=params, fns=fns, cc=cc, policy=args.policy, context=context,
            reps=reps, rounds=rounds, rng=rng, contiguous_step=contiguous_step,
        ))
    compiles = _compile_run(fns, params, cfg, cc, args.policy, run_steps, max_batch, rng, traces)

    head_row = next((r for r in rows if r["batch"] == 64), rows[-1])
    result = {
        "experiment": "decode_step",
        "quick": args.quick,
        "model": {
            "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
            "intermediate_size": cfg.intermediate_size, "num_params": cfg.num_params, "dtype": cfg.dtype,
        },
        "cache": {
            "block_size": bs, "num_blocks": cc.num_blocks, "max_seqs": cc.max_seqs,
            "max_blocks_per_seq": cc.max_blocks_per_seq, "policy": args.policy, "attention_impl": "xla",
        },
        "timing": {"reps": reps, "rounds": rounds, "statistic": "best-of-rounds mean"},
        "machine": machine_info(),
        "rows": rows,
        "compiles": compiles,
        "headline": {
            "batch": head_row["batch"],
            "block_mgmt_share": head_row["block_mgmt_share"],
            "paged_over_contiguous": head_row["paged_over_contiguous"],
            "block_mgmt_share_target": steps.MGMT_TARGET_SHARE,
            "block_mgmt_share_met": head_row["block_mgmt_share"] <= steps.MGMT_TARGET_SHARE,
            "decode_compiles": compiles["decode_traces_total"],
            "buckets_used": len(set(compiles["traced_shapes"]) | set(compiles["buckets_used"])),
        },
        "wall_s": time.perf_counter() - t_start,
    }
    _print_table(result)
    write_json(args.out, "decode_step", result)
    return 0


def _print_table(result):
    print(f"decode step, {result['model']['num_params'] / 1e6:.2f}M-param model, CPU, "
          f"block size {result['cache']['block_size']}, context {result['rows'][0]['context']}")
    print(f"{'batch':>6} {'paged ms':>9} {'contig ms':>10} {'mgmt ms':>8} {'mgmt share':>11} {'paged/contig':>13}")
    for r in result["rows"]:
        print(f"{r['batch']:>6} {r['paged_ms']:>9.3f} {r['contiguous_ms']:>10.3f} {r['block_mgmt_ms']:>8.3f} "
              f"{r['block_mgmt_share']:>11.3f} {r['paged_over_contiguous']:>13.3f}")
    c, h = result["compiles"], result["headline"]
    print(f"long run: {c['steps']} decode steps, batch {c['batch_range'][0]}-{c['batch_range'][1]}, "
          f"buckets {c['buckets_used']}; decode traced {c['decode_traces_total']} times in total "
          f"(shapes {c['traced_shapes']}), {c['decode_traces_during_run']} during the run")
    print(f"headline @ batch {h['batch']}: block_mgmt_share={h['block_mgmt_share']:.3f} "
          f"(target <= {h['block_mgmt_share_target']}: {'met' if h['block_mgmt_share_met'] else 'NOT met'}), "
          f"paged_over_contiguous={h['paged_over_contiguous']:.3f} ({result['wall_s']:.1f} s)")


if __name__ == "__main__":
    sys.exit(main())
