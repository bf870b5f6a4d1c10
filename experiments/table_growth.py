"""Table growth (claim C10): what static-shape block tables cost instead of growth.

    python -m experiments table_growth [--quick] [--out DIR]

The seed's claim C10 ("growing a per-sequence table by 1.5-2x steps rather than one entry
at a time avoids copy overhead") is about a table that is reallocated and copied as a
sequence grows. Ours never grows: ``block_tables`` is ``int32[max_seqs,
max_blocks_per_seq]``, fixed when the state is made, so nothing is ever copied. Under jit
the price of a shape is elsewhere, and this study measures it:

1. **Recompiles.** The decode step of a small Llama-shaped model
   (``experiments.lib.models.DECODE_STEP_MODEL``) is traced and compiled for each table width
   (``max_blocks_per_seq``, i.e. ``max_model_len`` 1x, 2x, 4x, 8x), and for each decode
   batch bucket as the batch grows one row at a time (the engine's default decode buckets,
   ``paged_jax.buckets.decode_buckets``). Counted with the step's trace hook, compile seconds = first call
   minus a steady call. A growable table would be a new shape at every growth step: the
   study counts the widths one-at-a-time, 1.5x and 2x growth would pass through up to
   ``max_model_len`` and prices them at the measured compile time.
2. **Table bytes.** For ShareGPT- and Alpaca-like requests (``paged_jax.workloads``,
   max_model_len 2048, block size 16): entries a static row holds (the whole width) vs
   what the sequence's blocks need (one-entry growth), and what power-of-two and 1.5x
   growth buckets would hold; the entries a growing table would copy over a sequence's
   life; and all of it against the KV bytes the same blocks hold.
3. **Step time vs table width.** The same decode step (batch 16, every row holding the
   same tokens) at each width: ``"xla"`` attention (length-aware) reads only the blocks a
   row holds, ``"reference"`` gathers the whole width. Also the per-step host cost that
   grows with width: the engine's host model of the block manager
   (``cache.HostBlockManager``) planning and replaying the step (a planning copy, the
   appends' ``blocks_needed``, the append replayed).

Headlines: ``recompiles_per_max_model_len_change`` (decode traces per width change),
``compile_s_per_width``, ``decode_bucket_compiles`` (batch 1..64), ``table_bytes_static_over_live``,
``table_bytes_pow2_over_live``, ``table_bytes_1p5x_over_live``, ``table_over_kv_bytes``,
``step_time_width_4x_over_1x_xla`` and ``..._reference`` (8x too in a full run),
``host_model_ms_width_4x_over_1x``.

Compile seconds are XLA compiling: JAX's persistent compilation cache (which ``LLM`` turns
on) is off while the study runs. Timings come from a shared 2-core CPU machine: expect
+-20% per cell. Full run ~30 s on an idle
2-core machine (~90 s under load), ``--quick`` ~15-45 s. Writes DIR/table_growth.json and DIR/table_growth.png.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import machine_info, print_headline, pyplot, write_json
from experiments.lib import models
from paged_jax import workloads
from paged_jax.buckets import bucket, decode_buckets, decode_rows, multiples_of, pad_decode
from paged_jax.cache import (
    HostBlockManager,
    append_slots,
    init_state,
    open_sequences,
    raise_for_status,
    release,
)
from paged_jax.config import CacheConfig, blocks_for
from paged_jax.kv import bytes_per_block
from paged_jax.model import init_params
from paged_jax.steps import init_pages_for, make_step_fns

BLOCK_SIZE = 16
FULL = dict(base_len=256, widths=(1, 2, 4, 8), rows=16, reps=20, bucket_cap=64, workload_len=2048,
            num_requests=1000)
QUICK = dict(base_len=128, widths=(1, 4), rows=8, reps=8, bucket_cap=16, workload_len=2048, num_requests=300)
TABLE_ROWS = 64  # max_seqs of every state: the engine's default max_num_seqs
LLAMA_7B_KV_BYTES_PER_TOKEN = 2 * 32 * 32 * 128 * 2  # K and V, 32 layers x 32 heads x 128, bf16


# --------------------------------------------------------------------------- 1 and 3: a step per width


@contextlib.contextmanager
def _no_persistent_cache():
    """JAX's persistent compilation cache off inside (restored after), so a compile is a
    compile and not a read of an earlier process's program."""
    from jax._src import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once per process whether it is used: ask again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def _cache_config(width: int, rows: int, held: int) -> CacheConfig:
    return CacheConfig(num_blocks=rows * blocks_for(held, BLOCK_SIZE) + 8, block_size=BLOCK_SIZE,
                       max_seqs=TABLE_ROWS, max_blocks_per_seq=width)


