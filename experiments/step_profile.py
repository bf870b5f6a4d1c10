"""Where a decode step's time goes, per dtype, on a SmolLM2-135M-shaped model (random weights).

    python -m experiments step_profile [--quick] [--out DIR]

For float32 and bfloat16 (``--dtypes``):

- **peak**: a matmul microbenchmark of the step's own dot form, ``[B, 576] x [576, 1536]``
  (f32; bf16 operands with f32 accumulation, as ``model.llama`` runs them) and the tied LM
  head ``[B, 576] x [49152, 576]^T``: the machine's achievable FLOP/s per dtype.
- **decode step** (the jitted ``StepFns.decode``) at ``--batch`` rows holding ``--context``
  tokens: wall and process-CPU time; FLOPs (matmuls 2 x params x rows, attention 4 x rows x
  context x heads x head_dim x layers) and bytes (weights once, KV read); XLA's own
  ``cost_analysis``; achieved FLOP/s and its share of the matmul peak.
- **per-row cost**: the step at 8, 16, 32 and ``--batch`` rows; the **padding waste** of
  power-of-two decode buckets = mean over 1..batch live rows of the time spent on padding
  rows (interpolating the measured curve), vs buckets in multiples of 8.
- **prefill**: one prefill call of 4 rows x 128 tokens: tokens/s vs decode's.
- **what the rest is**: the step at ``--batch`` rows without attention's reads
  (``experiments/lib/ablations.py``: zeros for attention's output; the K/V writes stay),
  its matmul FLOPs per second against the peak; the machine's streaming bandwidth (a
  jitted sum over a 512 MiB array, too big for any cache); and the **floor** those
  give: the matmuls at the peak plus the KV reads at that bandwidth (weights streamed
  from memory overlap the matmuls at best, so ``max(matmul time at peak, weight bytes at
  bandwidth)``).
- **host share**: an ``LLM`` decoding ``--batch`` prompts; its decode-only engine steps
  (``stats.timeline``) vs the bare step at the same rows: what scheduling, Python and the
  one fetch add.

Timings on a shared 2-core machine are noisy: each is the minimum (and median) of several
repetitions, and CPU time is reported beside wall time. Writes DIR/step_profile.json.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import machine_info, print_headline, write_json

SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
            num_kv_heads=3, head_dim=64, rope_theta=1e5, rms_norm_eps=1e-5, max_position_embeddings=8192,
            tie_word_embeddings=True)


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m experiments step_profile", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a 4-layer model, batch 8, float32 only")
    p.add_argument("--out", default="out")
    p.add_argument("--dtypes", default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    args = p.parse_args(argv)
    args.dtypes = (args.dtypes or ("float32" if args.quick else "float32,bfloat16")).split(",")
    args.batch = args.batch or (8 if args.quick else 64)
    args.context = args.context or (32 if args.quick else 200)
    args.reps = args.reps or (2 if args.quick else 5)
    return args


def model_config(quick: bool, dtype: str):
    from paged_jax.model import ModelConfig

    return ModelConfig(**{**SMOL, "num_layers": 4 if quick else 30}, dtype=dtype)


def _time(fn, reps: int, inner: int = 1) -> dict:
    """min/median wall and process-CPU seconds of ``fn()`` (blocked on) after one warm-up,
    per call. A measurement is ``inner`` calls one after another (each blocked on, so they
    never overlap), its time divided by ``inner``: a sub-millisecond op's CPU time alone is
    below the process clock's accounting grain (a 0.4 ms bf16 dot read as 0.07 ms of CPU).
    Dispatching them all before blocking instead let XLA:CPU run several at once, which
    measured 135-151 vs 170-178 GFLOP/s for the fp32 dot here: contention, not the dot."""
    jax.block_until_ready(fn())
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(inner):
            jax.block_until_ready(fn())
        wall.append((time.perf_counter() - t0) / inner)
        cpu.append((time.process_time() - c0) / inner)
    return {"wall_s": min(wall), "wall_median_s": float(np.median(wall)), "cpu_s": min(cpu),
            "cpu_median_s": float(np.median(cpu))}


def matmul_peak(dtype: str, rows: int, reps: int) -> dict:
    """FLOP/s of the model's dot forms at ``rows`` (see the module docstring)."""
    d = jnp.dtype(dtype)
    out = {}
    for name, (k, n, transposed) in {"mlp": (576, 1536, False), "head": (576, 49152, True)}.items():
        x = jnp.ones((rows, k), d)
        w = jnp.ones((n, k) if transposed else (k, n), d)
        dims = (((1,), (1 if transposed else 0,)), ((), ()))
        f = jax.jit(lambda x, w, dims=dims: jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32))
        t = _time(lambda f=f, x=x, w=w: f(x, w), 2 * reps, inner=1 if name == "head" else 50)  # >= ~20 ms each
        out[name] = {**t, "gflop_per_s": 2 * rows * k * n / t["wall_s"] / 1e9}
    return out


