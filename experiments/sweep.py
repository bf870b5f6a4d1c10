"""An ablation grid over any ``LLM`` keyword: every combination on the same requests and KV bytes.

    python -m experiments sweep --grid allocation_policy=lifo,fifo,random block_size=8,16,32 \\
        preemption_mode=recompute,swap [--workload sharegpt_like] [--seeds 3] [--quick] [--out DIR] \\
        [--num-requests N] [--model tiny|small] [--budget-blocks N | --budget-bytes B] [--set KEY=VALUE ...]

Change one argument, see the trade-off. Each ``--grid`` token is ``KEY=V1,V2,...`` where
KEY is any keyword of ``paged_jax.engine.LLM`` (checked against its signature before
anything runs: an unknown name is an error naming it) and the values are read as int,
float, bool (``true``/``false``), ``None`` or else a string. ``--set KEY=VALUE`` fixes a
keyword for every run. Every combination (the product of the axes) runs through one
``LLM`` built for it; each seed then draws a new workload from the same distribution
(``paged_jax.workloads``: ``sharegpt_like``, ``alpaca_like`` or ``fixed_length``, EOS
ignored so every run generates the same tokens) and gives every request its own sampling
seed, on the same engine (``reset_stats`` between seeds: the weights, and so the engine's
``seed``, stay those of the config).

**One memory budget in bytes**, not blocks: every run gets ``kv_cache_memory_bytes`` =
the budget, so the pool holds as many blocks as fit, and changing ``block_size`` or
``kv_cache_dtype`` keeps the memory equal (quantisation scales are counted). The default
is the KV of ``BUDGET_SEQUENCES`` sequences at ``max_model_len`` in the model's dtype, tight
enough that sequences compete for blocks; ``--budget-blocks N`` means N blocks of 16
tokens of that dtype. A grid or ``--set`` giving ``num_gpu_blocks`` (or
``kv_cache_memory_bytes``) replaces the byte budget for those runs.

Per run (one row per config and seed, in DIR/sweep.csv and DIR/sweep.json): every config
key, the seed, ``tokens_per_s`` (generated tokens over the engine's step time minus its
compile time: ``LLM.stats()``'s ``tokens_per_s_excl_compile``), ``kv_utilization`` (tokens
held / slots charged, averaged over steps), ``peak_blocks`` (blocks charged at the peak)
and ``peak_kv_mib`` (the same in bytes, comparable across block sizes), ``preemptions``,
``mean_running_batch``, ``num_blocks``, ``table_bytes`` (the block tables), ``steps``,
``wall_seconds`` (the measured ``generate`` call) and ``compile_seconds``. Each config first
runs seed 0's requests once, untimed (``warmup_seconds``), so its programs are compiled
and its first-call costs paid before the clock starts, whichever config ran first: the
warm-up's compile time is reported on the config's seed-0 row (plus any compile in a
measured run, which tokens/s excludes anyway). The headline is the
best config by tokens/s (mean over seeds) and its ratio over the worst, both measured in
this run. One plot per metric, DIR/sweep_<metric>.png: the first axis along x, every
combination of the other axes a series, mean over seeds with the seeds' spread as error
bars.

From Python (notebooks): ``sweep(grid, workload, seeds=..., ...) -> list[dict]`` returns the
same rows; ``format_table(rows)`` renders them, ``summarize(rows, metric)`` averages over
seeds and ``plot_metric(rows, metric, ax)`` draws one metric.

Models: ``tiny`` (2 layers, d=64; overhead-bound: tokens/s there is mostly the engine's own
cost) and ``small`` (the throughput study's 8-layer, 33M-parameter model, weight-dominated).
Without ``--quick``: 128 requests at max_model_len 256, up to 32 running sequences. With
``--quick`` (24 requests at max_model_len 128, up to 16 running, ``QUICK_BASE``: two step
programs per config): a 2 x 2 grid of block sizes and preemption modes took ~35 s of CPU
time with a cold compilation cache (69 s of wall time on the shared 2-core machine, other
jobs loading it to ~7) and ~10 s warm; almost all of it is each config compiling its
programs. Per-run tokens/s on a shared machine vary by tens of percent: use ``--seeds``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import difflib
import itertools
import math
import os
import time

import numpy as np

from experiments.common import machine_info, pyplot, write_json
from experiments.lib import models

WORKLOADS = ("sharegpt_like", "alpaca_like", "fixed_length")
MODELS = ("tiny", "small")
BUDGET_SEQUENCES = 2  # default budget: the KV of this many sequences at max_model_len (tight)
BUDGET_BLOCK_SIZE = 16  # the block size --budget-blocks counts in
# Engine settings every run gets unless the grid or --set says otherwise.
BASE = {"max_num_seqs": 32, "max_num_batched_tokens": 128}
# --quick: two step shapes to compile per config (decode calls of 16 rows, 16-token prefill chunks).
QUICK_BASE = {"max_num_seqs": 16, "max_num_batched_tokens": 16, "decode_buckets": (16,)}
# name in a row -> (label, what LLM.stats() reports it as)
METRICS = {
    "tokens_per_s": "tokens/s (excl. compile)",
    "kv_utilization": "KV utilisation (mean over steps)",
    "peak_blocks": "peak blocks charged",
    "peak_kv_mib": "peak KV charged, MiB",
    "preemptions": "preemptions",
    "mean_running_batch": "mean running batch",
    "compile_seconds": "compile s",
    "wall_seconds": "wall s (incl. compile)",
    "table_bytes": "block tables, bytes",
}
PLOTTED = ("tokens_per_s", "kv_utilization", "peak_blocks", "peak_kv_mib", "preemptions")


# ----------------------------------------------------------------------------- grid
def llm_keywords() -> list[str]:
    """The keyword arguments ``LLM(...)`` takes (everything but the model): ``EngineArgs``' fields."""
    from paged_jax.engine import EngineArgs

    return [f.name for f in dataclasses.fields(EngineArgs) if f.name != "model"]


