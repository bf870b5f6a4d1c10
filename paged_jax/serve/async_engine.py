"""The async engine: one thread stepping an ``LLM`` while requests join and leave between
steps, so HTTP requests batch with each other (continuous batching across clients).

The engine thread owns the ``LLM``: every ``add_request``, ``abort`` and ``step`` happens
on it, so the engine code is exactly the offline one (``LLM.add_request`` / ``step`` /
``abort``, nothing private). Callers on an asyncio loop talk to it through a command queue
and get each request's ``RequestOutput``s (cumulative, one per step that changed it): the
outputs of every request of a step are handed to the loop in one ``call_soon_threadsafe``,
and each request keeps only its latest output until its consumer reads it, so outputs
that pile up while the consumer is busy (a slow client, a loop waiting for the GIL) are
read as one (coalesced: the cumulative output holds every token, text and logprob).

- **Join/leave between steps.** Commands queued while a step runs are applied before the
  next one; an idle thread sleeps on the queue.
- **Abort.** A caller that stops consuming (client disconnect, cancellation) aborts its
  request; the next ``LLM.step`` releases its blocks, so an idle engine holds none.
- **Back-pressure.** More than ``max_waiting`` requests queued but not running: ``Overloaded``
  (the server's 503) before anything is queued.
- **Drain.** ``begin_drain`` refuses new requests (``Overloaded``) and lets the running ones
  finish; ``wait_idle`` waits for that; ``shutdown`` stops the thread (unfinished requests
  aborted).
- **Engine errors.** An exception inside a step (the engine resets itself, aborting
  everything) is delivered to every in-flight request as ``EngineError``; the loop goes on.

Metrics (``ServerMetrics``, prometheus_client): time to first token and inter-token
latency per request, measured here when its outputs reach the loop, and the engine's
counts (``LLM.usage()``) after every step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from concurrent.futures import Future

from paged_jax.engine import intake
from paged_jax.serve.metrics import ServerMetrics


class Overloaded(Exception):
    """The server cannot take a request now (back-pressure or draining): HTTP 503."""


class EngineError(Exception):
    """The engine failed while running a request (its step raised): HTTP 500."""


@dataclasses.dataclass(eq=False)
class _Stream:
    loop: asyncio.AbstractEventLoop
    arrival: float  # perf_counter when submitted
    last: float = 0.0  # perf_counter of the last output with new tokens (engine thread)
    tokens: int = 0  # engine thread
    item: object = None  # loop only: the latest unread output, or an exception (which sticks)
    waiter: asyncio.Future | None = None  # loop only: the consumer waiting for ``item``
    coalesced: int = 0  # loop only: outputs replaced by a later one before being read


class AsyncEngine:
    """Serve an ``LLM`` to asyncio callers (module docstring).

    Args:
      llm: the engine, used only from this object's thread once ``start`` is called.
      max_waiting: requests queued but not yet running beyond which ``generate`` raises
        ``Overloaded``.
      metrics: a ``ServerMetrics`` (default: a fresh one with its own registry).
    """

    def __init__(self, llm, *, max_waiting: int = 512, metrics: ServerMetrics | None = None):
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting!r}: must be an int >= 1")
        self.llm = llm
        self.max_waiting = max_waiting
        self.metrics = metrics or ServerMetrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._pending_adds = 0  # submitted, not yet added (guarded by _lock)
        self._lock = threading.Lock()
        self._usage = llm.usage()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.draining = False
        self.errors = 0
        self._next_id = 0
        self.metrics.bind(self)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> AsyncEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="paged_jax-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def begin_drain(self) -> None:
        """Refuse new requests from now on; running ones go on to completion."""
        self.draining = True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is queued, running or unreleased; True if it happened."""
        return self._idle.wait(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (after its current step); unfinished requests are aborted."""
        self.draining = True
        self._stopping = True
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ what callers see

    def usage(self):
        """``LLM.usage()`` as of the last step (read without touching the engine)."""
        return self._usage

    @property
    def num_waiting(self) -> int:
        """Requests submitted but not yet running."""
        u = self._usage
        return u.waiting + u.swapped + self._pending_adds

    def validate(self, prompt_token_ids: list[int], params) -> None:
        """``ValueError`` naming the limit for a request the engine would refuse (an empty or
        too long prompt, a bad token id, ``n`` above ``max_num_seqs``) or could never fit
        in the KV pool, checked on the caller's thread before anything is queued."""
        try:
            why = intake.validate(self.llm.config, 0, prompt_token_ids, params)
        except ValueError as e:
            raise ValueError(_one_request(str(e))) from None
        if why is not None:
            raise ValueError(_one_request(why))

    def submit(self, prompt_token_ids: list[int], params) -> RequestStream:
        """Queue a request; iterate the returned ``RequestStream`` for its outputs. Raises,
        before anything is queued, ``Overloaded`` (draining, or ``max_waiting`` requests
        already waiting) or ``ValueError`` (``validate``)."""
        if self.draining or not self.alive:
            raise Overloaded("the server is shutting down" if self.draining else "the engine is not running")
        if self.num_waiting >= self.max_waiting:
            self.metrics.rejected.inc()
            raise Overloaded(f"too many requests waiting ({self.num_waiting}; --max-waiting {self.max_waiting})")
        self.validate(prompt_token_ids, params)
        stream = _Stream(asyncio.get_running_loop(), time.perf_counter())
        added: Future = Future()
        with self._lock:
            self._pending_adds += 1
            self._next_id += 1
            request_id = f"srv-{self._next_id}"
            self._idle.clear()
        self._commands.put(("add", request_id, prompt_token_ids, params, stream, added))
        return RequestStream(self, request_id, stream, added)

    # ------------------------------------------------------------------ the engine thread

    def _apply(self, command) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, ids, params, stream, added = command
            try:
                self.llm.add_request({"prompt_token_ids": ids}, params, request_id=request_id)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                added.set_exception(e)
            else:
                self._streams[request_id] = stream
                added.set_result(request_id)
            finally:
                with self._lock:
                    self._pending_adds -= 1
        elif kind == "abort":
            _, request_id = command
            if self._streams.pop(request_id, None) is not None:
                self.metrics.aborted.inc()
                try:
                    self.llm.abort(request_id)
                except ValueError:  # finished in the step that just ran: nothing to abort
                    pass

    def _loop(self) -> None:
        llm = self.llm
        dirty = False  # an abort or a finish whose rows a step still has to release
        while not self._stopping:
            busy = llm.has_unfinished_requests()
            with self._lock:
                if not busy and not dirty and self._pending_adds == 0:
                    self._idle.set()
            try:  # block only when there is nothing to step
                command = self._commands.get(timeout=0.5) if not busy and not dirty else self._commands.get_nowait()
            except queue.Empty:
                command = None
            while command is not None:
                if command[0] == "abort":
                    dirty = True
                self._apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self._stopping:
                break
            if not llm.has_unfinished_requests() and not dirty:
                continue
            try:
                outputs = llm.step()
            except Exception as e:  # noqa: BLE001 - the engine reset itself; fail its requests
                self.errors += 1
                self._fail_all(EngineError(f"the engine failed: {type(e).__name__}: {e}"))
                dirty = True
                continue
            dirty = False  # an idle engine's step released every row left (LLM.step)
            self._usage = llm.usage()
            self._deliver(outputs)
        self._fail_all(Overloaded("the server shut down"))
        self._idle.set()

    def _deliver(self, outputs) -> None:
        now = time.perf_counter()
        by_loop: dict = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted by its caller
                continue
            tokens = sum(len(c.token_ids) for c in out.outputs)
            if tokens > stream.tokens:
                if stream.tokens == 0:
                    self.metrics.ttft.observe(now - stream.arrival)
                else:
                    self.metrics.itl.observe(now - stream.last)
                stream.tokens, stream.last = tokens, now
            if out.finished:
                del self._streams[out.request_id]
                self.metrics.finished(out, now - stream.arrival)
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, error: Exception) -> None:
        by_loop: dict = {}
        for stream in self._streams.values():
            by_loop.setdefault(stream.loop, []).append((stream, error))
        self._streams.clear()
        for loop, items in by_loop.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(_put_all, items)
        try:  # forget the aborted requests
            self.llm.step()
        except Exception:  # noqa: BLE001
            pass
        self._usage = self.llm.usage()


