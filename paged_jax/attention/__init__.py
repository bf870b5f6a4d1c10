"""Attention over paged and dense KV: a plain-XLA reference and an impl dispatcher."""

# The dispatcher: "auto" | "xla" | "pallas" | "pallas_interpret".
from paged_jax.attention.dispatch import IMPLS, paged_attention, paged_attention_chunk, resolve_impl

# Plain-XLA reference implementations (the oracle for kernels).
from paged_jax.attention.reference import (
    dense_causal_attention,
    gather_pages,
    paged_chunk_attention,
    paged_decode_attention,
)

__all__ = [
    "IMPLS", "dense_causal_attention", "gather_pages", "paged_attention", "paged_attention_chunk",
    "paged_chunk_attention", "paged_decode_attention", "resolve_impl",
]
