"""Serving under load (the vLLM paper's figure): latency vs request rate through the
OpenAI-compatible server, with vLLM's benchmark semantics.

    python -m experiments serving [--quick] [--out DIR] [--model DIR] [--request-rate R ...]
                                  [--burstiness B] [--num-prompts N] [--latency-bound S]

- **Workload**: a fixed set of real-text prompts (seeded slices of
  ``tests/fixtures/llama_text/corpus.txt``, 8-120 tokens) with seeded output lengths, run
  with ``ignore_eos`` so every request generates exactly its length (as vLLM's benchmark
  does for synthetic sets); the same requests at every rate.
- **Arrivals**: a seeded gamma process: inter-arrival times ~ Gamma(shape=burstiness,
  scale=1/(rate x burstiness)) (vLLM's ``--request-rate`` / ``--burstiness``; 1 =
  Poisson); ``inf`` sends everything at once.
- **Client**: asyncio + aiohttp streaming ``/v1/completions`` (``stream_options.include_usage``),
  one task per request, run in this process while the server runs in its own (``python -m
  paged_jax.serve``), so they do not share an interpreter. Per request: TTFT (send to first
  streamed chunk), ITL (gaps between chunks), TPOT ((E2E - TTFT) / (output tokens - 1)),
  E2E, normalised latency (E2E / output tokens, the paper's y axis).
- **Figures**: p50/p99 of each, mean normalised latency vs rate, goodput (requests/s that
  meet TTFT <= ``--slo-ttft`` and TPOT <= ``--slo-tpot``), and the highest rate in the sweep
  whose mean normalised latency stays under ``--latency-bound`` ("sustained"), and the
  capacity: what a server overloaded at the highest rate completes (output tokens/s,
  requests/s). The workload is finite, so queueing delay is bounded and a server can stay
  under the bound at a rate it does not keep up with; the capacity ratio says how far apart
  two such servers are.
- **Server overhead at rate 1** (requests alone): each request's E2E through the server
  minus the same request run alone by ``LLM.generate`` in this process (same options, warm),
  back to back so the machine's load drifts out of each difference: the median is the
  per-request cost of HTTP, SSE and the async engine.
- **vLLM**: when a side venv with vLLM exists (``~/.cache/paged_jax/venvs/vllm``,
  ``scripts/side_venv.sh``), the same client against ``vllm serve`` on the same checkpoint and
  dtype; otherwise it is skipped and the JSON says why (``vllm.reason``).
  ``sustained_rate_ratio_vs_vllm`` is ours / vLLM's sustained rate (null without vLLM).
  Both servers are up at once and every rate runs against one, then the other, the order
  rotating by rate (``--order interleaved``, the default; ``sequential`` runs our whole sweep
  first): this VM's speed drifts by tens of percent over the ~40 min of two sweeps, and
  interleaving lets the drift move both sides alike instead of biasing the ratio.

Headline: ``sustained_rate_ratio_vs_vllm``, ``sustained_rate``, ``server_overhead_ms_p50``,
``ttft_p50_s_at_rate_1``, ``normalized_latency_s_at_max_rate``, ``goodput_at_max_rate``,
``capacity_ratio_vs_vllm``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from experiments.common import machine_info, print_headline, shown_path, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "llama_text")
VLLM_VENV = os.path.expanduser("~/.cache/paged_jax/venvs/vllm")
NAME = "served"


# ---------------------------------------------------------------------------- workload


def workload(model_dir: str, num_prompts: int, min_out: int, max_out: int, seed: int = 0):
    """``num_prompts`` (prompt text, output tokens) pairs: seeded word slices of the
    fixture corpus (real text), 8-120 tokens by the model's tokenizer."""
    from paged_jax.text import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    with open(os.path.join(FIXTURE, "corpus.txt"), encoding="utf-8") as f:
        words = f.read().split()
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < num_prompts:
        start, length = int(rng.integers(0, len(words) - 100)), int(rng.integers(4, 80))
        text = " ".join(words[start:start + length])
        if tok is None or 8 <= len(tok.encode(text)) <= 120:
            out.append((text, int(rng.integers(min_out, max_out + 1))))
    return out


def arrival_times(n: int, rate: float, burstiness: float, seed: int = 0) -> np.ndarray:
    """Seconds from the start at which each of ``n`` requests is sent (vLLM's gamma
    process; ``rate`` inf: all at 0)."""
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


# ---------------------------------------------------------------------------- client


