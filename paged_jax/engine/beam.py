"""Beam search with the rules of Hugging Face transformers, as pure host-side functions.

The engine runs every beam of every beam request in the same batch as other requests;
each step brings back, per beam row, the top ``K`` log-probabilities and their token ids
(``K = max(2, 1 + n_eos) * beam_width``: any of the step's global top-K candidates is among
its own beam's top-K). ``beam_step`` turns them into the next beams (a parent beam and a
token each, which the runner realises with one ``select_parents`` for the whole batch)
and the updated finished hypotheses. Nothing here touches the device.

The rules (transformers' ``generate(num_beams=W, do_sample=False)``, its vectorised
implementation since 4.49, as kept in 5.x):

1. Scores are cumulative log-probabilities: ``log_softmax(logits)`` of each chosen token
   summed over the generated tokens (float32). Beam 0 starts at 0 and beams 1..W-1 at
   -1e9, so the first step's candidates all come from the prompt.
2. Each step takes the top ``K`` candidates over all ``W x vocab`` continuations.
   A candidate "hits" if its token is an EOS id (none with ``ignore_eos``) or if it
   makes the generated length reach ``max_tokens``.
3. The next running beams are the top ``W`` candidates that do not hit (hits get -1e9).
4. Only hits ranked among the top ``W`` of the ``K`` may become finished hypotheses, with
   score ``cum_logprob / generated_length ** length_penalty`` (the generated length
   includes the EOS). They are merged with the current ``W`` finished slots and the best
   ``W`` kept. No new hypothesis is accepted once every slot is full and
   ``early_stopping is True``, nor once the early-stop heuristic says no improvement is
   possible.
5. The heuristic (checked after each step): the best running beam's score normalised by
   a hypothetical length — ``max_tokens`` when ``early_stopping == "never"`` and
   ``length_penalty > 0``, else the current generated length — must beat the worst
   finished score (or some slot must still be empty), or the search is done.
6. The search stops when no improvement is possible, when ``early_stopping is True`` and
   every slot is full, or when every candidate of a step hits (e.g. at ``max_tokens``,
   where the top ``W`` are all finalised with the same normalisation).
7. The result is the ``W`` finished hypotheses, best first (``sequences_scores``).

Where vLLM differs (its ``LLM.beam_search``): it normalises by the length of prompt +
output, has no early stopping (every beam runs to ``max_tokens`` or EOS), keeps
``2 * W`` candidates per beam from a ``logprobs`` request, and drives the search from
Python with one ``generate`` call per token.

``temperature > 0`` scores with ``log_softmax(logits / temperature)`` (still a
deterministic search; transformers' sampling variant, ``do_sample=True``, is not
implemented).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

import numpy as np

_NEG = np.float32(-1e9)  # transformers' "impossible" score


@dataclasses.dataclass(frozen=True, kw_only=True)
class BeamSearchParams:
    """A beam search request (vLLM's names, plus transformers' ``early_stopping``).

    Attributes:
      beam_width: beams kept per step and hypotheses returned (>= 1).
      max_tokens: most tokens generated per hypothesis (>= 1).
      ignore_eos: never finish on EOS (every hypothesis runs to ``max_tokens``).
      temperature: 0 scores with the model's log-probabilities; > 0 divides the logits.
      length_penalty: exponent of the generated length in the score; > 0 favours longer
        hypotheses.
      early_stopping: True (stop once ``beam_width`` hypotheses are finished), False (stop
        when the heuristic says no running beam can beat them, at its current length) or
        "never" (the same with the best possible length).
      eos_token_id: an id or ids that end a hypothesis; None: the model's EOS.
    """

    beam_width: int
    max_tokens: int = 16
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        def is_int(x):
            return isinstance(x, numbers.Integral) and not isinstance(x, bool)

        if not is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width={self.beam_width!r}: must be an int >= 1")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}: must be an int >= 1")
        if not isinstance(self.temperature, numbers.Real) or not (self.temperature >= 0) \
                or not math.isfinite(self.temperature):
            raise ValueError(f"temperature={self.temperature!r}: must be a finite float >= 0")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, numbers.Real) \
                or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty={self.length_penalty!r}: must be a finite float")
        if self.early_stopping not in (True, False, "never") or not isinstance(self.early_stopping, bool | str):
            raise ValueError(f"early_stopping={self.early_stopping!r}: must be True, False or 'never'")
        eos = self.eos_token_id
        if eos is not None:
            ids = (eos,) if is_int(eos) else tuple(eos) if isinstance(eos, list | tuple) else None
            if ids is None or not ids or not all(is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"eos_token_id={eos!r}: must be None, a token id or a non-empty list of ids")
            object.__setattr__(self, "eos_token_id", tuple(int(t) for t in ids))


class BeamSearchSequence(NamedTuple):
    """One finished hypothesis."""

    tokens: list[int]  # prompt + generated, up to and including the EOS that ended it
    cum_logprob: float  # sum of the generated tokens' log-probabilities
    score: float  # cum_logprob / generated_length ** length_penalty (transformers' sequences_scores)
    finish_reason: str  # "stop" (EOS) or "length"
    text: str | None = None  # the prompt's and the generated tokens' text (the model has a tokenizer)


class BeamSearchOutput(NamedTuple):
    """The result of one beam search request: ``beam_width`` hypotheses, best first."""

    sequences: list[BeamSearchSequence]
    rejected: str | None = None  # why the request never ran (then ``sequences`` is empty)


class Hypothesis(NamedTuple):
    tokens: tuple[int, ...]  # generated tokens
    cum_logprob: np.float32
    score: np.float32  # normalised (finished) or cumulative (running)


@dataclasses.dataclass(frozen=True)
class BeamState:
    """One request's beam search between steps (host side, immutable).

    ``running[i]``: beam i's generated tokens and cumulative score (``_NEG`` for beams not
    yet started); ``finished``: the ``W`` best finished hypotheses so far (``score`` is
    ``_NEG`` for an empty slot), best first; ``improvable``: the early-stop heuristic is
    still unsatisfied; ``done``: the search has ended.
    """

    width: int
    num_candidates: int  # K
    running: tuple[Hypothesis, ...]
    finished: tuple[Hypothesis, ...]
    improvable: bool = True
    done: bool = False

    @property
    def generated(self) -> int:
        """Tokens generated so far by every running beam."""
        return len(self.running[0].tokens)


def num_candidates(width: int, num_eos: int) -> int:
    """K = max(2, 1 + number of EOS ids) * width."""
    return max(2, 1 + num_eos) * width


def init_state(width: int, num_eos: int) -> BeamState:
    empty = Hypothesis((), _NEG, _NEG)
    running = (Hypothesis((), np.float32(0.0), np.float32(0.0)),) + (empty,) * (width - 1)
    return BeamState(width, num_candidates(width, num_eos), running, (empty,) * width)


class StepChoice(NamedTuple):
    """The next running beams: beam i continues from beam ``parents[i]`` with ``tokens[i]``."""

    parents: list[int]
    tokens: list[int]
    logprobs: list[float]  # each token's own log-probability


def beam_step(
    state: BeamState,
    logprobs: np.ndarray,
    token_ids: np.ndarray,
    *,
    eos: tuple[int, ...],
    max_tokens: int,
    length_penalty: float,
    early_stopping: bool | str,
) -> tuple[BeamState, StepChoice | None]:
    """One step of the search (rules 2-6 of the module docstring).

    Args:
      logprobs, token_ids: f32/int[W, K] each running beam's top-K log-probabilities and
        their ids, best first (rows of beams not yet started are ignored).
      eos: the ids that end a hypothesis (empty with ``ignore_eos``).
      max_tokens: the most tokens a hypothesis may generate.

    Returns the new state and the next beams (None once the search is done).
    """
    w, k = state.width, state.num_candidates
    cur = state.generated
    # Rule 2: the top K of every (beam, token) continuation; ties to the lower flat index,
    # as a stable top-k over beam-major candidates would.
    cum = np.array([h.cum_logprob for h in state.running], np.float32)
    live = np.flatnonzero(cum != _NEG)
    lp_all = np.asarray(logprobs, np.float32)[live]
    scores = (cum[live, None] + lp_all).reshape(-1)
    beams = np.repeat(live, lp_all.shape[1])
    toks = np.asarray(token_ids)[live].reshape(-1).astype(np.int64)
    lps = lp_all.reshape(-1)
    order = np.lexsort((toks, beams, -scores))[:k].tolist()  # by score, then beam, then token
    scores, beams, toks = list(scores), beams.tolist(), toks.tolist()  # scores stay float32
    length = cur + 1
    hits = [toks[i] in eos or length >= max_tokens for i in order]

    # Rule 3: the best W candidates that do not hit continue.
    alive = [i for i, hit in zip(order, hits, strict=True) if not hit][:w]
    parents = [beams[i] for i in alive]
    running = tuple(
        Hypothesis(state.running[beams[i]].tokens + (toks[i],), scores[i], scores[i]) for i in alive
    )

    # Rule 4: finished hypotheses from the hits ranked in the top W.
    full = all(h.score != _NEG for h in state.finished)
    accepting = state.improvable and not (full and early_stopping is True)
    denom = np.float32(length**length_penalty)
    new = [
        Hypothesis(state.running[beams[i]].tokens + (toks[i],), scores[i], np.float32(scores[i] / denom))
        for rank, (i, hit) in enumerate(zip(order, hits, strict=True))
        if hit and rank < w and accepting
    ]
    merged = list(state.finished) + new
    finished = tuple(sorted(merged, key=lambda h: -h.score)[:w])  # stable: earlier slots first on ties

    # Rules 5-6: continue? (An empty slot counts as -1e9, as in transformers.)
    if alive:
        hypothetical = max_tokens if (early_stopping == "never" and length_penalty > 0) else length
        best_possible = np.float32(running[0].score / np.float32(hypothetical**length_penalty))
        filled = all(h.score != _NEG for h in finished)
        worst = min(h.score for h in finished) if filled else _NEG
        improvable = state.improvable and bool(best_possible > worst)
    else:
        improvable = False
    full = all(h.score != _NEG for h in finished)
    done = all(hits) or len(alive) < w or not improvable or (full and early_stopping is True)
    if done:
        return BeamState(w, k, state.running, finished, improvable, True), None
    choice = StepChoice(parents, [toks[i] for i in alive], [float(lps[i]) for i in alive])
    return BeamState(w, k, running, finished, improvable, False), choice


def results(state: BeamState, prompt: tuple[int, ...], eos: tuple[int, ...]) -> BeamSearchOutput:
    """The finished hypotheses, best first, as ``BeamSearchSequence``s."""
    seqs = []
    for h in state.finished:
        reason = "stop" if h.tokens and h.tokens[-1] in eos else "length"
        seqs.append(BeamSearchSequence(list(prompt) + list(h.tokens), float(h.cum_logprob), float(h.score), reason))
    return BeamSearchOutput(seqs)
