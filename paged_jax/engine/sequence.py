"""Requests and their completions on the host: tokens, where their KV lives, why they stopped.

A ``SequenceGroup`` is one request: its prompt, its parameters and its member
``Sequence``s (one per completion of a sampling request, one per beam of a beam search).
The scheduler admits, preempts and swaps whole groups, because the members of a group
share KV blocks (forked from the same prompt): preempting one member alone would free
little and recomputing it alone would lose the sharing.

How members get their table rows. Only the group's leader (its first live member) is
opened when the group is admitted; it prefills the prompt. The others get their rows
from it:

- sampling (``n > 1``), and any group rebuilt after a recompute preemption: once the
  leader holds the *shared prefix* (the prompt less its last token, ``shared_prefix``),
  the others are forked from it (every full block shared) and each feeds its own
  pending tokens from there, so a partly filled last block is copied on first write;
- beam search, before its first step: the leader prefills the whole prompt, and the first
  beam step makes every beam a child of it (``select_parents``). From then on each beam
  step rebuilds every beam's row from its parent's (``pending_select``).

Sampling completions finish one by one; a beam search ends as a whole.

A ``Sequence`` is one completion's mutable bookkeeping; nothing on the device refers to it.
Its KV state is summarised by two numbers:

- ``num_computed``: tokens whose K/V are in the cache (device pages, or the host swap
  pool while swapped). The device's ``seq_lens[slot]`` equals it while the sequence runs.
- pending tokens: prompt + output from ``num_computed`` on, still to be fed to the model.
  A decoding sequence has exactly one (the last one sampled); a fresh or
  recompute-preempted one has its whole prompt (plus earlier output) pending.

``SeqInfo`` is the frozen snapshot of a running group that a victim policy sees, so the
policy stays a pure function of plain values.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple

import numpy as np


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not holding KV: new, or preempted by recompute
    RUNNING = "running"  # holds table rows and device blocks
    SWAPPED = "swapped"  # its KV lives in the host swap pool
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    LENGTH = "length"  # max_tokens reached, or the sequence filled max_model_len
    STOP = "stop"  # a stop token (or EOS) was sampled; it is kept in the output
    REJECTED = "rejected"  # never ran: the request can never fit the KV pool
    ABORT = "abort"  # aborted: LLM.abort, or the call it ran in was interrupted
    ERROR = "error"  # the model's logits were NaN: nothing more could be sampled


@dataclasses.dataclass(eq=False)
class Sequence:
    """One completion of a request.

    Attributes:
      request_id: the public id of its request (``str``), unique per engine.
      index: its request's position in the ``generate`` call's prompt list.
      prompt_token_ids: the request's prompt, at least one token.
      params: the request's ``SamplingParams``.
      seed: uint32 sampling seed of this completion (from the request's seed and the
        completion index), so samples never depend on batch composition.
      max_tokens: output tokens allowed: ``params.max_tokens`` capped so that the whole
        sequence fits in ``max_model_len``.
      completion: which completion of the request it is (0 .. n - 1).
      output_logprobs: with ``params.logprobs`` = k set, one dict per output token:
        ``{token id: sampling.Logprob}`` for the sampled token and the k most likely
        (k or k + 1 entries; raw log-probabilities); None when logprobs is None.
      stop_reason: the stop token id the completion stopped on (vLLM's ``stop_reason``;
        a stop string's text once those exist); None for EOS, length, or still running.
    """

    request_id: str
    index: int
    prompt_token_ids: tuple[int, ...]
    params: Any  # SamplingParams (untyped: llm.py imports this module)
    seed: int
    max_tokens: int
    completion: int = 0
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    num_computed: int = 0  # tokens with K/V in the cache (see module docstring)
    slot: int | None = None  # block-table row while its group runs (reserved before it is live)
    row_live: bool = False  # the row exists on the device (opened, forked, selected or restored)
    candidates: Any = None  # beam search: (logprobs, ids) of its next token's top-K, once fed
    group: SequenceGroup | None = dataclasses.field(default=None, repr=False)  # set by the group
    output_logprobs: list[dict] | None = None  # set from params.logprobs (see above)
    stop_reason: int | str | None = None
    text_state: Any = dataclasses.field(default=None, repr=False)  # text_output.TextOutputs' (a tokenizer)
    # Output token counts for the penalties, caught up incrementally (``output_counts``).
    _counts: dict[int, int] = dataclasses.field(default_factory=dict, init=False, repr=False)
    _counted: int = dataclasses.field(default=0, init=False, repr=False)
    _prompt_ids: Any = dataclasses.field(default=None, init=False, repr=False)  # int32[U] distinct prompt ids
    # ``output_logprobs`` with their tokens' text filled in, caught up incrementally
    # (``outputs.decoded_logprobs``): a whole output per step must not decode them all again.
    _decoded: list = dataclasses.field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        if self.output_logprobs is None and getattr(self.params, "logprobs", None) is not None:
            self.output_logprobs = []

    def output_counts(self) -> dict[int, int]:
        """token id -> occurrences in the output. Counts only the tokens appended since the
        last call (O(new tokens) a step); recounts if the output was cut or rewritten
        shorter (a beam step, a stop-string trim)."""
        out = self.output_token_ids
        if len(out) < self._counted:
            self._counts, self._counted = {}, 0
        for t in out[self._counted:]:
            self._counts[t] = self._counts.get(t, 0) + 1
        self._counted = len(out)
        return self._counts

    def prompt_ids(self):
        """int32[U]: the prompt's distinct token ids, sorted (computed once)."""
        if self._prompt_ids is None:
            self._prompt_ids = np.unique(np.asarray(self.prompt_token_ids, np.int32))
        return self._prompt_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache; 1 for a decoding sequence."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_ids(self) -> list[int]:
        """Prompt plus output tokens so far."""
        return [*self.prompt_token_ids, *self.output_token_ids]

    def pending_token_ids(self, n: int) -> list[int]:
        """The next ``n`` tokens to feed the model (the first ``n`` pending ones)."""
        assert 0 < n <= self.num_pending, (n, self.num_pending)
        start = self.num_computed
        p = len(self.prompt_token_ids)
        out = list(self.prompt_token_ids[start : start + n]) if start < p else []
        if len(out) < n:
            lo = max(start - p, 0)
            out += self.output_token_ids[lo : lo + n - len(out)]
        return out


@dataclasses.dataclass(eq=False)
class SequenceGroup:
    """One request: its prompt, its parameters and its completions (``seqs``).

    Attributes:
      seqs: the members, completion 0 first.
      status: where the group's KV lives (``SeqStatus``).
      admitted_at: scheduler clock at its latest admission (victim order).
      num_preemptions: times the group was preempted.
      swapped: while SWAPPED, the host copy of its blocks (``swap.SwappedBlocks``).
      beam: for a beam search, its ``beam.BeamState``; None for sampling.
      pending_select: beam search: the parent (member index) of each member's new row,
        chosen by the last beam step and not yet made on the device.
      prompt_logprobs: with ``params.prompt_logprobs`` = k set, one entry per prompt
        position computed so far: None for the first, then ``{token id:
        sampling.Logprob}`` for the prompt token there and the k most likely given the
        tokens before it (raw log-probabilities); complete (``len == len(prompt)``) once
        the prompt is prefilled. Filled in order as chunks arrive, never twice (a
        recompute re-feeds positions already recorded without recording them). None when
        prompt_logprobs is None.
    """

    request_id: str
    index: int
    prompt_token_ids: tuple[int, ...]
    params: Any
    seqs: list[Sequence]
    status: SeqStatus = SeqStatus.WAITING
    admitted_at: int = -1
    num_preemptions: int = 0
    swapped: Any = None
    beam: Any = None
    pending_select: list[int] | None = None
    eos: tuple[int, ...] = ()  # beam search: the ids that end a hypothesis
    rejected: str | None = None  # why it can never run (it never reaches the scheduler)
    cache_salt: str | None = None  # prefix caching: blocks are shared only within one salt
    prompt_text: str | None = None  # the prompt's text, when it came as text
    metrics: dict | None = None  # outputs.RequestMetrics' fields, filled in as the request runs
    prompt_logprobs: list[dict | None] | None = None  # set from params.prompt_logprobs (see above)
    priority: int = 0  # the caller's (admission_policy="priority": lower is admitted sooner)

    def __post_init__(self):
        for seq in self.seqs:
            seq.group = self
        if self.prompt_logprobs is None and getattr(self.params, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = [None]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are wanted and some positions are still missing."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def shared_prefix(self) -> int:
        """Tokens the leader holds before the other members are forked from it."""
        return len(self.prompt_token_ids) - 1

    def forks_members(self) -> bool:
        """Whether members without a row get one by a fork from the leader (rather than
        by the first beam step)."""
        return self.beam is None or any(s.output_token_ids for s in self.seqs)

    @property
    def live(self) -> list[Sequence]:
        """Members still generating."""
        return [s for s in self.seqs if not s.finished]

    @property
    def finished(self) -> bool:
        if self.rejected:
            return True
        if self.beam is not None:
            return self.beam.done
        return all(s.finished for s in self.seqs)

    @property
    def num_tokens(self) -> int:
        """The longest live member's prompt + output (what admission must make room for)."""
        return max((s.num_tokens for s in self.live), default=0)

    @property
    def num_computed(self) -> int:
        return max((s.num_computed for s in self.live), default=0)

    def info(self, num_blocks: int) -> SeqInfo:
        return SeqInfo(
            request_id=self.request_id,
            index=self.index,
            admitted_at=self.admitted_at,
            num_tokens=self.num_tokens,
            num_computed=self.num_computed,
            num_blocks=num_blocks,
            num_preemptions=self.num_preemptions,
            num_seqs=len(self.live),
        )


class SeqInfo(NamedTuple):
    """What a victim policy may look at, for one running request (group)."""

    request_id: str
    index: int  # position in the generate call
    admitted_at: int  # scheduler clock at its latest admission; larger = more recent
    num_tokens: int  # prompt + output so far (its longest live completion)
    num_computed: int  # tokens whose KV it holds (its longest live completion)
    num_blocks: int  # device blocks it holds, a block its completions share counted once
    num_preemptions: int  # times it was preempted before
    num_seqs: int = 1  # live completions