async def _one(session, url: str, prompt: str, max_tokens: int, delay: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    events, tokens, error = [], 0, None
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
            else:
                async for raw in r.content:  # one line at a time
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if chunk.get("choices"):
                        events.append(time.perf_counter())
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - recorded as a failed request
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    if error is not None or not events:
        return {"ok": False, "error": error or "no output", "sent": sent - t0}
    ttft = events[0] - sent
    e2e = end - sent
    return {"ok": True, "sent": sent - t0, "ttft": ttft, "e2e": e2e, "tokens": tokens,
            "tpot": (e2e - ttft) / (tokens - 1) if tokens > 1 else 0.0,
            "itl": np.diff(events).tolist(), "normalized": e2e / max(tokens, 1)}


CLIENT = "asyncio + aiohttp streaming /v1/completions"  # what _session and _one are, for the JSON


def _session():
    """The study's HTTP client (aiohttp, as vLLM's benchmark client: it costs the measurement
    ~1.5-2 ms less per request than httpx on the 2-core VM, 2026-12-06), no connection limit."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=600.0))


async def _run(url: str, requests, times) -> tuple[list[dict], float]:
    async with _session() as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(session, url, p, m, float(d), t0)
                                         for (p, m), d in zip(requests, times, strict=True)))
        return list(results), time.perf_counter() - t0


def summarise(results: list[dict], duration: float, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r for r in results if r["ok"]]
    if not ok:
        return {"completed": 0, "failed": len(results), "errors": sorted({r["error"] for r in results})[:3]}

    def pct(key, q):
        return float(np.percentile([r[key] for r in ok], q))

    itl = [x for r in ok for x in r["itl"]]
    good = sum(1 for r in ok if r["ttft"] <= slo_ttft and r["tpot"] <= slo_tpot)
    tokens = sum(r["tokens"] for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_tokens_per_s": tokens / duration,
        **{f"{k}_p{q}_s": pct(k, q) for k in ("ttft", "tpot", "e2e") for q in (50, 99)},
        "itl_p50_s": float(np.percentile(itl, 50)) if itl else 0.0,
        "itl_p99_s": float(np.percentile(itl, 99)) if itl else 0.0,
        "normalized_latency_mean_s": float(np.mean([r["normalized"] for r in ok])),
        "normalized_latency_p50_s": pct("normalized", 50),
        "goodput": good / duration, "slo_attainment": good / len(results),
        **({"errors": sorted({r["error"] for r in results if not r["ok"]})[:3]} if len(ok) < len(results) else {}),
    }


# ---------------------------------------------------------------------------- servers


def _load(avg) -> str:
    return "/".join(f"{x:.1f}" for x in avg)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc, url: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no healthy server at {url} within {timeout} s")
        time.sleep(0.5)


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def engine_options(quick: bool, layer_loop: str = "auto") -> dict:
    """The LLM options both servers and the engine-only baseline run with (block size 32:
    vLLM's CPU attention takes multiples of 32 only); ``layer_loop`` is ours alone."""
    return dict(block_size=32, num_gpu_blocks=128 if quick else 512, max_num_seqs=16 if quick else 64,
                max_model_len=256, dtype="float32", enable_prefix_caching=False, layer_loop=layer_loop)


def ours_command(model: str, port: int, options: dict, engine: str | None = None) -> list[str]:
    """Our server's command line; ``engine``: where its engine core runs (``--engine``; None: the
    server's default)."""
    cmd = [sys.executable, "-m", "paged_jax.serve", model, "--port", str(port), "--served-model-name", NAME,
           "--log-level", "warning", "--max-waiting", "100000"]
    if engine is not None:
        cmd += ["--engine", engine]
    for k, v in options.items():
        flag = "--" + k.replace("_", "-")
        cmd += [flag if v else "--no-" + flag[2:]] if isinstance(v, bool) else [flag, str(v)]
    return cmd


def vllm_status() -> tuple[str | None, str]:
    """(the vLLM venv's python, "") when vLLM imports there, else (None, why not)."""
    python = os.path.join(VLLM_VENV, "bin", "python")
    if not os.path.exists(python):
        return None, f"no vLLM side venv at {VLLM_VENV} (scripts/side_venv.sh makes one)"
    probe = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                           timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"the side venv at {VLLM_VENV} has no importable vllm ({last})"
    return python, probe.stdout.strip()


def vllm_command(python: str, model: str, port: int, options: dict) -> list[str]:
    """``vllm serve`` with our options' values. Prefix caching is set explicitly: vLLM turns
    it on by default (ours off), and the study sends the same prompts at every rate, so a
    cache on one side only would skip that side's prefills from the second rate on."""
    caching = "--enable-prefix-caching" if options["enable_prefix_caching"] else "--no-enable-prefix-caching"
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
            "--served-model-name", NAME, "--dtype", options["dtype"], "--max-num-seqs", str(options["max_num_seqs"]),
            "--max-model-len", str(options["max_model_len"]), "--block-size", str(options["block_size"]), caching]


class ServerFailed(RuntimeError):
    """A server that never became healthy; ``log`` is what it printed (``failure_log``)."""

    def __init__(self, message: str, log: dict):
        super().__init__(message)
        self.log = log


def failure_log(text: str, keep: int = 120) -> dict:
    """A failed server's output for the JSON: its error lines (tracebacks' last lines, "Error"
    and "Exception" lines, with the line before each) and its last ``keep`` lines, not just
    the last few (a multi-process server's root cause is printed well before its last line)."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if any(w in line for w in ("Error", "error:", "Exception", "Traceback"))]
    return {"lines": len(lines), "error_lines": list(dict.fromkeys(errors))[:60], "last_lines": lines[-keep:]}


@contextlib.contextmanager
def started(command: list[str], env: dict | None = None, start_timeout: float = 600):
    """A server from ``command``, healthy and warmed with four requests (compiles on first
    use): yields (url, pid); stopped (SIGTERM) on exit. ``ServerFailed`` (with its log) if it
    never became healthy."""
    port = int(command[command.index("--port") + 1])
    url = f"http://127.0.0.1:{port}"
    if not _port_free(port):
        raise RuntimeError(f"port {port} is taken: another server is up")
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            _wait_healthy(proc, url, start_timeout)
        except (RuntimeError, TimeoutError) as e:
            log.seek(0)
            raise ServerFailed(str(e), failure_log(log.read())) from None
        yield url, proc.pid
    finally:
        _stop(proc)
        log.close()


def rate_pass(url: str, rate: float, requests, burstiness: float, slo: tuple[float, float], label: str = "") -> dict:
    """Every request at ``rate`` (seeded gamma arrivals) against the server at ``url``:
    {"summary", "results"}."""
    times = arrival_times(len(requests), rate, burstiness, seed=1)
    results, duration = asyncio.run(_run(url, requests, times))
    s = summarise(results, duration, *slo)
    print(f"  {label}rate {rate:>6}: {s.get('completed', 0):>3} ok, norm {s.get('normalized_latency_mean_s', 0):.4f} "
          f"s/tok, ttft p50 {s.get('ttft_p50_s', 0):.3f} s, tpot p50 {s.get('tpot_p50_s', 0) * 1e3:.1f} ms, "
          f"{s.get('output_tokens_per_s', 0):.0f} tok/s")
    return {"summary": s, "results": results}


def sweeps(servers: dict, rates, requests, burstiness: float, slo: tuple[float, float], during: dict | None = None,
           ) -> dict:
    """Every rate against every server in ``servers`` ({name: {"command", "env",
    "start_timeout"}}), all up at once and **interleaved**: at each rate each server runs in
    turn, the order rotating from one rate to the next, so a machine whose speed drifts over
    the minutes of a sweep (a shared VM's does) moves both sides alike instead of whichever ran
    second. A server that is up but not being measured is idle; its CPU seconds during the
    other's pass are recorded (``idle_cpu_s``) to show it took nothing. After the rates the
    servers without a ``during`` hook stop, then ``during[name](url, pid)`` runs on each
    remaining one alone (its result under "during").

    Returns {name: {rate: {"summary", "results"}, "loadavg": ..., ["during": ...]}} or, for a
    server that never became healthy, {name: ServerFailed}."""
    during = during or {}
    out: dict = {}
    with contextlib.ExitStack() as stack:
        up = {}  # name -> (its own exit stack, url, pid): each can stop before the others
        for name, spec in servers.items():
            own = stack.enter_context(contextlib.ExitStack())
            try:
                url, pid = own.enter_context(started(spec["command"], spec.get("env"), spec.get("start_timeout", 600)))
            except ServerFailed as e:
                out[name] = e
                continue
            up[name] = (own, url, pid)
            asyncio.run(_run(url, requests[:4], np.zeros(4)))  # warm-up (compiles on first use)
            out[name] = {}
        names = list(up)
        load_before = os.getloadavg()
        for i, rate in enumerate(rates):
            for name in names[i % len(names):] + names[:i % len(names)]:
                idle_pids = {o: up[o][2] for o in names if o != name}
                before = {o: process_cpu_s(pid) for o, pid in idle_pids.items()}
                entry = rate_pass(up[name][1], rate, requests, burstiness, slo,
                                  label=f"{name:<5} " if len(names) > 1 else "")
                after = {o: process_cpu_s(pid) for o, pid in idle_pids.items()}
                idle = {o: after[o] - before[o] for o in idle_pids if before[o] is not None and after[o] is not None}
                if idle:
                    entry["summary"]["idle_cpu_s"] = idle
                out[name][str(rate)] = entry
        load_after = os.getloadavg()
        print(f"  load average (1, 5, 15 min) before the rates {_load(load_before)}, after {_load(load_after)}")
        for name, (own, _, _) in up.items():
            out[name]["loadavg"] = {"before": list(load_before), "after": list(load_after)}
            if name not in during:
                own.close()
        for name, (_, url, pid) in up.items():
            if name in during:
                out[name]["during"] = during[name](url, pid)
    return out


def sweep(command: list[str], rates, requests, burstiness: float, slo: tuple[float, float],
          env: dict | None = None, start_timeout: float = 600, during=None) -> dict:
    """``sweeps`` with one server: {rate: ..., "loadavg": ..., ["during": ...]}; raises
    ``ServerFailed`` if it never became healthy."""
    got = sweeps({"one": {"command": command, "env": env, "start_timeout": start_timeout}}, rates, requests,
                 burstiness, slo, during={"one": during} if during else None)["one"]
    if isinstance(got, ServerFailed):
        raise got
    return got


def engine_alone(model: str, options: dict, requests):
    """An ``LLM`` with the server's options, warm: the engine-only baseline."""
    from paged_jax import LLM, SamplingParams

    llm = LLM(model, **options)
    llm.warmup(use_tqdm=False)
    for text, m in requests[:2]:
        llm.generate([text], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), use_tqdm=False)
    return llm


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds every thread of process ``pid`` and of its descendants (the server's engine
    process) has run (Linux ``/proc/PID/task/*/schedstat``, nanoseconds), or None where that is
    not readable."""
    total, todo, seen = 0, [pid], set()
    try:
        while todo:
            p = todo.pop()
            seen.add(p)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split() if int(c) not in seen]
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


def paired_overhead(url: str, llm, requests, repeats: int, pid: int | None = None) -> dict:
    """Each request sent alone through the server, then run alone by ``LLM.generate`` here,
    back to back (so a shared machine's load drifts out of the difference), ``repeats``
    times: the per-request server overhead is the median paired difference of wall time
    ("p50") and, with the server's ``pid``, of CPU time (the server process's, all threads,
    against this process's ``process_time`` around ``generate``): "cpu_ms_p50", which other
    processes' load inflates much less than wall time."""
    from paged_jax import SamplingParams

    async def pairs_of():
        pairs = []
        async with _session() as session:  # one session: no per-request setup
            for _ in range(repeats):
                for text, m in requests:
                    c0 = process_cpu_s(pid) if pid else None
                    served = await _one(session, url, text, m, 0.0, time.perf_counter())
                    c1 = process_cpu_s(pid) if pid else None
                    start, p0 = time.perf_counter(), time.process_time()
                    llm.generate([text], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), use_tqdm=False)
                    alone, cpu_alone = time.perf_counter() - start, time.process_time() - p0
                    if served["ok"]:
                        cpu = None if c0 is None or c1 is None else (c1 - c0) - cpu_alone
                        pairs.append((served["e2e"], alone, cpu, m))
        return pairs

    pairs = asyncio.run(pairs_of())
    diff = [a - b for a, b, _, _ in pairs]
    cpu = [c for _, _, c, _ in pairs if c is not None]
    split = overhead_split([m for *_, m in pairs], diff)
    return {"p50": 1e3 * float(np.median(diff)), "p90": 1e3 * float(np.percentile(diff, 90)),
            "p10": 1e3 * float(np.percentile(diff, 10)),
            "iqr": [1e3 * float(np.percentile(diff, 25)), 1e3 * float(np.percentile(diff, 75))],
            "cpu_ms_p50": 1e3 * float(np.median(cpu)) if cpu else None,
            "engine_e2e_ms_p50": 1e3 * float(np.median([b for _, b, _, _ in pairs])),
            "server_e2e_ms_p50": 1e3 * float(np.median([a for a, _, _, _ in pairs])),
            **split, "pairs": len(pairs), "per_request_ms": [1e3 * x for x in diff]}


def overhead_split(tokens: list[int], diff_s: list[float]) -> dict:
    """Where the server's time goes: a robust line through (output tokens, overhead) pairs,
    ``fixed_ms`` per request (HTTP request, parsing, tokenising, the add) plus
    ``per_token_ms`` per streamed token (the engine-to-loop hand-over, one SSE chunk, the
    client reading it). Theil-Sen (the median of pairwise slopes), so a few pairs a busy
    machine delayed do not tilt it; None where the lengths do not vary."""
    t, d = np.asarray(tokens, float), 1e3 * np.asarray(diff_s, float)
    i, j = np.triu_indices(len(t), 1)
    keep = t[j] != t[i]
    if not keep.any():
        return {"fixed_ms": None, "per_token_ms": None}
    slope = float(np.median((d[j] - d[i])[keep] / (t[j] - t[i])[keep]))
    return {"fixed_ms": float(np.median(d - slope * t)), "per_token_ms": slope}


def sustained(by_rate: dict, bound: float) -> float | None:
    """The highest swept rate up to which every rate's mean normalised latency is under
    ``bound`` with no failures (a failed request counts as over the bound, as in
    ``sustained_interpolated``, so the two agree on the grid); None if the lowest is over."""
    best = None
    for r, s in sorted((float(r), v["summary"]) for r, v in by_rate.items()):
        if s.get("failed", 1) or not s.get("completed") or s["normalized_latency_mean_s"] > bound:
            break
        best = r
    return best


def sustained_interpolated(by_rate: dict, bound: float) -> float | None:
    """The rate at which mean normalised latency crosses ``bound``, interpolated linearly in
    (log rate, log latency) between the last swept rate under it and the next one over it
    (finer than the sweep's grid); the highest rate if none is over, None if the lowest is
    over (or failed)."""
    pts = sorted((float(r), v["summary"]) for r, v in by_rate.items())
    lat = [(r, s["normalized_latency_mean_s"] if s.get("completed") and not s.get("failed") else math.inf)
           for r, s in pts]
    if not lat or lat[0][1] > bound:
        return None
    for (r0, y0), (r1, y1) in zip(lat, lat[1:], strict=False):
        if y1 > bound:
            if math.isinf(y1) or math.isinf(r1):
                return r0
            f = (math.log(bound) - math.log(y0)) / (math.log(y1) - math.log(y0)) if y1 > y0 else 1.0
            return float(math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0))))
    return lat[-1][0]


def capacity(by_rate: dict) -> dict:
    """What a server completed at the highest swept rate: output tokens/s and requests/s
    over the run, and whether that rate overloaded it (TTFT p50 >= 5x the lowest rate's:
    a queue formed), in which case those are its capacity for this workload. A finite
    workload bounds queueing delay, so an overloaded server can stay under a latency bound
    at a rate it does not keep up with; the capacity says how far from keeping up it is."""
    pts = sorted((float(r), v["summary"]) for r, v in by_rate.items())
    (_, low), (_, top) = pts[0], pts[-1]
    if not top.get("completed") or top.get("failed"):
        return {"output_tokens_per_s": None, "requests_per_s": None, "overloaded": None}
    return {"output_tokens_per_s": top["output_tokens_per_s"], "requests_per_s": top["request_throughput"],
            "overloaded": bool(low.get("ttft_p50_s") and top["ttft_p50_s"] >= 5 * low["ttft_p50_s"])}


def capacity_headline(ours: dict, vllm_by_rate: dict | None) -> dict:
    """The headline's capacity keys: ours, vLLM's, and the ratio when both were overloaded."""
    mine = capacity(ours)
    theirs = capacity(vllm_by_rate) if vllm_by_rate else None
    both = theirs is not None and mine["overloaded"] and theirs["overloaded"]
    return {"capacity_output_tokens_per_s": mine["output_tokens_per_s"],
            "capacity_requests_per_s": mine["requests_per_s"],
            "vllm_capacity_output_tokens_per_s": theirs["output_tokens_per_s"] if theirs else None,
            "vllm_capacity_requests_per_s": theirs["requests_per_s"] if theirs else None,
            "capacity_ratio_vs_vllm": mine["output_tokens_per_s"] / theirs["output_tokens_per_s"] if both else None,
            "capacity_overloaded": {"ours": mine["overloaded"], "vllm": theirs["overloaded"] if theirs else None}}


def bench_dataset(requests, path: str) -> str:
    """The workload as vLLM's custom dataset (JSONL: prompt, output_tokens), for its client."""
    with open(path, "w") as f:
        for text, m in requests:
            f.write(json.dumps({"prompt": text, "output_tokens": m}) + "\n")
    return path


VLLM_BENCH = ("import sys\n"
              "from vllm.benchmarks.serve import add_cli_args, main\n"
              "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
              "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n")


def vllm_bench_command(python: str, url: str, tokenizer: str, dataset: str, num: int, rate: float,
                       burstiness: float, result_dir: str, result_file: str) -> list[str]:
    """vLLM's own benchmark client (what ``vllm bench serve`` runs: ``vllm.benchmarks.serve``;
    the side venv's ``vllm`` console script has no package metadata) against ``url``: our
    workload as its custom dataset, as sent (no chat template, no shuffle), ignore_eos,
    greedy. Also in scripts/vllm_bench_serve.sh."""
    return [python, "-c", VLLM_BENCH, "--base-url", url, "--model", NAME, "--tokenizer", tokenizer,
            "--dataset-name", "custom", "--dataset-path", dataset, "--custom-output-len", "-1",
            "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(num), "--request-rate", str(rate),
            "--burstiness", str(burstiness), "--seed", "1", "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", result_dir, "--result-filename", result_file]


def vllm_bench_client(python: str, url: str, model: str, requests, rates, burstiness: float,
                      slo: tuple[float, float]) -> dict:
    """At each rate, our client then vLLM's (``vllm_bench_command``) against the server at
    ``url``, back to back on the same requests: both sides' TTFT/TPOT/ITL/E2E p50/p99 and
    output tokens/s, and their ratios (vLLM's client / ours)."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = bench_dataset(requests, os.path.join(tmp, "workload.jsonl"))
        for rate in rates:
            results, duration = asyncio.run(_run(url, requests, arrival_times(len(requests), rate, burstiness, seed=1)))
            ours = summarise(results, duration, *slo)
            cmd = vllm_bench_command(python, url, model, data, len(requests), rate, burstiness, tmp, f"r{rate}.json")
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                                  env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
            path = os.path.join(tmp, f"r{rate}.json")
            if proc.returncode != 0 or not os.path.exists(path):
                out[str(rate)] = {"ours": ours, "vllm_client": None,
                                  "error": failure_log(proc.stdout + proc.stderr, keep=30)}
                continue
            with open(path) as f:
                b = json.load(f)
            theirs = {"completed": b["completed"], "failed": b.get("failed"), "duration_s": b["duration"],
                      "request_throughput": b["request_throughput"], "output_tokens_per_s": b["output_throughput"],
                      **{f"{k}_p{q}_s": b[f"p{q}_{v}_ms"] / 1e3 for k, v in
                         (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2e", "e2el")) for q in (50, 99)}}
            keys = ("ttft_p50_s", "tpot_p50_s", "itl_p50_s", "e2e_p50_s", "output_tokens_per_s")
            out[str(rate)] = {"ours": {k: ours.get(k) for k in ("completed", "failed", "duration_s",
                                                                    "request_throughput", *keys[:4], "ttft_p99_s",
                                                                    "tpot_p99_s", "itl_p99_s", "e2e_p99_s",
                                                                    "output_tokens_per_s")},
                              "vllm_client": theirs,
                              "vllm_client_over_ours": {k: theirs[k] / ours[k] if ours.get(k) else None for k in keys}}
            r = out[str(rate)]["vllm_client_over_ours"]
            print(f"  vLLM's client / ours at rate {rate}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items() if v))
    return out


def claim_evidence(result: dict) -> dict:
    """C8's serving evidence for ``experiments.report`` (which appends it to the throughput
    study's row): the sustained request rate at the latency bound, ours against vLLM's. vLLM
    is itself paged, so this compares two paged engines serving, not the gain over static
    allocation, and leaves the verdict to ``experiments.throughput``."""
    h = result["headline"]
    ratio, bound = h.get("sustained_rate_ratio_vs_vllm"), h["latency_bound_s_per_token"]
    where = f"{os.path.basename(result['config']['model'].rstrip('/'))}, {result['machine'].get('date', '?')}"
    if ratio is None:
        return {"C8": {"ours": f"vs vLLM not measured ({h.get('sustained_rate_ratio_reason')})",
                       "why": "The serving comparison with vLLM did not run."}}
    cap = h.get("capacity_ratio_vs_vllm")
    at_least = lambda key: ">= " if h.get(f"{key}_censored") else ""  # under the bound at the highest rate
    rates = (f"{at_least('sustained_rate')}{h['sustained_rate']:.2f} vs vLLM's "
             f"{at_least('vllm_sustained_rate')}{h['vllm_sustained_rate']:.2f} req/s")
    return {"C8": {
        "ours": f"{rates} sustained at <= {bound} s/token ({ratio:.2f}x, {where})",
        "why": (f"Under arrivals over time (the paper's serving figure) our OpenAI server sustains {ratio:.2f}x the "
                f"request rate of `vllm serve` at the same normalised-latency bound ({rates}): "
                + ("at least vLLM's" if ratio >= 1 else "below vLLM's")
                + (f"; overloaded, ours completes {cap:.2f}x vLLM's output tokens/s" if cap else "")
                + ". vLLM is paged too, so this compares two paged engines serving (step speed, scheduling), "
                "not the gain over static allocation; the verdict stays the throughput study's.")}}


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    from paged_jax.engine.config import LAYER_LOOP_CHOICES
    from paged_jax.serve.__main__ import ENGINES  # the server's placements, its default first

    p = argparse.ArgumentParser(prog="python -m experiments serving", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="8 prompts, rates 1 and 8 (a smoke run)")
    p.add_argument("--out", default="out")
    p.add_argument("--model", default=FIXTURE, help="checkpoint directory (default: the tiny text fixture)")
    p.add_argument("--request-rate", type=float, nargs="+", default=None, help="requests/s to sweep (inf allowed)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, < 1 burstier")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--latency-bound", type=float, default=0.05, help="normalised latency bound, s per output token")
    p.add_argument("--slo-ttft", type=float, default=0.5, help="goodput SLO on TTFT, s")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="goodput SLO on TPOT, s")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--overhead-repeats", type=int, default=None,
                   help="passes over the prompts for the paired overhead (default 1 quick, else 3)")
    p.add_argument("--overhead-model", default=FIXTURE,
                   help="checkpoint the paired overhead runs on (default: the tiny fixture, whose short engine "
                        "runs leave the server's few ms visible above a shared machine's noise)")
    p.add_argument("--min-out", type=int, default=8, help="shortest output, tokens")
    p.add_argument("--max-out", type=int, default=None, help="longest output, tokens (default 16 quick, else 64)")
    p.add_argument("--vllm-bench-rates", type=float, nargs="*", default=None,
                   help="rates at which vLLM's own client also runs against our server (default: 1 and the "
                        "highest rate; none with --quick); needs the vLLM side venv")
    p.add_argument("--engine", choices=ENGINES, default=ENGINES[0],
                   help="where our server's engine core runs (its --engine)")
    p.add_argument("--layer-loop", choices=LAYER_LOOP_CHOICES, default="auto",
                   help="our engine's layer_loop (auto: unrolled on one CPU device, faster fp32 steps at "
                        "a longer compile; scan: one layer body)")
    p.add_argument("--order", choices=("interleaved", "sequential"), default="interleaved",
                   help="interleaved: both servers up at once, each rate run against one then the other (the "
                        "order rotating by rate), so the machine's drift moves both alike; sequential: our "
                        "whole sweep, then vLLM's")
    p.add_argument("--overhead-only", action="store_true",
                   help="only the paired per-request overhead on --overhead-model (its own server; no rates, "
                        "no vLLM): the A/B measurement of server changes; JSON serving_overhead.json")
    args = p.parse_args(argv)
    if args.overhead_only:
        return overhead_only(args)
    quick = args.quick
    rates = args.request_rate or ([1.0, 8.0] if quick else [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0])
    if 1.0 not in rates:
        rates = [1.0, *rates]
    num = args.num_prompts or (8 if quick else 64)
    requests = workload(args.model, num, args.min_out, args.max_out or (16 if quick else 64))
    options = engine_options(quick, args.layer_loop)
    slo = (args.slo_ttft, args.slo_tpot)
    print(f"serving: {num} prompts, outputs {min(m for _, m in requests)}-{max(m for _, m in requests)} tokens, "
          f"burstiness {args.burstiness}, rates {rates}")

    vllm_python, vllm_info = (None, "skipped (--skip-vllm)") if args.skip_vllm else vllm_status()
    bench_rates = args.vllm_bench_rates if args.vllm_bench_rates is not None else ([] if quick else [1.0, max(rates)])
    repeats = args.overhead_repeats or (1 if quick else 3)
    same = os.path.abspath(args.overhead_model) == os.path.abspath(args.model)
    oh_requests = requests if same else workload(args.overhead_model, num, args.min_out, args.max_out or (16 if quick else 64))[:16]
    baseline = engine_alone(args.overhead_model, options, oh_requests)

    def during_ours(url, pid):
        got = {}
        if same:
            got["overhead"] = paired_overhead(url, baseline, oh_requests, repeats, pid)
        if vllm_python is not None and bench_rates:
            print("vLLM's benchmark client against our server:")
            got["bench"] = vllm_bench_client(vllm_python, url, args.model, requests, bench_rates, args.burstiness, slo)
        return got

    servers = {"ours": {"command": ours_command(args.model, _free_port(), options, args.engine)}}
    if vllm_python is not None:
        servers["vllm"] = {"command": vllm_command(vllm_python, args.model, _free_port(), options),
                           "env": {"VLLM_CPU_KVCACHE_SPACE": "4"}, "start_timeout": 900}
    if args.order == "interleaved":
        print("paged_jax" + (f" and vLLM {vllm_info}" if vllm_python else "") + " servers, interleaved by rate:")
        swept = sweeps(servers, rates, requests, args.burstiness, slo, during={"ours": during_ours})
    else:
        swept = {}
        for name, spec in servers.items():
            print("paged_jax server:" if name == "ours" else f"vLLM {vllm_info} server:")
            swept.update(sweeps({name: spec}, rates, requests, args.burstiness, slo,
                                during={"ours": during_ours} if name == "ours" else None))
    ours = swept["ours"]
    if isinstance(ours, ServerFailed):
        raise ours
    got = ours.pop("during")
    load = {"ours": ours.pop("loadavg")}
    bench = got.get("bench")
    if same:
        overhead_ms = got["overhead"]
    else:  # its own server on the overhead model, alone on this machine
        print(f"paged_jax server on {shown_path(args.overhead_model)} for the per-request overhead:")
        oh = sweep(ours_command(args.overhead_model, _free_port(), options, args.engine), [], oh_requests, args.burstiness, slo,
                   during=lambda url, pid: paired_overhead(url, baseline, oh_requests, repeats, pid))
        overhead_ms = oh.pop("during")
        load["overhead"] = oh.pop("loadavg")
    print(f"  server overhead per request (alone, paired with LLM.generate): p50 {overhead_ms['p50']:.2f} ms, "
          f"p90 {overhead_ms['p90']:.2f} ms (fixed {overhead_ms['fixed_ms'] or float('nan'):.2f} ms + "
          f"{overhead_ms['per_token_ms'] or float('nan'):.3f} ms per token), CPU p50 {overhead_ms['cpu_ms_p50'] or float('nan'):.2f} ms (engine alone {overhead_ms['engine_e2e_ms_p50']:.1f} ms, through the "
          f"server {overhead_ms['server_e2e_ms_p50']:.1f} ms)")

    vllm = {"ran": False, "reason": vllm_info}
    if vllm_python is not None:
        if isinstance(swept["vllm"], ServerFailed):
            e = swept["vllm"]
            first = next((line for line in e.log["error_lines"] if "Error" in line), "")
            vllm = {"ran": False, "reason": f"vLLM {vllm_info} did not serve {shown_path(args.model)}: {e}"
                                            + (f"; first error: {first}" if first else ""), "log": e.log}
        else:
            vllm = {"ran": True, "version": vllm_info, "by_rate": swept["vllm"]}
            load["vllm"] = vllm["by_rate"].pop("loadavg")
    print(f"vLLM: {vllm['reason']}" if not vllm["ran"] else "vLLM: ran")

    ours_sustained = sustained(ours, args.latency_bound)
    vllm_sustained = sustained(vllm["by_rate"], args.latency_bound) if vllm["ran"] else None
    grid_ratio = (ours_sustained / vllm_sustained if ours_sustained is not None and vllm_sustained else None)
    ours_interp = sustained_interpolated(ours, args.latency_bound)
    vllm_interp = sustained_interpolated(vllm["by_rate"], args.latency_bound) if vllm["ran"] else None
    ratio = ours_interp / vllm_interp if ours_interp is not None and vllm_interp else None
    low = str(min(rates))
    low_lat = {"ours": ours[low]["summary"].get("normalized_latency_mean_s"),
               "vllm": vllm["by_rate"][low]["summary"].get("normalized_latency_mean_s") if vllm["ran"] else None}
    worst_low = max(v for v in low_lat.values() if v is not None) if low_lat["ours"] is not None else None
    bound_reason = (f"{args.latency_bound} s/token: {args.latency_bound / worst_low:.1f}x the slower server's mean "
                    f"normalised latency at the lowest rate ({min(rates)} req/s: ours {low_lat['ours']:.4f}, vLLM "
                    + (f"{low_lat['vllm']:.4f}" if low_lat["vllm"] is not None else "not run")
                    + " s/token), so both meet it unloaded and it is crossed where queueing sets in"
                    if worst_low else "no low-rate point completed")
    top = ours[str(max(rates))]["summary"]
    print(f"{'rate':>6} {'norm s/tok':>10} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>9} {'itl p99':>8} "
          f"{'e2e p99':>8} {'goodput':>8}")
    for rate in rates:
        s = ours[str(rate)]["summary"]
        if s.get("completed"):
            print(f"{rate:>6} {s['normalized_latency_mean_s']:>10.4f} {s['ttft_p50_s']:>9.3f} {s['ttft_p99_s']:>9.3f} "
                  f"{s['tpot_p50_s']:>9.4f} {s['itl_p99_s']:>8.4f} {s['e2e_p99_s']:>8.3f} {s['goodput']:>8.2f}")
    headline = {
        "sustained_rate_ratio_vs_vllm": ratio,
        "sustained_rate_ratio_reason": None if ratio is not None else (
            vllm["reason"] if not vllm["ran"] else "a server sustained none of the rates under the bound"),
        "sustained_rate": ours_interp,
        "vllm_sustained_rate": vllm_interp,
        # under the bound at the highest swept rate: the sustained rate is at least max_rate
        "sustained_rate_censored": ours_interp == max(rates),
        "vllm_sustained_rate_censored": vllm_interp == max(rates) if vllm["ran"] else None,
        "sustained_rate_ratio_vs_vllm_grid": grid_ratio,
        "sustained_rate_grid": ours_sustained,
        "vllm_sustained_rate_grid": vllm_sustained,
        "latency_bound_s_per_token": args.latency_bound,
        "latency_bound_reason": bound_reason,
        "server_overhead_ms_p50": overhead_ms["p50"],
        "server_overhead_ms_iqr": overhead_ms["iqr"],
        "server_cpu_overhead_ms_p50": overhead_ms["cpu_ms_p50"],
        "server_overhead_fixed_ms": overhead_ms["fixed_ms"],
        "server_overhead_per_token_ms": overhead_ms["per_token_ms"],
        "ttft_p50_s_at_rate_1": ours["1.0"]["summary"].get("ttft_p50_s"),
        "normalized_latency_s_at_max_rate": top.get("normalized_latency_mean_s"),
        "goodput_at_max_rate": top.get("goodput"),
        "max_rate": max(rates),
        **capacity_headline(ours, vllm["by_rate"] if vllm["ran"] else None),
    }
    if bench:
        agree = {r: v["vllm_client_over_ours"] for r, v in bench.items() if v.get("vllm_client")}
        headline["vllm_bench_client_over_ours_tpot_p50"] = {r: a["tpot_p50_s"] for r, a in agree.items()}
        headline["vllm_bench_client_over_ours_ttft_p50"] = {r: a["ttft_p50_s"] for r, a in agree.items()}
    print_headline(headline, 4)
    strip = lambda by: {r: {"summary": v["summary"], "sent_s": [x["sent"] for x in v["results"]]} for r, v in by.items()}
    result = {
        "study": "serving",
        "machine": machine_info(),
        "config": {"model": shown_path(args.model), "quick": quick, "num_prompts": num, "rates": rates,
                   "burstiness": args.burstiness, "slo_ttft_s": slo[0], "slo_tpot_s": slo[1],
                   "engine_options": options, "server_engine": args.engine, "order": args.order,
                   "output_tokens": [m for _, m in requests], "client": CLIENT},
        "ours": strip(ours),
        "vllm": {**vllm, "by_rate": strip(vllm["by_rate"])} if vllm["ran"] else vllm,
        "server_overhead": {**overhead_ms, "model": shown_path(args.overhead_model),
                            "output_tokens": [m for _, m in oh_requests], "repeats": repeats},
        "loadavg_1_5_15_min": load,
        "vllm_bench_client": bench if bench is not None else {
            "ran": False, "reason": vllm_info if vllm_python is None else "no --vllm-bench-rates"},
        "headline": headline,
    }
    write_json(args.out, "serving", result)
    _plot(args.out, ours, vllm)
    return result


def overhead_only(args) -> dict:
    """``--overhead-only``: the paired overhead alone (``paired_overhead``), its server on
    ``--overhead-model`` with the study's options; ``--num-prompts`` requests (default 8
    quick, else 16), ``--overhead-repeats`` passes."""
    quick = args.quick
    num = args.num_prompts or (8 if quick else 16)
    requests = workload(args.overhead_model, num, args.min_out, args.max_out or (16 if quick else 64))
    options = engine_options(quick, args.layer_loop)
    repeats = args.overhead_repeats or (1 if quick else 3)
    baseline = engine_alone(args.overhead_model, options, requests)
    mode = args.engine
    print(f"paged_jax server ({mode} engine) on {shown_path(args.overhead_model)}: {num} prompts x {repeats}, outputs "
          f"{min(m for _, m in requests)}-{max(m for _, m in requests)} tokens")
    got = sweep(ours_command(args.overhead_model, _free_port(), options, args.engine), [], requests, 1.0,
                (args.slo_ttft, args.slo_tpot),
                during=lambda url, pid: paired_overhead(url, baseline, requests, repeats, pid))
    oh = got["during"]
    print(f"  server overhead per request: p50 {oh['p50']:.2f} ms (iqr {oh['iqr'][0]:.2f}-{oh['iqr'][1]:.2f}), "
          f"CPU p50 {oh['cpu_ms_p50'] or float('nan'):.2f} ms, engine alone {oh['engine_e2e_ms_p50']:.1f} ms, "
          f"through the server {oh['server_e2e_ms_p50']:.1f} ms ({oh['pairs']} pairs)")
    result = {"study": "serving_overhead", "machine": machine_info(),
              "config": {"model": shown_path(args.overhead_model), "engine": mode, "client": CLIENT, "num_prompts": num, "repeats": repeats,
                         "engine_options": options, "output_tokens": [m for _, m in requests]},
              "server_overhead": oh, "loadavg_1_5_15_min": got["loadavg"],
              "headline": {"server_overhead_ms_p50": oh["p50"], "server_cpu_overhead_ms_p50": oh["cpu_ms_p50"]}}
    write_json(args.out, "serving_overhead", result)
    return result


def _plot(out_dir: str, ours: dict, vllm: dict) -> None:
    try:
        from experiments.common import pyplot

        plt = pyplot()
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, by in (("paged_jax", ours), ("vLLM", vllm.get("by_rate") if vllm.get("ran") else None)):
        if by:
            xs = [float(r) for r in by if by[r]["summary"].get("completed")]
            ys = [by[r]["summary"]["normalized_latency_mean_s"] for r in by if by[r]["summary"].get("completed")]
            ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalised latency (s/token)")
    ax.set_xscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "serving.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