def _filled(cc: CacheConfig, rows: int, tokens: int):
    """A state whose rows 0..rows-1 each hold ``tokens`` tokens."""
    ids = jnp.arange(rows, dtype=jnp.int32)
    state, (s_open, s_fill) = _open_and_fill(init_state(cc, "lifo"), ids, jnp.full((rows,), tokens, jnp.int32),
                                             tokens)
    raise_for_status("open", ids, s_open)
    raise_for_status("fill", ids, s_fill)
    return state


@functools.partial(jax.jit, static_argnums=3)
def _open_and_fill(state, ids, tokens, max_tokens: int):
    """Open rows ``ids`` and append ``tokens[i]`` tokens to each, in one program (eager
    ops would compile primitive by primitive)."""
    state, s_open = open_sequences(state, ids)
    state, out = append_slots(state, ids, tokens, max_tokens=max_tokens)
    return state, (s_open, out.status)


def step_per_width(cfg, params, impl: str, widths: list[int], rows: int, context: int, reps: int) -> list[dict]:
    """One fresh jit of the decode step per impl; per width: traces, first-call (compile)
    seconds, the median steady step, and the host model's per-step cost at that width.
    Steady calls go round-robin over the widths, so machine noise falls on all of them."""
    traces: list[tuple[str, tuple]] = []
    fns = make_step_fns(cfg, attention_impl=impl, on_trace=lambda name, shape: traces.append((name, shape)))
    ids = jnp.arange(rows, dtype=jnp.int32)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, rows), jnp.int32)
    boxes, first = {}, {}
    for width in widths:
        cc = _cache_config(width, rows, context + reps + 2)
        pages = init_pages_for(cfg, cc)
        boxes[width] = {"state": _filled(cc, rows, context), "pages": pages.replace(k=pages.k + 0.1, v=pages.v + 0.1),
                        "table_bytes": cc.table_bytes}
        before = len(traces)
        t0 = time.perf_counter()
        status = jax.block_until_ready(_decode(fns, params, boxes[width], tokens, ids))
        first[width] = (len(traces) - before, time.perf_counter() - t0)
        raise_for_status("decode", np.arange(rows), np.asarray(status))
        boxes[width]["host"] = HostBlockManager.from_state(boxes[width]["state"])
    step_s = {w: [] for w in widths}
    snap_s = {w: [] for w in widths}
    for _ in range(reps):
        for width, box in boxes.items():
            t0 = time.perf_counter()
            jax.block_until_ready(_decode(fns, params, box, tokens, ids))
            t1 = time.perf_counter()
            plan = box["host"].copy(elastic=True)  # the engine's per-step host work: plan, then replay
            plan.blocks_needed(np.arange(rows), np.ones(rows, np.int32))
            plan.apply("append_slots", (np.arange(rows), np.ones(rows, np.int32)), {"slots": False})
            step_s[width].append(t1 - t0)
            snap_s[width].append(time.perf_counter() - t1)
    out = []
    for width in widths:
        steady, view = float(np.median(step_s[width])), float(np.median(snap_s[width]))
        n_traces, first_s = first[width]
        out.append({
            "impl": impl, "width_blocks": width, "max_model_len": width * BLOCK_SIZE, "rows": rows,
            "context": context, "traces": n_traces, "first_call_s": first_s, "compile_s": max(first_s - steady, 0.0),
            "step_ms": steady * 1e3, "host_model_ms": view * 1e3, "table_bytes": boxes[width]["table_bytes"],
        })
        print(f"  {impl:>9} width {width:>4} blocks (max_model_len {width * BLOCK_SIZE:>5}): {n_traces} "
              f"trace(s), compile {out[-1]['compile_s']:.2f} s, step {steady * 1e3:.2f} ms, "
              f"host model {view * 1e3:.3f} ms", flush=True)
    return out


