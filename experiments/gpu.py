"""Everything worth measuring on a GPU, in one command that ends within 8 minutes (one H200).

    python -m experiments gpu [--quick] [--out DIR] [--budget-s 400]
    scripts/gpu_check.sh     # prints nvidia-smi, jax and its devices, then runs this into out/gpu

Three parts run in order, on a GPU each in a process of its own (a crash or a hang loses
that part only; ``--quick`` runs them in this process unless ``--isolate``), under a time
budget: seconds a part leaves unused pass to the next, a part that runs
out stops early and says what it skipped, and a part with too little time left is skipped
with a note. Each part writes its JSON as it goes; DIR/gpu.json gathers them with the
environment and a flat headline.

1. **kernels** (DIR/gpu_kernels.json): correctness at the shapes real models use. Every
   Pallas kernel (``pallas_kernels/decode.py``, ``chunk.py``) through ``paged_jax.attention``'s
   "pallas" implementation against its "reference" (``kernel_check.contract_checks``): bf16
   (tolerance 2e-2 of the output's max) and fp32 (1e-4), head_dim 64 and 128, GQA 4:1 and
   8:1, block sizes 16/32/64, contexts up to 32k with rows of 0, 1 and a block multiple of
   tokens, decode and 16-query chunks, int8 / int8_channel / fp8_e4m3 pages, layer-stacked
   pages read at a traced layer (as the model's scan calls them).
2. **kernel_bench** (DIR/kernel_bench.json): ``experiments/kernel_bench.py`` against the
   physical limit and against JAX: the device's copy bandwidth (a large device-to-device
   copy), our decode kernel's achieved GB/s of KV reads as a share of it, and its time
   against JAX's shipped Pallas ``paged_attention`` (``jax.experimental.pallas.ops.gpu``,
   where it imports) at the shapes both take, plus contiguous attention and the XLA oracle.
3. **throughput** (DIR/gpu_throughput.json, .png): ``experiments/throughput.py``'s paged-vs-
   static comparison (its step loop, step-time curve and plot) on a Llama-3.2-1B-shaped
   model (16 layers, d=2048, 32 q / 8 kv heads of 64, MLP 8192, vocab 128256, tied
   embeddings) in bf16 with random weights, at GPU-sized budgets (``GPU_THROUGHPUT``):
   ShareGPT-like requests at max_model_len 2048, a KV pool where the static engine fits
   ``static_seqs`` sequences, up to 256 running; attention "pallas" if part 1 passed on
   the GPU, else "xla" (said in the JSON).

The environment (gpu.json "environment"): jax / jaxlib versions, devices, device kind,
compute capability and memory, which Pallas GPU backends this JAX provides (Triton,
Mosaic GPU; JAX 0.11 deprecates Triton) and which one compiled each kernel (read off the
lowered program: ``pallas_kernels`` asks for Triton through ``triton.CompilerParams``), the
deprecation warnings seen, and whether the shipped kernel imports. Anything unavailable is
recorded with its error and the run goes on.

Without a GPU, ``--quick`` runs every part as a smoke (tiny shapes, the kernels in
interpret mode, a 2-layer model): 85-150 s on the shared 2-core CPU (compiles dominate;
the test trims the parts to ~8 s of CPU time); without ``--quick`` it says there is no GPU
and runs the smoke. The full run is sized for one H200: the parts' shares of the 400 s
budget are ``SHARES``; none of it has run on a GPU yet.

Headline: ``kernel_checks_ok`` / ``kernel_checks_run``, ``kernel_max_err_bf16``,
``kernel_max_err_fp32``, ``pallas_backend``, ``copy_bandwidth_gbps``,
``best_pct_copy_bw`` and ``min_pct_copy_bw_ctx_ge_4096`` (decode kernel), ``min_speedup_vs_shipped``,
``throughput_ratio``, ``batch_ratio``, ``paged_tokens_per_s``, ``static_tokens_per_s``,
``parts_completed``, ``device``, ``jax``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time

PARTS = ("kernels", "kernel_bench", "throughput")
BUDGET_S = 400.0  # the whole run; gpu_check.sh adds ~20-40 s around it (interpreter checks, nvidia-smi)
SHARES = {"kernels": 100.0, "kernel_bench": 130.0, "throughput": 170.0}  # seconds; unused time passes on
QUICK_SHARES = {"kernels": 60.0, "kernel_bench": 60.0, "throughput": 60.0}
MIN_PART_S = 20.0  # a part given less is skipped
GRACE_S = 20.0  # an isolated part is killed this long after its budget
FILES = {"kernels": "gpu_kernels.json", "kernel_bench": "kernel_bench.json", "throughput": "gpu_throughput.json"}
# Engine and workload of the throughput part (ShareGPT-like requests, EOS ignored, greedy).
# Decode rows in powers of two: each size is a program that costs seconds to compile, and
# a padding row is nearly free on a GPU at these batches (reading the weights dominates).
GPU_THROUGHPUT = dict(max_model_len=2048, static_seqs=32, max_num_seqs=256, max_num_batched_tokens=1024,
                      num_requests=384, decode_buckets=(16, 32, 64, 128, 256), curve_batches=(8, 64, 256))
SMOKE_THROUGHPUT = dict(max_model_len=256, static_seqs=4, max_num_seqs=32, max_num_batched_tokens=128,
                        num_requests=24, decode_buckets=(8, 16, 32), curve_batches=(8,))


# ------------------------------------------------------------------------ environment
def on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def environment() -> dict:
    """Versions, devices and the Pallas backends this JAX offers (errors recorded)."""
    from importlib import metadata

    import jax

    from experiments.common import machine_info

    env: dict = {"machine": machine_info(), "jax": jax.__version__, "backend": jax.default_backend()}
    for name in ("jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "triton"):
        try:
            env[f"{name}_version"] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[f"{name}_version"] = None
    devices = []
    for d in jax.devices():
        info = {"platform": d.platform, "kind": getattr(d, "device_kind", "?"),
                "compute_capability": getattr(d, "compute_capability", None)}
        try:
            info["bytes_limit"] = (d.memory_stats() or {}).get("bytes_limit")
        except Exception:  # memory_stats is optional per backend
            info["bytes_limit"] = None
        devices.append(info)
    env["devices"] = devices
    env["device_kind"] = devices[0]["kind"] if devices else None
    env["pallas"] = pallas_backends()
    return env


def pallas_backends() -> dict:
    """Which Pallas GPU backends import here, what ``pallas_call`` picks when a kernel
    names no backend, and what ``pallas_kernels`` asks for."""
    import importlib
    import warnings

    import jax

    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for label, module in (("triton", "jax.experimental.pallas.triton"),
                              ("mosaic_gpu", "jax.experimental.pallas.mosaic_gpu"),
                              ("shipped_paged_attention", "jax.experimental.pallas.ops.gpu.paged_attention")):
            try:
                importlib.import_module(module)
                out[label] = "available"
            except Exception as e:  # the backend is missing or broken here: say so, go on
                out[label] = f"unavailable: {type(e).__name__}: {str(e)[:200]}"
        try:
            from pallas_kernels import decode

            out["pallas_kernels_compiler_params"] = f"{decode.plgpu.__name__}.CompilerParams"
        except Exception as e:
            out["pallas_kernels_compiler_params"] = f"unavailable: {type(e).__name__}: {str(e)[:200]}"
        try:
            from paged_jax.attention import mosaic

            out["mosaic_gpu_kernel"] = mosaic.missing() or "available"
        except Exception as e:
            out["mosaic_gpu_kernel"] = f"unavailable: {type(e).__name__}: {str(e)[:200]}"
    flag = getattr(jax.config, "jax_pallas_use_mosaic_gpu", None)
    out["default_without_compiler_params"] = (
        None if flag is None else ("mosaic_gpu" if getattr(flag, "value", flag) else "triton"))
    out["import_warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught})
    return out


def write(out_dir: str, name: str, data: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
    return path


# ------------------------------------------------------------------------------ parts
def part_kernels(out_dir: str, quick: bool, deadline: float, **_) -> dict:
    """Part 1: ``kernel_check.contract_checks`` through "pallas" (interpret mode off the GPU)."""
    from experiments import kernel_check

    impl = "pallas" if on_gpu() else "pallas_interpret"
    print(f"kernels: every Pallas kernel vs the reference through paged_jax.attention (impl {impl!r})", flush=True)

    def save(rows):
        write(out_dir, FILES["kernels"], {"impl": impl, "rows": rows, "partial": True})

    result = kernel_check.contract_checks(impl, quick, deadline, on_row=save)
    rows = result["rows"]

    def max_err(dtype):
        errs = [r["err"] for r in rows if r["dtype"] == dtype and r["kv_format"] == "auto" and r.get("err") is not None]
        return max(errs) if errs else None

    # The Mosaic GPU kernel through "mosaic_gpu" (Hopper; off the GPU in interpret mode, one case).
    from paged_jax.attention import mosaic

    missing = mosaic.missing()
    if missing is None:
        print("kernels: the Mosaic GPU kernel (impl 'mosaic_gpu')" + ("" if on_gpu() else ", interpret mode, one case"),
              flush=True)
        result["mosaic"] = kernel_check.contract_checks("mosaic_gpu", quick, deadline,
                                                        limit=None if on_gpu() else 1)
    else:
        result["mosaic"] = {"rows": [], "skipped_reason": missing}
    result.update(
        impl=impl,
        partial=False,
        checks_run=len(rows),
        checks_ok=sum(r["ok"] for r in rows),
        max_err_bf16=max_err("bfloat16"),
        max_err_fp32=max_err("float32"),
        warnings=sorted({w for r in rows for w in r["warnings"]}),
    )
    write(out_dir, FILES["kernels"], result)
    return result


def part_kernel_bench(out_dir: str, quick: bool, deadline: float, **_) -> dict:
    """Part 2: ``kernel_bench.main``; its sweep gets the budget less a margin for the
    checks before it and the quantised formats after it."""
    from experiments import kernel_bench

    sweep_s = max(5.0, deadline - time.perf_counter() - (15.0 if quick else 60.0))
    argv = ["--out", out_dir, "--budget-s", f"{sweep_s:.0f}"] + (["--quick"] if quick else [])
    print(f"kernel_bench {' '.join(argv)}", flush=True)
    return kernel_bench.main(argv)


class OutOfTime(Exception):
    """The throughput part's budget ran out between two engine steps."""


