"""Sampling parameters and the jitted batch sampler.

``SamplingParams`` keeps vLLM's names, defaults and validation. ``sample`` turns a batch
of logits into one token per row with per-row temperature, top-k, top-p, min-p, seed,
penalties and min-tokens masking. A row's random draw is a pure function of its own
``(seed, step)`` pair, never of which other rows share the batch, its position in it, or
the padded batch size: that is what makes seeded sampling reproducible across preemption,
recompute and different batch mixes.

The order is vLLM v1's (``vllm/v1/sample/sampler.py``), per row:

1. min-tokens: while a completion has fewer than ``min_tokens`` outputs, its stop token
   ids and EOS get logit -inf; ``logit_bias`` is added to its tokens' logits;
2. penalties on those logits: repetition (a token seen in the prompt or the output:
   a positive logit divided by it, a negative one multiplied), then frequency
   (``- f * count``) and presence (``- p * (count > 0)``), counts over the output only;
3. greedy rows (temperature 0) take the argmax here;
4. temperature, then min-p (drop tokens whose probability is below ``min_p`` times the
   most likely one's), then top-k, then top-p (on the distribution left after min-p and
   top-k), then the inverse-CDF draw (in token-id order, over the kept tokens).

Steps 1-2 read a per-row sparse ``History`` (token ids, output counts, flags, biases) built on
the host (see ``History``). One compiled program serves every mix of rows: the greedy
choice and whether any row needs steps 1-2 are run-time conditions (``jax.lax.cond``),
so a batch that needs neither skips the truncation and the scatter without a program of its own.

Reported log-probabilities are vLLM v1's default ``logprobs_mode="raw_logprobs"``:
``log_softmax`` of the model's unmodified logits, before penalties, temperature and
truncation; ranks count the tokens at least as likely (``Logprob.rank``, 1 = the best).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import numbers
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# History flags (int32 bit field).
SEEN = 1  # the token occurs in the prompt or the output: the repetition penalty applies
BANNED = 2  # min_tokens not reached and the token would stop the completion: logit -inf


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's entry in a logprobs dict (vLLM's ``Logprob``).

    Attributes:
      logprob: its log-probability under the model's raw distribution.
      rank: vLLM's: the number of tokens whose log-probability is >= its own (1 = the
        most likely); the top-k entries carry their position (1..k).
      decoded_token: its text, when a tokenizer filled it in (else None).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class RequestOutputKind(enum.IntEnum):
    """What ``LLM.step()`` reports of a request (vLLM's ``RequestOutputKind``, same names and
    values). ``generate`` always returns whole outputs.

    - CUMULATIVE: every step, the whole output so far (each call copies it: O(length)).
    - DELTA: only what is new since the request's previous output (token ids, text,
      logprobs; ``cumulative_logprob`` stays the running total), and only in a step that
      brought something (a token, text, a finish); the prompt's fields (``prompt_token_ids``,
      ``prompt``, ``prompt_logprobs``) in the first output only, None after. Concatenating
      a request's deltas gives its cumulative output (``outputs.OutputAccumulator``).
    - FINAL_ONLY: nothing until the request finishes, then its whole output once.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias (its History width grows with them)


