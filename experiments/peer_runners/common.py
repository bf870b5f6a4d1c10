"""What every peer runner shares (standard library only: each runner runs in its own venv).

A runner is ``python RUNNER.py WORKLOAD.json OUT.json``. The workload (written by
``experiments/peers.py``): ``{"model": dir, "dtype": name, "prompts": [[ids]], "max_tokens": N,
"kv_cache_bytes": B, "max_model_len": N, "enable_prefix_caching": false}`` (prefix caching
off in every engine: the timed pass repeats the first pass's prompts). The runner loads the
engine (``load_s``), runs the whole workload once untimed-but-recorded (``first_call_s``: compiles included), then again timed, and writes
``{"name", "versions", "load_s", "first_call_s", "run_s", "cpu_s" (the timed pass's CPU seconds
over the process tree), "first_token_s": [per prompt, from
the run's start], "finish_s": [...], "tokens": [[ids]], "peak_rss_bytes"}``: the peak summed
resident memory of the runner's process tree (vLLM's engine core is a child), sampled.
With ``"first_pass_only": true`` in the workload it stops after the first pass and writes
``{"name", "versions", "dtype", "load_s", "first_call_s", "peak_rss_bytes"}`` (start-up only).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def read_workload(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def write_result(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f)


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and all its descendants now."""
    kids, total, todo = _children(), 0, [root]
    while todo:
        pid = todo.pop()
        total += _rss(pid)
        todo.extend(kids.get(pid, []))
    return total


def tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of ``root`` and its live descendants (``/proc/PID/stat``):
    an engine's work, whatever other jobs on the machine take of its wall time."""
    kids, total, todo = _children(), 0, [root]
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
        todo.extend(kids.get(pid, []))
    return total / tick


class PeakRSS:
    """Samples ``tree_rss(os.getpid())`` every ``period`` s in a daemon thread; ``.peak``."""

    def __init__(self, period: float = 0.25):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period,), daemon=True)
        self._thread.start()

    def _loop(self, period: float) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(os.getpid()))
            self._stop.wait(period)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_rss(os.getpid()))
        return self.peak


_PASSES = [0]


def drive(add_all, step, has_unfinished, n: int) -> dict:
    """Run one pass of a step-driven engine: ``add_all(prefix)`` queues the n prompts with
    request ids ``f"{prefix}{i}"`` (new ids every pass), ``step()`` returns
    ``[(request_id, token_ids so far, finished)]``. Returns the pass's wall time, per-prompt
    first-token and finish times (from the pass's start) and tokens."""
    _PASSES[0] += 1
    prefix = f"p{_PASSES[0]}-"
    first, finish, tokens = [None] * n, [None] * n, [None] * n
    t0, c0 = time.perf_counter(), tree_cpu_s(os.getpid())
    add_all(prefix)
    while has_unfinished():
        for rid, ids, done in step():
            i = int(rid[len(prefix):])
            now = time.perf_counter() - t0
            if first[i] is None and len(ids) > 0:
                first[i] = now
            if done:
                finish[i], tokens[i] = now, list(ids)
    return {"run_s": time.perf_counter() - t0, "cpu_s": tree_cpu_s(os.getpid()) - c0, "first_token_s": first,
            "finish_s": finish, "tokens": tokens}


def main(name: str, load, run_pass, versions: dict) -> None:
    """The runner protocol (module docstring): ``load(workload) -> engine``,
    ``run_pass(engine, workload) -> drive()'s dict``."""
    workload_path, out_path = sys.argv[1], sys.argv[2]
    workload = read_workload(workload_path)
    peak = PeakRSS()
    t0 = time.perf_counter()
    engine = load(workload)
    load_s = time.perf_counter() - t0
    first = run_pass(engine, workload)
    result = {"name": name, "versions": versions, "dtype": workload["dtype"], "load_s": load_s,
              "first_call_s": first["run_s"]}
    if not workload.get("first_pass_only"):  # else a start-up measurement (e.g. a warm compilation cache)
        timed = run_pass(engine, workload)
        result.update(first_pass_tokens_equal=first["tokens"] == timed["tokens"], **timed)
    result["peak_rss_bytes"] = peak.stop()
    write_result(out_path, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("tokens", "first_token_s", "finish_s")}))
