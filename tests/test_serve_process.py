"""The engine core in its own process (``ProcessEngine``), where it can die on its own: a
killed child fails its in-flight requests with 500 (streamed: an error event, then
[DONE]) and turns ``/health`` to 503; stopping the server stops the child; a parent that
dies takes the child with it. (The routes against the process mode, outputs equal to
``LLM.generate`` and abort freeing blocks, are test_serve.py's "process" cases.) Servers on
127.0.0.1, every wait bounded."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from proc_utils import gone

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from paged_jax.serve import ProcessEngine, start_in_thread  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "tests", "fixtures", "llama_text")
KW = dict(block_size=8, num_gpu_blocks=64, max_num_seqs=4, max_model_len=96, max_num_batched_tokens=64)
TIMEOUT = 60.0
BODY = {"model": "tiny", "prompt": "The sea", "max_tokens": 88, "temperature": 0, "ignore_eos": True}


def _wait_gone(pid: int, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not gone(pid):
        assert time.monotonic() < deadline, f"process {pid} is still alive"
        time.sleep(0.05)


def test_a_killed_engine_process_fails_requests_500_and_health_503():
    engine = ProcessEngine(TEXT, KW, warmup=False)
    server = start_in_thread(engine=engine, model_name="tiny")
    try:
        assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
        plain: dict = {}

        def post():
            plain["r"] = httpx.post(server.url + "/v1/completions", json=BODY, timeout=TIMEOUT)

        t = threading.Thread(target=post)
        t.start()
        with httpx.Client(timeout=TIMEOUT) as h, h.stream("POST", server.url + "/v1/completions",
                                                          json={**BODY, "stream": True}) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data:"))
            assert json.loads(next(lines)[5:])["choices"]
            deadline = time.monotonic() + TIMEOUT
            while engine.usage().running < 2:  # both requests running in the child
                assert time.monotonic() < deadline and t.is_alive(), engine.usage()
                time.sleep(0.01)
            os.kill(engine.pid, signal.SIGKILL)
            rest = list(lines)
        t.join(TIMEOUT)
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][5:])["error"]
        assert "engine process died" in err["message"]
        assert plain["r"].status_code == 500 and "engine process died" in plain["r"].json()["error"]["message"]
        assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 503
        assert not engine.alive and engine.wait_idle(0)
        again = httpx.post(server.url + "/v1/completions", json=BODY, timeout=TIMEOUT)
        assert again.status_code == 503 and "not running" in again.json()["error"]["message"]
    finally:
        server.stop()
    _wait_gone(engine.pid)


def test_stopping_the_server_stops_the_engine_process():
    engine = ProcessEngine(TEXT, KW, warmup=False)
    server = start_in_thread(engine=engine, model_name="tiny")
    try:
        r = httpx.post(server.url + "/v1/completions", json={**BODY, "max_tokens": 4}, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert engine.wait_idle(TIMEOUT) and engine.usage().blocks_used == 0
    finally:
        server.stop()
    assert not engine.alive
    _wait_gone(engine.pid, timeout=5)


_ORPHAN = """
import sys, time
from paged_jax.serve import ProcessEngine
if __name__ == "__main__":
    engine = ProcessEngine(sys.argv[1], {"block_size": 8, "num_gpu_blocks": 64, "max_model_len": 96}, warmup=False)
    print(engine.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_the_engine_process_exits_when_its_parent_dies(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(_ORPHAN)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    parent = subprocess.Popen([sys.executable, str(script), TEXT], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              text=True)
    try:
        child = int(parent.stdout.readline())
        assert not gone(child)
        parent.kill()  # no clean-up runs: only the closed pipe tells the child
        parent.wait(TIMEOUT)
        _wait_gone(child)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(TIMEOUT)
