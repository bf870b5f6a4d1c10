"""The typed seam between the scheduler and the runner (vLLM's ``SchedulerOutput`` /
``ModelRunnerOutput``): what a step is to do, and what came back.

``SchedulerOutput`` is the scheduler's whole decision for one step: the block-manager ops
(releases, swap-outs, beam selections, opens, forks, evictions, ...) in the order the runner
applies them, and the rows that run the model (``ScheduledRow``: a sequence and how many of
its pending tokens it feeds). It says nothing about how a row samples: the runner prepares
its inputs from the sequence itself (``inputs.py``). ``StepResult`` is what the runner
brings back in its one device fetch, aligned with ``SchedulerOutput.rows``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from paged_jax.engine.swap import SwappedBlocks


@dataclasses.dataclass
class ScheduledRow:
    """One row's part of a step: ``seq`` feeds ``num_tokens`` tokens from its first
    pending one. ``proposals`` (speculative decoding): the ``m`` proposed tokens fed after
    the pending one (n-gram: ids; a draft model's: ``None`` each, made on the device), so
    ``num_tokens == 1 + m``; None when the row does not speculate."""

    seq: Any  # sequence.Sequence
    num_tokens: int
    proposals: list | None = None

    @property
    def spec(self) -> int:
        """Proposals verified this step (0: not a speculative round)."""
        return len(self.proposals) if self.proposals else 0


class SwapIn(NamedTuple):
    """A request coming back from the host pool into the rows ``slots`` (one per live member
    whose row existed when it was swapped out)."""

    slots: list[int]
    blocks: SwappedBlocks


@dataclasses.dataclass
class SchedulerOutput:
    """What the runner does in one step, in this order: ``mark`` blocks cached (prefix
    caching); copy ``swap_out`` requests' rows to the host and release them; ``release``
    rows; ``select`` rows from parent rows (beam search); ``open`` rows (on the cached blocks
    ``prefix`` names, aligned with ``open``, for a prefix-cache hit); ``fork`` children from
    parents; ``evict`` cached-free blocks; ``unshare`` rows (the no-sharing baseline);
    ``swap_in`` requests from the host; then the model over ``rows``.

    ``swapped_out`` holds the request behind each ``swap_out`` entry."""

    rows: list[ScheduledRow] = dataclasses.field(default_factory=list)
    release: list[int] = dataclasses.field(default_factory=list)
    swap_out: list[list[int]] = dataclasses.field(default_factory=list)  # member rows per request
    swapped_out: list = dataclasses.field(default_factory=list)  # aligned with swap_out
    select: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (row, parent row)
    open: list[int] = dataclasses.field(default_factory=list)
    prefix: list[list[int]] = dataclasses.field(default_factory=list)  # per open row: cached blocks
    fork: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (parent, child) rows
    evict: list[int] = dataclasses.field(default_factory=list)  # cached-free blocks, after fork
    unshare: list[int] = dataclasses.field(default_factory=list)  # rows, after select and fork
    swap_in: list[SwapIn] = dataclasses.field(default_factory=list)
    mark: list[int] = dataclasses.field(default_factory=list)  # blocks to mark cached, first

    @property
    def empty(self) -> bool:
        return not (self.rows or self.release or self.swap_out or self.select or self.open or self.fork
                    or self.unshare or self.swap_in or self.mark or self.evict)

    @property
    def seqs(self) -> list:
        return [r.seq for r in self.rows]


class StepResult(NamedTuple):
    """What the runner brings back from a step, host side, aligned with ``rows``."""

    tokens: np.ndarray  # int32[R]: sampled at each row's last fed token (NAN_TOKEN: NaN logits)
    logprobs: np.ndarray  # f32[R]: its raw log-probability
    top_logprobs: np.ndarray  # f32[R, K]: the most likely next tokens' log-probs, best first
    top_ids: np.ndarray  # int32[R, K]
    swapped: list[SwappedBlocks]  # one per swap_out entry
    ranks: np.ndarray  # int32[R]: the sampled token's raw rank (rows that asked for logprobs)
    accepted: np.ndarray | None = None  # int32[R]: proposals kept (speculative rows)
    spec_tokens: np.ndarray | None = None  # int32[R, k + 1]: kept proposals, then the new token
    spec_logprobs: np.ndarray | None = None  # f32[R, k + 1]
    proposed: np.ndarray | None = None  # int32[R, k]: the proposals (draft or n-gram)
    # row -> (targets, logprob f32[n], rank int32[n], top_logprobs f32[n, K], top_ids
    # int32[n, K]) at its n fed positions, for rows that asked for prompt logprobs.
    prompt_logprobs: dict | None = None
