"""One entry point for paged attention, whichever implementation runs it.

``impl`` chooses:

- ``"xla"``: ``paged_jax.attention.reference`` (plain XLA; any backend).
- ``"pallas"``: ``pallas_kernels`` compiled for the GPU.
- ``"pallas_interpret"``: the same kernels in Pallas interpret mode (any backend; tests).
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

from paged_jax.attention import reference

IMPLS = ("auto", "xla", "pallas", "pallas_interpret")


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
    """The concrete implementation ``impl`` names here: "xla", "pallas" or "pallas_interpret"."""
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


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, scale=None, impl: str = "auto"):
    """Decode attention: q [B, Hq, D] over pages [Hkv, N, bs, D] -> [B, Hq, D].

    See ``reference.paged_decode_attention`` for the contract.
    """
    concrete = resolve_impl(impl)
    if concrete != "xla":
        fn = _pallas_fn("paged_attention")
        try:
            return fn(q, k_pages, v_pages, block_tables, lengths, scale=scale, interpret=concrete == "pallas_interpret")
        except ValueError as e:
            _fallback_or_raise(impl, e)
    return reference.paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, scale=scale)


def paged_attention_chunk(
    q, k_pages, v_pages, block_tables, lengths, q_lens, *, scale=None, impl: str = "auto"
):
    """Chunk/prefill attention: q [B, T, Hq, D] over pages [Hkv, N, bs, D] -> [B, T, Hq, D].

    See ``reference.paged_chunk_attention`` for the contract.
    """
    concrete = resolve_impl(impl)
    if concrete != "xla":
        fn = _pallas_fn("paged_attention_chunk")
        try:
            return fn(
                q, k_pages, v_pages, block_tables, lengths, q_lens, scale=scale,
                interpret=concrete == "pallas_interpret",
            )
        except ValueError as e:
            _fallback_or_raise(impl, e)
    return reference.paged_chunk_attention(q, k_pages, v_pages, block_tables, lengths, q_lens, scale=scale)