class LogitBias(Mapping):
    """``SamplingParams.logit_bias``: a read-only ``{token id: bias}`` (ints to floats), so
    the params stay hashable; reads as the dict it was given (``bias[5]``, ``dict(bias)``)."""

    __slots__ = ("_items",)

    def __init__(self, items):
        self._items = dict(items)

    def __getitem__(self, token: int) -> float:
        return self._items[token]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._items.items())))

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return repr(self._items)

    def __reduce__(self):
        return (LogitBias, (self._items,))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one request (vLLM's names; frozen, hashable, validated).

    Attributes:
      max_tokens: output tokens to generate at most (>= 1).
      temperature: 0 is greedy (argmax); > 0 divides the logits.
      top_p: nucleus sampling: keep the smallest set of most likely tokens whose
        probability reaches ``top_p``; in (0, 1], 1 disables it.
      top_k: keep the ``top_k`` most likely tokens; -1 (or 0) disables it.
      min_p: in [0, 1]; after temperature, drop tokens whose probability is below
        ``min_p`` times the most likely token's (before top-k/top-p, as vLLM); 0 disables.
      presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the raw logits
        of tokens the output already holds: ``frequency * count + presence * (count > 0)``.
      repetition_penalty: > 0, 1 disables; a token in the prompt or the output has its
        raw logit divided by it when positive, multiplied by it when negative.
      min_tokens: 0 <= min_tokens <= max_tokens: until the output holds that many
        tokens, EOS (unless ``ignore_eos``) and ``stop_token_ids`` cannot be sampled.
      logit_bias: None, or ``{token id: bias}`` (finite floats; at most
        ``MAX_LOGIT_BIAS`` entries): added to those tokens' logits before the penalties, as
        vLLM v1 does (OpenAI's ``logit_bias``: -100 bans a token, 100 all but forces it).
        Reported logprobs stay the model's raw ones. Kept as a read-only ``LogitBias``.
      logprobs: None, or k >= 0: per output token, the raw log-probability and rank of
        the sampled token and of the k most likely (``Sequence.output_logprobs``).
      prompt_logprobs: None, or k >= 0: per prompt position, the same for the prompt
        token and the k most likely (``SequenceGroup.prompt_logprobs``). Such a request
        does not start on prefix-cache hits until its prompt logprobs are complete.
      seed: per-request seed; None derives one from the engine seed and request id.
      stop_token_ids: generation stops after sampling any of these (kept in the output;
        ``Sequence.stop_reason`` records which).
      ignore_eos: do not stop at the model's EOS token.
      stop: stop strings (a string or a list; needs a tokenizer): generation stops when
        the output text contains one; the text is cut before it and ``stop_reason`` is it
        (``engine/text_output.py``). Checked once the output holds ``min_tokens``.
      include_stop_str_in_output: keep the matched stop string in the text.
      skip_special_tokens: leave special tokens (EOS, chat headers) out of the text.
      spaces_between_special_tokens: vLLM's flag; the ``tokenizers`` decoders have no
        such option, so it is accepted and has no effect (as with vLLM's fast tokenizers).
      n: completions per prompt (parallel sampling). The prompt is prefilled once and
        forked ``n`` ways: its full blocks are shared, and the partly filled last one is
        copied on first write. Completion i draws from its own stream, a pure function of
        (request seed, i, step); completion 0's is the request's (as with n = 1).
      output_kind: what ``LLM.step()`` reports of the request (``RequestOutputKind``):
        whole outputs every step (the default), deltas, or the final output only. The
        server asks for deltas when it streams and the final output when it does not, as
        vLLM's does.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: Mapping[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        def is_int(x):
            return isinstance(x, numbers.Integral) and not isinstance(x, bool)

        def is_real(x):
            return isinstance(x, numbers.Real) and not isinstance(x, bool)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}: must be an int >= 1")
        if not isinstance(self.temperature, numbers.Real) or not (self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r}: must be a float >= 0 (0 = greedy)")
        if not isinstance(self.top_p, numbers.Real) or not (0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r}: must be -1 or 0 (disabled) or an int >= 1")
        if not is_real(self.min_p) or not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p={self.min_p!r}: must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_real(value) or not (-2 <= value <= 2):
                raise ValueError(f"{name}={value!r}: must be in [-2, 2]")
        if not is_real(self.repetition_penalty) or not (self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r}: must be > 0 (1 disables it)")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens!r}: must be an int >= 0")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, Mapping) or not all(is_int(t) and t >= 0 and is_real(b) and math.isfinite(b)
                                                        for t, b in bias.items()):
                raise ValueError(f"logit_bias={bias!r}: must map token ids (ints >= 0) to finite floats")
            if len(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias: {len(bias)} entries, at most MAX_LOGIT_BIAS={MAX_LOGIT_BIAS}")
            object.__setattr__(self, "logit_bias", LogitBias({int(t): float(b) for t, b in bias.items()})
                               if bias else None)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise ValueError(f"{name}={value!r}: must be None or an int >= 0")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed={self.seed!r}: must be None or an int")
        stop = self.stop_token_ids
        stop = (stop,) if is_int(stop) else tuple(stop) if isinstance(stop, list | tuple | np.ndarray) else None
        if stop is None or not all(is_int(t) and t >= 0 for t in stop):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: must be non-negative ints")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n={self.n!r}: must be an int >= 1")
        strings = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(strings, list | tuple) or not all(isinstance(x, str) and x for x in strings):
            raise ValueError(f"stop={self.stop!r}: must be a non-empty string or a list of them")
        object.__setattr__(self, "stop", tuple(strings))
        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                     "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be True or False")
        try:
            if isinstance(self.output_kind, bool):
                raise ValueError
            object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))
        except ValueError:
            raise ValueError(f"output_kind={self.output_kind!r}: must be a RequestOutputKind "
                             "(CUMULATIVE, DELTA or FINAL_ONLY)") from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        """Any of presence, frequency or repetition penalty is on."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def as_token_ids(ids) -> tuple[int, ...]:
    """An EOS setting (None, an int, or a sequence of ints) as a tuple of ints."""
    if ids is None:
        return ()
    if isinstance(ids, numbers.Integral):
        return (int(ids),)
    return tuple(int(t) for t in ids)


def completion_seed(request_seed: int, completion: int) -> int:
    """uint32 seed of completion ``completion`` of a request seeded ``request_seed``:
    the request's own for completion 0, an independent stream for the others."""
    if completion == 0:
        return request_seed
    return int(np.random.SeedSequence([request_seed, completion]).generate_state(1)[0])