def memory_bandwidth(reps: int, mib: int = 512) -> dict:
    """GB/s of a jitted f32 sum over ``mib`` MiB: one streaming read, bigger than any cache."""
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    t = _time(lambda: f(x), 2 * reps)
    return {**t, "bytes": x.nbytes, "gb_per_s": x.nbytes / t["wall_s"] / 1e9}


def time_budget(fb: dict, step_s: float, no_attention_s: float, peak_flop_per_s: float, bandwidth: float) -> dict:
    """The step's time against its floor on this machine (seconds; shares of the step).

    ``fb``: ``step_flops_bytes``; ``bandwidth``: bytes/s. The floor: the matmuls at the
    microbenchmark's FLOP/s or the weights streamed at ``bandwidth`` (whichever is longer:
    they overlap at best), plus the KV read at ``bandwidth`` (attention's FLOPs are few)."""
    matmul_s, weights_s = fb["matmul_flops"] / peak_flop_per_s, fb["weight_bytes"] / bandwidth
    kv_s = fb["kv_read_bytes"] / bandwidth
    floor = max(matmul_s, weights_s) + kv_s
    return {"matmul_at_peak_s": matmul_s, "weights_at_bandwidth_s": weights_s, "kv_read_at_bandwidth_s": kv_s,
            "floor_s": floor, "step_over_floor": step_s / floor,
            "attention_s": step_s - no_attention_s, "attention_share": 1 - no_attention_s / step_s,
            "attention_over_kv_read_at_bandwidth": (step_s - no_attention_s) / kv_s,
            "no_attention_share_of_matmul_peak": fb["matmul_flops"] / no_attention_s / peak_flop_per_s}


def step_flops_bytes(cfg, rows: int, context: int) -> dict:
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer_params = h * q + 2 * h * kv + q * h + 3 * h * i
    matmul_params = layers * layer_params + h * cfg.vocab_size
    itemsize = jnp.dtype(cfg.jnp_dtype).itemsize
    attn = 4 * rows * context * cfg.num_heads * cfg.head_dim * layers
    return {"flops": 2 * matmul_params * rows + attn, "matmul_flops": 2 * matmul_params * rows, "attention_flops": attn,
            "weight_bytes": (matmul_params + layers * 2 * h) * itemsize,
            "kv_read_bytes": rows * context * layers * 2 * kv * itemsize}


