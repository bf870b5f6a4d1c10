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
                logprobs=with_decoded_tokens(s.output_logprobs, tokenizer),
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
