"""One entry point for paged attention, whichever implementation runs it.

``IMPLS`` maps a name to an implementation of the contract (``contract``):

- ``"reference"``: ``reference.paged_attention`` (plain XLA, gathers the whole table: the
  oracle every other implementation is tested against).
- ``"xla"``: ``blocked.paged_attention`` (plain XLA, length-aware: reads only the blocks
  rows hold; any backend; the default off the GPU), in every dtype: sub-fp32 pages are
  gathered as same-width integers (``reference.gather_blocks``), so XLA:CPU no longer
  converts the whole pool to f32 outside the loops on every call. Measured on the
  throughput study's model in bf16 (2-core CPU, decode, batch 8-32, context 159-318): the
  blocked and the reference implementations within 10% of each other, both dominated by
  XLA:CPU's bf16 matmuls.
- ``"pallas"``: ``pallas_kernels`` compiled for the GPU (``pallas.paged_attention``).
- ``"pallas_interpret"``: the same kernels in Pallas interpret mode (any backend; tests).

``"auto"`` is not an implementation but a choice: ``"pallas"`` on GPU, ``"xla"``
elsewhere. On GPU it falls back to ``"xla"`` with a warning if ``pallas_kernels`` cannot be
imported, or if the kernel refuses the call's shapes with a ValueError (e.g. a head_dim
or block_size it does not tile); an explicit ``"pallas"`` raises instead.

``register_impl`` adds a name (a study's variant or ablation, e.g.
``experiments/ablations.py``). The choice is made when the caller is traced (a
Python-level switch), so it costs nothing per call.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import jax

from paged_jax.attention import blocked, contract, pallas, reference

AUTO = "auto"


IMPLS: dict[str, Callable[..., jax.Array]] = {
    "reference": reference.paged_attention,
    "xla": blocked.paged_attention,
    "pallas": functools.partial(pallas.paged_attention, interpret=False),
    "pallas_interpret": functools.partial(pallas.paged_attention, interpret=True),
}


# Implementations that dequantise int8 / float8 pages with their scales (``kv.quant``).
READS_QUANTIZED: set[str] = {"reference", "xla", "pallas", "pallas_interpret"}


def register_impl(name: str, fn: contract.AttentionFn, *, reads_quantized: bool = False) -> None:
    """Make ``fn`` (the contract's signature) available as ``impl=name``; replaces an
    earlier registration of the same name. ``reads_quantized``: ``fn`` reads quantised
    pages (values x ``k_scale`` / ``v_scale``); otherwise it is refused them, so an
    implementation that knows nothing of scales never reads int8 bytes as keys."""
    if name == AUTO:
        raise ValueError(f"{AUTO!r} is the automatic choice, not a name an implementation can take")
    IMPLS[name] = fn
    if reads_quantized:
        READS_QUANTIZED.add(name)
    else:
        READS_QUANTIZED.discard(name)


def check_reads(impl: str, kv_cache_dtype: str) -> None:
    """ValueError naming both unless ``impl`` (or what "auto" may pick) reads pages of
    ``kv_cache_dtype``."""
    from paged_jax.kv.quant import kv_format

    fmt = kv_format(kv_cache_dtype)
    names = {"pallas", "xla"} if impl == AUTO else {resolve_impl(impl)}
    bad = sorted(n for n in names if fmt.quantized and n not in READS_QUANTIZED)
    if bad:
        raise ValueError(
            f"attention impl {bad[0]!r} cannot read kv_cache_dtype={fmt.name!r} pages (it was registered "
            f"without reads_quantized=True); use one of {sorted(READS_QUANTIZED)} or kv_cache_dtype='auto'"
        )


def tiling_problem(impl: str, *, head_dim: int, block_size: int, num_heads: int, num_kv_heads: int) -> str | None:
    """Why the Pallas kernels cannot run a model of this shape (None if they can, or if
    ``impl`` is not a Pallas one): checked before any weight loads, not at the first
    step's trace."""
    if impl not in ("pallas", "pallas_interpret"):
        return None
    try:
        from pallas_kernels import common
    except ImportError as e:
        return f"attention impl {impl!r} needs the pallas_kernels package ({e})"
    if head_dim not in common.SUPPORTED_HEAD_DIMS:
        return f"attention impl {impl!r}: head_dim={head_dim} is not supported (one of {common.SUPPORTED_HEAD_DIMS})"
    if block_size not in common.SUPPORTED_BLOCK_SIZES:
        return (f"attention impl {impl!r}: block_size={block_size} is not supported "
                f"(one of {common.SUPPORTED_BLOCK_SIZES})")
    if num_heads // num_kv_heads > common.MAX_GROUP:
        return (f"attention impl {impl!r}: {num_heads // num_kv_heads} query heads per kv head is more than "
                f"the kernels' {common.MAX_GROUP}")
    return None


def resolve_impl(impl: str) -> str:
    """The name of the implementation ``impl`` selects here: itself, or for ``"auto"``
    "pallas" on GPU (if ``pallas_kernels`` imports) or "xla". ValueError for an unknown name."""
    if impl != AUTO and impl not in IMPLS:
        raise ValueError(f"attention impl={impl!r}: choose one of {(AUTO, *IMPLS)}")
    if impl != AUTO:
        return impl
    if jax.default_backend() != "gpu":
        return "xla"
    try:
        pallas.kernels()
    except ImportError as e:
        warnings.warn(f"attention impl 'auto' on GPU falls back to 'xla': {e}", stacklevel=2)
        return "xla"
    return "pallas"


def paged_attention(
    q: jax.Array,
    pages,
    block_tables: jax.Array,
    lengths: jax.Array,
    q_lens: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    scale: float | None = None,
    impl: str = AUTO,
) -> jax.Array:
    """Paged attention (the contract of ``contract``) by the implementation ``impl`` names.

    q [B, T, Hq, D] (T = 1 decode, T > 1 a chunk); pages a KVPages, leaves [L, Hkv, N, bs, D]
    with ``layer`` (a Python int or a traced int32 scalar) or [Hkv, N, bs, D] with None;
    int32 block_tables [B, P], lengths and q_lens [B] -> [B, T, Hq, D] in q.dtype.
    """
    name = resolve_impl(impl)
    contract.check(q, pages, block_tables, lengths, q_lens, layer)
    if getattr(pages, "k_scale", None) is not None:
        check_reads(name, pages.kv_format)
    args = (q, pages, block_tables, lengths, q_lens)
    if impl != AUTO or name == "xla":
        return IMPLS[name](*args, layer=layer, scale=scale)
    try:
        return IMPLS[name](*args, layer=layer, scale=scale)
    except ValueError as e:  # the arguments passed the contract: the kernel refused them
        warnings.warn(f"attention impl 'auto': {name!r} refused this call ({e}); using 'xla'", stacklevel=2)
        return IMPLS["xla"](*args, layer=layer, scale=scale)
