"""Sampling parameters and the jitted batch sampler.

``SamplingParams`` keeps vLLM's names and defaults. ``sample`` turns a batch of logits
into one token per row with per-row temperature, top-k, top-p and seed. A row's random
draw is a pure function of its own ``(seed, step)`` pair, never of which other rows share
the batch, its position in it, or the padded batch size: that is what makes seeded
sampling reproducible across preemption, recompute and different batch mixes.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one request (vLLM's names; frozen, hashable, validated).

    Attributes:
      max_tokens: output tokens to generate at most (>= 1).
      temperature: 0 is greedy (argmax); > 0 divides the logits.
      top_p: nucleus sampling: keep the smallest set of most likely tokens whose
        probability reaches ``top_p``; in (0, 1], 1 disables it.
      top_k: keep the ``top_k`` most likely tokens; -1 (or 0) disables it.
      seed: per-request seed; None derives one from the engine seed and request id.
      stop_token_ids: generation stops after sampling any of these (kept in the output).
      ignore_eos: do not stop at the model's EOS token.
      n: completions per prompt (parallel sampling). The prompt is prefilled once and
        forked ``n`` ways: its full blocks are shared, and the partly filled last one is
        copied on first write. Completion i draws from its own stream, a pure function of
        (request seed, i, step); completion 0's is the request's (as with n = 1).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self):
        def is_int(x):
            return isinstance(x, numbers.Integral) and not isinstance(x, bool)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}: must be an int >= 1")
        if not isinstance(self.temperature, numbers.Real) or not (self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r}: must be a float >= 0 (0 = greedy)")
        if not isinstance(self.top_p, numbers.Real) or not (0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r}: must be -1 or 0 (disabled) or an int >= 1")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed={self.seed!r}: must be None or an int")
        stop = tuple(self.stop_token_ids)
        if not all(is_int(t) and t >= 0 for t in stop):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: must be non-negative ints")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n={self.n!r}: must be an int >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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


def _truncated(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array):
    """The ranking ``sample`` and ``sampling_probs`` share: ``(order int32[..., V]`` token
    ids most likely first (ties by id), ``probs f32[..., V]`` the softmax of
    ``logits / temperature`` over the top-k prefix in that order, ``keep bool[..., V]``
    the top-k and top-p prefix)``. temperature, top_k, top_p: shaped like ``logits``
    without its last axis."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[..., None]
    ids = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), scaled.shape)
    neg_sorted, order = jax.lax.sort_key_val(-scaled, ids, dimension=-1)  # stable: ties by id
    keep = jnp.arange(vocab) < jnp.where(top_k > 0, top_k, vocab)[..., None]
    probs = jax.nn.softmax(jnp.where(keep, -neg_sorted, -jnp.inf), axis=-1)
    # Keep a token while the ones ranked above it have not reached top_p; the most likely
    # token is always kept. Both masks are prefixes of the ranking.
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[..., None]
    return order, probs, keep


@functools.partial(jax.jit, static_argnames="greedy_only")
def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    steps: jax.Array,
    *,
    greedy_only: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """One token per row.

    Args:
      logits: f32[B, V].
      temperature: f32[B]; 0 = greedy.
      top_k: int32[B]; <= 0 disables.
      top_p: f32[B] in (0, 1].
      seeds: uint32[B] per-request seeds.
      steps: int32[B] index of the token being sampled within its request's output.
      greedy_only: static; every row is greedy: skip the sort (a cheaper program).

    Sampling is by inverse CDF: sort the (temperature-scaled) logits, keep the top-k
    prefix and the top-p prefix, and pick where a uniform draw ``_uniform(seed, step)``
    falls in their cumulative probabilities. Ties are broken by token id.

    Returns:
      (tokens int32[B], logprobs f32[B]): the token and its log-probability under the
      model's unmodified distribution (``log_softmax(logits)``, before temperature and
      truncation, as vLLM and Hugging Face report it).
    """
    logits = logits.astype(jnp.float32)
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not greedy_only:
        order, probs, keep = _truncated(logits, temperature, top_k, top_p)
        cdf = jnp.cumsum(jnp.where(keep, probs, 0.0), axis=-1)
        target = _uniform(seeds, steps) * cdf[:, -1]
        choice = jnp.minimum((cdf <= target[:, None]).sum(axis=-1), keep.sum(axis=-1) - 1)
        sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
        tokens = jnp.where(temperature == 0, tokens, sampled)
    logprobs = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs


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


def sampling_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The distribution ``sample`` draws from, as probabilities in token-id order.

    Args:
      logits: f32[..., V]; temperature, top_k, top_p: per row, shaped like ``logits``
        without the vocabulary axis (broadcastable). A greedy row (temperature 0) is
        one-hot on its argmax (lowest id among ties, as ``jnp.argmax``).

    Returns f32[..., V]: the softmax of ``logits / temperature`` restricted to the top-k
    and top-p prefix of the ranking (ties ranked by id), renormalised: exactly the set and
    the weights ``sample`` uses. Speculative decoding's acceptance rule needs these.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    temperature = jnp.broadcast_to(temperature, logits.shape[:-1])
    order, probs, keep = _truncated(logits, temperature, jnp.broadcast_to(top_k, logits.shape[:-1]),
                                    jnp.broadcast_to(top_p, logits.shape[:-1]))
    kept = jnp.where(keep, probs, 0.0)
    kept = kept / kept.sum(axis=-1, keepdims=True)
    # Back from rank order to token-id order: position order[j] holds kept[j].
    out = jnp.zeros_like(kept)
    out = jnp.put_along_axis(out, order, kept, axis=-1, inplace=False)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
    return jnp.where((temperature == 0)[..., None], greedy, out)


def draw(probs: jax.Array, seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """int32[...]: one token per row of ``probs`` f32[..., V] (need not be normalised; a
    row of zeros gives the last token), by inverse CDF in token-id order with the uniform
    ``_uniform(seeds, steps)``."""
    cdf = jnp.cumsum(probs, axis=-1)
    target = _uniform(seeds, steps) * cdf[..., -1]
    return jnp.minimum((cdf <= target[..., None]).sum(axis=-1), probs.shape[-1] - 1).astype(jnp.int32)
