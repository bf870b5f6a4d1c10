"""One request's host-side life: its tokens, where its KV lives, and why it stopped.

A ``Sequence`` is mutable host bookkeeping owned by the scheduler; nothing on the device
refers to it. Its KV state is summarised by two numbers:

- ``num_computed``: tokens whose K/V are in the cache (device pages, or the host swap
  pool while swapped). The device's ``seq_lens[slot]`` equals it while the sequence runs.
- ``pending``: ``all_token_ids[num_computed:]``, the tokens still to be fed to the model.
  A decoding sequence has exactly one pending token (the last one sampled); a fresh or
  recompute-preempted one has its whole prompt (plus earlier output) pending.

``SeqInfo`` is the frozen snapshot a victim policy sees, so the policy stays a pure
function of plain values.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not holding KV: new, or preempted by recompute
    RUNNING = "running"  # holds a table row and device blocks
    SWAPPED = "swapped"  # its KV lives in the host swap pool
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    LENGTH = "length"  # max_tokens reached, or the sequence filled max_model_len
    STOP = "stop"  # a stop token (or EOS) was sampled; it is kept in the output


@dataclasses.dataclass(eq=False)
class Sequence:
    """A request being served (one completion; parallel sampling is a later issue).

    Attributes:
      request_id: the public id (``str``), unique per engine.
      index: position in the ``generate`` call's prompt list (output order).
      prompt_token_ids: the prompt, at least one token.
      params: the request's ``SamplingParams``.
      seed: uint32 sampling seed (the request's own, or derived from the engine seed and
        the request id), so samples never depend on batch composition.
      max_tokens: output tokens allowed: ``params.max_tokens`` capped so that the whole
        sequence fits in ``max_model_len``.
    """

    request_id: str
    index: int
    prompt_token_ids: tuple[int, ...]
    params: object  # SamplingParams (kept untyped: llm.py imports this module)
    seed: int
    max_tokens: int
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed: int = 0  # tokens with K/V in the cache (see module docstring)
    slot: int | None = None  # block-table row while RUNNING
    host_blocks: list[int] | None = None  # swap-pool block ids while SWAPPED
    admitted_at: int = -1  # scheduler clock at the latest admission (victim order)
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache; 1 for a decoding sequence."""
        return self.num_tokens - self.num_computed

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

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def info(self, num_blocks: int) -> SeqInfo:
        return SeqInfo(
            request_id=self.request_id,
            index=self.index,
            admitted_at=self.admitted_at,
            num_tokens=self.num_tokens,
            num_computed=self.num_computed,
            num_blocks=num_blocks,
            num_preemptions=self.num_preemptions,
        )


class SeqInfo(NamedTuple):
    """What a victim policy may look at, for one running sequence."""

    request_id: str
    index: int  # position in the generate call
    admitted_at: int  # scheduler clock at its latest admission; larger = more recent
    num_tokens: int  # prompt + output so far
    num_computed: int  # tokens whose KV it holds
    num_blocks: int  # device blocks it holds (ceil(num_computed / block_size))
    num_preemptions: int  # times it was preempted before