def check_keywords(names) -> None:
    """ValueError naming the first of ``names`` that is not an ``LLM`` keyword (with the
    closest valid names), before anything is built."""
    valid = llm_keywords()
    for name in names:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=3)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"{name!r} is not a keyword of LLM{hint} (LLM takes: {', '.join(valid)})")


def parse_value(text: str):
    """A grid value: int, float, bool (true/false), None, or else the string itself."""
    lowered = text.strip().lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_assignment(token: str) -> tuple[str, list]:
    """``"KEY=V1,V2"`` -> ("KEY", [V1, V2]) with each value parsed (``parse_value``)."""
    key, sep, values = token.partition("=")
    if not sep or not key.strip() or not values.strip():
        raise ValueError(f"{token!r}: expected KEY=VALUE[,VALUE...]")
    return key.strip(), [parse_value(v) for v in values.split(",")]


def parse_grid(tokens: list[str]) -> dict[str, list]:
    """``["block_size=8,16", "preemption_mode=recompute,swap"]`` -> an ordered grid dict;
    ValueError for a malformed token, a repeated key or a name ``LLM`` does not take."""
    grid: dict[str, list] = {}
    for token in tokens:
        key, values = parse_assignment(token)
        if key in grid:
            raise ValueError(f"grid axis {key!r} given twice")
        grid[key] = values
    check_keywords(grid)
    return grid


def combinations(grid: dict[str, list]) -> list[dict]:
    """Every combination of the axes, the first axis varying slowest."""
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def config_label(config: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.items()) or "(base)"


# ------------------------------------------------------------------------ workloads
def model_config(model, max_model_len: int):
    """A ``ModelConfig`` by name ("tiny", "small"), or ``model`` itself."""
    from paged_jax.model import ModelConfig

    if isinstance(model, ModelConfig):
        return model
    if model == "tiny":
        return models.tiny(max_model_len)
    if model == "small":
        return models.llama_33m(max_model_len)
    raise ValueError(f"model={model!r}: choose one of {MODELS} or pass a ModelConfig")


