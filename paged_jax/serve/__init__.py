"""An OpenAI-compatible server for ``LLM``: ``python -m paged_jax.serve MODEL`` (or
``paged-jax-serve MODEL``), FastAPI + uvicorn (the ``serve`` extra).

- ``async_engine``: one thread stepping the offline engine while HTTP requests join and
  leave between steps (continuous batching across clients), abort on disconnect,
  back-pressure, drain;
- ``app``: the routes (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
  ``/health``, ``/metrics``, ``/tokenize``, ``/detokenize``); ``protocol``: the wire format;
  ``metrics``: Prometheus;
- ``server``: ``serve`` (blocking) and ``start_in_thread`` (tests, notebooks).
"""

from paged_jax.serve.app import build_app
from paged_jax.serve.async_engine import AsyncEngine, EngineError, Overloaded, RequestStream
from paged_jax.serve.server import RunningServer, serve, start_in_thread

__all__ = ["AsyncEngine", "EngineError", "Overloaded", "RequestStream", "RunningServer", "build_app", "serve",
           "start_in_thread"]
