"""One entry point for paged attention, whichever implementation runs it: a registry.

``IMPLS`` maps a name to an ``AttentionImpl`` record: the function (the contract of
``contract``), whether it reads quantised pages, which shapes it can tile, which backend it
needs, and where ``"auto"`` prefers it. The built-in entries:

- ``"reference"``: ``reference.paged_attention`` (plain XLA, gathers the whole table: the
  oracle every other implementation is tested against).
- ``"xla"``: ``blocked.paged_attention`` (plain XLA, length-aware: reads only the blocks
  rows hold; any backend; "auto"'s fallback), in every dtype: sub-fp32 pages are
  gathered as same-width integers (``reference.gather_blocks``), so XLA:CPU does not
  convert the whole pool to f32 outside the loops on every call.
- ``"cpu"``: the native XLA:CPU kernel (``cpu_kernel``: C++ through XLA's FFI, built on
  first use; reads blocks in place, where plain XLA on the CPU copies them first); the
  default on the CPU for float pages, "xla" for quantised ones or without a compiler.
- ``"pallas"``: ``pallas_kernels`` compiled for the GPU (``pallas.paged_attention``).
- ``"pallas_interpret"``: the same kernels in Pallas interpret mode (any backend; tests).
- ``"mosaic_gpu"``: the Mosaic GPU kernel (``pallas_kernels.mosaic``, Hopper), in Mosaic GPU
  interpret mode off the GPU (slow: tests); reads int8 / fp8_e4m3 pages, not int8_channel.

``"auto"`` is not an implementation but a choice: the first registered entry that names the
current backend in ``auto_on``, reads the pages' format and is ``available`` (``"pallas"`` on
GPU, ``"cpu"`` on the CPU), else ``"xla"``.
It falls back to ``"xla"`` with a warning when that entry's ``available`` says why not, or
when the kernel refuses the call's shapes with a ValueError; an explicit name raises instead.

``register`` adds an entry (a study's variant or ablation: ``experiments/ablations.py``; a new
kernel). The contract suite (``tests/test_attention_contract.py``) runs every entry that
obeys the contract and runs on this backend, so a registered implementation is tested
without editing a list (``docs/EXTENDING.md``). The choice is made when the caller is traced
(a Python-level switch), so it costs nothing per call.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable

import jax

from paged_jax.attention import blocked, contract, cpu_kernel, mosaic, pallas, reference

AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
    """One implementation of the attention contract.

    Attributes:
      name: what ``impl=`` / ``LLM(attention_impl=...)`` calls it.
      fn: ``fn(q, pages, block_tables, lengths, q_lens, *, layer=None, scale=None)``
        (``contract``'s shapes and rules).
      reads_quantized: ``fn`` dequantises int8 / float8 pages with their scales
        (``kv.quant``); otherwise quantised pages are refused it, naming both.
      tiling_problem: ``(head_dim, block_size, num_heads, num_kv_heads) -> str | None``:
        why a model of this shape cannot run (None if it can), checked before weights load.
      needs_backend: the JAX backend ``fn`` runs on ("gpu"), or None for any.
      auto_on: backends on which ``"auto"`` picks this entry (first registered wins).
      available: ``() -> str | None``: why it cannot run in this process (a missing
        package), or None.
      obeys_contract: False for a deliberate stand-in (an ablation that returns zeros):
        the contract suite then leaves it out.
      reads_formats: with ``reads_quantized``, the quantised kv_cache_dtypes it reads
        (None: every one); others are refused, naming these.
      slow_on: backends where it runs slowly (an interpreter): the contract suite runs it
        there on representative cases and marks the rest slow.
      ragged: its own ragged form (``contract``: packed queries ``q [N, Hq, D]`` with
        ``q_starts``), or None to run ``fn`` one query per row (``contract.ragged_as_rows``).
    """

    name: str
    fn: contract.AttentionFn
    reads_quantized: bool = False
    tiling_problem: Callable[..., str | None] | None = None
    needs_backend: str | None = None
    auto_on: tuple[str, ...] = ()
    available: Callable[[], str | None] | None = None
    obeys_contract: bool = True
    reads_formats: tuple[str, ...] | None = None
    slow_on: tuple[str, ...] = ()
    ragged: Callable | None = None

    @property
    def ragged_fn(self) -> Callable:
        """The ragged form: ``ragged``, or ``fn`` one query per row."""
        return self.ragged if self.ragged is not None else contract.ragged_as_rows(self.fn)

    def reads(self, kv_cache_dtype: str) -> bool:
        """Whether it reads pages of ``kv_cache_dtype`` (a float format, or a quantised one it
        was registered for)."""
        from paged_jax.kv.quant import kv_format

        fmt = kv_format(kv_cache_dtype)
        if not fmt.quantized:
            return True
        return self.reads_quantized and (self.reads_formats is None or fmt.name in self.reads_formats)

    def problem(self, *, head_dim: int, block_size: int, num_heads: int, num_kv_heads: int) -> str | None:
        """Why this entry cannot run a model of this shape here, or None."""
        if self.available is not None and (missing := self.available()) is not None:
            return f"attention impl {self.name!r}: {missing}"
        if self.tiling_problem is None:
            return None
        why = self.tiling_problem(head_dim=head_dim, block_size=block_size, num_heads=num_heads,
                                  num_kv_heads=num_kv_heads)
        return None if why is None else f"attention impl {self.name!r}: {why}"

    def runs_on(self, backend: str) -> bool:
        return self.needs_backend is None or self.needs_backend == backend


def _pallas_missing() -> str | None:
    try:
        pallas.kernels()
    except ImportError as e:
        return f"needs the pallas_kernels package ({e.__cause__ or e})"
    return None


def _pallas_tiling(*, head_dim: int, block_size: int, num_heads: int, num_kv_heads: int) -> str | None:
    from pallas_kernels import common

    return contract.kernel_tiling_problem(common, head_dim=head_dim, block_size=block_size,
                                          num_heads=num_heads, num_kv_heads=num_kv_heads)


IMPLS: dict[str, AttentionImpl] = {}


def register(impl: AttentionImpl) -> AttentionImpl:
    """Make ``impl`` available as ``impl=impl.name``; replaces an earlier entry of that name."""
    if impl.name == AUTO:
        raise ValueError(f"{AUTO!r} is the automatic choice, not a name an implementation can take")
    IMPLS[impl.name] = impl
    return impl


def register_impl(name: str, fn: contract.AttentionFn, *, reads_quantized: bool = False, **fields) -> AttentionImpl:
    """``register(AttentionImpl(name, fn, reads_quantized, **fields))``: the short form."""
    return register(AttentionImpl(name, fn, reads_quantized=reads_quantized, **fields))


register(AttentionImpl("reference", reference.paged_attention, reads_quantized=True))
register(AttentionImpl("xla", blocked.paged_attention, reads_quantized=True))
register(AttentionImpl("cpu", cpu_kernel.paged_attention, needs_backend="cpu", auto_on=("cpu",),
                       available=cpu_kernel.missing, ragged=cpu_kernel.ragged_paged_attention))
register(AttentionImpl("pallas", functools.partial(pallas.paged_attention, interpret=False), reads_quantized=True,
                       tiling_problem=_pallas_tiling, needs_backend="gpu", auto_on=("gpu",),
                       available=_pallas_missing))
register(AttentionImpl("pallas_interpret", functools.partial(pallas.paged_attention, interpret=True),
                       reads_quantized=True, tiling_problem=_pallas_tiling, available=_pallas_missing))
register(AttentionImpl("mosaic_gpu", mosaic.paged_attention, reads_quantized=True, reads_formats=mosaic.READS_FORMATS,
                       tiling_problem=mosaic.tiling_problem, available=mosaic.missing, slow_on=("cpu",)))


def get(name: str) -> AttentionImpl:
    """The entry ``name`` names (``"auto"`` resolved here). ValueError for an unknown name."""
    return IMPLS[resolve_impl(name)]


def check_reads(impl: str, kv_cache_dtype: str) -> None:
    """ValueError naming both unless ``impl`` (or what "auto" may pick) reads pages of
    ``kv_cache_dtype``."""
    from paged_jax.kv.quant import kv_format

    fmt = kv_format(kv_cache_dtype)
    names = {resolve_impl(impl, fmt.name)}
    bad = sorted(n for n in names if not IMPLS[n].reads(fmt.name))
    if bad:
        readers = sorted(n for n, r in IMPLS.items() if r.reads(fmt.name))
        formats = IMPLS[bad[0]].reads_formats if IMPLS[bad[0]].reads_quantized else None
        how = (f"it reads {list(formats)} only" if formats is not None
               else "it was registered without reads_quantized=True")
        raise ValueError(
            f"attention impl {bad[0]!r} cannot read kv_cache_dtype={fmt.name!r} pages ({how}); "
            f"use one of {readers} or kv_cache_dtype='auto'"
        )


def tiling_problem(impl: str, *, head_dim: int, block_size: int, num_heads: int, num_kv_heads: int) -> str | None:
    """Why ``impl`` cannot run a model of this shape (None if it can): checked before any
    weight loads, not at the first step's trace."""
    return IMPLS[resolve_impl(impl)].problem(head_dim=head_dim, block_size=block_size, num_heads=num_heads,
                                             num_kv_heads=num_kv_heads)


def resolve_impl(impl: str, kv_cache_dtype: str | None = None) -> str:
    """The name of the implementation ``impl`` selects here: itself, or for ``"auto"`` the
    first available entry preferred on this backend (and reading ``kv_cache_dtype`` pages,
    when given), else "xla". ValueError for an unknown name."""
    if impl != AUTO and impl not in IMPLS:
        raise ValueError(f"attention impl={impl!r}: choose one of {(AUTO, *IMPLS)}")
    if impl != AUTO:
        return impl
    backend = jax.default_backend()
    for name, entry in IMPLS.items():
        if backend in entry.auto_on and (kv_cache_dtype is None or entry.reads(kv_cache_dtype)):
            missing = entry.available() if entry.available is not None else None
            if missing is None:
                return name
            warnings.warn(f"attention impl 'auto' on {backend} falls back to 'xla': {missing}", stacklevel=2)
    return "xla"


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
    quantized = getattr(pages, "k_scale", None) is not None
    name = resolve_impl(impl, pages.kv_format if quantized else None)
    contract.check(q, pages, block_tables, lengths, q_lens, layer)
    if quantized:
        check_reads(name, pages.kv_format)
    args = (q, pages, block_tables, lengths, q_lens)
    if impl != AUTO or name == "xla":
        return IMPLS[name].fn(*args, layer=layer, scale=scale)
    try:
        return IMPLS[name].fn(*args, layer=layer, scale=scale)
    except ValueError as e:  # the arguments passed the contract: the kernel refused them
        warnings.warn(f"attention impl 'auto': {name!r} refused this call ({e}); using 'xla'", stacklevel=2)
        return IMPLS["xla"].fn(*args, layer=layer, scale=scale)


def ragged_paged_attention(
    q: jax.Array,
    pages,
    block_tables: jax.Array,
    lengths: jax.Array,
    q_starts: jax.Array,
    q_lens: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    scale: float | None = None,
    impl: str = AUTO,
) -> jax.Array:
    """Paged attention over packed queries (``contract``'s ragged form) by the implementation
    ``impl`` names: q [N, Hq, D]; int32 block_tables [B, P], lengths, q_starts and q_lens
    [B] -> [N, Hq, D] in q.dtype. The choice and the fallback are ``paged_attention``'s."""
    quantized = getattr(pages, "k_scale", None) is not None
    name = resolve_impl(impl, pages.kv_format if quantized else None)
    contract.check_ragged(q, pages, block_tables, lengths, q_starts, q_lens, layer)
    if quantized:
        check_reads(name, pages.kv_format)
    args = (q, pages, block_tables, lengths, q_starts, q_lens)
    if impl != AUTO or name == "xla":
        return IMPLS[name].ragged_fn(*args, layer=layer, scale=scale)
    try:
        return IMPLS[name].ragged_fn(*args, layer=layer, scale=scale)
    except ValueError as e:  # the arguments passed the contract: the kernel refused them
        warnings.warn(f"attention impl 'auto': {name!r} refused this call ({e}); using 'xla'", stacklevel=2)
        return IMPLS["xla"].ragged_fn(*args, layer=layer, scale=scale)