def make_requests(workload, num_requests: int, max_model_len: int, vocab_size: int, seed: int):
    """The requests of one seed: a fresh draw of a named workload, or the given list."""
    from paged_jax import workloads

    if not isinstance(workload, str):
        return list(workload)
    if workload == "fixed_length":
        quarter = max(1, max_model_len // 4)
        return workloads.fixed_length(num_requests, prompt_len=quarter, output_len=quarter,
                                      vocab_size=vocab_size, seed=seed)
    if workload not in WORKLOADS:
        raise ValueError(f"workload={workload!r}: choose one of {WORKLOADS} or pass a list of Requests")
    draw = getattr(workloads, workload)
    return draw(num_requests, max_model_len=max_model_len, vocab_size=vocab_size, seed=seed)


def default_budget_bytes(config, max_model_len: int) -> int:
    """The KV of ``BUDGET_SEQUENCES`` sequences of ``max_model_len`` tokens in the model's dtype."""
    return BUDGET_SEQUENCES * max_model_len * config.kv_bytes_per_token()


def blocks_budget_bytes(config, num_blocks: int) -> int:
    """``num_blocks`` blocks of ``BUDGET_BLOCK_SIZE`` tokens in the model's dtype, in bytes."""
    return num_blocks * BUDGET_BLOCK_SIZE * config.kv_bytes_per_token()


# ------------------------------------------------------------------------------ run
def generate(llm, requests, seed: int) -> float:
    """``requests`` through ``llm`` (greedy, EOS ignored, request i sampling seed
    ``seed * 1_000_003 + i``) after ``reset_stats``; returns the call's wall seconds."""
    from paged_jax.engine import SamplingParams

    prompts = [list(r.prompt_token_ids) for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True, seed=seed * 1_000_003 + i)
              for i, r in enumerate(requests)]
    llm.reset_stats()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def run_config(llm, requests, seed: int) -> dict:
    """One measured run of ``requests`` through ``llm``: the row's measured fields."""
    wall = generate(llm, requests, seed)
    s = llm.stats()
    cache = llm.config.device_shape()
    return {
        "tokens_per_s": s["tokens_per_s_excl_compile"],
        "kv_utilization": s["kv_utilization"],
        "peak_blocks": s["peak_blocks_used"],
        "peak_kv_mib": s["peak_blocks_used"] * s["bytes_per_block"] / 2**20,
        "preemptions": s["num_preemptions"],
        "mean_running_batch": s["mean_running_batch"],
        "generated_tokens": s["generated_tokens"],
        "steps": s["steps"],
        "num_blocks": llm.num_gpu_blocks,
        "bytes_per_block": s["bytes_per_block"],
        "table_bytes": cache.max_seqs * cache.max_blocks_per_seq * 4,  # int32 block tables
        "compile_seconds": s["compile_seconds"],
        "wall_seconds": wall,
    }


