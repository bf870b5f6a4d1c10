"""The runner's model inputs: per-row sampling settings kept in persistent arrays, and each
scheduled row turned into what one fused call feeds (vLLM's ``InputBatch``).

``InputBatch`` holds one entry per block-table row (slot): temperature, top-k, top-p, min-p,
seed, the three penalties and the top-K temperature, written when a sequence takes the row
(``bind``) and read back by slot for every call (``sampling``); nothing is rebuilt per step
but what changes per step: the output index (the sampler's step), the penalty /
min-tokens ``History`` entries, logprobs, prompt targets.

``prepare`` makes a ``Work`` item per ``ScheduledRow``: the tokens it feeds (its pending
tokens, or for a speculative round the pending one and the proposals), and what its sample
needs: the ``History`` (the distinct prompt and output tokens for the repetition penalty,
output counts for presence/frequency, and while ``min_tokens`` is not reached the stop ids
and EOS banned; counts from ``Sequence.output_counts``, kept incrementally), the top-K for
logprobs or beam candidates, and for prompt logprobs the prompt token each fed position
predicts.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from paged_jax import buckets
from paged_jax.engine.interface import ScheduledRow
from paged_jax.engine.programs import SamplingBatch
from paged_jax.engine.sampling import BANNED, SEEN, as_token_ids, empty_history

MIN_TOP = 16  # narrowest top-K call (one compiled width for beams up to 8 and logprobs <= 16)
MIN_HISTORY = 64  # narrowest penalty/min-tokens history (sampling.History): most batches fit it


class Work(NamedTuple):
    """One row's input to a fused call.

    ``slot``: its table row; ``tokens``: what it feeds; ``step``: the index of the output
    token being sampled (a pure function of the completion, so pressure never changes a
    sample); ``history``: ``(ids, counts, flags, bias)`` arrays of one length, or None;
    ``num_logprobs`` >= 0 asks for the sampled token's rank (-1: none); ``top`` > 0 also
    the ``top`` most likely next tokens (of ``log_softmax(logits / top_temperature)``);
    ``spec`` > 0: a speculative round of ``spec`` proposals; ``prompt_targets``: aligned
    with ``tokens``, the prompt token each position predicts (-1 where none is wanted), with
    the top ``prompt_top``.
    """

    slot: int
    tokens: list[int]
    step: int
    history: tuple | None = None
    num_logprobs: int = -1
    top: int = 0
    spec: int = 0
    prompt_targets: tuple[int, ...] | None = None
    prompt_top: int = 0


class InputBatch:
    """Persistent per-row sampling settings (module docstring). Arrays are ``[max_num_seqs]``."""

    def __init__(self, max_num_seqs: int):
        n = max_num_seqs
        self.temperature = np.zeros(n, np.float32)
        self.top_k = np.full(n, -1, np.int32)
        self.top_p = np.ones(n, np.float32)
        self.min_p = np.zeros(n, np.float32)
        self.seed = np.zeros(n, np.uint32)
        self.presence = np.zeros(n, np.float32)
        self.frequency = np.zeros(n, np.float32)
        self.repetition = np.ones(n, np.float32)
        self.top_temperature = np.zeros(n, np.float32)  # the top-K's distribution (0: the raw model's)
        # The sequence each row's settings are for (held, so its identity cannot be reused).
        self._owner: list = [None] * n

    def bind(self, slot: int, seq) -> None:
        """Write ``seq``'s settings into row ``slot`` unless they are there already. A beam
        member samples greedily and reports its top-K at the search's temperature."""
        if self._owner[slot] is seq:
            return
        p = seq.params
        beam = seq.group is not None and seq.group.beam is not None
        self.temperature[slot] = 0.0 if beam else p.temperature
        self.top_k[slot] = -1 if beam else p.top_k
        self.top_p[slot] = 1.0 if beam else p.top_p
        self.min_p[slot] = 0.0 if beam else p.min_p
        self.seed[slot] = 0 if beam else seq.seed
        self.presence[slot] = 0.0 if beam else p.presence_penalty
        self.frequency[slot] = 0.0 if beam else p.frequency_penalty
        self.repetition[slot] = 1.0 if beam else p.repetition_penalty
        self.top_temperature[slot] = p.temperature if beam else 0.0
        self._owner[slot] = seq

    def clear(self) -> None:
        """Forget every binding (after an engine reset)."""
        self._owner = [None] * len(self._owner)

    def sampling(self, items: list[Work], size: int) -> SamplingBatch:
        """The sampling inputs of ``items`` padded to ``size`` rows (host arrays). Padding
        rows are greedy and read row 0's history slot as empty.

        The history's width is the longest row's entries bucketed to a power of two, at
        least ``MIN_HISTORY``: a batch whose rows need no penalties has the narrowest, so it
        shares its program with small-history batches."""
        slots = np.asarray([w.slot for w in items], np.int64)
        pad = size - len(items)

        def rows(array, fill):
            return np.concatenate([array[slots], np.full(pad, fill, array.dtype)])

        longest = max((len(w.history[0]) for w in items if w.history is not None), default=0)
        history = empty_history(size, buckets.bucket(longest, lo=MIN_HISTORY))
        for i, w in enumerate(items):
            if w.history is not None:
                n = len(w.history[0])
                history.ids[i, :n], history.counts[i, :n], history.flags[i, :n], history.bias[i, :n] = w.history
        history = history._replace(presence=rows(self.presence, 0.0), frequency=rows(self.frequency, 0.0),
                                   repetition=rows(self.repetition, 1.0))
        steps = np.zeros(size, np.int32)
        steps[: len(items)] = [w.step for w in items]
        return SamplingBatch(
            temperature=rows(self.temperature, 0.0), top_k=rows(self.top_k, -1), top_p=rows(self.top_p, 1.0),
            min_p=rows(self.min_p, 0.0), seeds=rows(self.seed, 0), steps=steps,
            top_temperature=rows(self.top_temperature, 0.0), history=history,
        )