def seed_for(engine_seed: int, request_id: str, seed: int | None) -> int:
    """uint32 sampling seed: the request's own, or one derived from (engine seed, id)."""
    if seed is not None:
        return int(seed) % 2**32
    digits = [ord(c) for c in request_id]
    return int(np.random.SeedSequence([engine_seed % 2**32, *digits]).generate_state(1)[0])


def _uniform(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """f32 in [0, 1) per row: a counter-based hash of (seed, step).

    Two rounds of the murmur3 32-bit finaliser over ``seed`` and ``step``. Not
    cryptographic, but well mixed, a pure function of the pair, and cheap to compile:
    on CPU a threefry draw adds ~1 s of compile time to every batch shape, which the
    engine compiles O(log batch) of.
    """

    def fmix(x):
        x ^= x >> 16
        x *= jnp.uint32(0x85EBCA6B)
        x ^= x >> 13
        x *= jnp.uint32(0xC2B2AE35)
        x ^= x >> 16
        return x

    x = fmix(seeds.astype(jnp.uint32) ^ jnp.uint32(0x9E3779B9))
    x = fmix(x ^ (steps.astype(jnp.uint32) * jnp.uint32(0x27D4EB2F) + jnp.uint32(0x165667B1)))
    return (x >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


class History(NamedTuple):
    """What steps 1-2 of the sampler (module docstring) need of each row's past, sparse.

    A row lists the distinct token ids its penalties or its min-tokens mask touch, padded
    with -1 to a common width ``K``; the host builds it from the ``Sequence`` (whose
    output counts are kept incrementally), the sampler gathers those ``K`` logits,
    adjusts them and scatters them back. So nothing ``[B, V]`` crosses to the device and
    a row that needs nothing costs nothing but padding. ``K`` is a power of two (at least
    ``runner.MIN_HISTORY``): only a batch with a long history compiles a wider program.

    Attributes:
      ids: int32[B, K]: token ids, distinct within a row; -1 is padding.
      counts: int32[B, K]: occurrences of the token in the output (frequency/presence).
      flags: int32[B, K]: ``SEEN`` (in the prompt or the output: repetition penalty
        applies) | ``BANNED`` (logit -inf: min_tokens not reached).
      bias: f32[B, K]: added to the token's logit first (``logit_bias``; 0 = none).
      presence, frequency, repetition: f32[B]: the row's penalties (0, 0, 1 = none).
    """

    ids: jax.Array
    counts: jax.Array
    flags: jax.Array
    bias: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array


def apply_history(logits: jax.Array, history: History) -> jax.Array:
    """f32[B, V]: ``logits`` f32[B, V] after the logit biases, the penalties and min-tokens
    masking (vLLM v1's order and formulas: the bias, then repetition, frequency, presence;
    -inf for banned)."""
    logits = jnp.asarray(logits, jnp.float32)
    b, vocab = logits.shape
    # Padding (and any id past the vocabulary) points out of range: the scatter drops it.
    ids = jnp.where((history.ids >= 0) & (history.ids < vocab), history.ids, vocab)
    vals = jnp.take_along_axis(logits, jnp.minimum(ids, vocab - 1), axis=1) + history.bias
    rep = history.repetition[:, None]
    seen = (history.flags & SEEN) != 0
    vals = jnp.where(seen, jnp.where(vals > 0, vals / rep, vals * rep), vals)
    counts = history.counts.astype(jnp.float32)
    vals = vals - history.frequency[:, None] * counts - history.presence[:, None] * (counts > 0)
    vals = jnp.where((history.flags & BANNED) != 0, -jnp.inf, vals)
    return logits.at[jnp.arange(b)[:, None], ids].set(vals, mode="drop")


def empty_history(batch: int, width: int = 1) -> History:
    """A ``History`` that changes nothing (every entry padding)."""
    return History(np.full((batch, width), -1, np.int32), np.zeros((batch, width), np.int32),
                   np.zeros((batch, width), np.int32), np.zeros((batch, width), np.float32),
                   np.zeros(batch, np.float32), np.zeros(batch, np.float32), np.ones(batch, np.float32))


# Candidate counts tried, in order, before the binary searches: ``jax.lax.top_k`` of this
# many tokens decides a row's kept set exactly when the set ends inside it (``_keep_mask``).
# XLA:CPU sorts [32, 49152] f32 logits in ~600 ms (2026-12-07 Intel VM), 6x a model step;
# top-k of 128 takes ~5 ms there and of 2048 ~37 ms.
CANDIDATES = (128, 2048)


def _rank_prefix(scaled, ids, n, vals, idx):
    """bool[N, V]: the first ``n`` [N] tokens of each row's ranking (by scaled logit, ties
    by id), given the ranking's head ``vals``/``idx`` [N, >= max n] in rank order."""
    at = jnp.maximum(n - 1, 0)[:, None]
    v = jnp.take_along_axis(vals, at, axis=-1)
    i = jnp.take_along_axis(idx, at, axis=-1)
    return ((scaled > v) | ((scaled == v) & (ids <= i))) & (n > 0)[:, None]


def _ordered(x: jax.Array) -> jax.Array:
    """uint32 keys in the order of the float32 ``x`` (no NaNs): integer halving of the keys
    is a binary search over the floats."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits).astype(jnp.uint32) ^ jnp.uint32(0x80000000)


def _from_ordered(key: jax.Array) -> jax.Array:
    bits = (key ^ jnp.uint32(0x80000000)).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits), jnp.float32)


def _bisect_prefix(scaled, weights, n, mass=None):
    """bool[N, V]: the longest prefix of each row's ranking (``scaled`` f32[N, V], ties by
    id) in which every token has fewer than ``n`` int32[N] tokens and less than ``mass``
    f32[N] (None: no bound) of ``weights`` ranked above it (the most likely token always
    qualifies).

    Qualifying is monotone in the value, so a binary search (32 halvings of the values'
    ordered bit patterns, each one pass over the row) finds the lowest value ``v`` whose
    tokens qualify; of the tokens tied at ``v``, as many as still fit are kept, lowest ids
    first. No sort: the last level of ``_keep_mask``."""
    unbounded = mass is None
    mass = jnp.full(n.shape, jnp.inf, jnp.float32) if unbounded else mass

    def qualifies(v):
        above = scaled > v[:, None]
        ok = above.sum(axis=-1) < n
        return ok if unbounded else ok & (jnp.where(above, weights, 0.0).sum(axis=-1) < mass)

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = qualifies(_from_ordered(mid))
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    # The maximum qualifies (nothing is above it); the answer is a token's own value.
    bounds = (_ordered(jnp.min(scaled, axis=-1)), _ordered(jnp.max(scaled, axis=-1)))
    v = _from_ordered(jax.lax.fori_loop(0, 32, halve, bounds)[1])[:, None]
    above = scaled > v
    count = above.sum(axis=-1)
    weight = jnp.where(above, weights, 0.0).sum(axis=-1)
    tied = scaled == v
    each = jnp.max(jnp.where(tied, weights, 0.0), axis=-1)
    # The r-th tied token (by id) fits while count + r < n and weight + r * each < mass.
    by_mass = jnp.where(each > 0, jnp.ceil((mass - weight) / jnp.where(each > 0, each, 1.0)), jnp.inf)
    fit = jnp.maximum(jnp.minimum((n - count).astype(jnp.float32), by_mass), 1.0)
    return above | (tied & (jnp.cumsum(tied, axis=-1) <= fit[:, None]))


def _keep_mask(scaled, top_k, top_p, min_p, candidates=CANDIDATES):
    """bool[N, V]: the tokens a row may draw from ``scaled`` f32[N, V] (logits over
    temperature), in token-id order: vLLM's min-p (p >= min_p * p_max on the full tempered
    distribution), then top-k, then top-p on what is left (a token is kept while the
    tokens ranked above it hold less than ``top_p``; the most likely is always kept).
    Ties are ranked by id. top_k int32[N] (<= 0 or >= V: off), top_p f32[N] (>= 1: off),
    min_p f32[N] (0: off).

    Each mask is a prefix of the ranking, so a row whose prefix ends among its
    ``jax.lax.top_k`` best ``k`` tokens is decided from them alone (a threshold on the
    scaled logit and the id); a row with no top-k or top-p (or a top-k past every min-p
    survivor) is decided elementwise. Only rows neither settles try the next count in
    ``candidates`` and, last, binary searches over the values (``_bisect_prefix``), each
    under a ``lax.cond`` that runs when some row needs it. The set is the same whichever
    path decides it (the top-p normaliser summed in another order can move a boundary only
    where the cumulative mass equals ``top_p`` to the last bit)."""
    vocab = scaled.shape[-1]
    ids = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), scaled.shape)
    top = jnp.max(scaled, axis=-1, keepdims=True)
    gap = scaled - top  # log(p / p_max), <= 0
    survives = gap >= jnp.log(min_p)[:, None]  # min_p 0: log 0 = -inf, every token
    survivors = survives.sum(axis=-1)
    top_k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    n1 = jnp.minimum(top_k, survivors)  # the min-p and top-k prefix's length
    by_min_p = top_k >= survivors  # that prefix is the min-p survivors: elementwise
    use_p = top_p < 1
    weights = jnp.exp(gap)
    z_min_p = jnp.sum(jnp.where(survives, weights, 0.0), axis=-1)

    def from_head(vals, idx):
        """(mask, settled bool[N]) from the ranking's head ``vals``/``idx`` [N, k]."""
        # No static slice of ``vals`` anywhere: XLA:CPU then turns the top-k back into a
        # full sort (300-400 ms at [32, 49152]).
        k = vals.shape[-1]
        head = jnp.arange(k)[None] < n1[:, None]
        e = jnp.where(head, jnp.exp(vals - top), 0.0)
        z = jnp.where(n1 <= k, e.sum(axis=-1), z_min_p)  # known unless top-k binds past k
        probs = e / z[:, None]
        cumulative = jnp.cumsum(probs, axis=-1)
        n2 = (head & ((cumulative - probs) < top_p[:, None])).sum(axis=-1)
        p_settled = (n1 <= k) | (by_min_p & ((n2 < k) | (probs.sum(axis=-1) >= top_p)))
        n = jnp.where(use_p, n2, n1)
        mask = jnp.where((~use_p & (n1 > k))[:, None], survives, _rank_prefix(scaled, ids, n, vals, idx))
        return mask, jnp.where(use_p, p_settled, (n1 <= k) | by_min_p)

    def levels(sizes):
        if not sizes:  # binary searches over the values: settle every row
            head = jax.lax.cond(jnp.all(by_min_p), lambda: survives, lambda: _bisect_prefix(scaled, weights, n1))
            z = jnp.where(head, weights, 0.0).sum(axis=-1)
            return jnp.where(use_p[:, None], _bisect_prefix(scaled, weights, n1, jnp.where(use_p, top_p * z, 1.0)),
                             head)
        vals, idx = jax.lax.top_k(scaled, min(sizes[0], vocab))
        mask, settled = from_head(vals, idx.astype(jnp.int32))
        if sizes[0] >= vocab:
            return mask
        rest = jax.lax.cond(jnp.all(settled), lambda: mask, lambda: levels(sizes[1:]))
        return jnp.where(settled[:, None], mask, rest)

    elementwise = ~use_p & by_min_p  # no top-p, no top-k short of the min-p survivors
    return jax.lax.cond(jnp.all(elementwise), lambda: survives,
                        lambda: jnp.where(elementwise[:, None], survives, levels(tuple(candidates))))