def sweep(
    grid: dict[str, list],
    workload="sharegpt_like",
    *,
    seeds: int = 1,
    num_requests: int = 64,
    model="tiny",
    max_model_len: int = 256,
    budget_bytes: int | None = None,
    base: dict | None = None,
    warmup: bool = True,
    verbose: bool = True,
) -> list[dict]:
    """Run every combination of ``grid`` (LLM keyword -> values) over ``seeds`` draws of
    ``workload`` under one KV byte budget; one row (dict) per config and seed.

    Args:
      grid: ordered axes, e.g. ``{"block_size": [8, 16, 32]}``; names must be ``LLM``
        keywords (ValueError naming the first that is not, before anything runs).
      workload: "sharegpt_like", "alpaca_like", "fixed_length", or a list of
        ``workloads.Request`` (then every seed runs the same list).
      seeds: workload draws (seed 0, 1, ...) per config, on the config's one engine.
      num_requests, max_model_len: the workload's size and the engine's context.
      model: "tiny", "small" or a ``ModelConfig`` (random weights).
      budget_bytes: the KV pool in bytes for every run (``kv_cache_memory_bytes``);
        default ``default_budget_bytes``.
      base: keywords every run gets (over ``BASE``; the grid wins over both).
      warmup: run the first draw once, untimed, on each config's engine before the
        measured runs, so every config's programs are compiled (and its first-call costs
        paid) before its clock starts, whichever config ran first.
      verbose: print one line per run.

    Returns rows with every config key (grid and base), ``seed``, ``workload``,
    ``budget_bytes`` and the measured fields of ``run_config``.
    """
    from paged_jax.engine import LLM

    if not grid:
        raise ValueError("the grid is empty: give at least one axis, e.g. {'block_size': [8, 16]}")
    if any(not isinstance(v, (list, tuple)) or not v for v in grid.values()):
        raise ValueError(f"every grid axis needs a non-empty list of values, got {grid!r}")
    base = {**BASE, **(base or {})}
    check_keywords(list(grid) + list(base))
    if seeds < 1:
        raise ValueError(f"seeds={seeds}: must be >= 1")
    config = model_config(model, max_model_len)
    budget = default_budget_bytes(config, max_model_len) if budget_bytes is None else int(budget_bytes)
    label = workload if isinstance(workload, str) else "given requests"
    draws = [make_requests(workload, num_requests, max_model_len, config.vocab_size, seed) for seed in range(seeds)]
    rows = []
    for combo in combinations(grid):
        kwargs = {**base, **combo}
        if "num_gpu_blocks" not in kwargs and "kv_cache_memory_bytes" not in kwargs:
            kwargs["kv_cache_memory_bytes"] = budget
        kwargs.setdefault("max_model_len", max_model_len)
        llm = LLM(config, **kwargs)
        warmup_compile = 0.0
        if warmup:  # compile (and first-call costs) before anything is timed
            warmup_wall = generate(llm, draws[0], 0)
            warmup_compile = llm.stats()["compile_seconds"]
        for seed, requests in enumerate(draws):
            measured = run_config(llm, requests, seed)
            measured["compile_seconds"] += warmup_compile if seed == 0 else 0.0
            if warmup:
                measured["warmup_seconds"] = warmup_wall
            fixed = {k: v for k, v in kwargs.items() if k not in combo and k != "kv_cache_memory_bytes"}
            row = {**combo, **fixed, "seed": seed, "workload": label, "budget_bytes": kwargs.get("kv_cache_memory_bytes"),
                   **measured}
            rows.append(row)
            if verbose:
                print(f"  {config_label(combo)}, seed {seed}: {measured['tokens_per_s']:.0f} tokens/s, "
                      f"utilisation {measured['kv_utilization']:.3f}, peak {measured['peak_blocks']} of "
                      f"{measured['num_blocks']} blocks, {measured['preemptions']} preemptions, "
                      f"{measured['wall_seconds']:.1f} s", flush=True)
        del llm
        release_compiled_programs()
    return rows


def release_compiled_programs(fraction: float = 0.4) -> bool:
    """Drop JAX's compiled programs once the process holds ``fraction`` of its memory-mapping
    limit (XLA:CPU maps hundreds per program; a long grid would otherwise crash XLA):
    later configs recompile what they need, from the persistent cache when it has it."""
    from paged_jax.compilation_cache import memory_mappings

    usage = memory_mappings()
    if usage is None or usage[0] < fraction * usage[1]:
        return False
    import jax

    jax.clear_caches()
    return True


# --------------------------------------------------------------------------- tables
def axes_of(rows: list[dict], grid: dict | None = None) -> list[str]:
    """The config keys that vary across ``rows`` (the grid's axes, in its order, if given)."""
    if grid is not None:
        return list(grid)
    measured = set(METRICS) | {"seed", "workload", "budget_bytes", "generated_tokens", "steps", "num_blocks",
                               "bytes_per_block", "table_bytes", "warmup_seconds"}
    keys = [k for k in rows[0] if k not in measured] if rows else []
    return [k for k in keys if len({repr(r.get(k)) for r in rows}) > 1]