def stop_at(llm, deadline: float) -> None:
    """Make ``llm``'s engine raise ``OutOfTime`` at its first step past ``deadline``."""
    step = llm.engine.step

    def step_unless_late(*args, **kwargs):
        if time.perf_counter() > deadline:
            raise OutOfTime
        return step(*args, **kwargs)

    llm.engine.step = step_unless_late


def throughput_model(quick: bool, max_model_len: int):
    """Llama-3.2-1B's shape in bf16 (random weights); ``quick``: the 2-layer stand-in."""
    from experiments.lib import models

    if quick:
        return models.one_b(quick=True).replace(max_position_embeddings=max_model_len)
    return models.one_b(quick=False).replace(dtype="bfloat16", max_position_embeddings=max_model_len)


def params_label(config) -> str:
    n = config.num_params
    return f"{n / 1e9:.2f}B-param" if n >= 1e9 else f"{n / 1e6:.1f}M-param"


def part_throughput(out_dir: str, quick: bool, deadline: float, attention: str = "xla", **_) -> dict:
    """Part 3: paged vs static engines on the 1B shape, stepped in turn (``comparison.run_interleaved``)."""
    from experiments.lib import comparison, timing
    from paged_jax.config import blocks_for
    from paged_jax.engine import LLM, SamplingParams
    from paged_jax.engine.stats import StepRecord
    from paged_jax.workloads import describe, sharegpt_like

    size = SMOKE_THROUGHPUT if quick else GPU_THROUGHPUT
    max_len = size["max_model_len"]
    config = throughput_model(quick, max_len)
    requests = sharegpt_like(size["num_requests"], max_model_len=max_len, vocab_size=config.vocab_size, seed=0)
    workload = describe(requests)
    bs = comparison.BLOCK_SIZE
    num_blocks = size["static_seqs"] * blocks_for(max_len, bs)
    result: dict = {
        "attention_impl": attention,
        "model": {"layers": config.num_layers, "hidden": config.hidden_size, "heads": config.num_heads,
                  "kv_heads": config.num_kv_heads, "head_dim": config.head_dim, "intermediate": config.intermediate_size,
                  "vocab": config.vocab_size, "params": config.num_params, "dtype": config.dtype,
                  "kv_bytes_per_token": config.kv_bytes_per_token(), "weights": "random (seed 0)"},
        "workload": {"kind": "sharegpt_like", "seed": 0, "max_model_len": max_len, **workload},
        "budget": {**size, "block_size": bs, "num_blocks": num_blocks,
                   "bytes": num_blocks * bs * config.kv_bytes_per_token()},
        "partial": True,
    }
    print(f"throughput: {params_label(config)} {config.dtype} model, attention {attention!r}, "
          f"{len(requests)} requests, pool {num_blocks} blocks ({result['budget']['bytes'] / 2**30:.2f} GiB)",
          flush=True)
    mean_ctx = int(workload["mean_prompt"] + workload["mean_output"] / 2)
    start = time.perf_counter()
    result["step_time_vs_batch"] = (timing.step_curve(config, list(size["curve_batches"]), [mean_ctx], max_len,
                                                      attention) if size["curve_batches"] else [])
    result["step_curve_seconds"] = time.perf_counter() - start
    for row in result["step_time_vs_batch"]:
        print(f"  decode step, batch {row['batch']:4d}, context {row['context']}: {row['step_ms']:.2f} ms "
              f"({row['tokens_per_s']:.0f} tokens/s)", flush=True)
    write(out_dir, FILES["throughput"], result)

    engines = {kind: LLM(config, block_size=bs, num_gpu_blocks=num_blocks, max_num_seqs=size["max_num_seqs"],
                         max_model_len=max_len, max_num_batched_tokens=size["max_num_batched_tokens"],
                         admission_lookahead=bs, kv_cache=kind, attention_impl=attention,
                         decode_buckets=size["decode_buckets"], seed=0)
               for kind in ("paged", "static")}
    # A few other requests first, untimed: the engines' fixed first-call costs (bookkeeping
    # programs, the first buckets) stay out of the measured run; later compiles are
    # excluded from tokens/s by the stats themselves.
    warmup = sharegpt_like(8, max_model_len=max_len, vocab_size=config.vocab_size, seed=1)
    start = time.perf_counter()
    for llm in engines.values():
        llm.generate([list(r.prompt_token_ids) for r in warmup],
                     [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in warmup],
                     use_tqdm=False)
        llm.reset_stats()
        stop_at(llm, deadline)
    result["warmup_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    try:
        outputs = comparison.run_interleaved(engines, requests)
        result["outputs_identical"] = outputs["paged"] == outputs["static"]
        result["partial"] = False
    except OutOfTime:
        result["stopped"] = "time budget: both engines stopped before the workload finished"
    result["run_seconds"] = time.perf_counter() - start
    total = sum(r.max_tokens for r in requests)
    timelines = {}
    for kind, llm in engines.items():
        stats = llm.stats()
        stats.pop("request_peak_blocks", None)
        stats["fraction_generated"] = stats["generated_tokens"] / total
        result[kind] = stats
        timelines[kind] = {**stats, "timeline": {name: list(col) for name, col in
                                                 zip(StepRecord._fields, zip(*llm.engine.stats.timeline))}}
    paged, static = result["paged"], result["static"]

    def ratio(key):  # None when the run stopped before the static engine got anywhere
        return paged[key] / static[key] if static[key] > 0 else None

    result["headline"] = {
        "throughput_ratio": ratio("tokens_per_s_excl_compile"),
        "batch_ratio": ratio("mean_running_batch"),
        "paged_tokens_per_s": paged["tokens_per_s_excl_compile"],
        "static_tokens_per_s": static["tokens_per_s_excl_compile"],
        "paged_kv_utilization": paged["kv_utilization"],
        "static_kv_utilization": static["kv_utilization"],
    }
    tput_ratio = result["headline"]["throughput_ratio"]
    print(f"  paged {paged['tokens_per_s_excl_compile']:.0f} tokens/s (batch {paged['mean_running_batch']:.1f}), "
          f"static {static['tokens_per_s_excl_compile']:.0f} tokens/s (batch {static['mean_running_batch']:.1f}): "
          + ("no ratio" if tput_ratio is None else f"{tput_ratio:.2f}x")
          + (" [stopped early]" if result["partial"] else ""), flush=True)
    if all(t["timeline"].get("end_seconds") for t in timelines.values()):
        comparison.plot_timelines(os.path.join(out_dir, "gpu_throughput.png"), timelines,
                                  f"{params_label(config)} {config.dtype} model, {len(requests)} ShareGPT-like "
                                  f"requests, max_model_len {max_len}, {num_blocks}-block pool, attention {attention}")
    write(out_dir, FILES["throughput"], result)
    return result


PART_FNS = {"kernels": part_kernels, "kernel_bench": part_kernel_bench, "throughput": part_throughput}


# ---------------------------------------------------------------------------- running
def run_inline(name: str, out_dir: str, quick: bool, budget: float, attention: str) -> dict:
    """A part in this process; an exception is recorded, not raised."""
    try:
        return PART_FNS[name](out_dir, quick, time.perf_counter() + budget, attention=attention)
    except Exception as e:  # one part must not lose the others
        return {"error": f"{type(e).__name__}: {str(e)[:600]}"}


def run_child(cmd: list[str], timeout: float) -> tuple[int | None, str]:
    """Run ``cmd`` echoing its output; kill its process group after ``timeout`` seconds.
    Returns (exit code or None if killed, the last lines of its output)."""
    tail: collections.deque = collections.deque(maxlen=40)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def pump():
        for line in proc.stdout:
            print(line, end="", flush=True)
            tail.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the part's own process group (start_new_session)
        proc.wait()
        reader.join(timeout=5)
        return None, "".join(tail)
    reader.join(timeout=5)
    return proc.returncode, "".join(tail)


def run_isolated(name: str, out_dir: str, quick: bool, budget: float, attention: str) -> dict:
    """A part in a child process (``--part``); its JSON file is the result."""
    cmd = [sys.executable, "-m", "experiments.gpu", "--part", name, "--out", out_dir, "--budget-s", f"{budget:.1f}",
           "--attention", attention] + (["--quick"] if quick else [])
    path = os.path.join(out_dir, FILES[name])
    if os.path.exists(path):
        os.remove(path)  # an old run's file must not pass for this one's
    code, tail = run_child(cmd, budget + GRACE_S)
    result = {}
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
    if code != 0:
        result["error"] = ("killed: past its budget" if code is None else f"exit code {code}") + \
            f"; output tail:\n{tail[-3000:]}"
    return result


def choose_attention(kernels: dict) -> str:
    """"pallas" for the throughput part if part 1 compiled both kernels for the GPU and
    they passed at the model's own shape (bf16 pages, head_dim 64); else "xla"."""
    rows = [r for r in kernels.get("rows") or []
            if r["dtype"] == "bfloat16" and r["kv_format"] == "auto" and r["head_dim"] == 64]
    compiled = {r["kernel"] for r in rows if r.get("backend") in ("triton", "mosaic_gpu")}
    return "pallas" if compiled == {"decode", "chunk"} and all(r["ok"] for r in rows) else "xla"


def headline(env: dict, parts: dict, wall: float) -> dict:
    kernels, bench, tput = (parts.get(n) or {} for n in PARTS)
    rows = kernels.get("rows") or []
    mosaic_rows = (kernels.get("mosaic") or {}).get("rows") or []
    backends = sorted({r["backend"] for r in rows if "backend" in r})
    bench_head = bench.get("headline") or {}
    bench_rows = bench.get("rows") or []
    tput_head = tput.get("headline") or {}
    return {
        "device": env.get("device_kind"),
        "jax": env.get("jax"),
        "pallas_backend": ",".join(backends) if backends else None,
        "kernel_checks_ok": sum(bool(r.get("ok")) for r in rows),
        "kernel_checks_run": len(rows),
        "kernel_max_err_bf16": kernels.get("max_err_bf16"),
        "kernel_max_err_fp32": kernels.get("max_err_fp32"),
        "mosaic_checks_ok": sum(bool(r.get("ok")) for r in mosaic_rows),
        "mosaic_checks_run": len(mosaic_rows),
        "mosaic_backend": ",".join(sorted({r["backend"] for r in mosaic_rows if "backend" in r})) or None,
        "max_mosaic_over_ours": bench_head.get("max_mosaic_over_ours"),
        "copy_bandwidth_gbps": bench.get("copy_bandwidth_gbps"),
        "best_pct_copy_bw": max((r["pct_copy_bw"] for r in bench_rows), default=None),
        "min_pct_copy_bw_ctx_ge_4096": bench_head.get("min_pct_copy_bw_ctx_ge_4096"),
        "min_speedup_vs_shipped": bench_head.get("min_speedup_vs_shipped"),
        "throughput_ratio": tput_head.get("throughput_ratio"),
        "batch_ratio": tput_head.get("batch_ratio"),
        "paged_tokens_per_s": tput_head.get("paged_tokens_per_s"),
        "static_tokens_per_s": tput_head.get("static_tokens_per_s"),
        "throughput_attention": tput.get("attention_impl"),
        "parts_completed": sum(bool(p) and not p.get("error") and not p.get("skipped_part") and not p.get("partial")
                               for p in parts.values()),
        "parts_total": len(PARTS),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (tiny shapes; interpret mode off the GPU)")
    parser.add_argument("--out", default="out", help="directory for gpu.json and every part's files")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"seconds for the whole run (default {BUDGET_S:.0f}; per part with --part)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run, in order")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="each part in its own process (default: yes on a GPU without --quick)")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # a child of an isolated run
    parser.add_argument("--attention", default="xla", help=argparse.SUPPRESS)  # the throughput part's impl
    args = parser.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # parts share the device with the parent

    if args.part:  # one part, in a child process: its JSON file is the answer
        budget = args.budget_s or SHARES[args.part]
        result = run_inline(args.part, args.out, args.quick, budget, args.attention)
        if "error" in result:  # keep what the part saved before it failed, and say why it stopped
            path = os.path.join(args.out, FILES[args.part])
            saved = json.load(open(path)) if os.path.exists(path) else {}
            write(args.out, FILES[args.part], {**saved, **result})
        return result

    start = time.perf_counter()
    env = environment()
    gpu = env["backend"] == "gpu"
    quick = args.quick or not gpu
    if not gpu and not args.quick:
        print(f"No GPU here (JAX backend: {env['backend']}). This command measures kernels and throughput on a "
              "GPU; running its CPU smoke (--quick: tiny shapes, interpret mode) instead, so the code path is checked.")
    isolate = gpu and not args.quick if args.isolate is None else args.isolate
    budget_total = args.budget_s or (sum(QUICK_SHARES.values()) if quick else BUDGET_S)
    shares = QUICK_SHARES if quick else SHARES
    print(f"gpu: device {env['device_kind']}, jax {env['jax']} (jaxlib {env.get('jaxlib_version')}), backend "
          f"{env['backend']}, pallas: {env['pallas']}, {'quick smoke' if quick else 'full'}, "
          f"budget {budget_total:.0f} s, parts {'isolated' if isolate else 'in this process'}", flush=True)

    parts: dict = {}
    end = start + budget_total
    planned = start
    for name in args.parts:
        planned = min(planned + shares[name] * budget_total / sum(shares[n] for n in args.parts), end)
        budget = planned - time.perf_counter()
        if budget < (5.0 if quick else MIN_PART_S):
            parts[name] = {"skipped_part": f"no time left ({budget:.0f} s of the {budget_total:.0f} s budget)"}
            print(f"== {name}: skipped, no time left", flush=True)
            continue
        attention = "xla"
        if name == "throughput" and gpu:
            attention = choose_attention(parts.get("kernels") or {})
        print(f"== {name} ({budget:.0f} s)", flush=True)
        t0 = time.perf_counter()
        runner = run_isolated if isolate else run_inline
        parts[name] = runner(name, args.out, quick, budget, attention)
        parts[name]["part_seconds"] = time.perf_counter() - t0
        if parts[name].get("error"):
            print(f"== {name}: error: {parts[name]['error'][:300]}", flush=True)
    wall = time.perf_counter() - start
    result = {
        "study": "gpu",
        "headline": headline(env, parts, wall),
        "quick": quick,
        "environment": env,
        "budget_s": budget_total,
        "isolated": isolate,
        "parts": {name: summary(name, part) for name, part in parts.items()},
        "files": {name: FILES[name] for name in parts},
        "note": None if gpu else "no GPU: a smoke of the code path (interpret mode); no figure here means anything",
        "machine": env["machine"],
    }
    from experiments.common import write_json

    print("headline:", json.dumps(result["headline"], default=str))
    write_json(args.out, "gpu", result)
    return result


def summary(name: str, part: dict) -> dict:
    """What gpu.json keeps of a part (its own file has everything)."""
    keep = {"kernels": ("all_ok", "checks_run", "checks_ok", "max_err_bf16", "max_err_fp32", "backends", "skipped",
                        "warnings", "impl", "rows", "mosaic"),
            "kernel_bench": ("headline", "correctness_ok", "copy_bandwidth_gbps", "pallas_backends", "triton_kernels",
                             "mosaic_gpu", "device",
                             "jax_version", "quick", "correctness", "rows", "quantized", "skipped"),
            "throughput": ("headline", "attention_impl", "model", "budget", "workload", "step_time_vs_batch",
                           "partial", "stopped", "outputs_identical", "run_seconds")}[name]
    out = {k: part[k] for k in keep if k in part}
    for k in ("error", "skipped_part", "partial", "part_seconds"):
        if k in part:
            out[k] = part[k]
    return out


if __name__ == "__main__":
    main()