def _weights(logits, temperature, top_k, top_p, min_p, candidates=CANDIDATES):
    """f32[N, V]: unnormalised probabilities ``exp(scaled - max)`` on the kept set
    (``_keep_mask``), 0 elsewhere, in token-id order."""
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    keep = _keep_mask(scaled, top_k, top_p, min_p, candidates)
    return jnp.where(keep, jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), 0.0)


def _draw_truncated(logits, temperature, top_k, top_p, min_p, seeds, steps):
    """int32[B]: the inverse-CDF draw of ``sample`` for every row (greedy rows included)."""
    return draw(_weights(logits, temperature, top_k, top_p, min_p), seeds, steps)


def argmax_last(x: jax.Array) -> jax.Array:
    """int32[B]: ``jnp.argmax(x, axis=-1)`` of ``x [B, V]`` (the first maximum), in two
    levels: the maximum of each chunk of up to 128 entries, the first chunk holding the row's
    maximum, the first maximum in it. XLA:CPU's one-pass argmax reduces (value, index) pairs
    without vectorising: 6.8 ms for a [64, 49152] f32 batch where this takes 0.3 ms (2-core
    EPYC, 2026-12-05). Rows holding a NaN give some index (callers flag such rows)."""
    b, vocab = x.shape
    chunk = 128
    while vocab % chunk and chunk > 8:
        chunk //= 2
    if vocab % chunk:  # an odd vocabulary: one level
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    tiles = x.reshape(b, vocab // chunk, chunk)
    which = jnp.argmax(jnp.max(tiles, axis=-1), axis=-1)
    tile = jnp.take_along_axis(tiles, which[:, None, None], axis=1)[:, 0]
    return (which * chunk + jnp.argmax(tile, axis=-1)).astype(jnp.int32)


def _choose(processed, raw, temperature, top_k, top_p, seeds, steps, min_p, greedy_only):
    """(tokens, raw log-probabilities) from ``processed`` logits (after the history) and the
    ``raw`` ones (the reported distribution): greedy rows take the argmax, the others draw."""
    greedy = argmax_last(processed)

    def sampled():
        drawn = _draw_truncated(processed, temperature, top_k, top_p, min_p, seeds, steps)
        return jnp.where(temperature == 0, greedy, drawn).astype(jnp.int32)

    if greedy_only is None:  # one program: truncation and the draw run only if some row samples
        tokens = jax.lax.cond(jnp.all(temperature == 0), lambda: greedy, sampled)
    elif greedy_only:
        tokens = greedy
    else:
        tokens = sampled()
    # log_softmax at the chosen token only: no [B, V] log-probabilities are materialised
    top = jnp.max(raw, axis=-1, keepdims=True)
    lse = top[:, 0] + jnp.log(jnp.sum(jnp.exp(raw - top), axis=-1))
    logprobs = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0] - lse
    return tokens, logprobs


