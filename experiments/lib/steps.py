"""Jitted pieces around a bare decode step (``paged_jax.steps``), as the step-cost studies
(decode_step, small_kv) time them: a cache state with every row filled, block management
alone, and the same model's decode over a contiguous cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.cache import append_slots, init_state, open_sequences, raise_for_status
from paged_jax.config import CacheConfig
from paged_jax.kv import copy_blocks
from paged_jax.model import ModelConfig, forward, logits_from_hidden, make_contiguous_attend
from paged_jax.steps import abstract_graphdef

# The most of a paged decode step block management may take (decode_step's target; small_kv's
# crossover threshold).
MGMT_TARGET_SHARE = 0.05


def filled_state(cc: CacheConfig, policy: str, batch: int, context: int):
    """A cache state with rows 0..batch-1 live, each holding ``context`` tokens."""
    state = init_state(cc, policy)
    ids = jnp.arange(batch, dtype=jnp.int32)
    state, status = open_sequences(state, ids)
    raise_for_status("open", ids, status)
    fill = jax.jit(lambda s, i, n: append_slots(s, i, n, max_tokens=context))
    state, res = fill(state, ids, jnp.full((batch,), context, jnp.int32))
    raise_for_status("fill", ids, res.status)
    return state


def copy_tree(tree):
    """A copy of every array of ``tree`` (a donated argument's replacement)."""
    return jax.tree.map(jnp.copy, tree)


_MGMT = {}


def mgmt_fn():
    """jit(append_slots + copy_blocks) with state and pages donated (built once)."""
    if "fn" not in _MGMT:

        def mgmt(state, pages, ids, num_tokens):
            state, res = append_slots(state, ids, num_tokens, max_tokens=1)
            pages = copy_blocks(pages, res.copy_src, res.copy_dst)
            return state, pages, res.slot_mapping

        _MGMT["fn"] = jax.jit(mgmt, donate_argnums=(0, 1))
    return _MGMT["fn"]


def make_contiguous_decode(cfg: ModelConfig):
    """jit(params, kv, tokens int32[B], lengths int32[B]) -> (logits, kv, lengths + 1); kv donated."""
    graphdef = abstract_graphdef(cfg)

    def step(params, kv, tokens, lengths):
        positions = lengths[:, None]
        new_len = lengths + 1
        attend = make_contiguous_attend(positions, new_len, jnp.ones_like(lengths))
        hidden, kv = forward(graphdef, params, tokens[:, None], positions, kv, attend)
        return logits_from_hidden(graphdef, params, hidden[:, 0]), kv, new_len

    return jax.jit(step, donate_argnums=(1,))
