"""The async engine: an ``LLM`` stepped by an engine core (``core.EngineCore``) while
requests from asyncio callers join and leave between steps, so HTTP requests batch with each
other (continuous batching across clients).

``EngineClient`` is the caller's side, shared by the three places the core can run (the
server's ``--engine``): ``InlineEngine`` takes the core's turns on the callers' own asyncio
loop, between its other callbacks (nothing crosses a thread or a process: the lowest
latency per token at low load; ``build_app(llm)``'s default);
``AsyncEngine`` runs it on a thread of this process; ``engine_process.ProcessEngine`` in a
process of its own, so the HTTP side's Python does not share a GIL with the engine step.
Every way callers get each request's ``RequestOutput``s as its ``SamplingParams.output_kind``
asks (vLLM's ``RequestOutputKind``): deltas (what the server streams), the final output only
(what it answers when not streaming), or whole outputs (the default). The core always
reports deltas, so what crosses from the engine process per step is O(new tokens), not
O(length); this side adds them up where a caller wants more. The news of every request of a
step is handed to the loop in one ``call_soon_threadsafe`` (inline: at once), and each request keeps one
unread output until its consumer reads it, so outputs that pile up while the consumer is
busy (a slow client, a loop waiting for the GIL) are read as one (coalesced: deltas merged,
or the latest whole output).

- **Join/leave between steps, abort, engine errors**: the core (``core.py``). A caller
  that stops consuming (client disconnect, cancellation) aborts its request.
- **Back-pressure.** More than ``max_waiting`` requests queued but not running: ``Overloaded``
  (the server's 503) before anything is queued.
- **Drain.** ``begin_drain`` refuses new requests (``Overloaded``) and lets the running ones
  finish; ``wait_idle`` waits for that; ``shutdown`` stops the core (unfinished requests
  get ``Overloaded``).

Metrics (``ServerMetrics``, prometheus_client): time to first token and inter-token
latency per request, measured here when a step's report reaches this side, and the
engine's counts (``LLM.usage()``) after every step.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import queue
import threading
import time

from paged_jax.engine import intake
from paged_jax.engine.outputs import OutputAccumulator, merge_deltas
from paged_jax.engine.sampling import RequestOutputKind
from paged_jax.serve.core import EngineCore, EngineError, Overloaded, StepReport
from paged_jax.serve.metrics import ServerMetrics

__all__ = ["AsyncEngine", "EngineClient", "InlineEngine", "EngineError", "Overloaded", "RequestStream"]


@dataclasses.dataclass(eq=False)
class _Stream:
    loop: asyncio.AbstractEventLoop
    arrival: float  # perf_counter when submitted
    kind: RequestOutputKind | None = None  # what the caller reads (None: as the core reports, e.g. beams)
    prompt_tokens: int = 0
    acc: OutputAccumulator | None = None  # reporting thread: the whole output, for CUMULATIVE and FINAL_ONLY
    last: float = 0.0  # perf_counter of the last output with new tokens (reporting thread)
    tokens: int = 0  # reporting thread: tokens generated so far (all completions)
    reasons: dict = dataclasses.field(default_factory=dict)  # reporting thread: completion -> finish reason
    item: object = None  # loop only: the unread output (a merged delta, or the latest whole one) or an exception
    waiter: asyncio.Future | None = None  # loop only: the consumer waiting for ``item``
    coalesced: int = 0  # loop only: outputs merged into (or replaced by) a later one before being read


class EngineClient:
    """The caller's side of an engine core (module docstring); subclasses say where the core
    runs (``_send`` a command to it, ``alive``) and call ``_on_reports`` with what it reports.

    Attributes:
      model: what the HTTP side reads about the model (tokenizer, limits, defaults, chat
        rendering): the ``LLM`` itself, or an ``LLMInfo`` of the one in another process.
      metrics: the ``ServerMetrics``.
    """

    def __init__(self, model, usage, *, max_waiting: int = 512, metrics: ServerMetrics | None = None):
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting!r}: must be an int >= 1")
        self.model = model
        self.max_waiting = max_waiting
        self.metrics = metrics or ServerMetrics()
        self._streams: dict[str, _Stream] = {}  # submitted, not yet ended (guarded by _lock)
        self._lock = threading.Lock()
        self._usage = usage
        self._unapplied = 0  # commands sent, not yet reported applied (guarded by _lock)
        self._pending_adds = 0  # adds among them
        self._closed = False  # the core is gone: nothing sent now would be answered
        self._idle = threading.Event()
        self._idle.set()
        self.draining = False
        self._next_id = 0
        self.metrics.bind(self)

    # ------------------------------------------------------------------ where the core runs

    def start(self) -> EngineClient:
        return self

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def _send(self, command) -> None:
        """Hand a command to the core (in order with the caller's earlier ones); never raises."""
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ lifecycle

    def begin_drain(self) -> None:
        """Refuse new requests from now on; running ones go on to completion."""
        self.draining = True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is queued, running or unreleased; True if it happened."""
        return self._idle.wait(timeout)

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
            why = intake.validate(self.model.config, 0, prompt_token_ids, params)
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
        kind = getattr(params, "output_kind", None)
        if kind is not None and kind != RequestOutputKind.DELTA:  # the core always reports deltas
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        stream = _Stream(asyncio.get_running_loop(), time.perf_counter(), kind, len(prompt_token_ids),
                         OutputAccumulator() if kind is not None and kind != RequestOutputKind.DELTA else None)
        with self._lock:
            if self._closed:
                raise Overloaded("the engine is not running")
            self._next_id += 1
            request_id = f"srv-{self._next_id}"
            self._streams[request_id] = stream
            self._pending_adds += 1
            self._unapplied += 1
            self._idle.clear()
        # Outside the lock (a full pipe must not stall the reports); a stream registered before
        # the core went away gets its error from ``_close``.
        self._send(("add", request_id, prompt_token_ids, params))
        return RequestStream(self, request_id, stream)

    def _abort(self, request_id: str) -> None:
        with self._lock:
            if self._streams.pop(request_id, None) is None or self._closed:  # ended already
                return
            self.metrics.aborted.inc()
            self._unapplied += 1
            self._idle.clear()
        self._send(("abort", request_id))

    # ------------------------------------------------------------------ what the core reports

    def _on_reports(self, reports: list[StepReport]) -> None:
        """On the thread the reports arrive on: metrics, then every stream's news handed to
        its loop, one ``call_soon_threadsafe`` per loop for all of ``reports``. The core
        reports deltas: a DELTA stream gets them as they are; CUMULATIVE and FINAL_ONLY
        streams get them added up here (a FINAL_ONLY stream is handed only its final output,
        so a request that does not stream costs its loop one wake-up, not one per token)."""
        now = time.perf_counter()
        news: list = []
        items: list = []
        with self._lock:
            streams = self._streams
            for r in reports:
                self._usage = r.usage
                self._unapplied -= r.applied
                self._pending_adds -= r.adds
                for request_id, error in r.rejected:
                    if (stream := streams.pop(request_id, None)) is not None:
                        items.append((stream, error))
                for out in r.outputs:
                    stream = streams.get(out.request_id)
                    if stream is None:  # aborted by its caller
                        continue
                    if out.finished:
                        del streams[out.request_id]
                    news.append((stream, out))
                if r.failed is not None:
                    error, ids = r.failed
                    for request_id in ids:
                        if (stream := streams.pop(request_id, None)) is not None:
                            items.append((stream, error))
            if reports[-1].idle and self._unapplied == 0:
                self._idle.set()
        metrics = self.metrics
        for stream, out in news:
            kind = stream.kind
            if kind is None:  # whole outputs (a beam search): count what grew
                tokens = sum(len(c.token_ids) for c in out.outputs)
            else:
                tokens = stream.tokens + sum(len(c.token_ids) for c in out.outputs)
            if tokens > stream.tokens:
                if stream.tokens == 0:
                    metrics.ttft.observe(now - stream.arrival)
                else:
                    metrics.itl.observe(now - stream.last)
                stream.tokens, stream.last = tokens, now
            for c in out.outputs:
                if c.finish_reason is not None:
                    stream.reasons[c.index] = c.finish_reason
            if out.finished:
                metrics.finished(list(stream.reasons.values()), stream.tokens, stream.prompt_tokens,
                                 now - stream.arrival)
            if stream.acc is not None:
                stream.acc.add(out)
                if kind == RequestOutputKind.FINAL_ONLY and not out.finished:
                    continue
                out = stream.acc.output()
            items.append((stream, out))
        if items:
            _hand_over(items)

    def _close(self, error: Exception) -> None:
        """The core is gone: every stream still open gets ``error``; nothing more will run."""
        with self._lock:
            self._closed = True
            items = [(s, error) for s in self._streams.values()]
            self._streams.clear()
            self._unapplied = self._pending_adds = 0
            self._idle.set()
        _hand_over(items)


class AsyncEngine(EngineClient):
    """Serve an ``LLM`` to asyncio callers from an engine core on a thread of this process
    (module docstring).

    Args:
      llm: the engine, used only from this object's thread once ``start`` is called.
      max_waiting: requests queued but not yet running beyond which ``submit`` raises
        ``Overloaded``.
      metrics: a ``ServerMetrics`` (default: a fresh one with its own registry).
    """

    def __init__(self, llm, *, max_waiting: int = 512, metrics: ServerMetrics | None = None):
        super().__init__(llm, llm.usage(), max_waiting=max_waiting, metrics=metrics)
        self.llm = llm
        self.core = EngineCore(llm)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> AsyncEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="paged_jax-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (after its current step); unfinished requests get ``Overloaded``."""
        self.draining = True
        self._commands.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)

    def _send(self, command) -> None:
        self._commands.put(command)

    def _take(self, timeout: float) -> list:
        try:
            first = self._commands.get(timeout=timeout) if timeout > 0 else self._commands.get_nowait()
        except queue.Empty:
            return []
        batch = [first]
        while True:
            try:
                batch.append(self._commands.get_nowait())
            except queue.Empty:
                return batch

    def _loop(self) -> None:
        try:
            self.core.run(self._take, lambda report: self._on_reports([report]))
        finally:
            self._close(Overloaded("the server shut down"))


