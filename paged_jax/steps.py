"""Jitted prefill and decode steps threading (params, cache state, KV pages).

This module is the contract the engine codes against:

    fns = make_step_fns(model_config, attention_impl="auto")
    logits, state, pages, status = fns.prefill(params, state, pages, tokens, seq_ids, num_tokens)
    logits, state, pages, status = fns.decode(params, state, pages, tokens, seq_ids)

One call is one ``jax.jit`` program: ``append_slots``, the copy-on-write block copies (all
layers, one fused op), the K/V writes, attention and the LM head at each row's last new
token. ``state`` and ``pages`` are donated: use the returned ones, never the inputs again.
Positions come from ``state.seq_lens``. The call is atomic: if any row's status is not
``Status.OK`` (0) the returned state equals the input and the pages are unchanged (the
slot mapping is all -1, so writes drop, and no copy is made); the logits are then
meaningless.

Host-side helpers keep the number of compiled programs bounded: ``bucket`` rounds sizes
up to powers of two (or given buckets), ``pad_batch``/``pad_decode`` pad a batch to them,
and ``validate_prompt`` rejects what the jitted code cannot report well (too-long
sequences, out-of-vocabulary ids) with an error naming the numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.attention.dispatch import resolve_impl
from paged_jax.cache import CacheState, Status, append_slots, raise_for_status
from paged_jax.config import CacheConfig
from paged_jax.kv.pages import KVPages, copy_blocks, init_pages
from paged_jax.model.config import ModelConfig
from paged_jax.model.llama import (
    LlamaForCausalLM,
    PagedContext,
    forward,
    logits_from_hidden,
    make_paged_attend,
)

NO_SEQ = CacheState.NO_SEQ
# Status of a row holding a token id outside [0, vocab_size); the whole call is rejected
# (atomic) like any other error.
STATUS_INVALID_TOKEN = int(Status.INVALID_TOKEN)


class StepFns(NamedTuple):
    """The two jitted steps (see the module docstring).

    prefill(params, cache_state, pages, tokens int32[B, T], seq_ids int32[B], num_tokens int32[B])
      -> (logits f32[B, vocab] at each row's last new token, cache_state, pages, status int32[B])
      Appends ``num_tokens[b]`` tokens (``tokens[b, :num_tokens[b]]``) to ``seq_ids[b]``
      at positions ``seq_lens[b]...``; a row may already hold tokens (chunked prefill).
      Rows with ``seq_id == -1`` are padding; a row with ``num_tokens == 0`` gets
      meaningless logits.
    decode(params, cache_state, pages, tokens int32[B], seq_ids int32[B])
      -> (logits f32[B, vocab], cache_state, pages, status int32[B])
      Appends one token to every non-padding row.
    """

    prefill: Callable
    decode: Callable


def abstract_graphdef(model_config: ModelConfig) -> nnx.GraphDef:
    """The ``nnx.GraphDef`` of ``model_config``'s model, built without allocating weights."""
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(model_config, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)[0]


def _step(graphdef, cfg: ModelConfig, impl: str, decode: bool, params, state, pages, tokens, seq_ids, num_tokens):
    """One prefill/decode step; see ``StepFns``. tokens: int32[B, T]."""
    b, t = tokens.shape
    seq_ids = seq_ids.astype(jnp.int32)
    num_tokens = num_tokens.astype(jnp.int32)
    real = seq_ids != NO_SEQ
    in_chunk = jnp.arange(t)[None, :] < num_tokens[:, None]
    bad_token = real & jnp.any(in_chunk & ((tokens < 0) | (tokens >= cfg.vocab_size)), axis=1)
    # An out-of-range token count makes append_slots reject the whole call, keeping the
    # step atomic without a second code path; the row's status is then overwritten.
    request = jnp.where(bad_token, -1, num_tokens)

    safe = jnp.clip(seq_ids, 0, state.max_seqs - 1)
    start = state.seq_lens[safe]  # [B] tokens held before this step
    state, res = append_slots(state, seq_ids, request, max_tokens=t)
    ok = jnp.all(res.status == 0)
    status = jnp.where(bad_token, STATUS_INVALID_TOKEN, res.status).astype(jnp.int32)
    pages = copy_blocks(pages, res.copy_src, res.copy_dst)  # before any write (copy-on-write)

    ctx = PagedContext(
        slot_mapping=res.slot_mapping,
        block_tables=state.block_tables[safe],
        lengths=jnp.where(real, state.seq_lens[safe], 0),
        q_lens=jnp.where(real & ok, num_tokens, 0),
    )
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    attend = make_paged_attend(ctx, impl=impl, decode=decode)
    tokens = jnp.clip(tokens, 0, cfg.vocab_size - 1)
    hidden, pages = forward(graphdef, params, tokens, positions, pages, attend)
    last = jnp.clip(num_tokens - 1, 0, t - 1)
    logits = logits_from_hidden(graphdef, params, hidden[jnp.arange(b), last])
    return logits, state, pages, status


def make_step_fns(
    model_config: ModelConfig,
    *,
    attention_impl: str = "auto",
    on_trace: Callable[[str, tuple], Any] | None = None,
) -> StepFns:
    """Build the jitted ``prefill`` and ``decode`` steps for ``model_config``.

    Args:
      model_config: the model; ``params`` passed to the steps must be ``nnx.split``'s
        state of this config's ``LlamaForCausalLM`` (e.g. from ``load_model``).
      attention_impl: "auto" | "xla" | "reference" | "pallas" | "pallas_interpret"
        (``attention.dispatch``).
      on_trace: optional hook called as ``on_trace("prefill" | "decode", tokens.shape)``
        each time a step is traced (i.e. compiled for a new shape): for compile counts.

    Returns ``StepFns(prefill, decode)``, both ``jax.jit`` with cache_state and pages
    donated.
    """
    resolve_impl(attention_impl)  # fail fast on a bad name; "auto" is kept for per-call fallback
    impl = attention_impl
    graphdef = abstract_graphdef(model_config)

    def prefill(params, cache_state, pages, tokens, seq_ids, num_tokens):
        if on_trace is not None:
            on_trace("prefill", tokens.shape)
        return _step(graphdef, model_config, impl, False, params, cache_state, pages, tokens, seq_ids, num_tokens)

    def decode(params, cache_state, pages, tokens, seq_ids):
        if on_trace is not None:
            on_trace("decode", tokens.shape)
        num_tokens = (seq_ids != NO_SEQ).astype(jnp.int32)
        return _step(
            graphdef, model_config, impl, True, params, cache_state, pages, tokens[:, None], seq_ids, num_tokens
        )

    return StepFns(
        prefill=jax.jit(prefill, donate_argnums=(1, 2)),
        decode=jax.jit(decode, donate_argnums=(1, 2)),
    )


# Steps report through the block manager's Status (INVALID_TOKEN included).
raise_for_step_status = raise_for_status


def init_pages_for(model_config: ModelConfig, cache_config: CacheConfig, dtype: Any = None) -> KVPages:
    """Zero KV pages shaped for the model and the pool (dtype defaults to the model's)."""
    return init_pages(
        model_config.num_layers,
        model_config.num_kv_heads,
        cache_config.num_blocks,
        cache_config.block_size,
        model_config.head_dim,
        model_config.jnp_dtype if dtype is None else dtype,
    )


# --------------------------------------------------------------------------- host helpers


def bucket(n: int, buckets: Sequence[int] | None = None) -> int:
    """Smallest bucket >= n: the next power of two (1, 2, 4, ...) or the smallest of ``buckets``.

    Raises ValueError if n < 0 or n exceeds every given bucket.
    """
    if n < 0:
        raise ValueError(f"cannot bucket a negative size ({n})")
    if buckets is None:
        return 1 << max(n - 1, 0).bit_length()
    fits = [x for x in buckets if x >= n]
    if not fits:
        raise ValueError(f"size {n} exceeds the largest bucket {max(buckets)}")
    return min(fits)


class PaddedBatch(NamedTuple):
    """A prefill batch padded to buckets (numpy, ready for ``StepFns.prefill``)."""

    tokens: np.ndarray  # int32[B_bucket, T_bucket]; 0 past each row's tokens
    seq_ids: np.ndarray  # int32[B_bucket]; NO_SEQ (-1) for padding rows
    num_tokens: np.ndarray  # int32[B_bucket]; 0 for padding rows


def pad_batch(
    seq_ids: Sequence[int],
    token_lists: Sequence[Sequence[int]],
    *,
    batch_buckets: Sequence[int] | None = None,
    length_buckets: Sequence[int] | None = None,
) -> PaddedBatch:
    """Pad ragged prefill chunks to a (batch, length) bucket.

    Args:
      seq_ids: one sequence id per row.
      token_lists: the new tokens of each row (a chunk; lengths may differ).
      batch_buckets, length_buckets: allowed padded sizes; default powers of two.
    """
    if len(seq_ids) != len(token_lists):
        raise ValueError(f"{len(seq_ids)} seq_ids but {len(token_lists)} token lists")
    b = bucket(len(seq_ids), batch_buckets)
    t = bucket(max((len(x) for x in token_lists), default=1), length_buckets)
    tokens = np.zeros((b, t), np.int32)
    ids = np.full((b,), NO_SEQ, np.int32)
    num = np.zeros((b,), np.int32)
    for i, (sid, toks) in enumerate(zip(seq_ids, token_lists)):
        tokens[i, : len(toks)] = toks
        ids[i], num[i] = sid, len(toks)
    return PaddedBatch(tokens, ids, num)


def pad_decode(
    seq_ids: Sequence[int], tokens: Sequence[int], *, batch_buckets: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens int32[B_bucket], seq_ids int32[B_bucket])`` for ``StepFns.decode``; padding
    rows have seq_id NO_SEQ and token 0."""
    if len(seq_ids) != len(tokens):
        raise ValueError(f"{len(seq_ids)} seq_ids but {len(tokens)} tokens")
    b = bucket(len(seq_ids), batch_buckets)
    out_tokens = np.zeros((b,), np.int32)
    out_ids = np.full((b,), NO_SEQ, np.int32)
    out_tokens[: len(tokens)] = tokens
    out_ids[: len(seq_ids)] = seq_ids
    return out_tokens, out_ids


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
    (``max_seq_len``: ``max_position_embeddings``, or the sliding window if smaller).
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
        limit = (
            f"max_position_embeddings = {model_config.max_position_embeddings}"
            if model_config.max_seq_len == model_config.max_position_embeddings
            else f"sliding_window = {model_config.sliding_window} (sliding-window attention is not implemented)"
        )
        raise ValueError(f"sequence of {total} tokens ({what}) exceeds the model's {limit}")
    bad = np.flatnonzero((ids < 0) | (ids >= model_config.vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"token id {int(ids[i])} at index {i} is outside the vocabulary [0, {model_config.vocab_size})"
            + (f" ({bad.size} bad ids)" if bad.size > 1 else "")
        )
    return ids.astype(np.int32)
