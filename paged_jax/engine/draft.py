"""A draft model beside the target: its KV in the same blocks, its proposals on the device.

The draft's KV pages are one more page store in the pytree the block manager's blocks
index: ``DraftPages(target, draft)``, each ``[L, Hkv, N, bs, D]`` with its own layers,
heads and head size but the same blocks. So block ``b`` holds the target's *and* the
draft's K/V of the same tokens, and every block operation (copy-on-write, swap,
prefix-cache reuse, truncation, the byte budget) covers the draft with no code of its
own: the draft is rolled back exactly like the target.

Two pure functions (``make_draft_steps``), jitted by the engine's runner:

- ``step(params, state, pages, tokens, seq_ids, num_tokens, *, all_logits=False)``: the
  model-step contract (``paged_jax.steps``) for ``params = (target, draft)``: every token
  the target is fed (prefill chunks, decodes) is fed to the draft too, so the draft's KV
  always covers the same tokens.
- ``propose(params, state, pages, last, seq_ids, num_tokens, temperature, top_k, top_p,
  seeds, steps)``: one round's proposals and the target's verification logits in one
  program. ``append_slots`` reserves ``m + 1`` slots per row (``num_tokens = m + 1``);
  the draft decodes ``m + 1`` times (feeding ``last, d_1, ..., d_m``: the last feed only
  writes ``d_m``'s draft KV, so a fully accepted round leaves the draft complete), each
  draw from its sampling distribution q (one-hot argmax for greedy rows); then the target
  runs once over ``[last, d_1..d_m]``. Returns ``(proposals int32[B, K], q f32[B, K, V],
  logits f32[B, K + 1, V], state, pages, status)``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from paged_jax.engine.sampling import draw, sampling_probs
from paged_jax.engine.speculative import DRAFT_STREAM
from paged_jax.kv.pages import KVPages
from paged_jax.model.config import ModelConfig
from paged_jax.model.llama import PagedContext, forward, logits_from_hidden, make_paged_attend
from paged_jax.steps import abstract_graphdef, prepare


class DraftPages(NamedTuple):
    """The target's and the draft's KV pages over one pool of blocks."""

    target: KVPages
    draft: KVPages


class DraftSteps(NamedTuple):
    step: object
    propose: object


def check_draft(target: ModelConfig, draft: ModelConfig) -> None:
    """ValueError unless ``draft`` can propose for ``target`` (same vocabulary)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model vocabulary {draft.vocab_size} differs from the target's {target.vocab_size}: "
            "proposals must be the target's token ids"
        )


def _step(tg, dg, tcfg, dcfg, impl, params, state, pages, tokens, seq_ids, num_tokens, *, all_logits=False):
    tp, dp = params
    prep = prepare(tcfg, state, pages, tokens, seq_ids, num_tokens)
    attend = make_paged_attend(prep.ctx, impl=impl)
    hidden, target_pages = forward(tg, tp, prep.tokens, prep.positions, prep.pages.target, attend)
    _, draft_pages = forward(dg, dp, prep.tokens, prep.positions, prep.pages.draft, attend)
    pages = DraftPages(target_pages, draft_pages)
    hidden = prep.every(hidden) if all_logits else prep.at_last(hidden)
    return logits_from_hidden(tg, tp, hidden), prep.state, pages, prep.status


def _propose(tg, dg, tcfg, dcfg, impl, k, params, state, pages, last, seq_ids, num_tokens,
             temperature, top_k, top_p, seeds, steps):
    tp, dp = params
    b = last.shape[0]
    num_tokens = num_tokens.astype(jnp.int32)
    # The fed tokens are known only after the draft runs; prepare needs their count
    # (and checks the first: the proposals come from the vocabulary).
    fed = jnp.zeros((b, k + 1), jnp.int32).at[:, 0].set(last)
    prep = prepare(tcfg, state, pages, fed, seq_ids, num_tokens)
    ctx = prep.ctx

    def draft_feed(carry, i):
        draft_pages, token = carry
        sub = PagedContext(
            slot_mapping=jax.lax.dynamic_slice_in_dim(ctx.slot_mapping, i, 1, axis=1),
            block_tables=ctx.block_tables,
            lengths=jnp.where(ctx.q_lens > i, prep.start + i + 1, 0),
            q_lens=jnp.where(ctx.q_lens > i, 1, 0),
        )
        hidden, draft_pages = forward(dg, dp, token[:, None], (prep.start + i)[:, None], draft_pages,
                                      make_paged_attend(sub, impl=impl))
        q = sampling_probs(logits_from_hidden(dg, dp, hidden[:, 0]), temperature, top_k, top_p)
        nxt = draw(q, seeds ^ DRAFT_STREAM, steps + i)
        return (draft_pages, nxt), (nxt, q)

    (draft_pages, _), (drafted, q) = jax.lax.scan(
        draft_feed, (prep.pages.draft, prep.tokens[:, 0]), jnp.arange(k + 1))
    proposals = jnp.swapaxes(drafted[:k], 0, 1)  # [B, K]
    q = jnp.swapaxes(q[:k], 0, 1)  # [B, K, V]
    tokens = jnp.concatenate([prep.tokens[:, :1], proposals], axis=1)
    attend = make_paged_attend(ctx, impl=impl)
    hidden, target_pages = forward(tg, tp, tokens, prep.positions, prep.pages.target, attend)
    logits = logits_from_hidden(tg, tp, hidden)
    return proposals, q, logits, prep.state, DraftPages(target_pages, draft_pages), prep.status


@functools.cache
def make_draft_steps(target: ModelConfig, draft: ModelConfig, attention_impl: str, k: int) -> DraftSteps:
    """The combined step and the proposal program for a target and its draft (module
    docstring); ``k`` the proposals per round (the static width)."""
    check_draft(target, draft)
    tg, dg = abstract_graphdef(target), abstract_graphdef(draft)
    return DraftSteps(
        step=functools.partial(_step, tg, dg, target, draft, attention_impl),
        propose=functools.partial(_propose, tg, dg, target, draft, attention_impl, k),
    )