def summarize(rows: list[dict], metric: str, axes: list[str] | None = None) -> list[dict]:
    """Mean and spread of ``metric`` over seeds, one dict per config (first-seen order):
    the axes' values, ``mean``, ``std`` (0 for one seed) and ``n``."""
    axes = axes_of(rows) if axes is None else axes
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(a) for a in axes), []).append(float(r[metric]))
    return [{**dict(zip(axes, key)), "mean": float(np.mean(v)), "std": float(np.std(v)), "n": len(v)}
            for key, v in groups.items()]


def headline(rows: list[dict], axes: list[str] | None = None) -> dict:
    """The best config by mean tokens/s and its ratio over the worst (same run)."""
    axes = axes_of(rows) if axes is None else axes
    means = summarize(rows, "tokens_per_s", axes)
    best = max(means, key=lambda m: m["mean"])
    worst = min(means, key=lambda m: m["mean"])
    return {
        "best_config": config_label({a: best[a] for a in axes}),
        "best_tokens_per_s": best["mean"],
        "worst_config": config_label({a: worst[a] for a in axes}),
        "worst_tokens_per_s": worst["mean"],
        "best_over_worst": best["mean"] / worst["mean"] if worst["mean"] > 0 else math.inf,
        "configs": len(means),
        "runs": len(rows),
    }


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A plain-text table of ``rows`` (default columns: the varying config keys, the seed
    and the headline metrics)."""
    if not rows:
        return "(no rows)"
    columns = columns or [*axes_of(rows), "seed", "tokens_per_s", "kv_utilization", "peak_blocks", "peak_kv_mib",
                          "preemptions", "compile_seconds", "wall_seconds"]
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def write_csv(path: str, rows: list[dict]) -> None:
    """One line per row; the columns are the union of the rows' keys, first-seen order."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


