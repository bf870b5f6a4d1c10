"""One entry point for paged attention, whichever implementation runs it.

``impl`` chooses:

- ``"xla"``: ``paged_jax.attention.blocked`` (plain XLA, length-aware: reads only the
  blocks rows hold; any backend; the default off the GPU).
  Exception: sub-fp32 pages (bf16, f16) on XLA:CPU take ``"reference"``: XLA:CPU
  converts a bf16 gather's whole operand to f32, and inside a loop that convert (of the
  whole layer) is hoisted and paid per call (~30 ms per layer for a 4k-block pool).
- ``"reference"``: ``paged_jax.attention.reference`` (plain XLA, gathers the whole table:
  the oracle every other implementation is tested against).
- ``"pallas"``: ``pallas_kernels`` compiled for the GPU.
- ``"pallas_interpret"``: the same kernels in Pallas interpret mode (any backend; tests).
- ``"none"``: a cost ablation, not attention: returns zeros of q's shape without reading
  the pages. A study run with it times everything but attention (model outputs are
  meaningless), which bounds what any faster attention could give
  (``python -m experiments throughput --attention none``).
- ``"auto"``: ``"pallas"`` on GPU, ``"xla"`` elsewhere. On GPU it falls back to ``"xla"``
  with a warning if ``pallas_kernels`` cannot be imported, or if the kernel rejects the
  call's shapes with a ValueError (e.g. a head_dim or block_size it does not tile).

The choice is made when the caller is traced (a Python-level switch), so it costs nothing
per call. Both functions take the same arguments as their reference counterparts.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import jax
import jax.numpy as jnp

from paged_jax.attention import blocked, reference

IMPLS = ("auto", "xla", "reference", "pallas", "pallas_interpret", "none")


@functools.cache
def _pallas_module():
    try:
        return importlib.import_module("pallas_kernels")
    except ImportError as e:
        raise ImportError(
            "attention impl 'pallas'/'pallas_interpret' needs the pallas_kernels package, "
            f"which could not be imported ({e}); use impl='xla'"
        ) from e


def _pallas_fn(name: str):
    module = _pallas_module()
    fn = getattr(module, name, None)
    if fn is None:
        raise ImportError(f"pallas_kernels has no {name!r}; use impl='xla'")
    return fn


def resolve_impl(impl: str) -> str:
    """The concrete implementation ``impl`` names here: "xla", "reference", "pallas",
    "pallas_interpret" or "none"."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl={impl!r}: choose one of {IMPLS}")
    if impl != "auto":
        return impl
    if jax.default_backend() != "gpu":
        return "xla"
    try:
        _pallas_fn("paged_attention")
        _pallas_fn("paged_attention_chunk")
    except ImportError as e:
        warnings.warn(f"attention impl 'auto' on GPU falls back to 'xla': {e}", stacklevel=2)
        return "xla"
    return "pallas"


def _fallback_or_raise(impl: str, error: ValueError) -> None:
    """An explicit pallas request propagates the kernel's refusal; "auto" degrades to xla."""
    if impl != "auto":
        raise error
    warnings.warn(f"attention impl 'auto': the Pallas kernel refused this call ({error}); using 'xla'", stacklevel=3)


def _blocked_pays(pages) -> bool:
    """Whether "xla" runs the length-aware implementation for these pages (see module doc)."""
    return jnp.dtype(pages.dtype).itemsize >= 4 or jax.default_backend() != "cpu"


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, scale=None, layer=None, impl: str = "auto"):
    """Decode attention: q [B, Hq, D] over pages -> [B, Hq, D].

    Pages are one layer's ``[Hkv, N, bs, D]``, or every layer's ``[L, Hkv, N, bs, D]``
    with ``layer`` naming one (inside a model, pass these: "xla" and the Pallas kernels
    then read the layer in place, where a slice taken outside them would be copied).
    See ``reference.paged_decode_attention`` for the contract.
    """
    concrete = resolve_impl(impl)
    if concrete == "none":
        return jnp.zeros_like(q)
    if concrete == "reference" or (concrete == "xla" and not _blocked_pays(k_pages)):
        return reference.paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, scale=scale, layer=layer)
    if concrete != "xla":
        fn = _pallas_fn("paged_attention")
        try:
            return fn(
                q, k_pages, v_pages, block_tables, lengths, scale=scale, layer=layer,
                interpret=concrete == "pallas_interpret",
            )
        except ValueError as e:
            _fallback_or_raise(impl, e)
    return blocked.paged_decode_attention_blocked(q, k_pages, v_pages, block_tables, lengths, scale=scale, layer=layer)


def paged_attention_chunk(
    q, k_pages, v_pages, block_tables, lengths, q_lens, *, scale=None, layer=None, impl: str = "auto"
):
    """Chunk/prefill attention: q [B, T, Hq, D] over pages -> [B, T, Hq, D].

    Pages as for ``paged_attention``. See ``reference.paged_chunk_attention`` for the
    contract.
    """
    concrete = resolve_impl(impl)
    if concrete == "none":
        return jnp.zeros_like(q)
    if concrete == "reference" or (concrete == "xla" and not _blocked_pays(k_pages)):
        return reference.paged_chunk_attention(
            q, k_pages, v_pages, block_tables, lengths, q_lens, scale=scale, layer=layer
        )
    if concrete != "xla":
        fn = _pallas_fn("paged_attention_chunk")
        try:
            return fn(
                q, k_pages, v_pages, block_tables, lengths, q_lens, scale=scale, layer=layer,
                interpret=concrete == "pallas_interpret",
            )
        except ValueError as e:
            _fallback_or_raise(impl, e)
    return blocked.paged_attention_blocked(q, k_pages, v_pages, block_tables, lengths, q_lens, scale=scale, layer=layer)
