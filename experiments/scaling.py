"""Beyond one device: KV capacity and communication vs tensor (t) and data (d) parallelism.

    python -m experiments scaling [--quick] [--out DIR] [--time]

Claim (the issue's targets): sharding the KV pages over their kv-head axis divides a
device's KV bytes by t (when t divides the kv heads; replicated heads divide it by the
kv-head count instead), so under a fixed per-device byte budget a replica's pool, and the
batch of full-length sequences it holds, grow t-fold, and d replicas multiply them by d;
a decode step communicates two all-reduces of ``[rows, hidden]`` per layer and never
moves a page (0 all-gathers).

Method: simulated CPU devices (``--xla_force_host_platform_device_count=8``; when this
process has fewer, the study re-runs itself in a subprocess that has them). For every
(t, d) with t x d <= 8: ``LLM(ModelConfig, tensor_parallel_size=t, data_parallel_size=d,
kv_cache_memory_bytes=<per-device budget>)`` (random weights), and from the engines
built: blocks per replica, the pages' bytes on each device (measured on the arrays),
bytes per block per device, the batch of ``max_model_len``-token sequences the pools
hold; from the optimised HLO of replica 0's decode step (``decode_rows`` rows): its
collectives (``paged_jax.parallel.hlo``: ops, executions, result bytes per device per
step; ring traffic ~ 2 (t - 1) / t of an all-reduce's bytes). Models: Llama-shaped,
8 kv heads (GQA 1:1, t up to 8) and 2 kv heads (GQA 4:1: t = 4, 8 replicate each kv head).
With ``--time`` (default on a GPU backend) each configuration also generates a batch and
reports output tokens/s and ms per step; simulated CPU devices share this machine's
cores, so CPU times say nothing about scaling and are off by default.

Workload: none for capacity (arithmetic on the built pools, no step runs); a decode
step's program is compiled once per t (replica 0 of every d shares it).

Headlines: ``kv_bytes_per_device_ratio`` (per-device bytes per block at the largest t
that divides the kv heads over t = 1's: target 1/t), ``max_batch_gain_t`` (sequences held
at that t over t = 1, same per-device budget), ``max_batch_gain_d`` (d = largest over d =
1 at t = 1), ``decode_all_gathers`` (0 is the target), ``decode_allreduce_bytes_per_layer``
(at the largest t), ``replicated_kv_bytes_ratio`` (2-kv-head model at t = 8 over t = 1:
1/2, not 1/8). Full (14 configurations): 1 min of CPU, ~4 min wall on the shared 2-core
machine; ``--quick`` (t x d <= 4 over {1, 2, 4} x {1, 2}, a tiny model): ~15 s of CPU, under a
minute wall. Writes DIR/scaling.json and DIR/scaling.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from experiments.common import machine_info, pyplot, write_json

DEVICES = 8
BLOCK_SIZE = 16
DECODE_ROWS = 8


def model_shapes(quick: bool) -> dict:
    """name -> ModelConfig (float32, random weights)."""
    from paged_jax.model import ModelConfig

    if quick:
        return {"gqa1_4kv": ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                                        num_heads=4, num_kv_heads=4, head_dim=16, max_position_embeddings=512)}
    common = dict(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8,
                  head_dim=64, max_position_embeddings=2048)
    return {"gqa1_8kv": ModelConfig(num_kv_heads=8, **common), "gqa4_2kv": ModelConfig(num_kv_heads=2, **common)}


def grid(quick: bool, name: str, cfg) -> list[tuple[int, int]]:
    """(t, d) pairs to run for one model: every t x d <= 8 (powers of two) for the
    1:1 model, d = 1 for the replicated one (its point is the kv-head layout)."""
    ts = (1, 2, 4) if quick else (1, 2, 4, 8)
    ds = (1, 2) if quick else (1, 2, 4, 8)
    if name.startswith("gqa4"):
        ds = (1,)
    devices = 4 if quick else DEVICES  # quick: the smoke's 5 configurations
    return [(t, d) for t in ts for d in ds if t * d <= devices and cfg.num_heads % t == 0]


def decode_hlo(llm) -> str:
    """Optimised HLO of replica 0's decode step at ``DECODE_ROWS`` rows (padding rows:
    the program is the one the runner compiles, no step runs)."""
    runner = llm.engine.runner
    sampling = runner.inputs.sampling([], DECODE_ROWS)
    lowered = runner._step.lower(runner.params, runner.cache_state, runner.pages,
                                 np.zeros((DECODE_ROWS, 1), np.int32), np.full(DECODE_ROWS, -1, np.int32),
                                 np.zeros(DECODE_ROWS, np.int32), sampling, None, num_top=0, prompt_top=0)
    return lowered.compile().as_text()


def pages_bytes_per_device(llm) -> list[int]:
    """Bytes of KV pages on every device of every replica."""
    import jax

    out = []
    for rep in llm.engines:
        leaves = jax.tree.leaves(rep.runner.pages)
        for device in sorted({s.device for x in leaves for s in x.addressable_shards}, key=lambda d: d.id):
            out.append(sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device))
    return out


def timed_generate(llm, cfg, rows: int, tokens: int) -> dict:
    """Output tokens/s and ms per engine step over ``rows`` requests per replica of
    ``tokens`` prompt and ``tokens`` output tokens, after an identical warm-up call."""
    from paged_jax import SamplingParams

    d = llm.data_parallel_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, tokens).tolist() for _ in range(rows * d)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    llm.reset_stats()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.stats()
    return {"tokens_per_s": stats["generated_tokens"] / seconds, "ms_per_step": 1e3 * seconds / max(stats["steps"], 1)}


def measure(name: str, cfg, t: int, d: int, budget: int, max_model_len: int, timing: bool) -> dict:
    """One configuration's row (module docstring)."""
    from paged_jax import LLM
    from paged_jax.config import blocks_for
    from paged_jax.parallel import hlo
    from paged_jax.parallel.sharding import check_model

    llm = LLM(cfg, tensor_parallel_size=t, data_parallel_size=d, kv_cache_memory_bytes=budget, block_size=BLOCK_SIZE,
              max_model_len=max_model_len, max_num_seqs=64, attention_impl="xla", dtype="float32",
              skip_tokenizer_init=True)
    per_device = pages_bytes_per_device(llm)
    blocks = llm.num_gpu_blocks  # per replica
    seq_blocks = blocks_for(max_model_len, BLOCK_SIZE)
    row = {
        "model": name, "t": t, "d": d, "devices": t * d, "kv_heads": cfg.num_kv_heads,
        "stored_kv_heads_per_device": check_model(cfg, t).stored_kv_heads // t,
        "kv_replicas": check_model(cfg, t).replicas,
        "blocks_per_replica": blocks, "blocks_total": blocks * d,
        "pages_bytes_per_device": max(per_device), "pages_bytes_per_device_min": min(per_device),
        "bytes_per_block_per_device": max(per_device) / blocks,
        "budget_per_device": budget,
        "max_batch": d * (blocks // seq_blocks),  # sequences of max_model_len held at once
        "tokens_held": blocks * d * BLOCK_SIZE,
    }
    if d == 1 or timing:
        text = decode_hlo(llm)
        s = hlo.summary(text)
        row.update({
            "decode_allreduce_ops": s["all-reduce"]["ops"], "decode_allreduce_runs": s["all-reduce"]["runs"],
            "decode_allreduce_bytes": s["all-reduce"]["bytes"],
            "decode_allreduce_ring_bytes": s["all-reduce"]["bytes"] * 2 * (t - 1) / t,
            "decode_all_gathers": s["all-gather"]["ops"],
            "decode_other_collectives": sum(s[k]["ops"] for k in ("reduce-scatter", "all-to-all",
                                                                   "collective-permute")),
            "decode_collective_bytes": s["bytes_per_call"],
        })
    if timing:
        row.update(timed_generate(llm, cfg, rows=DECODE_ROWS, tokens=32 if max_model_len < 512 else 128))
    return row


def fill_collectives(rows: list[dict]) -> None:
    """A decode step's program depends on t only (replica 0 of every d is the same
    program): copy the d = 1 figures to the other rows of the same model and t."""
    keys = [k for k in rows[0] if k.startswith("decode_")]
    by_t = {(r["model"], r["t"]): r for r in rows if r["d"] == 1}
    for r in rows:
        for k in keys:
            r.setdefault(k, by_t[(r["model"], r["t"])][k])


def headline(rows: list[dict]) -> dict:
    main_model = rows[0]["model"]
    own = [r for r in rows if r["model"] == main_model]
    base = next(r for r in own if (r["t"], r["d"]) == (1, 1))
    t_max = max(r["t"] for r in own if r["d"] == 1 and r["kv_replicas"] == 1)
    top = next(r for r in own if (r["t"], r["d"]) == (t_max, 1))
    d_max = max(r["d"] for r in own if r["t"] == 1)
    wide = next(r for r in own if (r["t"], r["d"]) == (1, d_max))
    out = {
        "largest_t": t_max,
        "kv_bytes_per_device_ratio": top["bytes_per_block_per_device"] / base["bytes_per_block_per_device"],
        "max_batch_gain_t": top["max_batch"] / max(base["max_batch"], 1),
        "largest_d": d_max,
        "max_batch_gain_d": wide["max_batch"] / max(base["max_batch"], 1),
        "decode_all_gathers": max(r["decode_all_gathers"] for r in rows),
        "decode_other_collectives": max(r["decode_other_collectives"] for r in rows),
        "decode_allreduce_bytes_per_layer": top["decode_allreduce_bytes"] / max(top["decode_allreduce_runs"] // 2, 1),
    }
    replicated = [r for r in rows if r["kv_replicas"] > 1 and r["d"] == 1]
    if replicated:
        r = max(replicated, key=lambda r: r["t"])
        one = next(x for x in rows if x["model"] == r["model"] and (x["t"], x["d"]) == (1, 1))
        out["replicated_kv_bytes_ratio"] = r["bytes_per_block_per_device"] / one["bytes_per_block_per_device"]
        out["replicated_t"] = r["t"]
    return out


def plot(rows: list[dict], out_dir: str) -> str:
    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["model"] for r in rows):
        own = sorted((r for r in rows if r["model"] == name and r["d"] == 1), key=lambda r: r["t"])
        a.plot([r["t"] for r in own], [r["bytes_per_block_per_device"] for r in own], "o-", label=name)
        b.plot([r["t"] for r in own], [r["decode_allreduce_bytes"] for r in own], "o-", label=name)
    a.set(xscale="log", yscale="log", xlabel="tensor_parallel_size t", ylabel="KV bytes per block per device",
          title="pages per device (d = 1)")
    b.set(xscale="log", xlabel="tensor_parallel_size t", ylabel="all-reduce bytes per decode step per device",
          title=f"decode step collectives ({DECODE_ROWS} rows)")
    for ax in (a, b):
        ax.set_xticks(sorted({r["t"] for r in rows}), [str(t) for t in sorted({r["t"] for r in rows})])
        ax.minorticks_off()
        ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "scaling.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_table(rows: list[dict]) -> None:
    cols = ["model", "t", "d", "stored_kv_heads_per_device", "bytes_per_block_per_device", "blocks_per_replica",
            "blocks_total", "max_batch", "decode_allreduce_ops", "decode_allreduce_bytes", "decode_all_gathers"]
    if any("tokens_per_s" in r for r in rows):
        cols += ["tokens_per_s", "ms_per_step"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r.get(c, ''):.1f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols))