class _Decode:
    """A jitted decode step at ``rows`` rows each holding ``context`` tokens, re-run in place."""

    def __init__(self, cfg, params, rows: int, context: int, attention_impl: str = "auto"):
        from experiments.lib import steps as lib_steps
        from paged_jax.config import CacheConfig
        from paged_jax.steps import init_pages_for, make_step_fns

        per = context // 16 + 4
        self.cc = CacheConfig(num_blocks=rows * per, block_size=16, max_seqs=rows, max_blocks_per_seq=per)
        self.fns = make_step_fns(cfg, attention_impl=attention_impl)
        self.params = params
        self.state = lib_steps.filled_state(self.cc, "lifo", rows, context)
        self.pages = init_pages_for(cfg, self.cc)
        self.ids = jnp.arange(rows, dtype=jnp.int32)
        self.tok = jnp.ones((rows,), jnp.int32)
        self.first = None

    def __call__(self):
        t0 = time.perf_counter()
        logits, self.state, self.pages, _ = self.fns.decode(self.params, self.state, self.pages, self.tok, self.ids)
        if self.first is None:
            jax.block_until_ready(logits)
            self.first = time.perf_counter() - t0
        return logits

    def cost(self) -> dict:
        compiled = self.fns.decode.lower(self.params, self.state, self.pages, self.tok, self.ids).compile()
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, list) else ca
        return {"xla_flops": float(ca.get("flops", 0.0)), "xla_bytes_accessed": float(ca.get("bytes accessed", 0.0))}


def _prefill_time(cfg, params, reps: int, rows: int = 4, length: int = 128) -> dict:
    from paged_jax.cache import init_state, open_sequences
    from paged_jax.config import CacheConfig
    from paged_jax.steps import init_pages_for, make_step_fns

    per = length // 16 + 1
    cc = CacheConfig(num_blocks=rows * per * (reps + 2), block_size=16, max_seqs=rows * (reps + 2), max_blocks_per_seq=per)
    fns = make_step_fns(cfg)
    box = {"state": init_state(cc), "pages": init_pages_for(cfg, cc), "next": 0}
    tokens = jnp.ones((rows, length), jnp.int32)
    counts = jnp.full((rows,), length, jnp.int32)

    def once():  # fresh rows each call (a prefill appends to empty rows)
        ids = jnp.arange(box["next"], box["next"] + rows, dtype=jnp.int32)
        box["next"] += rows
        state, _ = open_sequences(box["state"], ids)
        logits, box["state"], box["pages"], _ = fns.prefill(params, state, box["pages"], tokens, ids, counts)
        return logits

    t = _time(once, reps)
    return {**t, "rows": rows, "length": length, "tokens_per_s": rows * length / t["wall_s"]}