def _decode(fns, params, box: dict, tokens, ids):
    """One decode step on ``box``'s state and pages (donated, replaced); its status."""
    _, box["state"], box["pages"], status = fns.decode(params, box["state"], box["pages"], tokens, ids)
    return status


def bucket_compiles(cfg, params, width: int, cap: int) -> dict:
    """A batch growing from 1 to ``cap`` rows, one row per step, each new row's first
    token decoded: decode traces and compile seconds with the engine's default decode
    buckets (``buckets.decode_buckets``), against the shapes one per size, powers of two
    from 1 and multiples of 8 would need."""
    traces: list[tuple[str, tuple]] = []
    fns = make_step_fns(cfg, attention_impl="xla", on_trace=lambda name, shape: traces.append((name, shape)))
    cc = CacheConfig(num_blocks=cap * blocks_for(cap, BLOCK_SIZE) + 8, block_size=BLOCK_SIZE, max_seqs=max(cap, 8),
                     max_blocks_per_seq=width)
    state, pages = init_state(cc, "lifo"), init_pages_for(cfg, cc)
    rng = np.random.default_rng(1)
    compile_s = 0.0
    sizes = decode_buckets(cap)
    for n in range(1, cap + 1):
        state, status = open_sequences(state, jnp.array([n - 1], jnp.int32))
        tokens, seq_ids = pad_decode(list(range(n)), rng.integers(0, cfg.vocab_size, n), size=decode_rows(n, sizes))
        before = len(traces)
        t0 = time.perf_counter()
        _, state, pages, status = jax.block_until_ready(fns.decode(params, state, pages, tokens, seq_ids))
        if len(traces) > before:
            compile_s += time.perf_counter() - t0
        raise_for_status("decode", seq_ids, np.asarray(status))
    state, _ = release(state, jnp.arange(cap, dtype=jnp.int32))
    return {
        "batch_range": [1, cap], "decode_traces": len(traces), "traced_rows": sorted({s[0] for _, s in traces}),
        "compile_s": compile_s, "shapes_one_per_size": cap,
        "shapes_pow2": len({bucket(n) for n in range(1, cap + 1)}),
        "shapes_engine_buckets": len(sizes), "shapes_multiples_of_8": len(multiples_of(8, cap)),
    }


# --------------------------------------------------------------------------- 2: table bytes


def growth_sizes(needed: int, factor: float) -> list[int]:
    """Capacities a table starting at 1 entry passes through to hold ``needed`` entries,
    growing by ``factor`` (at least one entry; 1.0 = one entry at a time); the last >= needed."""
    sizes = [1]
    while sizes[-1] < needed:
        sizes.append(sizes[-1] + 1 if factor <= 1 else max(sizes[-1] + 1, math.ceil(sizes[-1] * factor)))
    return sizes


def table_bytes(requests, max_model_len: int, kv_bytes_per_block: int) -> dict:
    """Per-sequence table entries under each sizing, the entries growth would copy, and
    table bytes against KV bytes, for one stream of requests."""
    width = blocks_for(max_model_len, BLOCK_SIZE)
    needed = np.array([blocks_for(len(r.prompt_token_ids) + r.max_tokens, BLOCK_SIZE) for r in requests])
    sizing = {
        "static": np.full_like(needed, width),
        "live": needed,  # one entry at a time: exactly what is used
        "pow2": np.array([growth_sizes(n, 2.0)[-1] for n in needed]),
        "1p5x": np.array([growth_sizes(n, 1.5)[-1] for n in needed]),
    }
    # A reallocation copies the old capacity's entries: the sum of every size but the last.
    copied = {name: np.array([sum(growth_sizes(n, f)[:-1]) for n in needed])
              for name, f in (("one_at_a_time", 1.0), ("pow2", 2.0), ("1p5x", 1.5))}
    widths_seen = {name: len(growth_sizes(width, f)) for name, f in (("one_at_a_time", 1.0), ("pow2", 2.0),
                                                                     ("1p5x", 1.5))}
    live = float(needed.mean())
    return {
        "num_requests": len(requests), "max_model_len": max_model_len, "width_blocks": width,
        "mean_blocks_needed": live,
        **{f"mean_entries_{k}": float(v.mean()) for k, v in sizing.items()},
        **{f"{k}_over_live": float(v.mean()) / live for k, v in sizing.items() if k != "live"},
        **{f"mean_entries_copied_{k}": float(v.mean()) for k, v in copied.items()},
        "mean_entries_copied_static": 0.0,
        "distinct_widths_to_max": {"static": 1, **widths_seen},
        "static_table_over_kv_bytes": (width * 4) / (live * kv_bytes_per_block),
        "static_table_over_kv_bytes_llama7b": (width * 4) / (live * BLOCK_SIZE * LLAMA_7B_KV_BYTES_PER_TOKEN),
    }


