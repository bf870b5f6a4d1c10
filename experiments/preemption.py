"""Preemption (mechanism M5): recompute vs swap, by sequence length and pool pressure.

    python -m experiments preemption [--quick] [--out DIR]

When the pool runs dry the scheduler preempts a request group, either dropping its blocks
and recomputing them later (``"recompute"``: release, then a prefill of every token it
held) or copying them to the host and back (``"swap"``: gather, fetch, host pool,
``restore_rows`` + write). Two measurements on a small Llama-shaped model
(``experiments.lib.models.DECODE_STEP_MODEL``: 4 layers, 4 kv heads of 32, 4 KB of fp32 KV per
token):

1. **Cost of one preemption + resume vs length.** One sequence holding L tokens, L from
   16 to 1024, through the pieces the runner uses, each jitted as the runner jits it:
   *recompute* = ``release`` + ``open_sequences`` + one prefill of the L tokens (width
   padded to a power of two, as ``buckets.plan_prefill`` pads); *swap* = ``read_blocks`` of
   the row's blocks + one fetch + the host pool's copy (``engine.swap.HostSwapPool``) +
   ``release``, then the host blocks back to the device + ``restore_rows`` +
   ``write_blocks``. Median of several cycles after a compiling one; the first swap cycle
   checks the restored blocks hold the same bytes. The crossover is the shortest length
   from which swap is faster at every longer length measured.
2. **Throughput under pressure.** The same ShareGPT-like stream (``paged_jax.workloads``,
   EOS ignored, greedy) through ``LLM(preemption_mode="recompute" | "swap")`` with pools
   of a fraction of the peak blocks an unconstrained run of the stream holds: tokens/s
   (compile excluded, median over repeats after a compiling run; the modes in turn),
   preemptions, blocks swapped, tokens recomputed; outputs compared with the
   unconstrained run's.

On this CPU "host" and "device" memory are the same RAM, so a swap is a memory copy; on an
accelerator it crosses PCIe (~25-50 GB/s) while recompute runs at the chip's FLOPs, and a
model's recompute cost per KV byte grows with its size (parameters per KV byte: ~1k here,
~27k for a 7B Llama), so the crossover measured here is this machine's, not a GPU's.

Headlines: ``swap_beats_recompute_from_len`` (None if swap never wins),
``recompute_over_swap_at_16``, ``..._at_512``, ``swap_gb_per_s_at_1024``,
``swap_over_recompute_tokens_per_s_<fraction>`` per pool fraction (of the unconstrained
peak), ``outputs_identical``.

Timings come from a shared 2-core CPU machine: expect +-20% per cell. Full run ~2 min on a lightly
loaded 2-core machine, ``--quick`` ~25 s (no compilation cache). Writes DIR/preemption.json and DIR/preemption.png.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import machine_info, print_headline, pyplot, write_json
from experiments.lib import models
from paged_jax.buckets import MIN_PREFILL_WIDTH, bucket
from paged_jax.cache import NO_BLOCK, init_state, open_sequences, raise_for_status, release, restore_rows
from paged_jax.compilation_cache import enable_compilation_cache
from paged_jax.config import CacheConfig, blocks_for
from paged_jax.engine.swap import HostSwapPool
from paged_jax.kv import block_axis, read_blocks, write_blocks
from paged_jax.model import init_params
from paged_jax.steps import init_pages_for, make_step_fns

BLOCK_SIZE = 16
FULL = dict(lengths=(16, 32, 64, 128, 256, 512, 1024), cycles=7, num_requests=32, max_model_len=512,
            pool_fractions=(0.6, 0.35), repeats=1)
QUICK = dict(lengths=(16, 256), cycles=3, num_requests=8, max_model_len=256, pool_fractions=(0.5,),
             repeats=1)
MAX_NUM_SEQS = 32


# --------------------------------------------------------------------------- 1. one preemption


def _swap_in(state, pages, seq_ids, lens, local_tables, num_local, data, *, max_local):
    """restore_rows, then the host data into the fresh blocks, in one program (the runner's)."""
    state, ids, status = restore_rows(state, seq_ids, lens, local_tables, num_local, max_local=max_local)
    return state, write_blocks(pages, ids, data), ids, status


class _Programs:
    """The jitted pieces, state and pages donated where the runner donates them."""

    def __init__(self, cfg):
        self.fns = make_step_fns(cfg, attention_impl="xla")
        self.release = jax.jit(release, donate_argnums=0)
        self.open = jax.jit(open_sequences, donate_argnums=0)
        self.read = jax.jit(read_blocks)
        self.swap_in = jax.jit(_swap_in, donate_argnums=(0, 1), static_argnames="max_local")


def _recompute(progs, params, box, row, tokens, length):
    """Preempt by release, resume by open + one prefill of ``length`` tokens."""
    box["state"], s_release = progs.release(box["state"], row)
    box["state"], s_open = progs.open(box["state"], row)
    _, box["state"], box["pages"], s_prefill = progs.fns.prefill(
        params, box["state"], box["pages"], tokens, row, jnp.array([length], jnp.int32))
    return s_release, s_open, s_prefill


def _swap(progs, box, row, blocks: np.ndarray, length: int, host: HostSwapPool):
    """Preempt by copying the row's ``blocks`` to ``host`` and releasing; resume by
    restoring the row on fresh blocks and writing the data back. Returns (statuses, the
    row's new blocks) after one fetch each way, as the runner fetches."""
    n = len(blocks)
    size = bucket(n)
    ids = np.concatenate([blocks, np.full(size - n, blocks[-1])]).astype(np.int32)
    data = jax.device_get(progs.read(box["pages"], ids))
    axis = block_axis(data)
    host_ids = host.reserve(n)
    host.write(host_ids, [np.moveaxis(np.asarray(x), axis, 0) for x in jax.tree.leaves(data)])
    box["state"], s_release = progs.release(box["state"], row)
    # ... and back.
    local = np.full((1, box["state"].max_blocks_per_seq), NO_BLOCK, np.int32)
    local[0, :n] = np.arange(n)
    leaves = [np.concatenate([x, np.repeat(x[-1:], size - n, axis=0)]) for x in host.load(host_ids)]
    back = jax.tree.unflatten(host.treedef, [jnp.asarray(np.moveaxis(x, 0, axis)) for x in leaves])
    host.free(host_ids)
    box["state"], box["pages"], new_ids, s_restore = progs.swap_in(
        box["state"], box["pages"], row, jnp.array([length], jnp.int32), local, np.int32(n), back, max_local=size)
    new_ids, s_release, s_restore = jax.device_get((new_ids, s_release, s_restore))
    return (s_release, s_restore), np.asarray(new_ids[:n])


def preemption_costs(cfg, lengths, cycles: int, seed: int = 0) -> list[dict]:
    """Median milliseconds of one recompute and one swap preemption + resume per length."""
    progs = _Programs(cfg)
    _, params = init_params(cfg, seed=seed)
    longest = max(lengths)
    cc = CacheConfig(num_blocks=blocks_for(longest, BLOCK_SIZE) + 8, block_size=BLOCK_SIZE, max_seqs=8,
                     max_blocks_per_seq=blocks_for(longest, BLOCK_SIZE))
    kv_bytes_block = cfg.kv_bytes_per_token() * BLOCK_SIZE
    rng = np.random.default_rng(seed)
    row = jnp.array([0], jnp.int32)
    rows = []
    for length in lengths:
        width = bucket(length, lo=MIN_PREFILL_WIDTH)
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :length] = rng.integers(0, cfg.vocab_size, length)
        tokens = jnp.asarray(tokens)
        box = {"state": init_state(cc, "lifo"), "pages": init_pages_for(cfg, cc)}
        box["state"], status = progs.open(box["state"], row)
        raise_for_status("open", row, status)
        _, box["state"], box["pages"], status = progs.fns.prefill(params, box["state"], box["pages"], tokens, row,
                                                                 jnp.array([length], jnp.int32))
        raise_for_status("prefill", row, status)
        host = HostSwapPool.for_pages(blocks_for(length, BLOCK_SIZE), box["pages"])
        blocks = np.asarray(box["state"].block_tables[0, : blocks_for(length, BLOCK_SIZE)])
        times = {"recompute": [], "swap": []}
        for cycle in range(cycles + 1):  # cycle 0 compiles
            before = jax.device_get(read_blocks(box["pages"], jnp.asarray(blocks))) if cycle == 0 else None
            t0 = time.perf_counter()
            statuses, blocks = _swap(progs, box, row, blocks, length, host)
            t1 = time.perf_counter()
            for name, s in zip(("release", "restore_rows"), statuses):
                raise_for_status(name, np.asarray(row), s)
            if before is not None:  # the same bytes, wherever the blocks went
                after = jax.device_get(read_blocks(box["pages"], jnp.asarray(blocks)))
                for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
                    np.testing.assert_array_equal(x, y)
            t2 = time.perf_counter()
            statuses = jax.block_until_ready(_recompute(progs, params, box, row, tokens, length))
            t3 = time.perf_counter()
            for name, s in zip(("release", "open", "prefill"), statuses):
                raise_for_status(name, np.asarray(row), s)
            blocks = np.asarray(box["state"].block_tables[0, : blocks_for(length, BLOCK_SIZE)])
            if cycle:
                times["swap"].append(t1 - t0)
                times["recompute"].append(t3 - t2)
        swap_s, recompute_s = float(np.median(times["swap"])), float(np.median(times["recompute"]))
        n = blocks_for(length, BLOCK_SIZE)
        rows.append({
            "length": length, "blocks": n, "prefill_width": width, "kv_bytes": n * kv_bytes_block,
            "swap_ms": swap_s * 1e3, "recompute_ms": recompute_s * 1e3, "recompute_over_swap": recompute_s / swap_s,
            # Both directions move the blocks once.
            "swap_gb_per_s": 2 * n * kv_bytes_block / swap_s / 1e9,
            "recompute_tokens_per_s": length / recompute_s,
        })
        r = rows[-1]
        print(f"  L={length:>5} ({n:>3} blocks, {r['kv_bytes'] / 1e6:6.2f} MB): swap out+in {r['swap_ms']:8.2f} ms "
              f"({r['swap_gb_per_s']:.2f} GB/s), recompute {r['recompute_ms']:8.2f} ms "
              f"-> recompute/swap {r['recompute_over_swap']:.2f}", flush=True)
    return rows


