"""The engine core: the loop that owns an ``LLM`` and steps it while requests join and leave,
the same code wherever it runs: on the server's asyncio loop between its callbacks
(``InlineEngine``), on a thread of the server's process (``AsyncEngine``) or in a process of
its own (``engine_process``). No asyncio and no HTTP here: commands come in
(``("add", request_id, prompt_token_ids, params)``, ``("abort", request_id)``,
``("stop",)``), and one ``StepReport`` goes out per step (and per batch of commands that
needed no step), holding everything the caller's side needs to deliver that step.

- **Join/leave between steps.** Commands that arrived while a step ran are applied before
  the next one; with nothing to step, the core waits for the next command.
- **Abort.** ``LLM.abort``; the next step releases the request's blocks, so an idle
  engine holds none (an abort or a finish leaves the core "dirty" until a step ran).
- **Engine errors.** A step that raises (the ``LLM`` has reset itself, aborting everything)
  fails every request the core holds with ``EngineError``; the loop goes on.
- **Stop.** ``("stop",)`` (or the command source ending) fails what is left with
  ``Overloaded`` and returns.

Only the requests a caller still follows are reported: outputs of aborted requests are
dropped here, so in the process mode they are never pickled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

IDLE_WAIT_S = 0.5  # the longest an idle core waits for a command before looking again


class Overloaded(Exception):
    """The server cannot take a request now (back-pressure or draining): HTTP 503."""


class EngineError(Exception):
    """The engine failed while running a request (its step raised): HTTP 500."""


@dataclasses.dataclass
class StepReport:
    """What one step (or one batch of commands) changed, for the caller's side; picklable.

    Attributes:
      outputs: the ``RequestOutput`` of every followed request the step changed, as its
        ``output_kind`` asks (``EngineClient`` asks for deltas: O(new tokens) to pickle).
      usage: ``LLM.usage()`` after it.
      applied: commands applied since the last report; adds: how many of them were adds.
      rejected: ``(request_id, exception)`` for adds that ``LLM.add_request`` refused.
      failed: ``(exception, request_ids)``: requests ended by an engine error or a stop.
      idle: nothing unfinished and nothing left to release (no block held).
    """

    outputs: list
    usage: object
    applied: int = 0
    adds: int = 0
    rejected: list = dataclasses.field(default_factory=list)
    failed: tuple | None = None
    idle: bool = False


class EngineCore:
    """Owns ``llm`` (module docstring): ``run(commands, send)`` until a stop."""

    def __init__(self, llm):
        self.llm = llm
        self.live: set[str] = set()  # added, not finished, aborted or failed
        self.dirty = False  # an abort or a failure whose rows a step still has to release
        self.errors = 0  # steps that raised
        self._applied = self._adds = 0
        self._rejected: list = []

    def apply(self, command) -> bool:
        """Apply one command; False for a stop."""
        kind = command[0]
        if kind == "stop":
            return False
        self._applied += 1
        if kind == "add":
            _, request_id, ids, params = command
            self._adds += 1
            try:
                self.llm.add_request({"prompt_token_ids": ids}, params, request_id=request_id)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                self._rejected.append((request_id, e if isinstance(e, ValueError) else EngineError(
                    f"the engine refused the request: {type(e).__name__}: {e}")))
            else:
                self.live.add(request_id)
        elif kind == "abort":
            _, request_id = command
            if request_id in self.live:
                self.live.discard(request_id)
                self.dirty = True
                try:
                    self.llm.abort(request_id)
                except ValueError:  # finished in the step that just ran: nothing to abort
                    pass
        else:
            raise ValueError(f"unknown engine command {kind!r}")
        return True

    def has_work(self) -> bool:
        return self.dirty or self.llm.has_unfinished_requests()

    def step(self) -> StepReport:
        """One ``LLM.step``; its report."""
        try:
            outputs = self.llm.step()
        except Exception as e:  # noqa: BLE001 - the engine reset itself; fail its requests
            self.errors += 1
            return self._fail(EngineError(f"the engine failed: {type(e).__name__}: {e}"))
        self.dirty = False  # an idle engine's step released every row left (LLM.step)
        live = self.live
        followed = [o for o in outputs if o.request_id in live]
        for o in followed:
            if o.finished:
                live.discard(o.request_id)
        return self.report(followed)

    def report(self, outputs=(), failed=None) -> StepReport:
        r = StepReport(list(outputs), self.llm.usage(), self._applied, self._adds, self._rejected, failed,
                       idle=not self.has_work())
        self._applied = self._adds = 0
        self._rejected = []
        return r

    def _fail(self, error: Exception) -> StepReport:
        ids, self.live = sorted(self.live), set()
        try:  # forget the aborted requests (and release their rows)
            self.llm.step()
            self.dirty = False
        except Exception:  # noqa: BLE001
            self.dirty = True
        return self.report(failed=(error, ids))

    def turn(self, commands) -> tuple[StepReport | None, bool]:
        """Apply ``commands`` (those queued now), then step if there is work: the report to
        send (None: nothing happened) and whether to go on (False after a stop, whose report
        fails what is left with ``Overloaded``). One turn of ``run``; the server's inline
        engine takes the turns on its asyncio loop instead."""
        for command in commands:
            if not self.apply(command):
                return self._fail(Overloaded("the server shut down")), False
        if self.has_work():
            return self.step(), True
        if self._applied:  # e.g. a refused add: the caller's counts still move on
            return self.report(), True
        return None, True

    def run(self, commands: Callable[[float], list], send: Callable[[StepReport], None]) -> None:
        """Step until a stop. ``commands(timeout)``: the commands queued now, waiting up to
        ``timeout`` seconds for one when there are none (0: do not wait); ``send(report)``
        hands a report to the caller's side."""
        while True:
            report, go_on = self.turn(commands(0.0 if self.has_work() else IDLE_WAIT_S))
            if report is not None:
                send(report)
            if not go_on:
                return