# --------------------------------------------------------------------------- the study


def claims(result: dict) -> list[dict]:
    """C10's verdict from the saved JSON."""
    h = result["headline"]
    return [{
        "claim": "C10",
        "seed": "growing a per-sequence table by 1.5-2x steps, not one entry at a time, avoids copy overhead",
        "ours": (f"tables never grow (0 entries copied); a static row holds {h['table_bytes_static_over_live']:.1f}x "
                 f"the entries a sequence needs (pow2 buckets {h['table_bytes_pow2_over_live']:.2f}x, 1.5x "
                 f"{h['table_bytes_1p5x_over_live']:.2f}x), {h['table_over_kv_bytes']:.1e} of the KV bytes; each "
                 f"max_model_len change is {h['recompiles_per_max_model_len_change']:.0f} recompile "
                 f"(~{h['compile_s_per_width']:.1f} s); width 4x costs {h['step_time_width_4x_over_1x_xla']:.2f}x "
                 f"step time with xla attention, {h['step_time_width_4x_over_1x_reference']:.2f}x with reference"),
        "verdict": "not applicable",
        "why": ("Tables are static-shape arrays fixed at init, so nothing is ever reallocated or copied; under jit "
                "every new shape is a recompile, which is why only the batch and prefill shapes vary, in "
                "geometric buckets (buckets.py): C10's principle applied to compiled shapes, not to copies."),
    }]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments table_growth", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller context, fewer buckets (< 45 s)")
    parser.add_argument("--out", default="out")
    args = parser.parse_args(argv)
    quick = args.quick
    cfg_run = QUICK if quick else FULL
    t_start = time.perf_counter()
    cfg = models.DECODE_STEP_MODEL
    _, params = init_params(cfg, seed=0)
    base = blocks_for(cfg_run["base_len"], BLOCK_SIZE)
    widths = [base * f for f in cfg_run["widths"]]
    context = cfg_run["base_len"] - cfg_run["reps"] - 8  # room for the timed steps in the 1x table
    print(f"table_growth study, {'quick' if quick else 'FULL'}: decode step per table width "
          f"({cfg_run['rows']} rows x {context} tokens), {cfg.num_params / 1e6:.1f}M-param model")
    steps = []
    with _no_persistent_cache():
        for impl in ("xla", "reference"):
            steps += step_per_width(cfg, params, impl, widths, cfg_run["rows"], context, cfg_run["reps"])
        print(f"decode batch growing 1..{cfg_run['bucket_cap']} one row per step (buckets.decode_buckets)")
        buckets_run = bucket_compiles(cfg, params, base, cfg_run["bucket_cap"])
    print(f"  {buckets_run['decode_traces']} decode traces (rows {buckets_run['traced_rows']}), "
          f"{buckets_run['compile_s']:.1f} s compiling; one shape per size would be "
          f"{buckets_run['shapes_one_per_size']}, powers of two {buckets_run['shapes_pow2']}")

    kv_block = bytes_per_block(jax.eval_shape(lambda: init_pages_for(cfg, CacheConfig(1, BLOCK_SIZE))))
    tables = {}
    for name, make in (("sharegpt_like", workloads.sharegpt_like), ("alpaca_like", workloads.alpaca_like)):
        reqs = make(cfg_run["num_requests"], max_model_len=cfg_run["workload_len"], vocab_size=2, seed=0)
        tables[name] = table_bytes(reqs, cfg_run["workload_len"], kv_block)
        t = tables[name]
        print(f"  {name:>14}: mean {t['mean_blocks_needed']:.1f} blocks needed of {t['width_blocks']}; "
              f"entries static/live {t['static_over_live']:.1f}x, pow2 {t['pow2_over_live']:.2f}x, "
              f"1.5x {t['1p5x_over_live']:.2f}x; entries a growing table copies: one at a time "
              f"{t['mean_entries_copied_one_at_a_time']:.0f}, 1.5x {t['mean_entries_copied_1p5x']:.1f}, "
              f"pow2 {t['mean_entries_copied_pow2']:.1f}; static table / KV bytes {t['static_table_over_kv_bytes']:.1e}")

    xla = {r["width_blocks"]: r for r in steps if r["impl"] == "xla"}
    ref = {r["width_blocks"]: r for r in steps if r["impl"] == "reference"}
    w1, w4, w8 = base, 4 * base, 8 * base
    width_changes = len(widths) - 1
    compile_per_width = float(np.median([r["compile_s"] for r in xla.values()]))
    share = tables["sharegpt_like"]
    growth = {name: n * compile_per_width for name, n in share["distinct_widths_to_max"].items()}
    headline = {
        "recompiles_per_max_model_len_change": sum(xla[w]["traces"] for w in widths[1:]) / width_changes,
        "compile_s_per_width": compile_per_width,
        "decode_bucket_compiles": buckets_run["decode_traces"],
        "decode_bucket_compiles_one_per_size": buckets_run["shapes_one_per_size"],
        "table_bytes_static_over_live": share["static_over_live"],
        "table_bytes_pow2_over_live": share["pow2_over_live"],
        "table_bytes_1p5x_over_live": share["1p5x_over_live"],
        "table_over_kv_bytes": share["static_table_over_kv_bytes"],
        "step_time_width_4x_over_1x_xla": xla[w4]["step_ms"] / xla[w1]["step_ms"],
        "step_time_width_4x_over_1x_reference": ref[w4]["step_ms"] / ref[w1]["step_ms"],
        "step_time_width_8x_over_1x_xla": xla[w8]["step_ms"] / xla[w1]["step_ms"] if w8 in xla else None,
        "step_time_width_8x_over_1x_reference": ref[w8]["step_ms"] / ref[w1]["step_ms"] if w8 in ref else None,
        "host_model_ms_width_4x_over_1x": xla[w4]["host_model_ms"] / xla[w1]["host_model_ms"],
    }
    result = {
        "study": "table_growth", "machine": machine_info(), "quick": quick,
        "config": {**cfg_run, "block_size": BLOCK_SIZE, "table_rows": TABLE_ROWS, "widths_blocks": widths,
                   "context": context, "model": {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                                                 "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                                                 "num_params": cfg.num_params},
                   "kv_bytes_per_block": kv_block, "statistic": "median",
                   "persistent_compilation_cache": "off while compiling",
                   "note": "shared 2-core CPU machine: timings +-20% per cell"},
        "steps": steps, "batch_buckets": buckets_run, "table_bytes": tables,
        "projected_compile_s_growing_to_max": growth,
        "headline": headline, "wall_s": time.perf_counter() - t_start,
    }
    print_headline(headline, digits=4)
    write_json(args.out, "table_growth", result)
    _plot(args.out, result)
    return result


def _plot(out_dir: str, result: dict) -> None:
    import os

    plt = pyplot()

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.6))
    for impl in ("xla", "reference"):
        rows = [r for r in result["steps"] if r["impl"] == impl]
        a.plot([r["max_model_len"] for r in rows], [r["step_ms"] for r in rows], "o-", label=f"{impl} attention")
    a.set_xscale("log", base=2)
    a.set_xlabel("table width as max_model_len (tokens held fixed)")
    a.set_ylabel("decode step, ms")
    a.legend(fontsize=8)
    names = ["static", "pow2", "1p5x", "live"]
    x = np.arange(len(names))
    for i, (wl, t) in enumerate(result["table_bytes"].items()):
        b.bar(x + (i - 0.5) * 0.4, [t[f"mean_entries_{n}"] * 4 for n in names], 0.4, label=wl)
    b.set_xticks(x, ["static row", "pow2 growth", "1.5x growth", "exact"], fontsize=8)
    b.set_ylabel("table bytes per sequence")
    b.legend(fontsize=8)
    growth = result["projected_compile_s_growing_to_max"]
    c.bar(list(growth), list(growth.values()))
    c.set_yscale("log")
    c.set_ylabel("compile s to reach max_model_len")
    c.set_title("if the table width grew (one compile per width)", fontsize=9)
    c.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, "table_growth.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
