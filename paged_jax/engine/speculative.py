"""Speculative decoding: propose k tokens cheaply, verify them in one target step, keep
the longest accepted prefix and roll the rest back.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    LLM(model, speculative_config={"method": "draft_model", "model": "path/or/ModelConfig",
                                   "num_speculative_tokens": 4})

One round for a decoding sequence holding ``n`` tokens (its last sampled token pending):

1. **Propose** ``m <= k`` tokens ``d_1..d_m``: ``ngram_propose`` on the host (prompt
   lookup: the tokens that followed the latest earlier occurrence of the sequence's
   longest matching suffix n-gram), or the draft model on the device
   (``paged_jax.engine.draft``), which writes its own KV beside the target's in the
   same blocks.
2. **Verify**: one target step feeds ``[last, d_1..d_m]`` (``m + 1`` tokens, the
   multi-query paged attention path) and keeps the logits at every position; the K/V of
   all ``m + 1`` are written.
3. **Accept** (``verify``, jitted): greedy rows keep ``d_i`` while it is the target's
   argmax; sampled rows keep it with probability ``min(1, p(d_i) / q(d_i))`` (p the
   target's sampling distribution, q the proposer's; q is one-hot for n-gram
   proposals), and at the first rejection draw from ``max(p - q, 0)`` renormalised
   (Leviathan et al. 2023, which leaves the output distributed exactly as the target's
   sampler); if every proposal is kept, a bonus token is drawn from ``p`` at the last
   position. So a round emits ``a + 1`` tokens for ``a`` accepted.
4. **Roll back**: ``cache.truncate`` shortens the row to ``n + a`` tokens (the pending
   bonus token is fed next round): blocks left empty return to the pool. Written blocks
   are always private (``append_slots`` copies a shared block before the write), so a
   rollback never touches another sequence. Steps 2-4 are one program.

Greedy outputs equal plain greedy decoding token for token. A sampled row's draws are a
pure function of (seed, output index): reproducible, but not the tokens plain sampling
would draw with the same seed.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.engine.sampling import _uniform, draw, sampling_probs

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16

# Streams of the acceptance test, the residual/bonus draw and the draft's own samples:
# distinct, so no two decisions about one output index share a uniform.
_ACCEPT_STREAM = np.uint32(0xA5A5A5A5)
_RESIDUAL_STREAM = np.uint32(0x5A5A5A5A)
DRAFT_STREAM = np.uint32(0x3C3C3C3C)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` keys, validated.

    Attributes:
      method: "ngram" (prompt lookup) or "draft_model".
      num_speculative_tokens: k >= 1, tokens proposed per round (at most 16).
      prompt_lookup_max, prompt_lookup_min: n-gram sizes tried, longest first.
      model: the draft (checkpoint directory or ``ModelConfig``), draft_model only.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: Any = None

    @classmethod
    def from_dict(cls, spec: dict | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config={spec!r}: expected a dict")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in spec:
            raise ValueError(f"speculative_config needs 'method', one of {list(METHODS)}")
        if "num_speculative_tokens" not in spec:
            raise ValueError("speculative_config needs 'num_speculative_tokens' (k >= 1)")
        return cls(**spec)

    def __post_init__(self):
        def is_int(x):
            return isinstance(x, numbers.Integral) and not isinstance(x, bool)

        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r}: unknown; choose one of {list(METHODS)}")
        k = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens={k!r}: must be an int in [1, {MAX_SPECULATIVE_TOKENS}]")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (is_int(lo) and is_int(hi) and 1 <= lo <= hi):
            raise ValueError(f"prompt_lookup_min={lo!r}, prompt_lookup_max={hi!r}: need ints with 1 <= min <= max")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative method 'draft_model' needs 'model' (a checkpoint directory or ModelConfig)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative method 'ngram' takes no 'model'")


def ngram_propose(tokens, k: int, max_n: int, min_n: int) -> list[int]:
    """Prompt lookup: up to ``k`` tokens that followed the latest earlier occurrence of the
    sequence's last ``n`` tokens, for the largest ``n`` in ``[min_n, max_n]`` that occurs.

    tokens: the sequence so far (prompt + output), ints. Returns [] when nothing matches.
    """
    seq = np.asarray(tokens, np.int64)
    length = len(seq)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = seq[length - n:]
        # Windows starting at 0 .. length - n - 1 (the suffix itself excluded).
        windows = np.lib.stride_tricks.sliding_window_view(seq[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start: start + k].tolist()
    return []


class Verified(NamedTuple):
    """What one verification round returns per row (device arrays)."""

    accepted: jax.Array  # int32[B]: proposals kept, a <= m
    tokens: jax.Array  # int32[B, K + 1]: d_1..d_a then the bonus/residual token; padding after
    logprobs: jax.Array  # f32[B, K + 1]: each under log_softmax(target logits) (as sample reports)


def verify(
    logits: jax.Array,
    proposals: jax.Array,
    num_proposed: jax.Array,
    draft_probs: jax.Array | None,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    steps: jax.Array,
    *,
    greedy_only: bool = False,
) -> Verified:
    """The acceptance rule (module docstring, step 3), jittable.

    Args:
      logits: f32[B, K + 1, V]: the target's logits after each fed token (position i
        predicts the token after ``d_i``; position 0 the one after the last sampled).
      proposals: int32[B, K]: d_1..d_K (entries past ``num_proposed`` ignored).
      num_proposed: int32[B]: m per row, 0 <= m <= K.
      draft_probs: f32[B, K, V]: the proposer's distribution for each d_i, or None for
        deterministic proposals (n-gram: q is one-hot on d_i).
      temperature, top_k, top_p, seeds: per row, as for ``sample``.
      steps: int32[B]: output index of the first token this round decides.
      greedy_only: static: every row is greedy (no sort, no draws).
    """
    b, width, vocab = logits.shape
    k = width - 1
    pos = jnp.arange(k)
    target_argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, K + 1]
    in_range = pos[None, :] < num_proposed[:, None]
    greedy_ok = target_argmax[:, :k] == proposals
    if greedy_only:
        ok = greedy_ok
    else:
        p = sampling_probs(logits, temperature[:, None], top_k[:, None], top_p[:, None])  # [B, K + 1, V]
        p_d = jnp.take_along_axis(p[:, :k], proposals[..., None], axis=-1)[..., 0]
        if draft_probs is None:
            ratio = p_d
        else:
            q_d = jnp.take_along_axis(draft_probs, proposals[..., None], axis=-1)[..., 0]
            ratio = p_d / jnp.maximum(q_d, 1e-30)
        u = _uniform(seeds[:, None] ^ _ACCEPT_STREAM, steps[:, None] + pos[None, :])
        ok = jnp.where((temperature == 0)[:, None], greedy_ok, u < ratio)
    accepted = jnp.argmin(jnp.concatenate([ok & in_range, jnp.zeros((b, 1), bool)], axis=1), axis=1)
    accepted = accepted.astype(jnp.int32)  # leading run of accepts, <= m
    rows = jnp.arange(b)
    final = target_argmax[rows, accepted]
    if not greedy_only:
        p_a = p[rows, accepted]  # [B, V]
        rejected = accepted < num_proposed
        d_a = proposals[rows, jnp.minimum(accepted, k - 1)]
        if draft_probs is None:
            q_a = jax.nn.one_hot(d_a, vocab, dtype=jnp.float32)
        else:
            q_a = draft_probs[rows, jnp.minimum(accepted, k - 1)]
        residual = jnp.maximum(p_a - q_a, 0.0)
        # p == q at a rejection has probability 0; guard the division anyway.
        residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_a)
        probs = jnp.where(rejected[:, None], residual, p_a)
        drawn = draw(probs, seeds ^ _RESIDUAL_STREAM, steps + accepted)
        final = jnp.where(temperature == 0, final, drawn)
    kept = jnp.concatenate([proposals, jnp.zeros((b, 1), jnp.int32)], axis=1)
    cols = jnp.arange(width)[None, :]
    tokens = jnp.where(cols < accepted[:, None], kept, jnp.where(cols == accepted[:, None], final[:, None], 0))
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[..., None], axis=-1)[..., 0]
    return Verified(accepted, tokens.astype(jnp.int32), logprobs)


def propose(spec: SpeculativeConfig, tokens: list[int], m: int) -> list:
    """This round's proposals for a decoding sequence's ``tokens`` (at most ``m``): n-gram
    prompt lookup on the host, or ``m`` placeholders (None) for a draft model, whose
    proposals are made on the device inside the verification program."""
    if spec.method == "ngram":
        return ngram_propose(tokens, m, spec.prompt_lookup_max, spec.prompt_lookup_min)
    return [None] * m