# ---------------------------------------------------------------------------- plots
def plot_metric(rows: list[dict], metric: str, ax=None, axes: list[str] | None = None):
    """``metric`` over the first axis (x), one series per combination of the others:
    lines for a numeric first axis, grouped bars otherwise; mean over seeds, the seeds'
    standard deviation as error bars. Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    axes = axes_of(rows) if axes is None else axes
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 3.6))
    stats = summarize(rows, metric, axes)
    first, others = (axes[0], axes[1:]) if axes else (None, [])
    xs = list(dict.fromkeys(s[first] for s in stats)) if first else [None]
    series = list(dict.fromkeys(tuple(s[a] for a in others) for s in stats))
    numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)
    width = 0.8 / max(len(series), 1)
    for i, key in enumerate(series):
        points = {s[first] if first else None: s for s in stats if tuple(s[a] for a in others) == key}
        pos = [j for j, x in enumerate(xs) if x in points]
        mean = [points[xs[j]]["mean"] for j in pos]
        std = [points[xs[j]]["std"] for j in pos]
        label = config_label(dict(zip(others, key))) if others else None
        if numeric:
            ax.errorbar(pos, mean, yerr=std, marker="o", capsize=3, label=label)
        else:
            ax.bar([p - 0.4 + width * (i + 0.5) for p in pos], mean, width, yerr=std, capsize=3, label=label)
    ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    ax.set_xlabel(first or "")
    ax.set_ylabel(METRICS.get(metric, metric))
    if others:
        ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    return ax


def plot_all(rows: list[dict], out_dir: str, axes: list[str], title: str) -> list[str]:
    """DIR/sweep_<metric>.png for every plotted metric; returns the paths."""
    plt = pyplot()

    paths = []
    for metric in PLOTTED:
        fig, ax = plt.subplots(figsize=(6.5, 3.6))
        plot_metric(rows, metric, ax, axes)
        ax.set_title(title, fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, f"sweep_{metric}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    print(f"wrote {len(paths)} plots in {out_dir}")
    return paths


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--grid", nargs="+", required=True, metavar="KEY=V1,V2",
                        help="axes: any LLM keyword and its values, e.g. block_size=8,16,32")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", dest="fixed",
                        help="keywords every run gets, e.g. max_num_seqs=64")
    parser.add_argument("--workload", default="sharegpt_like", choices=WORKLOADS)
    parser.add_argument("--seeds", type=int, default=1, help="workload draws per config (default 1)")
    parser.add_argument("--num-requests", type=int, default=None, help="requests per draw (default 24 quick, 128)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context (default 128 quick, 256)")
    parser.add_argument("--model", default="tiny", choices=MODELS)
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budget-blocks", type=int, default=None,
                        help=f"KV budget as N blocks of {BUDGET_BLOCK_SIZE} tokens in the model's dtype")
    budget.add_argument("--budget-bytes", type=int, default=None, help="KV budget in bytes")
    parser.add_argument("--quick", action="store_true", help="small workload and context (a smoke run)")
    parser.add_argument("--out", default="out", help="directory for sweep.csv, sweep.json and sweep_*.png")
    args = parser.parse_args(argv)
    try:
        grid = parse_grid(args.grid)
        fixed = dict(parse_assignment(t) for t in args.fixed)
        fixed = {k: v[0] if len(v) == 1 else v for k, v in fixed.items()}
        check_keywords(fixed)
    except ValueError as e:
        parser.error(str(e))
    for name in ("seeds", "num_requests", "max_model_len", "budget_blocks", "budget_bytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}={value}: must be >= 1")

    max_model_len = args.max_model_len or (128 if args.quick else 256)
    num_requests = args.num_requests or (24 if args.quick else 128)
    config = model_config(args.model, max_model_len)
    if args.budget_bytes is not None:
        budget = args.budget_bytes
    elif args.budget_blocks is not None:
        budget = blocks_budget_bytes(config, args.budget_blocks)
    else:
        budget = default_budget_bytes(config, max_model_len)
    combos = combinations(grid)
    print(f"sweep: {len(combos)} configs x {args.seeds} seeds, {num_requests} {args.workload} requests, "
          f"max_model_len {max_model_len}, model {args.model} ({config.num_params / 1e6:.1f}M params, random), "
          f"KV budget {budget / 2**20:.2f} MiB" + ("  [quick]" if args.quick else ""))
    start = time.perf_counter()
    base = {**(QUICK_BASE if args.quick else BASE), **fixed}
    rows = sweep(grid, args.workload, seeds=args.seeds, num_requests=num_requests, model=config,
                 max_model_len=max_model_len, budget_bytes=budget, base=base)
    seconds = time.perf_counter() - start
    axes = list(grid)
    print()
    print(format_table(rows))
    head = headline(rows, axes)
    print(f"\nbest: {head['best_config']} at {head['best_tokens_per_s']:.1f} tokens/s, "
          f"{head['best_over_worst']:.2f}x the worst ({head['worst_config']}); {seconds:.0f} s in all")
    os.makedirs(args.out, exist_ok=True)
    write_csv(os.path.join(args.out, "sweep.csv"), rows)
    title = (f"{args.workload}, {num_requests} requests x {args.seeds} seeds, KV {budget / 2**20:.2f} MiB, "
             f"{args.model} model" + (" [quick]" if args.quick else ""))
    plots = plot_all(rows, args.out, axes, title)
    result = {
        "study": "sweep",
        "headline": head,
        "grid": grid,
        "fixed": fixed,
        "config": {"workload": args.workload, "seeds": args.seeds, "num_requests": num_requests,
                   "max_model_len": max_model_len, "model": args.model, "model_params": config.num_params,
                   "budget_bytes": budget, "base": base, "quick": args.quick},
        "method": "one LLM per config; every seed a fresh workload draw on it (reset_stats between); greedy, "
                  "EOS ignored; tokens/s = generated / (step time - compile time); one KV byte budget "
                  "(kv_cache_memory_bytes) for every run; timings from a shared machine are noisy",
        "rows": rows,
        "plots": [os.path.basename(p) for p in plots],
        "seconds": seconds,
        "machine": machine_info(),
    }
    write_json(args.out, "sweep", result)
    return result


if __name__ == "__main__":
    main()