def _host_share(cfg, rows: int, context: int, new_tokens: int, bare: dict) -> dict:
    """An LLM decoding ``rows`` prompts of ``context`` tokens: its decode-only steps at ``rows``
    against the bare step's timing ``bare`` (``_time``'s dict), median to median and min to min
    (a median against a min read the machine's noise as host work)."""
    from paged_jax import LLM, SamplingParams

    llm = LLM(cfg, seed=0, max_model_len=context + new_tokens + 16, max_num_seqs=rows)
    prompts = [[1 + (i * 7 + j) % 1000 for j in range(context)] for i in range(rows)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # compiles
    llm.reset_stats()
    llm.generate(prompts, params, use_tqdm=False)
    rows_t = llm.engine.stats.timeline
    ends = np.array([r.end_seconds for r in rows_t])
    durs = np.diff(np.concatenate([[0.0], ends]))
    decode = [d for d, r in zip(durs, rows_t) if r.prefilled == 0 and r.batch == rows and r.compile_seconds == 0]
    step = float(np.median(decode)) if decode else float("nan")
    step_min = float(np.min(decode)) if decode else float("nan")
    phases = llm.stats()["phase_seconds"]
    total = sum(phases.values())
    return {"engine_decode_step_s": step, "engine_decode_step_min_s": step_min,
            "bare_step_s": bare["wall_median_s"], "bare_step_min_s": bare["wall_s"], "decode_steps": len(decode),
            "host_share_vs_bare_step": (step - bare["wall_median_s"]) / step if decode else None,
            "host_share_vs_bare_step_min": (step_min - bare["wall_s"]) / step_min if decode else None,
            "phase_seconds": phases,
            # schedule + update: host-only phases of every step (the run phase holds host work too)
            "host_phase_share": (total - phases.get("run", 0.0)) / total if total else None}


def derive(results: dict) -> dict:
    """CPU-time versions of the shares (``results[dtype]`` as ``main`` builds them): on a
    shared machine a process's wall time includes waiting for a core; its CPU time does not.
    FLOPs per CPU-second of the step over those of the matmul microbenchmark."""
    out = {}
    for dtype, r in results.items():
        d, mm = r["decode"], r["matmul_peak"]["mlp"]
        mm_flops = 2 * r["config_rows"] * 576 * 1536
        step_rate, mm_rate = d["flops"] / d["cpu_s"], mm_flops / mm["cpu_s"]
        out[dtype] = {"flops_per_cpu_s": step_rate, "matmul_flops_per_cpu_s": mm_rate,
                      "share_of_matmul_peak_cpu": step_rate / mm_rate,
                      "wall_over_cpu": d["wall_s"] / d["cpu_s"]}
    return out


def _padding_waste(times: dict[int, float], batch: int) -> dict:
    """Mean share of decode time spent on padding rows over 1..batch live rows."""
    xs = sorted(times)
    ys = np.maximum.accumulate([times[x] for x in xs])  # more rows never cost less: noise out
    t = lambda r: float(np.interp(r, xs, ys))  # noqa: E731
    pow2 = lambda r: max(8, 1 << (r - 1).bit_length())  # noqa: E731
    mult8 = lambda r: -(-r // 8) * 8  # noqa: E731
    waste = {}
    for name, bucket in (("pow2_from_8", pow2), ("multiples_of_8", mult8)):
        shares = [(t(min(bucket(r), batch)) - t(max(r, xs[0]))) / t(min(bucket(r), batch)) for r in range(1, batch + 1)]
        waste[name] = float(np.mean(shares))
    return waste


def main(argv=None) -> dict:
    args = _parse(argv)
    from experiments.lib import ablations
    from paged_jax.model import init_params
    from paged_jax.model.llama import pack_params

    no_attention = ablations.register()
    print("memory bandwidth ...", flush=True)
    bandwidth = memory_bandwidth(args.reps, mib=64 if args.quick else 512)
    results = {}
    for dtype in args.dtypes:
        cfg = model_config(args.quick, dtype)
        params = pack_params(init_params(cfg, 0)[1])
        print(f"{dtype}: matmul peak ...", flush=True)
        peak = matmul_peak(dtype, args.batch, args.reps)
        print(f"{dtype}: decode steps ...", flush=True)
        curve, main_step = {}, None
        for rows in sorted({8, 16, 32, args.batch} if not args.quick else {4, args.batch}):
            step = _Decode(cfg, params, rows, args.context)
            t = _time(step, args.reps)
            curve[rows] = t
            if rows == args.batch:
                main_step = (step, t)
        step, t = main_step
        t_none = _time(_Decode(cfg, params, args.batch, args.context, no_attention), args.reps)
        fb = step_flops_bytes(cfg, args.batch, args.context)
        achieved = fb["flops"] / t["wall_s"]
        peak_flops = peak["mlp"]["gflop_per_s"] * 1e9
        print(f"{dtype}: prefill and engine ...", flush=True)
        prefill = _prefill_time(cfg, params, args.reps)
        host = _host_share(cfg, args.batch, args.context, 8 if args.quick else 24, t)
        results[dtype] = {
            "matmul_peak": peak, "decode": {**t, "first_call_s": step.first, **fb, **step.cost(),
                                            "achieved_gflop_per_s": achieved / 1e9,
                                            "share_of_matmul_peak": achieved / peak_flops,
                                            "weight_gb_per_s": fb["weight_bytes"] / t["wall_s"] / 1e9},
            "per_rows": {str(r): v for r, v in curve.items()},
            "per_row_ms": {str(r): v["wall_s"] / r * 1e3 for r, v in curve.items()},
            "padding_waste": _padding_waste({r: v["wall_s"] for r, v in curve.items()}, args.batch),
            "prefill": prefill, "prefill_over_decode_tokens_per_s": prefill["tokens_per_s"] / (args.batch / t["wall_s"]),
            "prefill_over_decode_tokens_per_cpu_s": (prefill["rows"] * prefill["length"] / prefill["cpu_s"])
            / (args.batch / t["cpu_s"]),
            "host": host, "config_rows": args.batch,
            "no_attention": t_none,
            "budget": time_budget(fb, t["wall_s"], t_none["wall_s"], peak_flops, bandwidth["gb_per_s"] * 1e9),
        }
        results[dtype]["cpu_basis"] = derive({dtype: results[dtype]})[dtype]
        d = results[dtype]["decode"]
        print(f"  decode {args.batch} rows: {t['wall_s'] * 1e3:.0f} ms wall ({t['cpu_s'] * 1e3:.0f} ms CPU), "
              f"{d['achieved_gflop_per_s']:.0f} GFLOP/s = {d['share_of_matmul_peak']:.0%} of the matmul peak "
              f"{peak['mlp']['gflop_per_s']:.0f} ({results[dtype]['cpu_basis']['share_of_matmul_peak_cpu']:.0%} per "
              f"CPU-second); host phases {host['host_phase_share']:.1%} of an engine step", flush=True)
        b = results[dtype]["budget"]
        print(f"  without attention's reads {t_none['wall_s'] * 1e3:.0f} ms ({b['no_attention_share_of_matmul_peak']:.0%} "
              f"of the peak); attention {b['attention_share']:.0%} of the step, {b['attention_over_kv_read_at_bandwidth']:.1f}x "
              f"its KV read at {bandwidth['gb_per_s']:.1f} GB/s; floor {b['floor_s'] * 1e3:.0f} ms (matmuls at peak "
              f"{b['matmul_at_peak_s'] * 1e3:.0f}, weights at bandwidth {b['weights_at_bandwidth_s'] * 1e3:.0f}, KV "
              f"{b['kv_read_at_bandwidth_s'] * 1e3:.0f}): step / floor {b['step_over_floor']:.2f}", flush=True)
    head = {}
    for dtype, r in results.items():
        s = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
        head[f"{s}_decode_step_ms"] = r["decode"]["wall_s"] * 1e3
        head[f"{s}_share_of_matmul_peak"] = r["decode"]["share_of_matmul_peak"]
        head[f"{s}_matmul_peak_gflop_per_s"] = r["matmul_peak"]["mlp"]["gflop_per_s"]
        head[f"{s}_share_of_matmul_peak_cpu"] = r["cpu_basis"]["share_of_matmul_peak_cpu"]
        head[f"{s}_host_phase_share"] = r["host"]["host_phase_share"]
        head[f"{s}_host_share_vs_bare_step"] = r["host"]["host_share_vs_bare_step"]
        head[f"{s}_host_share_vs_bare_step_min"] = r["host"]["host_share_vs_bare_step_min"]
        head[f"{s}_padding_waste_pow2"] = r["padding_waste"]["pow2_from_8"]
        head[f"{s}_attention_share"] = r["budget"]["attention_share"]
        head[f"{s}_no_attention_share_of_matmul_peak"] = r["budget"]["no_attention_share_of_matmul_peak"]
        head[f"{s}_step_over_floor"] = r["budget"]["step_over_floor"]
    if "float32" in results and "bfloat16" in results:
        head["bf16_over_fp32_decode_speedup"] = results["float32"]["decode"]["wall_s"] / results["bfloat16"]["decode"]["wall_s"]
        head["bf16_over_fp32_decode_speedup_cpu"] = (results["float32"]["decode"]["cpu_s"]
                                                     / results["bfloat16"]["decode"]["cpu_s"])
    head["memory_gb_per_s"] = bandwidth["gb_per_s"]
    print_headline(head)
    out = {"study": "step_profile", "config": vars(args), "machine": machine_info(), "memory_bandwidth": bandwidth,
           "results": results,
           "headline": head, "note": "wall figures (share_of_matmul_peak: step FLOPs per wall second over the matmul microbenchmark's) hold on a quiet machine; cpu_basis figures (per CPU-second) are what other jobs disturb least"}
    write_json(args.out, "step_profile", out)
    return out


if __name__ == "__main__":
    main()
