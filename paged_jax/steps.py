"""The model step: one jitted program threading (params, cache state, KV pages).

This module is the contract the engine codes against:

    step = make_model_step(model_config, attention_impl="auto")   # pure; jit it (the runner does)
    logits, state, pages, status = step(params, state, pages, tokens, seq_ids, num_tokens)

    fns = make_step_fns(model_config)                             # the same, jitted, for scripts
    logits, state, pages, status = fns.prefill(params, state, pages, tokens, seq_ids, num_tokens)
    logits, state, pages, status = fns.decode(params, state, pages, tokens, seq_ids)

One call is one program: ``append_slots``, the copy-on-write block copies (all layers, one
fused op), the K/V writes, attention and the LM head at each row's last new token (at
every fed token with ``all_logits=True``: speculative verification). ``prepare`` is the
bookkeeping part alone, for steps that run more than one model (a draft beside the
target, ``paged_jax.engine.draft``). Decode is a step of one token per row
(``tokens int32[B, 1]``); there is no separate decode path. In the jitted functions ``state`` and ``pages`` are donated: use the returned ones, never
the inputs again. Positions come from ``state.seq_lens``. The call is atomic: if any row's
status is not ``Status.OK`` (0) the returned state equals the input and the pages are
unchanged (the slot mapping is all -1, so writes drop, and no copy is made); the logits
are then meaningless. Padding shapes to buckets is ``paged_jax.buckets``' job.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.attention.dispatch import resolve_impl
from paged_jax.cache import NO_SEQ, NO_SLOT, CacheState, Status, append_slots
from paged_jax.config import CacheConfig
from paged_jax.kv.pages import KVPages, copy_blocks, init_pages
from paged_jax.model.config import ModelConfig
from paged_jax.model.llama import (
    PagedContext,
    abstract_model,
    forward,
    logits_from_hidden,
    make_paged_attend,
)

ModelStep = Callable[..., tuple[jax.Array, CacheState, KVPages, jax.Array]]


class StepFns(NamedTuple):
    """The model step jitted twice over (see the module docstring).

    prefill(params, cache_state, pages, tokens int32[B, T], seq_ids int32[B], num_tokens int32[B])
      -> (logits f32[B, vocab] at each row's last new token, cache_state, pages, status int32[B])
      Appends ``num_tokens[b]`` tokens (``tokens[b, :num_tokens[b]]``) to ``seq_ids[b]``
      at positions ``seq_lens[b]...``; a row may already hold tokens (chunked prefill).
      Rows with ``seq_id == -1`` are padding; a row with ``num_tokens == 0`` gets
      meaningless logits.
    decode(params, cache_state, pages, tokens int32[B], seq_ids int32[B])
      -> (logits f32[B, vocab], cache_state, pages, status int32[B])
      The same step with one token for every non-padding row.
    """

    prefill: Callable
    decode: Callable


def abstract_graphdef(model_config: ModelConfig) -> nnx.GraphDef:
    """The ``nnx.GraphDef`` of ``model_config``'s model, built without allocating weights."""
    return nnx.split(abstract_model(model_config))[0]


class Prepared(NamedTuple):
    """A step's bookkeeping before any model runs (``prepare``). Padded steps: the model
    sees ``[B, T]`` tokens; packed ones ``[1, N]``."""

    state: CacheState  # after append_slots
    pages: Any  # after the copy-on-write copies
    ctx: PagedContext  # slots, tables, lengths (including the new tokens), query lengths (+ packed starts)
    positions: jax.Array  # int32[B, T] (packed: [1, N])
    start: jax.Array  # int32[B]: tokens each row held before the step
    tokens: jax.Array  # int32[B, T] (packed: [1, N]), clipped into the vocabulary
    status: jax.Array  # int32[B]
    ok: jax.Array  # bool[]: every status is OK (else nothing was applied)
    last: jax.Array  # int32[B]: where each row's last new token sits along the model's T axis

    @property
    def packed(self) -> bool:
        return self.ctx.q_starts is not None

    def at_last(self, hidden: jax.Array) -> jax.Array:
        """``hidden [B, T, ...]`` (packed: ``[1, N, ...]``) at each row's last new token: [B, ...]."""
        if self.packed:
            return hidden[0, self.last]
        return hidden[jnp.arange(hidden.shape[0]), self.last]

    def every(self, hidden: jax.Array) -> jax.Array:
        """``hidden`` at every fed position: ``[B, T, ...]``, or ``[N, ...]`` packed."""
        return hidden[0] if self.packed else hidden


def packed_rows(num_tokens: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Rows packed one after another (row b's ``num_tokens[b]`` tokens right after row
    b-1's) in ``n`` slots: ``(starts int32[B], row int32[N], offset int32[N], valid
    bool[N])``: where each row starts, each token's row (clamped into [0, B)) and index in
    it, and whether a token belongs to a row (the tail past the last row's does not)."""
    num_tokens = jnp.maximum(num_tokens.astype(jnp.int32), 0)
    ends = jnp.cumsum(num_tokens)
    starts = ends - num_tokens
    i = jnp.arange(n, dtype=jnp.int32)
    row = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)  # zero-token rows are skipped
    safe = jnp.minimum(row, num_tokens.shape[0] - 1)
    return starts, safe, i - starts[safe], row < num_tokens.shape[0]


def last_positions(num_tokens: jax.Array, width: int, *, packed: bool) -> jax.Array:
    """int32[B]: where each row's last fed token sits: along T in a padded ``[B, T]`` batch,
    along N in a packed one (``width`` = T or N; an empty row points at its start)."""
    num_tokens = num_tokens.astype(jnp.int32)
    last = (jnp.cumsum(jnp.maximum(num_tokens, 0)) if packed else num_tokens) - 1
    return jnp.clip(last, 0, width - 1)


def prepare(cfg: ModelConfig, state, pages, tokens, seq_ids, num_tokens, *, copy=None) -> Prepared:
    """append_slots, the copy-on-write copies and the attention context of a step
    (module docstring): everything but the model. tokens: int32[B, T] padded, or int32[N]
    packed (row b's ``num_tokens[b]`` tokens right after row b-1's; the model then sees
    ``[1, N]``). ``copy``: how blocks are copied (default ``kv.copy_blocks``; per shard
    under ``paged_jax.parallel``)."""
    packed = tokens.ndim == 1
    seq_ids = seq_ids.astype(jnp.int32)
    num_tokens = num_tokens.astype(jnp.int32)
    real = seq_ids != NO_SEQ
    bad = (tokens < 0) | (tokens >= cfg.vocab_size)
    if packed:
        n = width = tokens.shape[0]
        q_starts, row, offset, valid = packed_rows(num_tokens, n)
        # a row's bad tokens, summed by row (tokens past the last row go to a dropped index)
        bad_count = jnp.zeros(seq_ids.shape, jnp.int32).at[jnp.where(valid, row, seq_ids.shape[0])].add(
            bad.astype(jnp.int32), mode="drop")
        bad_token = real & (bad_count > 0)
    else:
        width = tokens.shape[1]
        in_chunk = jnp.arange(width)[None, :] < num_tokens[:, None]
        bad_token = real & jnp.any(in_chunk & bad, axis=1)
    # An out-of-range token count makes append_slots reject the whole call, keeping the
    # step atomic without a second code path; the row's status is then overwritten.
    request = jnp.where(bad_token, -1, num_tokens)

    safe = jnp.clip(seq_ids, 0, state.max_seqs - 1)
    start = state.seq_lens[safe]  # [B] tokens held before this step (padding rows: meaningless)
    state, res = append_slots(state, seq_ids, request, max_tokens=width)
    ok = jnp.all(res.status == Status.OK)
    status = jnp.where(bad_token, jnp.int32(Status.INVALID_TOKEN), res.status).astype(jnp.int32)
    pages = (copy or copy_blocks)(pages, res.copy_src, res.copy_dst)  # before any write (copy-on-write)

    q_lens = jnp.where(real & ok, num_tokens, 0)
    tokens = jnp.clip(tokens, 0, cfg.vocab_size - 1)
    if packed:
        # the slot of token i: its row's slot mapping at its offset (-1 if rejected or padding)
        slots = jnp.where(valid, res.slot_mapping[row, jnp.clip(offset, 0, width - 1)], NO_SLOT)
        positions = jnp.where(valid, start[row] + offset, 0)
        slot_mapping, positions, tokens = slots[None], positions[None], tokens[None]
    else:
        slot_mapping, q_starts = res.slot_mapping, None
        positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    last = last_positions(num_tokens, width, packed=packed)
    ctx = PagedContext(
        slot_mapping=slot_mapping,
        block_tables=state.block_tables[safe],
        lengths=jnp.where(real, state.seq_lens[safe], 0),
        q_lens=q_lens,
        q_starts=q_starts,
    )
    return Prepared(state, pages, ctx, positions, start, tokens, status, ok, last)


def _model_step(graphdef, cfg: ModelConfig, impl: str, params, state, pages, tokens, seq_ids, num_tokens,
                *, all_logits: bool = False, make_attend=None, copy=None):
    """One step; see the module docstring. tokens: int32[B, T] padded or int32[N] packed.
    ``all_logits`` (static): logits at every fed position (f32[B, T, V]; packed f32[N, V])
    instead of f32[B, V] at each row's last (speculative verification, prompt logprobs)."""
    prep = prepare(cfg, state, pages, tokens, seq_ids, num_tokens, copy=copy)
    attend = (make_attend or make_paged_attend)(prep.ctx, impl=impl)
    hidden, pages = forward(graphdef, params, prep.tokens, prep.positions, prep.pages, attend)
    hidden = prep.every(hidden) if all_logits else prep.at_last(hidden)
    return logits_from_hidden(graphdef, params, hidden), prep.state, pages, prep.status


@functools.cache
def make_model_step(model_config: ModelConfig, attention_impl: str = "auto", make_attend=None,
                    copy=None) -> ModelStep:
    """The pure model step for ``model_config`` (not jitted; the caller jits it, fused with
    whatever it adds). Cached: the same (config, impl) gives the same function object, so
    jit caches keyed on it are shared by every engine with that model.

    ``params`` passed to it must be ``nnx.split``'s state of this config's family's
    module (e.g. from ``load_model``). ``attention_impl``: a name in
    ``attention.dispatch`` ("auto" is kept, so the per-call fallback still works).
    ``make_attend``: ``(ctx, *, impl) -> AttendFn``, the layers' cache backend, and
    ``copy``: the copy-on-write block copy; default ``make_paged_attend`` and
    ``kv.copy_blocks`` (``paged_jax.parallel`` passes versions that run per shard).
    """
    resolve_impl(attention_impl)  # fail fast on a bad name
    return functools.partial(_model_step, abstract_graphdef(model_config), model_config, attention_impl,
                             make_attend=make_attend, copy=copy)


def make_step_fns(
    model_config: ModelConfig,
    *,
    attention_impl: str = "auto",
    on_trace: Callable[[str, tuple], Any] | None = None,
) -> StepFns:
    """The model step jitted as ``StepFns(prefill, decode)``, cache state and pages donated.

    ``on_trace``: optional hook called as ``on_trace("prefill" | "decode", tokens.shape)``
    each time a step is traced (i.e. compiled for a new shape): for compile counts.
    """
    step = make_model_step(model_config, attention_impl)

    def prefill(params, cache_state, pages, tokens, seq_ids, num_tokens):
        if on_trace is not None:
            on_trace("prefill", tokens.shape)
        return step(params, cache_state, pages, tokens, seq_ids, num_tokens)

    def decode(params, cache_state, pages, tokens, seq_ids):
        if on_trace is not None:
            on_trace("decode", tokens.shape)
        return step(params, cache_state, pages, tokens[:, None], seq_ids, (seq_ids != NO_SEQ).astype(jnp.int32))

    return StepFns(
        prefill=jax.jit(prefill, donate_argnums=(1, 2)),
        decode=jax.jit(decode, donate_argnums=(1, 2)),
    )


def init_pages_for(
    model_config: ModelConfig, cache_config: CacheConfig, dtype: Any = None, kv_cache_dtype: str = "auto"
) -> KVPages:
    """Zero KV pages shaped for the model and the pool (dtype defaults to the model's;
    ``kv_cache_dtype`` a ``kv.quant`` format)."""
    return init_pages(
        model_config.num_layers,
        model_config.num_kv_heads,
        cache_config.num_blocks,
        cache_config.block_size,
        model_config.head_dim,
        model_config.jnp_dtype if dtype is None else dtype,
        kv_cache_dtype,
    )


# --------------------------------------------------------------------------- host checks


def validate_prompt(
    tokens: Sequence[int],
    *,
    model_config: ModelConfig,
    cache_config: CacheConfig | None = None,
    start_len: int = 0,
    max_new_tokens: int = 0,
) -> np.ndarray:
    """Host-side check of a prompt (or chunk) before it is queued; returns int32[T] ids.

    The sequence will hold ``start_len + len(tokens) + max_new_tokens`` tokens; that must
    fit both the cache row (``max_blocks_per_seq * block_size``) and the model
    (``max_seq_len``: ``max_position_embeddings`` stretched by RoPE scaling, or the sliding window if smaller).
    Every id must lie in ``[0, vocab_size)``.

    Raises ValueError naming the offending numbers.
    """
    ids = np.asarray(tokens)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"a prompt must be a non-empty 1-D list of token ids (got shape {ids.shape})")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token ids must be integers (got dtype {ids.dtype})")
    total = start_len + ids.size + max_new_tokens
    what = f"{start_len} held + " if start_len else ""
    what += f"{ids.size} prompt" + (f" + {max_new_tokens} new" if max_new_tokens else "")
    if cache_config is not None and total > cache_config.max_tokens_per_seq:
        raise ValueError(
            f"sequence of {total} tokens ({what}) exceeds the cache row: max_blocks_per_seq * "
            f"block_size = {cache_config.max_blocks_per_seq} * {cache_config.block_size} = "
            f"{cache_config.max_tokens_per_seq}"
        )
    if total > model_config.max_seq_len:
        if model_config.max_seq_len == model_config.max_position_embeddings:
            limit = f"max_position_embeddings = {model_config.max_position_embeddings}"
        elif model_config.max_seq_len == model_config.max_context:
            limit = (f"context of {model_config.max_context} ({model_config.rope_scaling.rope_type} RoPE scaling "
                     f"by {model_config.rope_scaling.factor:g})")
        else:
            limit = f"sliding_window = {model_config.sliding_window} (sliding-window attention is not implemented)"
        raise ValueError(f"sequence of {total} tokens ({what}) exceeds the model's {limit}")
    bad = np.flatnonzero((ids < 0) | (ids >= model_config.vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"token id {int(ids[i])} at index {i} is outside the vocabulary [0, {model_config.vocab_size})"
            + (f" ({bad.size} bad ids)" if bad.size > 1 else "")
        )
    return ids.astype(np.int32)