@functools.partial(jax.jit, static_argnames="greedy_only")
def _sample(logits, temperature, top_k, top_p, seeds, steps, min_p, history, greedy_only):
    logits = logits.astype(jnp.float32)
    if min_p is None:
        min_p = jnp.zeros_like(temperature)
    args = (temperature, top_k, top_p, seeds, steps, min_p, greedy_only)
    if history is None:
        return _choose(logits, logits, *args)
    # Skipped at run time when no row lists anything (every id padding). Each branch returns
    # only [B] results: a branch returning the [B, V] logits unchanged would copy them.
    return jax.lax.cond(jnp.any(history.ids >= 0),
                        lambda x: _choose(apply_history(x, history), x, *args),
                        lambda x: _choose(x, x, *args), logits)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    steps: jax.Array,
    *,
    min_p: jax.Array | None = None,
    history: History | None = None,
    greedy_only: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One token per row (jitted; callable inside a jit).

    Args:
      logits: f32[B, V].
      temperature: f32[B]; 0 = greedy.
      top_k: int32[B]; <= 0 disables.
      top_p: f32[B] in (0, 1].
      seeds: uint32[B] per-request seeds.
      steps: int32[B] index of the token being sampled within its request's output.
      min_p: f32[B] in [0, 1], or None (0 for every row).
      history: the rows' penalties and min-tokens bans (``History``), or None.
      greedy_only: None (default): decided at run time, inside one program, whether
        every row is greedy (then the truncation and the draw are skipped). True/False force it statically
        (a program of its own; kept for callers that know).

    The order of the processing is the module docstring's. Sampling is by inverse CDF:
    keep the min-p, top-k and top-p prefix of the ranking of the processed,
    temperature-scaled logits (ties ranked by id; ``_keep_mask``, which ranks only what it
    must), and pick where a uniform draw ``_uniform(seed, step)`` falls in the kept
    tokens' cumulative probabilities in token-id order (``draw``, as speculative decoding
    draws).

    Returns:
      (tokens int32[B], logprobs f32[B]): the token and its log-probability under the
      model's unmodified distribution (``log_softmax(logits)``, before penalties,
      temperature and truncation, as vLLM v1 and Hugging Face report it).
    """
    return _sample(logits, temperature, top_k, top_p, seeds, steps, min_p, history, greedy_only)


def top_logprobs(logits: jax.Array, temperature: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The ``k`` most likely tokens of each row and their log-probabilities.

    Args:
      logits: f32[B, V].
      temperature: f32[B]: the distribution is ``log_softmax(logits / temperature)``; 0
        means 1 (the model's own log-probabilities, as vLLM reports them).
      k: static, <= V.

    Returns (logprobs f32[B, k], ids int32[B, k]), most likely first; ties by lower id.
    """
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)
    values, ids = jax.lax.top_k(logprobs, k)
    return values, ids.astype(jnp.int32)


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int):
    """Raw log-probabilities of given tokens, their ranks and the top ``k`` (vLLM v1's
    ``raw_logprobs``).

    Args:
      logits: f32[..., V].
      tokens: int32[...]: one token per row (a negative id gives rank/logprob of id 0).
      k: static, 0 <= k <= V.

    Returns ``(logprob f32[...], rank int32[...], top_logprobs f32[..., k], top_ids
    int32[..., k])``: rank = the number of tokens whose log-probability is >= the token's
    (1 = the most likely; vLLM's ``batched_count_greater_than``), the top most likely
    first, ties by lower id.
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    lp = jnp.take_along_axis(logprobs, jnp.maximum(tokens, 0)[..., None].astype(jnp.int32), axis=-1)[..., 0]
    rank = (logprobs >= lp[..., None]).sum(axis=-1).astype(jnp.int32)
    top_lp, top_ids = jax.lax.top_k(logprobs, k)
    return lp, rank, top_lp, top_ids.astype(jnp.int32)


def sampling_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                   min_p: jax.Array | None = None) -> jax.Array:
    """The distribution ``sample`` draws from, as probabilities in token-id order.

    Args:
      logits: f32[..., V] (already processed: ``apply_history`` is not applied here);
        temperature, top_k, top_p, min_p (None: 0): per row, shaped like ``logits``
        without the vocabulary axis (broadcastable). A greedy row (temperature 0) is
        one-hot on its argmax (lowest id among ties, as ``jnp.argmax``).

    Returns f32[..., V]: the softmax of ``logits / temperature`` restricted to the min-p,
    top-k and top-p prefix of the ranking (ties ranked by id), renormalised: exactly the
    set and the weights ``sample`` uses. Speculative decoding's acceptance rule needs these.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    shape = logits.shape[:-1]
    flat = [jnp.broadcast_to(x, shape).reshape(-1) for x in
            (temperature, top_k, top_p, jnp.zeros(shape, jnp.float32) if min_p is None else min_p)]
    weights = _weights(logits.reshape(-1, vocab), *flat).reshape(logits.shape)
    out = weights / weights.sum(axis=-1, keepdims=True)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
    return jnp.where((jnp.broadcast_to(temperature, shape) == 0)[..., None], greedy, out)