class RequestStream:
    """One submitted request: ``async for out in stream`` yields its ``RequestOutput``s
    (each cumulative; the last has ``finished``), raising ``EngineError`` if the engine
    failed. Leaving the loop early, being cancelled in it, or ``abort()`` aborts it."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream, added: Future):
        self.engine, self.request_id, self._stream, self._added = engine, request_id, stream, added
        self.done = False

    def abort(self) -> None:
        """Abort the request (its blocks are released at the engine's next step); no-op once done."""
        if not self.done:
            self.done = True
            self.engine._commands.put(("abort", self.request_id))  # runs after its add: commands keep order

    async def __aiter__(self):
        try:
            await asyncio.wrap_future(self._added)  # add_request's ValueError lands here
            s = self._stream
            while True:
                item = s.item
                if item is None:
                    s.waiter = s.loop.create_future()
                    try:
                        await s.waiter
                    finally:
                        s.waiter = None
                    continue
                if isinstance(item, BaseException):
                    self.done = True
                    raise item
                s.item = None
                if item.finished:
                    self.done = True
                yield item
                if item.finished:
                    return
        finally:
            self.abort()


def _one_request(message: str) -> str:
    """intake's message about request 0 of a batch, about the one request."""
    return message.replace("request 0: ", "", 1).replace("prompt 0 ", "the prompt ", 1)


def _put_all(items) -> None:
    """On the loop: each stream's latest output replaces an unread one (outputs are
    cumulative); an exception replaces anything and is never replaced; the waiting
    consumer, if any, is woken."""
    for stream, item in items:
        held = stream.item
        if isinstance(held, BaseException):
            continue
        if held is not None:
            stream.coalesced += 1
        stream.item = item
        waiter = stream.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
