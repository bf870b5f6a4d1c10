"""The engine core in a process of its own (the server's ``--engine process``, as vLLM V1's
EngineCore): the HTTP side's Python (parsing, routing, pydantic, tokenising, writing SSE
chunks) does not share a GIL with the engine step, and runs beside it rather than between
steps, at the price of a pipe and two wake-ups per step on each streamed token's way.

``ProcessEngine(model, engine_kwargs)`` starts a child with multiprocessing's "spawn"
context (JAX must not be forked once initialised), which builds ``LLM(model,
**engine_kwargs)`` (and warms it up), sends back its ``EngineConfig`` (less anything
device-bound: the parent reads the tokenizer, limits, defaults and chat template from it
through an ``LLMInfo``, without building the model), and runs ``core.EngineCore``:
commands arrive on one pipe, and each step's ``StepReport`` (the outputs of the requests
it changed and ``usage()``) leaves on another as one message. In the parent a reader
thread blocks on that pipe (the GIL released) and hands each batch of reports to the
asyncio loop with one ``call_soon_threadsafe`` (``EngineClient._on_reports``: the same
delivery, metrics and coalescing as the thread mode).

- **Child death** (killed, crashed): the reader sees the pipe close; every open request
  gets ``EngineError`` (the server's 500) and ``alive`` turns False (``/health`` 503).
- **Parent death**: the child sees its command pipe close (between steps, or while idle)
  and exits, so no engine outlives its server.
- **Signals**: the child ignores SIGINT and SIGTERM (a Ctrl-C or a SIGTERM to the whole
  process group reaches it too); the server drains on them and then stops it with a stop
  command (``shutdown``: its unfinished requests get ``Overloaded``), killing it only if it
  does not exit in time.
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing
import signal
import threading
import time
import traceback

from paged_jax.serve.async_engine import EngineClient
from paged_jax.serve.core import EngineCore, EngineError, Overloaded
from paged_jax.serve.metrics import ServerMetrics

READY_TIMEOUT_S = 900.0  # building and warming a model in the child


def serving_config(config):
    """``config`` without what cannot leave its process: a mesh (devices) or a backend object
    given as the model (step functions); what the HTTP side reads is all there."""
    model = dataclasses.replace(config.model, backend=None)
    if model.draft is not None:
        model = dataclasses.replace(model, draft=dataclasses.replace(model.draft, backend=None))
    return dataclasses.replace(config, model=model, parallel=dataclasses.replace(config.parallel, mesh=None))


class ProcessEngine(EngineClient):
    """An ``EngineClient`` whose core runs ``LLM(model, **engine_kwargs)`` in a child process
    (module docstring). Returns once the child has built its ``LLM`` (``RuntimeError`` with the
    child's error if it could not; ``TimeoutError`` after ``ready_timeout`` seconds).

    Args:
      model, engine_kwargs: what the child's ``LLM`` is built from (picklable: a path and
        the ``EngineArgs`` options the command line gives).
      warmup: compile the decode/prefill programs in the child before serving.
      max_waiting, metrics: as ``AsyncEngine``'s.

    Attributes:
      model: an ``LLMInfo`` of the child's ``LLM``. pid: the child's process id.
    """

    def __init__(self, model, engine_kwargs: dict | None = None, *, warmup: bool = True, max_waiting: int = 512,
                 metrics: ServerMetrics | None = None, ready_timeout: float = READY_TIMEOUT_S):
        from paged_jax.engine.llm import LLMInfo

        ctx = multiprocessing.get_context("spawn")
        commands_r, self._commands = ctx.Pipe(duplex=False)
        self._reports, reports_w = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_child_main, args=(commands_r, reports_w, model, dict(engine_kwargs or {}),
                                                              warmup), name="paged_jax-engine-core", daemon=True)
        self._process.start()
        commands_r.close()  # the child's ends: their closing is how each side sees the other die
        reports_w.close()
        self._send_lock = threading.Lock()
        self._dead = self._stopping = False
        atexit.register(self._kill)  # before multiprocessing's own exit hook, which would wait on the child
        try:
            config, usage = self._wait_ready(ready_timeout)
        except BaseException:
            self._kill()
            raise
        super().__init__(LLMInfo(config), usage, max_waiting=max_waiting, metrics=metrics)
        self.pid = self._process.pid
        self._reader = threading.Thread(target=self._read, name="paged_jax-engine-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout: float):
        deadline = time.monotonic() + timeout
        while not self._reports.poll(1.0):
            if not self._process.is_alive():
                raise RuntimeError(f"the engine process exited (code {self._process.exitcode}) before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine process was not ready within {timeout} s")
        try:
            message = self._reports.recv()
        except EOFError:
            self._process.join(5)
            raise RuntimeError(f"the engine process exited (code {self._process.exitcode}) before it was ready") \
                from None
        if message[0] == "error":
            raise RuntimeError(f"the engine process could not build its LLM: {message[1]}\n{message[2]}")
        return message[1], message[2]

    # ------------------------------------------------------------------ EngineClient

    @property
    def alive(self) -> bool:
        return not self._dead and not self._closed and self._process.is_alive()

    def _send(self, command) -> None:
        try:
            with self._send_lock:
                self._commands.send(command)
        except (OSError, ValueError):  # the child is gone (or stopped): the reader fails what is open
            pass

    def _read(self) -> None:
        """The reader thread: reports to the loop until the child's pipe closes."""
        conn = self._reports
        error: Exception | None = None
        try:
            while True:
                batch = [conn.recv()]  # blocks with the GIL released
                while len(batch) < 64 and conn.poll():  # what else has arrived: one hand-over for all
                    batch.append(conn.recv())
                self._on_reports(batch)
        except (EOFError, OSError):
            pass
        except Exception as e:  # noqa: BLE001 - a report this side cannot read: the engine is lost to it
            error = EngineError(f"the engine process's report could not be read: {type(e).__name__}: {e}")
        self._dead = True
        if error is None and not self._stopping:
            self._process.join(1.0)
            error = EngineError(f"the engine process died (exit code {self._process.exitcode})")
        self._close(error or Overloaded("the server shut down"))
        if not self._stopping:
            self._kill()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the child (after its current step; unfinished requests get ``Overloaded``),
        killing it if it has not exited within ``timeout`` seconds."""
        self.draining = self._stopping = True
        self._send(("stop",))
        self._process.join(timeout)
        self._kill()
        self._reader.join(timeout)

    def _kill(self) -> None:
        """Make sure the child is gone (idempotent; also at interpreter exit)."""
        if self._process.is_alive():
            self._process.kill()
        self._process.join(5)
        try:
            self._commands.close()
        except OSError:
            pass
        atexit.unregister(self._kill)


def _child_main(commands, reports, model, engine_kwargs: dict, warmup: bool) -> None:
    """The engine process: build the ``LLM``, say ready (or why not), run the core."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent drains on these, then stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        from paged_jax.engine.llm import LLM

        llm = LLM(model, **engine_kwargs)
        if warmup:
            llm.warmup(use_tqdm=False)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        reports.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    try:
        reports.send(("ready", serving_config(llm.config), llm.usage()))
    except OSError:  # the parent is gone
        return

    def take(timeout: float) -> list:
        batch = []
        try:
            if commands.poll(timeout):
                batch.append(commands.recv())
                while commands.poll():
                    batch.append(commands.recv())
        except (EOFError, OSError):  # the parent is gone: stop
            batch.append(("stop",))
        return batch

    try:
        EngineCore(llm).run(take, reports.send)
    except OSError:  # the parent is gone while a report was sent
        pass