class InlineEngine(EngineClient):
    """Serve an ``LLM`` from an engine core stepped on the server's own asyncio loop
    (``build_app(llm)``'s default, the CLI's ``--engine inline``): a loop callback takes one of the core's turns (``EngineCore.turn``: the
    commands queued, then one step) and, while there is work, schedules the next, so HTTP
    requests are read, submitted and answered between two steps, as the other engines'
    requests join between steps. Nothing crosses a thread or a process: a command is a deque
    append, a step's news is put straight into its streams, and each SSE chunk is written by
    the same thread right after the step, where the other placements pay a wake-up per hop (a
    pipe, the reader thread, ``call_soon_threadsafe``) on each streamed token
    (``docs/results/notes/serving.md``). The price: the loop answers nothing during a step
    (``/health`` and ``/metrics`` wait for its end), and the HTTP side's Python (parsing,
    tokenising, every stream's chunk) runs between steps rather than beside them (under load
    on the real model the two placements served about the same, measured in the notes). The
    server runs it on asyncio's own loop (``server._event_loop``: under uvloop each timer
    turn let libuv take one new connection).

    Each turn is scheduled as a timer due at once (``call_at(loop.time())``), not as a
    ready callback: the loop runs due timers after the I/O callbacks of the same pass, so
    a turn is the last thing of its pass and whatever arrived during the step is read
    before any timer of the next pass fires (on asyncio's loop; uvloop orders its phases
    otherwise). As a task resumed from the ready queue, the step ran before the timers of its
    pass, so a keep-alive timeout could close a connection whose next request arrived during
    the step; the resets measured with aiohttp went away with ``server.KEEP_ALIVE_S``.
    The turn's timer is armed one pass ahead (``_admit``): a request read in the pass that
    ends with a turn has its handler task queued behind that turn, so stepping at once made
    every request arriving during a step wait for the step after next (probes beside a
    running stream on SmolLM2-135M, A/B: TTFT p50 170 -> 99 ms; later 110 ms against vLLM's 108).

    Args:
      llm: the engine, used only from the loop's thread once ``start`` is called (from the
        loop: the app's lifespan calls it).
      max_waiting, metrics: as ``AsyncEngine``'s.
    """

    def __init__(self, llm, *, max_waiting: int = 512, metrics: ServerMetrics | None = None):
        super().__init__(llm, llm.usage(), max_waiting=max_waiting, metrics=metrics)
        self.llm = llm
        self.core = EngineCore(llm)
        self._commands: collections.deque = collections.deque()  # appends and pops are thread-safe
        self._loop: asyncio.AbstractEventLoop | None = None
        self._armed = False  # a turn is scheduled (loop only)
        self._stopped = threading.Event()

    def start(self) -> InlineEngine:
        """Start taking turns on the running loop (call it on that loop)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._arm()
        return self

    @property
    def alive(self) -> bool:
        return self._loop is not None and not self._stopped.is_set() and not self._closed

    def _send(self, command) -> None:
        self._commands.append(command)
        loop = self._loop
        if loop is None:  # not started: the first turn takes it
            return
        if asyncio._get_running_loop() is loop:
            self._arm()
        else:
            try:
                loop.call_soon_threadsafe(self._arm)
            except RuntimeError:  # the loop is closed: nothing will answer
                pass

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core after its current step (unfinished requests get ``Overloaded``); off
        the loop's thread, wait up to ``timeout`` seconds for it."""
        self.draining = True
        self._send(("stop",))
        if self._loop is not None and asyncio._get_running_loop() is not self._loop:
            self._stopped.wait(timeout)

    def _arm(self) -> None:
        """Schedule a turn (at most one at a time), one loop pass away (``_admit``)."""
        if not self._armed and not self._stopped.is_set():
            self._armed = True
            self._loop.call_at(self._loop.time(), self._admit)

    def _admit(self) -> None:
        """Let one loop pass go by before the turn: a request read in this pass (it arrived
        during the last step) has its handler's task queued behind this callback; that task
        runs in the next pass, before the turn's timer fires there, so its request joins the
        very next step rather than the one after (one step less TTFT)."""
        self._loop.call_at(self._loop.time(), self._turn)

    def _turn(self) -> None:
        self._armed = False
        commands = self._commands
        try:
            report, go_on = self.core.turn([commands.popleft() for _ in range(len(commands))])
            if report is not None:
                self._on_reports([report])
        except BaseException:
            self._finish()
            raise
        if not go_on:
            self._finish()
        elif commands or self.core.has_work():
            self._arm()

    def _finish(self) -> None:
        self._stopped.set()
        self._close(Overloaded("the server shut down"))


