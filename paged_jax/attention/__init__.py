"""Attention over paged and dense KV: a plain-XLA reference, a length-aware XLA fast path,
and an impl dispatcher."""

# Length-aware plain XLA (dispatch's "xla"; the default off the GPU).
from paged_jax.attention.blocked import paged_attention_blocked, paged_decode_attention_blocked

# The dispatcher: "auto" | "xla" | "reference" | "pallas" | "pallas_interpret".
from paged_jax.attention.dispatch import IMPLS, paged_attention, paged_attention_chunk, resolve_impl

# Plain-XLA reference implementations (the oracle for kernels).
from paged_jax.attention.reference import (
    dense_causal_attention,
    gather_pages,
    paged_chunk_attention,
    paged_decode_attention,
    select_layer,
)

__all__ = [
    "IMPLS", "dense_causal_attention", "gather_pages", "paged_attention", "paged_attention_chunk",
    "paged_attention_blocked", "paged_chunk_attention", "paged_decode_attention",
    "paged_decode_attention_blocked", "resolve_impl", "select_layer",
]
