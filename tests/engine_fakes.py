"""A tiny fake model obeying the step-function contract, for fast scheduler tests.

It stores each token's id (K) and position (V) in the real KV page store through the
real block manager, and its logits are a chaotic function of everything the sequence's
table row holds, read back through the block table. So any KV the engine loses, misplaces
or corrupts (a bad swap, a leaked or reused block, a wrong length) changes the sampled
tokens, while the arithmetic is identical whether a token arrived by prefill, decode,
recompute or swap-in (the readout always reduces the same fixed-size row in the same
order), so outputs must match bit for bit across memory pressure.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from paged_jax import kv
from paged_jax.cache import append_slots
from paged_jax.engine import ModelBackend
from paged_jax.steps import packed_rows

VOCAB = 48


def _readout(pages, state, seq_ids, lens=None):
    """logits f32[B, VOCAB] from the first ``lens`` (default: every) tokens each row
    holds."""
    safe = jnp.maximum(seq_ids, 0)
    rows = jnp.maximum(state.block_tables[safe], 0)  # [B, P]
    toks = pages.k[0, 0][rows][..., 0].reshape(rows.shape[0], -1)  # [B, P * bs]
    pos = pages.v[0, 0][rows][..., 0].reshape(rows.shape[0], -1)
    lens = state.seq_lens[safe] if lens is None else lens
    idx = jnp.arange(toks.shape[1])
    held = idx[None, :] < lens[:, None]
    # Position must match the slot's logical index, or the KV is misplaced.
    consistent = jnp.where(held, pos == idx[None, :], True).all(axis=1)
    weight = jnp.cos(idx * 0.37) + 1.5
    feat = jnp.where(held, toks * weight, 0.0).sum(axis=1) + lens * 0.1
    v = jnp.arange(VOCAB, dtype=jnp.float32)
    logits = jnp.sin(feat[:, None] * (v + 1) * 0.0137 + 0.5 * v) * 4.0
    return jnp.where(consistent[:, None], logits, jnp.nan)


def _append(params, state, pages, tokens, seq_ids, num_tokens, *, all_logits=False):
    if tokens.ndim == 1:  # packed: run as the padded [B, N] batch, logits back at the packed positions
        n = tokens.shape[0]
        starts, row, offset, valid = packed_rows(num_tokens, n)
        padded = tokens[jnp.clip(starts[:, None] + jnp.arange(n)[None, :], 0, n - 1)]
        logits, state, pages, status = _append(params, state, pages, padded, seq_ids, num_tokens,
                                               all_logits=all_logits)
        if all_logits:
            logits = jnp.where(valid[:, None], logits[row, jnp.clip(offset, 0, n - 1)], 0.0)
        return logits, state, pages, status
    del params
    width = tokens.shape[1]
    old_lens = state.seq_lens[jnp.maximum(seq_ids, 0)]
    state, res = append_slots(state, seq_ids, num_tokens, max_tokens=width)
    pages = kv.copy_blocks(pages, res.copy_src, res.copy_dst)
    k_new = (tokens + 1).astype(jnp.float32)[None, :, :, None, None]  # [L=1, B, T, H=1, D=1]
    pos = (old_lens[:, None] + jnp.arange(width)[None, :]).astype(jnp.float32)
    v_new = pos[None, :, :, None, None]
    pages = kv.write_tokens(pages, res.slot_mapping, k_new, v_new)
    if all_logits:  # after each fed token: the row read up to it (speculative verification)
        per_position = [_readout(pages, state, seq_ids, old_lens + t + 1) for t in range(width)]
        return jnp.stack(per_position, axis=1), state, pages, res.status
    # Logits at each row's last new token = a function of the whole row after the append.
    return _readout(pages, state, seq_ids), state, pages, res.status


@functools.cache  # one backend per setting: engines share its compiled steps
def fake_backend(block_size: int = 4, eos_token_id: int | None = None, max_position: int | None = 256) -> ModelBackend:
    return ModelBackend(
        step=_append,
        params={},
        init_pages=lambda num_blocks: kv.init_pages(1, 1, num_blocks, block_size, 1),
        vocab_size=VOCAB,
        eos_token_id=eos_token_id,
        max_position=max_position,
        name="fake",
    )


def assert_drained(llm) -> None:
    """After a generate: no block leaked (every block free or cached-free: the prefix
    cache's blocks are accounted, each holding only the cache's reference), no row left
    live, no request queued, the host swap pool empty."""
    for replica in range(llm.data_parallel_size):
        cache = llm.inspect(replica)  # checks the invariants
        assert int(cache.cached.sum()) == cache.prefix_cached_blocks
        assert cache.num_free + int(cache.cached.sum()) == llm.num_gpu_blocks
        assert np.array_equal(cache.ref_counts, cache.cached.astype(np.int32))
        assert cache.idle and not cache.rows
        assert cache.swap_used == 0
    assert not llm.has_unfinished_requests()