class RequestStream:
    """One submitted request: ``async for out in stream`` yields its ``RequestOutput``s (as
    its ``output_kind`` asks, module docstring; the last has ``finished``), raising
    ``EngineError`` if the engine failed (``ValueError`` if the engine refused it). Leaving
    the loop early, being cancelled in it, or ``abort()`` aborts it."""

    def __init__(self, engine: EngineClient, request_id: str, stream: _Stream):
        self.engine, self.request_id, self._stream = engine, request_id, stream
        self.done = False

    def abort(self) -> None:
        """Abort the request (its blocks are released at the engine's next step); no-op once done."""
        if not self.done:
            self.done = True
            self.engine._abort(self.request_id)  # sent after its add: commands keep order

    async def __aiter__(self):
        try:
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


def _hand_over(items) -> None:
    """``(stream, output or exception)`` pairs to their loops: one ``call_soon_threadsafe`` per
    loop, or at once for the loop running on this thread (the inline engine's: no wake-up)."""
    by_loop: dict = {}
    for item in items:
        by_loop.setdefault(item[0].loop, []).append(item)
    here = asyncio._get_running_loop()
    for loop, its in by_loop.items():
        if loop is here:
            _put_all(its)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(_put_all, its)


def _put_all(items) -> None:
    """On the loop: each stream's news joins its unread output (a DELTA stream's deltas are
    merged; a whole output replaces the older one); an exception replaces anything and is
    never replaced; the waiting consumer, if any, is woken."""
    for stream, item in items:
        held = stream.item
        if isinstance(held, BaseException):
            continue
        if held is not None:
            stream.coalesced += 1
            if stream.kind == RequestOutputKind.DELTA and not isinstance(item, BaseException):
                item = merge_deltas(held, item)
        stream.item = item
        waiter = stream.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
