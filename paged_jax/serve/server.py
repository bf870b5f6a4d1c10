"""Running the app: ``serve(llm, host, port)`` (blocking; what the CLI runs) and
``start_in_thread(llm)`` (a server on 127.0.0.1 in a background thread, for tests,
notebooks and studies), both on uvicorn.

SIGTERM (and Ctrl-C) drain: uvicorn stops accepting connections, the engine refuses new
requests (503), in-flight requests finish (up to ``app.DRAIN_SECONDS``), then the engine
(its thread, or its process) stops.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from paged_jax.serve.app import build_app
from paged_jax.serve.async_engine import InlineEngine

# How long an idle keep-alive connection stays open, s: longer than the clients' own idle
# expiry (aiohttp 15 s, httpx and so the openai package 5 s), so that a client never reuses
# a connection the server is closing at that moment (the client's request then meets a
# reset). uvicorn's default, 5 s, raced aiohttp's pool: 2 of 128 requests reset at 1 req/s
# with the inline engine, whose keep-alive closes leave right after a step's burst of SSE
# chunks, while the client is busy reading them (docs/results/notes/serving.md). nginx's
# default.
KEEP_ALIVE_S = 75.0


def _event_loop(engine) -> str:
    """uvicorn's ``loop`` for ``engine``: asyncio's own loop for the inline engine, whose turns
    are timers due at once. Under uvloop (what uvicorn's "auto" picks where it is installed)
    each such timer made libuv take one new connection per loop iteration, i.e. one request
    per engine step: 10 connections 50 ms apart were read over 1.8 s behind 0.2 s steps, in
    batches over 0.4 s on asyncio's loop, and under load the inline server admitted one
    request per step (docs/results/notes/serving.md). Other engines: uvicorn's default."""
    return "asyncio" if isinstance(engine, InlineEngine) else "auto"


class _Server(uvicorn.Server):
    """uvicorn's server, telling the engine to drain when a signal asks it to exit."""

    def __init__(self, config, engine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame):
        self.engine.begin_drain()
        super().handle_exit(sig, frame)


def serve(llm=None, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
          timeout_keep_alive: float = KEEP_ALIVE_S, **app_kw) -> None:
    """Serve ``llm`` (or ``engine=``, ``build_app``'s keywords pass through) until SIGTERM/SIGINT."""
    app = build_app(llm, **app_kw)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=60,
                            timeout_keep_alive=timeout_keep_alive, loop=_event_loop(app.state.engine))
    _Server(config, app.state.engine).run()


class RunningServer:
    """A server in a background thread: ``url`` (``http://127.0.0.1:PORT``), ``app``,
    ``engine``; ``stop()`` drains and joins it (also as a context manager)."""

    def __init__(self, server: _Server, thread: threading.Thread, port: int, app):
        self._server, self._thread, self.port, self.app = server, thread, port, app
        self.url = f"http://127.0.0.1:{port}"
        self.engine = app.state.engine

    def stop(self, timeout: float = 30.0) -> None:
        self.engine.begin_drain()
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the server thread did not stop within {timeout} s")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_in_thread(llm=None, *, timeout: float = 30.0, log_level: str = "warning",
                    timeout_keep_alive: float = KEEP_ALIVE_S, **app_kw) -> RunningServer:
    """Start a server for ``llm`` (or ``engine=``: ``build_app``'s keywords pass through) on 127.0.0.1 at a free port (the socket is bound here, so
    no other process can take the port in between); returns once it accepts connections
    (TimeoutError after ``timeout`` seconds)."""
    app = build_app(llm, **app_kw)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=30,
                            timeout_keep_alive=timeout_keep_alive, loop=_event_loop(app.state.engine))
    server = _Server(config, app.state.engine)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="paged_jax-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"the server did not start within {timeout} s")
        time.sleep(0.02)
    return RunningServer(server, thread, port, app)
