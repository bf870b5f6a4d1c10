"""``python -m paged_jax.serve`` as a user runs it: a subprocess on 127.0.0.1, LLM options
on the command line, the openai client against it, and SIGTERM draining a stream in flight
(it runs to its end, then the process exits by the signal, as uvicorn does, with no
traceback), with the engine stepped on the server's loop (the default), in its own process
(that process is gone too once the server exits) or on a thread. Slow: a fresh process loads
and compiles."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from proc_utils import gone

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "tests", "fixtures", "llama_text")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["inline", "process", "thread"])
def test_cli_serves_the_openai_client_and_sigterm_drains(engine):
    port = _free_port()
    cmd = [sys.executable, "-m", "paged_jax.serve", TEXT, "--port", str(port), "--served-model-name", "tiny",
           "--block-size", "8", "--num-gpu-blocks", "64", "--max-num-seqs", "4", "--max-model-len", "96",
           "--no-enable-prefix-caching", "--no-warmup", "--log-level", "warning", "--engine", engine]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        children = _children(proc.pid)  # the engine process (and multiprocessing's resource tracker)
        engines = [c for c in children if "resource_tracker" not in _cmdline(c)]
        assert len(engines) == (1 if engine == "process" else 0), [_cmdline(c) for c in children]
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120, max_retries=0)
        r = c.completions.create(model="tiny", prompt="The little lighthouse", max_tokens=6, temperature=0)
        assert r.usage.completion_tokens <= 6 and r.model == "tiny"
        body = {"model": "tiny", "prompt": "The sea", "max_tokens": 40, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.Client(timeout=120) as h, h.stream("POST", url + "/v1/completions", json=body) as s:
            lines = (line for line in s.iter_lines() if line.startswith("data:"))
            next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "length"
        # uvicorn re-raises the signal once it has shut down gracefully: the process ends by it
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert "Traceback" not in proc.stdout.read()
        deadline = time.monotonic() + 30  # the resource tracker exits once it sees its parent's pipe close
        while not all(gone(child) for child in children):
            assert time.monotonic() < deadline, [_cmdline(c) for c in children if not gone(c)]
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_cli_options_engine_and_keep_alive():
    """``--engine`` takes the three placements (inline by default); a bad one, or a
    keep-alive that is not > 0, is refused before anything is built."""
    from paged_jax.serve.__main__ import ENGINES, main, parser

    assert parser().parse_args([TEXT]).engine == "inline" and set(ENGINES) == {"process", "inline", "thread"}
    with pytest.raises(SystemExit):
        parser().parse_args([TEXT, "--engine", "fork"])
    with pytest.raises(ValueError, match="--timeout-keep-alive 0.0: must be > 0"):
        main([TEXT, "--timeout-keep-alive", "0"])
