"""What ``LLM.generate`` returns, with vLLM's names and fields.

``RequestOutput`` per request (its ``n`` ``CompletionOutput``s), with the prompt's text
when it came as text; ``RequestMetrics`` the request's wall-clock times. Beam searches
return ``beam.BeamSearchOutput`` instead.
"""

from __future__ import annotations

import dataclasses
import time

from paged_jax.engine import beam as beam_lib
from paged_jax.engine.sequence import FinishReason


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """One completion of a request.

    Attributes:
      index: which of the request's ``n`` completions.
      token_ids: the generated tokens (a stop token kept; every token sampled before a
        stop string completed kept, as vLLM keeps them).
      cumulative_logprob: sum of log p(token) under the unmodified model distribution.
      finish_reason: "stop" (EOS, a stop token or a stop string), "length", "abort" or
        "rejected".
      text: the generated text (the model has a tokenizer), cut before a stop string
        unless ``include_stop_str_in_output``; "" without a tokenizer.
      logprobs: with ``SamplingParams.logprobs`` = k, one ``{token id: Logprob}`` per
        generated token (the sampled one and the k most likely); else None.
      stop_reason: the stop string or stop token id that ended it; None for EOS, length.
    """

    index: int
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str
    text: str = ""
    logprobs: list[dict] | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """Wall-clock times (``time.time()`` seconds) of one request."""

    arrival_time: float
    first_token_time: float | None = None  # its first generated token was sampled
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """One request's result.

    Attributes:
      request_id: the engine's id for it.
      prompt_token_ids: the prompt as the model saw it.
      outputs: its completions.
      finished: every completion finished.
      rejected: why it never ran (its completions are then empty), or None.
      prompt: the prompt's text, when it was given as text (or a chat); else None.
      prompt_logprobs: with ``SamplingParams.prompt_logprobs`` = k, per prompt token a
        ``{token id: Logprob}`` (None for the first); else None.
      metrics: its times.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    rejected: str | None = None
    prompt: str | None = None
    prompt_logprobs: list | None = None
    metrics: RequestMetrics | None = None


# ---------------------------------------------------------------------------- assembly


def is_done(group) -> bool:
    """A request is done: rejected, or every completion finished."""
    return group.rejected is not None or all(s.finish_reason is not None for s in group.seqs)


def with_decoded_tokens(logprobs: list | None, tokenizer) -> list | None:
    """Per-position ``{id: Logprob}`` dicts with ``decoded_token`` filled in (the model has
    a tokenizer), as vLLM reports them."""
    if logprobs is None or tokenizer is None:
        return logprobs
    return [None if d is None else {t: dataclasses.replace(lp, decoded_token=tokenizer.decode([t], skip_special_tokens=False))
                                    for t, lp in d.items()} for d in logprobs]


def decoded_logprobs(seq, tokenizer) -> list | None:
    """``seq.output_logprobs`` with ``decoded_token`` filled in (``with_decoded_tokens``), a
    new list; each entry is decoded once and kept on the sequence (``seq._decoded``), so
    reporting a whole output every step stays O(length), not O(length x k) decodes."""
    raw = seq.output_logprobs
    if raw is None or tokenizer is None:
        return None if raw is None else list(raw)
    done = seq._decoded
    # (raw entry, decoded entry) pairs; anything that rewrote the list (not a plain append)
    # starts the cache over.
    if len(done) > len(raw) or (done and raw[len(done) - 1] is not done[-1][0]):
        done.clear()
    if len(done) < len(raw):
        fresh = raw[len(done):]
        done.extend(zip(fresh, with_decoded_tokens(fresh, tokenizer), strict=True))
    return [d for _, d in done]


def request_output(group, text=None, tokenizer=None):
    """The output of one request as it stands: a ``RequestOutput`` (sampling; unfinished
    completions as they are) or a ``beam.BeamSearchOutput``. ``text``: the engine's
    ``text_output.TextOutputs`` when the model has a tokenizer."""
    if group.beam is not None:
        result = (beam_lib.BeamSearchOutput([], group.rejected) if group.rejected
                  else beam_lib.results(group.beam, group.prompt_token_ids, group.eos))
        if text is not None:
            result = result._replace(sequences=[b._replace(text=text.decode(b.tokens)) for b in result.sequences])
        return result
    reason = FinishReason.REJECTED.value if group.rejected else None
    metrics = group.metrics or {"arrival_time": time.time()}
    return RequestOutput(
        request_id=group.request_id,
        prompt_token_ids=list(group.prompt_token_ids),
        outputs=[
            CompletionOutput(
                index=s.completion,
                token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob,
                finish_reason=reason or (s.finish_reason.value if s.finish_reason else None),
                text="" if text is None else text.text(s, final=s.finish_reason is not None),
                logprobs=decoded_logprobs(s, tokenizer),
                stop_reason=s.stop_reason,
            )
            for s in group.seqs
        ],
        finished=is_done(group),
        rejected=group.rejected,
        prompt=group.prompt_text,
        prompt_logprobs=with_decoded_tokens(group.prompt_logprobs, tokenizer),
        metrics=RequestMetrics(**metrics),
    )


# ---------------------------------------------------------------------------- deltas


def delta_output(group, text, tokenizer, sent: dict) -> RequestOutput | None:
    """What is new in request ``group`` since its previous delta (``RequestOutputKind.DELTA``):
    a ``RequestOutput`` holding only the completions that brought a token, text or their
    finish, each with only the new token ids, text and logprobs (``cumulative_logprob`` the
    running total); the prompt's fields on the first delta only (None after). None when
    nothing is new and the request is not done. Costs O(what is new), not O(length).

    Args:
      group: a sampling request's ``SequenceGroup`` (beam searches rewrite their
        hypotheses: not deltas).
      text, tokenizer: as ``request_output``'s.
      sent: the caller's record of what was reported, ``{}`` before the first delta;
        updated here (completion index -> [tokens, characters, finished]).
    """
    first = not sent
    if first:
        sent[-1] = True  # the prompt's fields went out
    reason = FinishReason.REJECTED.value if group.rejected else None
    outs = []
    for s in group.seqs:
        state = sent.setdefault(s.completion, [0, 0, False])
        if state[2]:
            continue
        finish = reason or (s.finish_reason.value if s.finish_reason else None)
        ids = s.output_token_ids[state[0]:]
        body = "" if text is None else text.text(s, final=s.finish_reason is not None)
        new_text = body[state[1]:]
        if not (ids or new_text or finish):
            continue
        logprobs = None if s.output_logprobs is None else with_decoded_tokens(s.output_logprobs[state[0]:], tokenizer)
        outs.append(CompletionOutput(index=s.completion, token_ids=list(ids), cumulative_logprob=s.cumulative_logprob,
                                     finish_reason=finish, text=new_text, logprobs=logprobs,
                                     stop_reason=s.stop_reason))
        state[0], state[1], state[2] = len(s.output_token_ids), max(len(body), state[1]), finish is not None
    done = is_done(group)
    if not outs and not done and not first:
        return None
    metrics = group.metrics or {"arrival_time": time.time()}
    return RequestOutput(
        request_id=group.request_id,
        prompt_token_ids=list(group.prompt_token_ids) if first else None,
        outputs=outs,
        finished=done,
        rejected=group.rejected,
        prompt=group.prompt_text if first else None,
        prompt_logprobs=with_decoded_tokens(group.prompt_logprobs, tokenizer) if first else None,
        metrics=RequestMetrics(**metrics),
    )


class OutputAccumulator:
    """A request's cumulative ``RequestOutput`` rebuilt from its deltas (``add`` each in
    order; ``output()`` the whole so far). Appending is O(delta); ``output`` copies."""

    def __init__(self):
        self.first: RequestOutput | None = None
        self.last: RequestOutput | None = None
        self.completions: dict[int, list] = {}  # index -> [token ids, text pieces, logprobs, latest CompletionOutput]

    def add(self, delta: RequestOutput) -> None:
        if self.first is None:
            self.first = delta
        self.last = delta
        for c in delta.outputs:
            acc = self.completions.get(c.index)
            if acc is None:
                acc = self.completions[c.index] = [[], [], None, c]
            acc[0].extend(c.token_ids)
            if c.text:
                acc[1].append(c.text)
            if c.logprobs is not None:
                if acc[2] is None:
                    acc[2] = []
                acc[2].extend(c.logprobs)
            acc[3] = c

    def output(self) -> RequestOutput:
        first, last = self.first, self.last
        outs = []
        for index in sorted(self.completions):
            ids, pieces, logprobs, c = self.completions[index]
            if len(pieces) > 1:
                pieces[:] = ["".join(pieces)]
            outs.append(dataclasses.replace(c, token_ids=list(ids), text=pieces[0] if pieces else "",
                                            logprobs=None if logprobs is None else list(logprobs)))
        return dataclasses.replace(last, prompt_token_ids=first.prompt_token_ids, prompt=first.prompt,
                                   prompt_logprobs=first.prompt_logprobs, outputs=outs)


def merge_deltas(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One delta saying what deltas ``a`` then ``b`` (of one request) say: a consumer that
    fell behind reads them as one."""
    acc = OutputAccumulator()
    acc.add(a)
    acc.add(b)
    return acc.output()