def draw(probs: jax.Array, seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """int32[...]: one token per row of ``probs`` f32[..., V] (need not be normalised; a
    row of zeros gives the last token), by inverse CDF in token-id order with the uniform
    ``_uniform(seeds, steps)``: the first token whose cumulative weight passes ``u`` times
    the row's total (never one of weight 0).

    In two levels where the vocabulary splits into chunks of 128 (or a power-of-two
    divisor): the chunk where the target falls by the chunks' cumulative sums, then the
    token in it. XLA:CPU's cumsum over [32, 49152] takes ~13 ms; this reads the weights
    once. Sums taken in that order can move a pick only where the target equals a
    cumulative weight to the last bit."""
    lead, vocab = probs.shape[:-1], probs.shape[-1]
    flat = probs.reshape(-1, vocab)
    target = _uniform(jnp.broadcast_to(seeds, lead).reshape(-1), jnp.broadcast_to(steps, lead).reshape(-1))

    def pick(weights, target):
        """(index int32[N], its cumulative weight before it): the inverse-CDF pick in
        ``weights`` [N, W], never past the last positive weight (W - 1 if none)."""
        cdf = jnp.cumsum(weights, axis=-1)
        positions = jnp.arange(weights.shape[-1])
        last = jnp.max(jnp.where(weights > 0, positions, -1), axis=-1)
        i = jnp.minimum((cdf <= target[:, None]).sum(axis=-1), jnp.where(last < 0, weights.shape[-1] - 1, last))
        at = i[:, None].astype(jnp.int32)
        before = (jnp.take_along_axis(cdf, at, axis=-1) - jnp.take_along_axis(weights, at, axis=-1))[:, 0]
        return i.astype(jnp.int32), before

    chunk = 128
    while vocab % chunk and chunk > 8:
        chunk //= 2
    if vocab % chunk or vocab <= chunk:  # one level
        total = flat.sum(axis=-1)
        return pick(flat, target * total)[0].reshape(lead)
    tiles = flat.reshape(flat.shape[0], vocab // chunk, chunk)
    sums = tiles.sum(axis=-1)
    goal = target * sums.sum(axis=-1)
    c, before = pick(sums, goal)
    tile = jnp.take_along_axis(tiles, c[:, None, None], axis=1)[:, 0]
    j, _ = pick(tile, goal - before)
    return (c * chunk + j).reshape(lead)