def _child_main(args) -> dict:
    import jax

    timing = args.time or jax.default_backend() == "gpu"
    budget = (4 << 20) if args.quick else (64 << 20)
    max_model_len = 256 if args.quick else 1024
    rows = []
    from tqdm import tqdm

    jobs = [(name, cfg, t, d) for name, cfg in model_shapes(args.quick).items() for t, d in grid(args.quick, name, cfg)]
    for name, cfg, t, d in tqdm(jobs, desc="scaling", disable=args.quick):
        rows.append(measure(name, cfg, t, d, budget, max_model_len, timing))
    fill_collectives(rows)
    result = {
        "study": "scaling",
        "machine": machine_info(),
        "config": {"quick": args.quick, "devices": jax.device_count(), "platform": jax.default_backend(),
                   "simulated_devices": jax.default_backend() == "cpu", "budget_per_device": budget,
                   "max_model_len": max_model_len, "block_size": BLOCK_SIZE, "decode_rows": DECODE_ROWS,
                   "timing": timing,
                   "note": "shared 2-core machine; simulated CPU devices share its cores, so no times unless --time"},
        "rows": rows,
        "headline": headline(rows),
    }
    print_table(rows)
    write_json(args.out, "scaling", result)
    plot(rows, args.out)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments scaling", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small grid and model: a smoke test")
    parser.add_argument("--out", default="out", help="output directory")
    parser.add_argument("--time", action="store_true", help="also time generation (default on a GPU backend)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import jax

    if args.child or jax.device_count() >= DEVICES or jax.default_backend() != "cpu":
        return _child_main(args)
    # This process has too few CPU devices (the flag works only before JAX starts): a
    # subprocess with 8 simulated ones runs the study and writes the JSON.
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES} --xla_backend_optimization_level=0")
    cache = jax.config.jax_compilation_cache_dir
    if cache:
        env.setdefault("PAGED_JAX_COMPILATION_CACHE", cache)
    out = os.path.abspath(args.out)
    flags = ["--out", out, "--child"] + ["--quick"] * args.quick + ["--time"] * args.time
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-m", "experiments.scaling", *flags], env=env, cwd=root, check=True)
    with open(os.path.join(out, "scaling.json")) as f:
        return json.load(f)


if __name__ == "__main__":
    main()