def swap_wins_from(rows: list[dict]):
    """The shortest length from which swap is faster at every longer length; None if it
    is not faster at the longest."""
    found = None
    for r in sorted(rows, key=lambda r: -r["length"]):
        if r["recompute_over_swap"] <= 1:
            break
        found = r["length"]
    return found


# --------------------------------------------------------------------------- 2. under pressure


def engine_model():
    """What the pressure runs serve: ``models.DECODE_STEP_MODEL`` (tests swap in a fake backend)."""
    return models.DECODE_STEP_MODEL


def pressure_runs(model, run: dict) -> tuple[dict, list[dict]]:
    """An unconstrained run (a pool for every request at once) gives the peak blocks the
    stream holds; then both modes at each fraction of that peak, in turn in each
    repetition. Returns (the unconstrained run, one row per fraction); tokens/s medians."""
    from paged_jax import workloads
    from paged_jax.engine import LLM, SamplingParams

    reqs = workloads.sharegpt_like(run["num_requests"], max_model_len=run["max_model_len"],
                                   vocab_size=model.vocab_size, seed=0)
    prompts = [list(r.prompt_token_ids) for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    lengths = [len(r.prompt_token_ids) + r.max_tokens for r in reqs]
    demand = sum(blocks_for(n, BLOCK_SIZE) for n in lengths)
    # The pool must hold the longest request alone (LLM checks max_model_len against it).
    max_model_len = max(lengths)

    def engine(pool: int, mode: str):
        return LLM(model, block_size=BLOCK_SIZE, num_gpu_blocks=pool, max_num_seqs=MAX_NUM_SEQS,
                   max_model_len=max_model_len, preemption_mode=mode, attention_impl="xla")

    free = engine(demand, "recompute")
    reference = [o.outputs[0].token_ids for o in free.generate(prompts, params, use_tqdm=False)]
    peak = free.stats()["peak_blocks_allocated"]
    unconstrained = {"num_gpu_blocks": demand, "peak_blocks_allocated": peak, "demand_blocks": demand,
                     "num_requests": len(reqs), "max_model_len": max_model_len}
    out = []
    for fraction in run["pool_fractions"]:
        pool = max(int(fraction * peak), blocks_for(max_model_len, BLOCK_SIZE) + 1)
        engines = {mode: engine(pool, mode) for mode in ("recompute", "swap")}
        speeds = {mode: [] for mode in engines}
        stats, outputs = {}, {}
        for rep in range(run["repeats"] + 1):  # rep 0 compiles (swap-in programs too)
            for mode, llm in engines.items():
                llm.reset_stats()
                outs = llm.generate(prompts, params, use_tqdm=False)
                outputs[mode] = [o.outputs[0].token_ids for o in outs]
                stats[mode] = llm.stats()
                if rep:
                    speeds[mode].append(stats[mode]["tokens_per_s_excl_compile"])
        row = {"pool_fraction": fraction, "num_gpu_blocks": pool, "peak_blocks_unconstrained": peak,
               "outputs_identical": outputs["recompute"] == outputs["swap"] == reference}
        for mode in engines:
            s = stats[mode]
            row[mode] = {
                "tokens_per_s": float(np.median(speeds[mode])), "preemptions": s["num_preemptions"],
                "swap_outs": s["swap_outs"], "blocks_swapped_out": s["blocks_swapped_out"],
                "swap_fallbacks": s["swap_fallbacks"], "prefill_tokens": s["prefill_tokens"],
                "generated_tokens": s["generated_tokens"], "mean_running_batch": s["mean_running_batch"],
                "steps": s["steps"], "programs_compiled": s["compiles"],
            }
        row["swap_over_recompute_tokens_per_s"] = row["swap"]["tokens_per_s"] / row["recompute"]["tokens_per_s"]
        out.append(row)
        print(f"  pool {pool:>4} blocks ({fraction:.2f} of the peak {peak}): recompute {row['recompute']['tokens_per_s']:7.1f} "
              f"tokens/s ({row['recompute']['preemptions']} preemptions, {row['recompute']['prefill_tokens']} "
              f"prefill tokens), swap {row['swap']['tokens_per_s']:7.1f} ({row['swap']['preemptions']} preemptions, "
              f"{row['swap']['blocks_swapped_out']} blocks out) -> swap/recompute "
              f"{row['swap_over_recompute_tokens_per_s']:.2f}; mean batch {row['recompute']['mean_running_batch']:.1f} vs "
              f"{row['swap']['mean_running_batch']:.1f}, steps {row['recompute']['steps']} vs {row['swap']['steps']}; "
              f"outputs identical {row['outputs_identical']}", flush=True)
    return unconstrained, out


# --------------------------------------------------------------------------- the study


def claims(result: dict) -> list[dict]:
    """M5 is a mechanism, not a claim of the seed: nothing to rule on."""
    del result
    return []


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments preemption", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two lengths, one pool (< 45 s)")
    parser.add_argument("--out", default="out")
    args = parser.parse_args(argv)
    quick = args.quick
    run = QUICK if quick else FULL
    t_start = time.perf_counter()
    # LLM turns JAX's persistent compilation cache on anyway; on from the start, a rerun
    # reads every program of this study back (no figure here is a compile time).
    enable_compilation_cache()
    cfg = models.DECODE_STEP_MODEL
    print(f"preemption study, {'quick' if quick else 'FULL'}: {cfg.num_params / 1e6:.1f}M-param model, "
          f"{cfg.kv_bytes_per_token()} KV bytes/token; 1. one preemption + resume vs length")
    costs = preemption_costs(cfg, run["lengths"], run["cycles"])
    print(f"2. {run['num_requests']} ShareGPT-like requests (max_model_len {run['max_model_len']}) under pressure")
    unconstrained, pressure = pressure_runs(engine_model(), run)
    by_len = {r["length"]: r for r in costs}
    longest = max(by_len)
    headline = {
        "swap_beats_recompute_from_len": swap_wins_from(costs),
        "recompute_over_swap_at_16": by_len[16]["recompute_over_swap"] if 16 in by_len else None,
        "recompute_over_swap_at_512": by_len[512]["recompute_over_swap"] if 512 in by_len else None,
        f"swap_gb_per_s_at_{longest}": by_len[longest]["swap_gb_per_s"],
        **{f"swap_over_recompute_tokens_per_s_{r['pool_fraction']:g}": r["swap_over_recompute_tokens_per_s"]
           for r in pressure},
        "outputs_identical": all(r["outputs_identical"] for r in pressure),
    }
    result = {
        "study": "preemption", "machine": machine_info(), "quick": quick,
        "config": {**run, "block_size": BLOCK_SIZE, "max_num_seqs": MAX_NUM_SEQS,
                   "model": {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                             "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                             "num_params": cfg.num_params, "kv_bytes_per_token": cfg.kv_bytes_per_token()},
                   "statistic": "median", "note": "shared 2-core CPU machine: timings +-20% per cell"},
        "costs": costs, "unconstrained": unconstrained, "pressure": pressure, "headline": headline, "wall_s": time.perf_counter() - t_start,
    }
    print_headline(headline)
    write_json(args.out, "preemption", result)
    _plot(args.out, result)
    return result


def _plot(out_dir: str, result: dict) -> None:
    import os

    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    costs = result["costs"]
    lens = [r["length"] for r in costs]
    a.plot(lens, [r["recompute_ms"] for r in costs], "o-", label="recompute (release + prefill)")
    a.plot(lens, [r["swap_ms"] for r in costs], "s-", label="swap (out to host and back)")
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("tokens held by the preempted sequence")
    a.set_ylabel("ms per preemption + resume")
    a.legend(fontsize=8)
    pressure = result["pressure"]
    x = np.arange(len(pressure))
    b.bar(x - 0.2, [r["recompute"]["tokens_per_s"] for r in pressure], 0.4, label="recompute")
    b.bar(x + 0.2, [r["swap"]["tokens_per_s"] for r in pressure], 0.4, label="swap")
    b.set_xticks(x, [f"pool {r['pool_fraction']:g} of peak" for r in pressure])
    b.set_ylabel("tokens/s under pressure")
    b.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, "preemption.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
