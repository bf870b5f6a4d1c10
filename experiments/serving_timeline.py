"""Where one request's time goes in our server, phase by phase, from timestamps taken in
every process on its path (the paired overhead of ``serving`` says how much the server adds,
within the machine's noise; this says where).

``python -m experiments serving_timeline [--model DIR] [--num-prompts 16] [--repeats 3]
[--engine inline|process|thread] [--pin] [--out DIR]``

Our server (``serving.ours_command``, the study's quick options) starts with a
``sitecustomize`` on its ``PYTHONPATH`` that wraps a few functions to log
``time.perf_counter()`` (CLOCK_MONOTONIC: one clock for every process on Linux): uvicorn's
``data_received``, ``EngineClient.submit``, ``EngineCore.apply``/``step``, the HTTP side's
report arrivals. The client (aiohttp, this process) sends streamed requests one at a time and logs
when it sent each and when each event arrived. Per request, medians over requests:

- ``client_to_server``: the client's send until the server reads the request's bytes;
- ``http_to_submit``: parsing, routing, validation, tokenising, up to ``submit``;
- ``submit_to_engine``: the add command's trip to the engine core (its process, its thread,
  or the loop's next turn);
- ``add_to_first_step``: ``LLM.add_request`` in the engine (the engine-only path has it too);
- ``step``, ``between_steps``: engine steps and what the core does between two (its
  report: ``usage()``; in the process engine pickling and the pipe write that wakes the
  HTTP side; inline, the loop's callbacks: the SSE chunk's write, requests arriving);
- ``report_to_http``: a step's end until its report is read on the HTTP side;
- ``last_step_to_client``: the last step's end until the client has the end of the response.

Beside each served request the same request runs through an ``EngineCore`` in this process
(no pipe, no HTTP; same options, same ``LLM.step``): ``alone_step`` and
``alone_between_steps`` are what the engine's steps take when nothing else shares the machine
(not with ``--pin``, where the server's engine computes on one CPU).

Also the machine's thread wake-up latency (a pipe ping-pong between two processes after
0, 1 and 20 ms idle): on a VM an idle vCPU's wake-up is what each hop between processes
costs. ``--pin``: the engine process on CPU 0, the HTTP process and this client on CPU 1
(Linux affinity), to tell CPU sharing from hand-over cost.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import multiprocessing
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np

from experiments import serving as S
from experiments.common import machine_info, shown_path, write_json

FIXTURE = S.FIXTURE

# Wraps the functions named in the module docstring; TIMELINE_DIR says where each process
# writes ``<pid>.txt`` (lines "perf_counter event"), flushed after every step and report.
SITECUSTOMIZE = textwrap.dedent('''
    import importlib.abc, importlib.machinery, os, sys, time
    _dir = os.environ.get("TIMELINE_DIR")
    if _dir:
        _f = open(os.path.join(_dir, f"{os.getpid()}.txt"), "w", buffering=1 << 16)
        def log(ev, _t=time.perf_counter, _w=_f.write):
            _w(f"{_t():.7f} {ev}\\n")
        def patch(mod):
            if mod.__name__.endswith(".core"):
                C = mod.EngineCore
                apply, step, turn = C.apply, C.step, C.turn
                def t_apply(self, c):
                    log("apply_" + c[0]); return apply(self, c)
                def t_step(self):
                    log("step_start"); r = step(self); log("step_end"); return r
                def t_turn(self, commands):
                    r = turn(self, commands); _f.flush(); return r
                C.apply, C.step, C.turn = t_apply, t_step, t_turn
            else:
                E = mod.EngineClient
                submit, on_reports = E.submit, E._on_reports
                def t_submit(self, *a, **k):
                    log("submit"); return submit(self, *a, **k)
                def t_on_reports(self, reports):
                    log("reports"); on_reports(self, reports); _f.flush()
                E.submit, E._on_reports = t_submit, t_on_reports
        class _Loader(importlib.abc.Loader):
            def __init__(self, real): self.real = real
            def create_module(self, spec): return self.real.create_module(spec)
            def exec_module(self, module): self.real.exec_module(module); patch(module)
        class _Finder(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name not in ("paged_jax.serve.core", "paged_jax.serve.async_engine"):
                    return None
                spec = importlib.machinery.PathFinder.find_spec(name, path)
                spec.loader = _Loader(spec.loader)
                return spec
        sys.meta_path.insert(0, _Finder())
        try:
            import uvicorn.protocols.http.httptools_impl as _h
            _received = _h.HttpToolsProtocol.data_received
            def _t_received(self, data):
                log("received"); return _received(self, data)
            _h.HttpToolsProtocol.data_received = _t_received
        except ImportError:
            pass
''')

PHASES = ["client_to_server", "http_to_submit", "submit_to_engine", "add_to_first_step", "step", "between_steps",
          "report_to_http", "last_step_to_client", "e2e", "alone_step", "alone_between_steps"]


def _ping_child(r, w):
    while (x := r.recv()) is not None:
        w.send(x)


def wake_latency(rounds: int = 200) -> dict:
    """Round trips through two pipes to another process after 0, 1 and 20 ms idle, µs p50."""
    ctx = multiprocessing.get_context("spawn")
    a_r, a_w = ctx.Pipe(False)
    b_r, b_w = ctx.Pipe(False)
    child = ctx.Process(target=_ping_child, args=(a_r, b_w), daemon=True)
    child.start()
    out = {}
    try:
        for idle_ms in (0, 1, 20):
            rt = []
            for _ in range(rounds):
                time.sleep(idle_ms / 1e3)
                t0 = time.perf_counter()
                a_w.send(1)
                b_r.recv()
                rt.append(time.perf_counter() - t0)
            out[f"after_{idle_ms}ms_idle_round_trip_us_p50"] = 1e6 * float(np.median(rt))
    finally:
        a_w.send(None)
        child.join(5)
    return out


def alone(llm, text: str, max_tokens: int) -> list[tuple[float, float]]:
    """(start, end) of each step of one request run alone through an ``EngineCore`` here,
    fed as the server's core is (token ids, greedy, deltas)."""
    from paged_jax import SamplingParams
    from paged_jax.engine.sampling import RequestOutputKind
    from paged_jax.serve.core import EngineCore

    core, steps = EngineCore(llm), []
    step = core.step

    def timed():
        t0 = time.perf_counter()
        report = step()
        steps.append((t0, time.perf_counter()))
        return report

    core.step = timed
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    commands = [[("add", "alone", llm.get_tokenizer().encode(text), params)]]
    core.run(lambda timeout: commands.pop(0) if commands else [] if core.has_work() else [("stop",)],
             lambda report: None)
    return steps