# ---------------------------------------------------------------------------- one row's input


def prepare(row: ScheduledRow, eos_token_ids) -> Work:
    """The ``Work`` of one scheduled row (module docstring). ``eos_token_ids``: what
    ``min_tokens`` bans besides the stop ids (unless ``ignore_eos``)."""
    seq, n = row.seq, row.num_tokens
    p, group = seq.params, seq.group
    step = len(seq.output_token_ids)
    if group is not None and group.beam is not None:
        return Work(seq.slot, seq.pending_token_ids(n), step, top=group.beam.num_candidates)
    if row.proposals:
        fed = seq.pending_token_ids(1) + [t for t in row.proposals if t is not None]
        return Work(seq.slot, fed, step, spec=len(row.proposals))
    # A chunk that leaves tokens pending samples nothing we keep: no history, no logprobs.
    samples = seq.num_computed + n == seq.num_tokens
    targets = prompt_targets(seq, n) if group is not None and group.needs_prompt_logprobs else None
    if not samples:
        return Work(seq.slot, seq.pending_token_ids(n), step, prompt_targets=targets,
                    prompt_top=p.prompt_logprobs or 0)
    return Work(seq.slot, seq.pending_token_ids(n), step, history=history(seq, eos_token_ids),
                num_logprobs=-1 if p.logprobs is None else p.logprobs, top=p.logprobs or 0,
                prompt_targets=targets, prompt_top=p.prompt_logprobs or 0)


def banned(seq, eos_token_ids) -> tuple[int, ...]:
    """The ids ``min_tokens`` keeps from being sampled: stop ids, and EOS unless ignore_eos."""
    eos = () if seq.params.ignore_eos else as_token_ids(eos_token_ids)
    return tuple(sorted({*seq.params.stop_token_ids, *eos}))


def history(seq, eos_token_ids) -> tuple | None:
    """``seq``'s ``sampling.History`` entries for its next output token as ``(ids, counts,
    flags, bias)``, or None when it uses no penalty, no logit bias and no active min_tokens."""
    p = seq.params
    ban = banned(seq, eos_token_ids) if len(seq.output_token_ids) < p.min_tokens else ()
    repetition = p.repetition_penalty != 1
    bias = p.logit_bias
    if not (ban or p.uses_penalties or bias):
        return None
    counts = seq.output_counts() if p.uses_penalties else {}
    out_ids = np.fromiter(counts.keys(), np.int32, len(counts))
    seen = np.union1d(seq.prompt_ids(), out_ids) if repetition else None  # sorted, distinct
    ids = seen if repetition else np.sort(out_ids)
    if ban:
        ids = np.union1d(ids, np.asarray(ban, np.int32))
    if bias:
        bias_ids = np.fromiter(bias.keys(), np.int32, len(bias))
        ids = np.union1d(ids, bias_ids)
    ids = ids.astype(np.int32)
    num = np.zeros(len(ids), np.int32)
    num[np.searchsorted(ids, out_ids)] = np.fromiter(counts.values(), np.int32, len(counts))
    flags = np.zeros(len(ids), np.int32)
    if repetition:  # the prompt's and the output's tokens, not the ones only listed for a ban or a bias
        flags[np.searchsorted(ids, seen)] = SEEN
    if ban:
        flags[np.searchsorted(ids, np.asarray(ban, np.int32))] |= BANNED
    add = np.zeros(len(ids), np.float32)
    if bias:
        add[np.searchsorted(ids, bias_ids)] = np.fromiter(bias.values(), np.float32, len(bias))
    return ids, num, flags, add


def prompt_targets(seq, n: int) -> tuple[int, ...] | None:
    """For a feed of ``n`` tokens from ``seq.num_computed``: the prompt token each position
    predicts where its prompt logprob is still missing, else -1; None when no position is
    wanted (positions already recorded, or past the prompt)."""
    prompt, have = seq.prompt_token_ids, len(seq.group.prompt_logprobs)
    start = seq.num_computed
    targets = tuple(prompt[j + 1] if have <= j + 1 < len(prompt) else -1 for j in range(start, start + n))
    return targets if any(t >= 0 for t in targets) else None
