"""An OpenAI-compatible server for ``LLM``: ``python -m paged_jax.serve MODEL`` (or
``paged-jax-serve MODEL``), FastAPI + uvicorn (the ``serve`` extra).

- ``core``: the engine core, the loop stepping the offline engine while HTTP requests join
  and leave between steps (continuous batching across clients), abort, engine errors;
  ``async_engine``: the asyncio callers' side of it (back-pressure, drain, delivery), the
  core stepped on the server's own loop (``InlineEngine``, the default of ``build_app(llm)``
  and of the CLI) and on a thread (``AsyncEngine``); ``engine_process``: the core in a process
  of its own (``ProcessEngine``, ``--engine process``);
- ``app``: the routes (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
  ``/health``, ``/metrics``, ``/tokenize``, ``/detokenize``); ``protocol``: the wire format;
  ``metrics``: Prometheus;
- ``server``: ``serve`` (blocking) and ``start_in_thread`` (tests, notebooks).
"""

from paged_jax.serve.app import build_app
from paged_jax.serve.async_engine import (
    AsyncEngine,
    EngineClient,
    EngineError,
    InlineEngine,
    Overloaded,
    RequestStream,
)
from paged_jax.serve.engine_process import ProcessEngine
from paged_jax.serve.server import RunningServer, serve, start_in_thread

__all__ = ["AsyncEngine", "EngineClient", "EngineError", "InlineEngine", "Overloaded", "ProcessEngine", "RequestStream",
           "RunningServer", "build_app", "serve", "start_in_thread"]