async def _requests(url: str, requests, repeats: int, llm=None) -> tuple[list, list]:
    """Each request alone, streamed: (sent at, [arrival of each data line]); with ``llm``,
    each followed by the same request through ``alone`` (its steps)."""
    out, solo = [], []
    async with S._session() as session:
        for _ in range(repeats):
            for text, m in requests:
                body = {"model": S.NAME, "prompt": text, "max_tokens": m, "temperature": 0, "ignore_eos": True,
                        "stream": True}
                t0, arrivals = time.perf_counter(), []
                async with session.post(url + "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for line in r.content:
                        if line.startswith(b"data:"):
                            arrivals.append(time.perf_counter())
                out.append((t0, arrivals))
                if llm is not None:
                    solo.append(alone(llm, text, m))
                await asyncio.sleep(0.02)
    return out, solo


def phases(events: list[tuple[float, str]], requests: list[tuple[float, list[float]]],
           solo: list[list[tuple[float, float]]] = ()) -> dict:
    """Per-request phase durations (s) from the merged, sorted server ``events`` and the
    client's ``requests`` (and ``solo``: each alone run's step (start, end) pairs); each
    phase's list (steps and gaps: one entry per step)."""
    times = np.array([t for t, _ in events])
    got: dict = {k: [] for k in PHASES}
    for t0, arrivals in requests:
        if not arrivals:
            continue
        end = arrivals[-1]
        window = events[np.searchsorted(times, t0):np.searchsorted(times, end, side="right")]

        def first(name, after=t0):
            return next((t for t, e in window if e == name and t >= after), None)

        received, submit, add = first("received"), first("submit"), first("apply_add")
        starts = [t for t, e in window if e == "step_start"]
        ends = [t for t, e in window if e == "step_end"]
        reports = [t for t, e in window if e == "reports"]
        if None in (received, submit, add) or not starts or len(starts) != len(ends):
            continue
        got["client_to_server"].append(received - t0)
        got["http_to_submit"].append(submit - received)
        got["submit_to_engine"].append(add - submit)
        got["add_to_first_step"].append(starts[0] - add)
        got["step"] += [b - a for a, b in zip(starts, ends, strict=True)]
        got["between_steps"] += [b - a for a, b in zip(ends, starts[1:], strict=False)]
        got["report_to_http"] += [r - e for e in ends if (r := next((x for x in reports if x >= e), None))]
        got["last_step_to_client"].append(end - ends[-1])
        got["e2e"].append(end - t0)
    for steps in solo:
        got["alone_step"] += [b - a for a, b in steps]
        got["alone_between_steps"] += [b[0] - a[1] for a, b in zip(steps, steps[1:], strict=False)]
    return got


def run(model: str, num: int, repeats: int, pin: bool, engine: str | None = None) -> dict:
    requests = S.workload(model, num, 8, 16)
    llm = None if pin else S.engine_alone(model, S.engine_options(True), requests)
    with tempfile.TemporaryDirectory() as site, tempfile.TemporaryDirectory() as logs:
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write(SITECUSTOMIZE)
        env = {**os.environ, "TIMELINE_DIR": logs,
               "PYTHONPATH": os.pathsep.join([site, *filter(None, [os.environ.get("PYTHONPATH")])])}
        port = S._free_port()
        command = S.ours_command(model, port, S.engine_options(True), engine)
        proc = subprocess.Popen((["taskset", "-c", "0"] if pin else []) + command, cwd=S.ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        mine = os.sched_getaffinity(0)
        try:
            url = f"http://127.0.0.1:{port}"
            S._wait_healthy(proc, url, 600)
            if pin:  # the HTTP process's threads to CPU 1; the engine process (its child) stays on 0
                subprocess.run(["taskset", "-a", "-p", "-c", "1", str(proc.pid)], check=True, capture_output=True)
                os.sched_setaffinity(0, {1})
            asyncio.run(_requests(url, requests[:4], 1))  # warm
            got, solo = asyncio.run(_requests(url, requests, repeats, llm))
        finally:
            os.sched_setaffinity(0, mine)
            S._stop(proc)
        events = []
        for path in glob.glob(os.path.join(logs, "*.txt")):
            with open(path) as f:
                for line in f:
                    t, _, e = line.strip().partition(" ")
                    if e:
                        events.append((float(t), e))
    events.sort()
    per = phases(events, got, solo)
    return {"requests": len(per["e2e"]), "sse_events_per_request_p50": float(np.median([len(a) for _, a in got])),
            "ms_p50": {k: 1e3 * float(np.median(v)) if v else None for k, v in per.items()},
            "ms_p90": {k: 1e3 * float(np.percentile(v, 90)) if v else None for k, v in per.items()}}


def main(argv: list[str] | None = None) -> dict:
    from paged_jax.serve.__main__ import ENGINES  # the server's placements, its default first

    p = argparse.ArgumentParser(prog="python -m experiments serving_timeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=FIXTURE)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engine", choices=ENGINES, default=ENGINES[0],
                   help="where the server's engine core runs (its --engine)")
    p.add_argument("--pin", action="store_true",
                   help="engine process on CPU 0, HTTP process and client on CPU 1 (with --engine process)")
    p.add_argument("--quick", action="store_true", help="4 prompts, once")
    p.add_argument("--out", default="docs/results")
    args = p.parse_args(argv)
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        sys.exit("--pin needs two CPUs")
    if args.pin and args.engine != "process":
        sys.exit("--pin places the engine process: it needs --engine process")
    num, repeats = (4, 1) if args.quick else (args.num_prompts, args.repeats)
    wake = wake_latency(50 if args.quick else 200)
    print("wake-up round trip between two processes (µs p50): "
          + ", ".join(f"{k.split('_')[1]} idle {v:.0f}" for k, v in wake.items()))
    got = run(args.model, num, repeats, args.pin, args.engine)
    print(f"{args.engine} engine, one request at a time, {got['requests']} requests, "
          f"{got['sse_events_per_request_p50']:.0f} SSE events p50"
          f"{' (pinned)' if args.pin else ''}:")
    for k in PHASES:
        v50, v90 = got["ms_p50"][k], got["ms_p90"][k]
        if v50 is not None:
            print(f"  {k:22s} p50 {v50:7.3f} ms  p90 {v90:7.3f} ms")
    result = {"study": "serving_timeline", "machine": machine_info(),
              "config": {"model": shown_path(args.model), "num_prompts": num, "repeats": repeats, "pin": args.pin,
                         "engine": args.engine,
                         "engine_options": S.engine_options(True), "client": S.CLIENT},
              "wake_latency": wake, **got,
              "headline": {"e2e_ms_p50": got["ms_p50"]["e2e"], "step_ms_p50": got["ms_p50"]["step"],
                           "between_steps_ms_p50": got["ms_p50"]["between_steps"],
                           "alone_step_ms_p50": got["ms_p50"]["alone_step"],
                           "wake_round_trip_us_after_20ms_idle": wake["after_20ms_idle_round_trip_us_p50"]}}
    write_json(args.out, "serving_timeline", result)
    return result


if __name__ == "__main__":
    main()
