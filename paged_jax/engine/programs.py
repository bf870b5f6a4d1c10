"""The engine's jitted programs: pure functions of (params, cache state, pages, inputs),
apart from the runner object that calls them (nano-vllm keeps them in its model runner;
here they are plain module-level functions, jitted once per process and shared by every
runner, so engines with the same shapes compile once).

- ``fused(step)``: the model step then the sampler, one program per (rows, width, top-K
  width, history width), per layout (tokens ``[B, T]`` padded or ``[N]`` packed) and per
  prompt-logprobs variant; state and pages donated.
- ``fused_verify(step, propose)``: one speculative round (proposals by a draft model on the
  device if any, the target over them, acceptance, ``truncate`` back): one program.
- ``housekeeping`` (+ ``_cached`` with prefix caching): mark, release, select parents,
  open, fork, evict: one fixed-shape program.
- ``unshare_program``, ``swap_in_program``, ``read_blocks_program``.

``TRACES`` counts each program's traces (a runner reads it to count the compiles its calls
cause). A row whose logits hold a NaN samples ``NAN_TOKEN``.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from paged_jax.cache import (
    evict_cached,
    fork,
    mark_cached,
    open_sequences,
    release,
    restore_rows,
    select_parents,
    truncate,
    unshare,
)
from paged_jax.cache.sentinels import NO_SEQ
from paged_jax.engine import speculative
from paged_jax.engine.sampling import History, sample, token_logprobs, top_logprobs
from paged_jax.kv.pages import copy_blocks, read_blocks, write_blocks
from paged_jax.steps import last_positions

# The token a row gets when its logits hold a NaN (NaN weights, an overflow): the engine
# ends that request with finish reason "error" instead of emitting argmax-of-NaN forever.
NAN_TOKEN = -1


class SamplingBatch(NamedTuple):
    """The per-row sampling inputs of one fused call (device side, rows padded to B).

    temperature f32[B], top_k int32[B], top_p f32[B], min_p f32[B], seeds uint32[B],
    steps int32[B], top_temperature f32[B] (the top-K's distribution: 0 = raw), history
    ``sampling.History`` of width K (a power of two >= ``MIN_HISTORY``).
    """

    temperature: Any
    top_k: Any
    top_p: Any
    min_p: Any
    seeds: Any
    steps: Any
    top_temperature: Any
    history: History



class StepOut(NamedTuple):
    tokens: Any  # int32[B_pad]
    logprobs: Any  # f32[B_pad]
    status: Any  # int32[B_pad]
    top_logprobs: Any  # f32[B_pad, num_top]
    top_ids: Any  # int32[B_pad, num_top]
    ranks: Any  # int32[B_pad]: the sampled token's raw rank (0 when num_top is 0)
    prompt: Any = None  # prompt-logprobs calls: sampling.token_logprobs at [B_pad, T] (packed: [N])


class VerifyOut(NamedTuple):
    accepted: Any  # int32[B_pad]
    tokens: Any  # int32[B_pad, k + 1]
    logprobs: Any  # f32[B_pad, k + 1]
    status: Any  # int32[B_pad]
    proposals: Any  # int32[B_pad, k]


# Jitted functions are shared by every runner (module-level caches), so engines with the
# same shapes compile once per process; a runner counts only the traces its calls cause.
TRACES: collections.Counter = collections.Counter()


@functools.cache
def fused(step: Callable) -> Callable:
    """jit(step, then sample): one program and one dispatch per model call. Its Python
    body runs only when it traces, which ``TRACES`` counts. State and pages are donated.

    One program per (rows, width, num_top, history width) whatever the rows' sampling
    options: the greedy shortcut and the penalties/min-tokens scatter are ``lax.cond``s
    on the batch's values (``sampling.sample``), skipped at run time when no row needs
    them. ``num_top`` (static) > 0 adds the top-K and the sampled tokens' ranks (beam
    search, logprobs): 0 keeps them out of the common program, whose compile they would
    lengthen. ``prompt_top`` > 0 (static) is the prompt-logprobs variant: the step keeps
    the logits at every fed position, samples at each row's last, and also returns
    ``token_logprobs`` of ``prompt_targets`` (int32[B, T], or [N] packed) at every position."""

    def traced(params, state, pages, tokens, seq_ids, num_tokens, rows: SamplingBatch, prompt_targets, *,
               num_top, prompt_top):
        TRACES[program] += 1
        prompt = None
        if prompt_top:
            every, state, pages, status = step(params, state, pages, tokens, seq_ids, num_tokens, all_logits=True)
            packed = tokens.ndim == 1  # every: [N, V] packed, [B, T, V] padded
            last = last_positions(num_tokens, every.shape[0 if packed else 1], packed=packed)
            logits = every[last] if packed else every[jnp.arange(every.shape[0]), last]
            prompt = token_logprobs(every, prompt_targets, prompt_top)
        else:
            logits, state, pages, status = step(params, state, pages, tokens, seq_ids, num_tokens)
        toks, logprobs = sample(logits, rows.temperature, rows.top_k, rows.top_p, rows.seeds, rows.steps,
                                min_p=rows.min_p, history=rows.history)
        # A row with a NaN has a NaN maximum (the sampler takes the same max: one reduction).
        toks = jnp.where(jnp.isnan(jnp.max(logits.astype(jnp.float32), axis=-1)), NAN_TOKEN, toks)
        b = toks.shape[0]
        if num_top:
            raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            own = jnp.take_along_axis(raw, toks[:, None], axis=-1)
            top_lp, top_ids = top_logprobs(logits, rows.top_temperature, num_top)
            ranks = (raw >= own).sum(axis=-1).astype(jnp.int32)
        else:
            top_lp, top_ids = jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0), jnp.int32)
            ranks = jnp.zeros((b,), jnp.int32)
        return StepOut(toks, logprobs, status, top_lp, top_ids, ranks, prompt), state, pages

    program = jax.jit(traced, donate_argnums=(1, 2), static_argnames=("num_top", "prompt_top"))
    return program


@functools.cache
def fused_verify(step: Callable, propose: Callable | None) -> Callable:
    """jit(one speculative round): the target over the proposals (n-gram: given; draft:
    ``propose`` makes them in the same program), the acceptance rule, and ``truncate``
    back to the accepted tokens: one program, state and pages donated. ``greedy_only``
    None (the runner's): whether every row is greedy (no sort, no draws) is decided at
    run time inside the one program; True/False force it (a program of its own)."""

    def traced(params, state, pages, tokens, seq_ids, num_tokens, temperature, top_k, top_p, seeds, steps, *,
               greedy_only=None):
        TRACES[program] += 1
        seq_ids = seq_ids.astype(jnp.int32)
        real = seq_ids != NO_SEQ
        start = state.seq_lens[jnp.clip(seq_ids, 0, state.max_seqs - 1)]
        if propose is None:
            logits, state, pages, status = step(params, state, pages, tokens, seq_ids, num_tokens, all_logits=True)
            proposals, draft_probs = tokens[:, 1:], None
        else:
            proposals, draft_probs, logits, state, pages, status = propose(
                params, state, pages, tokens[:, 0], seq_ids, num_tokens, temperature, top_k, top_p, seeds, steps)

        def run(greedy: bool):
            # Greedy acceptance compares argmaxes: no draft distribution needed.
            return speculative.verify(logits, proposals, jnp.maximum(num_tokens - 1, 0),
                                      None if greedy else draft_probs, temperature, top_k, top_p, seeds, steps,
                                      greedy_only=greedy)

        if greedy_only is None:
            out = jax.lax.cond(jnp.all(temperature == 0), lambda: run(True), lambda: run(False))
        else:
            out = run(greedy_only)
        fed = jnp.arange(logits.shape[1])[None, :] < num_tokens[:, None]  # padding positions are not read
        nan = (jnp.isnan(logits).any(axis=2) & fed).any(axis=1)  # void round: keep only the pending token
        out = out._replace(accepted=jnp.where(nan, 0, out.accepted),
                           tokens=jnp.where(nan[:, None], NAN_TOKEN, out.tokens))
        # Keep the pending token and the accepted proposals; the new token is fed next round.
        state, cut = truncate(state, jnp.where(real, seq_ids, NO_SEQ), jnp.where(real, start + 1 + out.accepted, 0))
        status = jnp.where(status == 0, cut, status)
        return VerifyOut(out.accepted, out.tokens, out.logprobs, status, proposals), state, pages

    program = jax.jit(traced, donate_argnums=(1, 2), static_argnames=("greedy_only",))
    return program


def _housekeeping(state, release_ids, select_ids, select_parents_ids, open_ids, fork_parents, fork_children,
                  open_prefix=None):
    """Release, select parents, open (on cached blocks where ``open_prefix`` int32[S, P]
    names them), fork (int32[S] each, NO_SEQ-padded), in that order: one program."""
    state, released = release(state, release_ids)
    state, selected = select_parents(state, select_ids, select_parents_ids)
    state, opened = open_sequences(state, open_ids, open_prefix)
    state, forked = fork(state, fork_parents, fork_children)
    return state, (released, selected, opened, forked)


def _housekeeping_cached(state, mark_ids, release_ids, select_ids, select_parents_ids, open_ids, open_prefix,
                         fork_parents, fork_children, evict_ids):
    """With prefix caching: mark cached, then ``_housekeeping`` (opening rows on cached
    blocks), then evict: one program. Block ids int32[M] padded with NO_BLOCK. Nothing
    in between allocates, so evicting last serves every allocation of the step
    (swap-ins, appends). A program of its own, so that the plain one compiles as cheaply
    as before for engines without the cache."""
    state, marked = mark_cached(state, mark_ids)
    state, (released, selected, opened, forked) = _housekeeping(
        state, release_ids, select_ids, select_parents_ids, open_ids, fork_parents, fork_children, open_prefix)
    state, evicted = evict_cached(state, evict_ids)
    return state, (marked, released, selected, opened, forked, evicted)


def _unshare(state, pages, seq_ids):
    """unshare, then the copies in the KV store, in one program."""
    state, out = unshare(state, seq_ids)
    return state, copy_blocks(pages, out.copy_src, out.copy_dst), out.status


def _swap_in(state, pages, seq_ids, lens, local_tables, num_local, data, *, max_local):
    """restore_rows, then the host data into the fresh blocks, in one program."""
    state, ids, status = restore_rows(state, seq_ids, lens, local_tables, num_local, max_local=max_local)
    return state, write_blocks(pages, ids, data), status


housekeeping = jax.jit(_housekeeping, donate_argnums=0)
housekeeping_cached = jax.jit(_housekeeping_cached, donate_argnums=0)
swap_in_program = jax.jit(_swap_in, donate_argnums=(0, 1), static_argnames="max_local")
unshare_program = jax.jit(_unshare, donate_argnums=(0, 1))
read_blocks_program = jax.jit(read_blocks)
