"""A native paged-attention kernel for XLA:CPU (``cpu_kernel.cc``), called through XLA's FFI.

Why: plain XLA on the CPU reads a row's blocks by gathering them into a new buffer and
will not fuse that gather into the reductions (see docs/DESIGN.md, "Where a step's time
goes"), so every K/V byte a step reads is copied first and read again. The kernel walks the
block table and reads blocks in place, once, on XLA's intra-op threads.

``paged_attention`` has the contract's signature (``contract``), ``ragged_paged_attention``
its packed form: q [B, T, Hq, D] (or [N, Hq, D] packed) in any float dtype (computed in fp32, returned in q's dtype), fp32 / bf16 / fp16 pages (16-bit
ones as stored bits, ``KVPages.bits_of``, or as floats), 5-D pages with an int or traced
layer or 4-D ones with ``layer=None``. Quantised pages are refused (``reads_quantized``
is False: "auto" leaves them to "xla").

The shared library is compiled on first use with the C++ compiler (``$CXX``, else ``c++``,
``g++``) against jaxlib's FFI headers, for this CPU (``-march=native``), into
``$XDG_CACHE_HOME/paged_jax/ffi`` keyed by the source, the flags, the compiler, jaxlib's
version and the CPU, then registered as the FFI target ``paged_jax_paged_attention_cpu``.
``missing()`` says why it cannot be had (no compiler, a failed build): the registry's
``available``, so "auto" falls back to "xla" with that reason.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.attention import contract

TARGET = "paged_jax_paged_attention_cpu"
SOURCE = Path(__file__).with_name("cpu_kernel.cc")
# Reassociation lets the compiler vectorise the dot products' sums (the results differ from
# a sequential sum by rounding only); infinities stay IEEE (no -ffinite-math-only): the
# online softmax starts from -inf.
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fassociative-math",
         "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast")
PAGE_KINDS = {"float32": 0, "bfloat16": 1, "float16": 2}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_key() -> str:
    """What ``-march=native`` depends on: the machine and its CPU flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + flags


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "paged_jax" / "ffi"


@functools.cache
def _library() -> ctypes.CDLL:
    """Build (once per key) and load the kernel's shared library; register its FFI target.
    RuntimeError saying why when it cannot be built."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX, or install g++)")
    import jaxlib

    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), cxx.encode(), jaxlib.__version__.encode(),
                                     _cpu_key().encode()])).hexdigest()[:16]
    path = cache_dir() / f"paged_attention_cpu-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # build aside, then rename: atomic
            out = Path(tmp) / path.name
            cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", str(out)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"building {SOURCE.name} failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
            os.replace(out, path)
    lib = ctypes.cdll.LoadLibrary(str(path))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.PagedAttentionCpu), platform="cpu")
    return lib


@functools.cache
def missing() -> str | None:
    """Why the kernel cannot run in this process (no compiler, a failed build), or None."""
    try:
        _library()
    except (RuntimeError, OSError, AttributeError, subprocess.SubprocessError) as e:
        return f"the native CPU kernel is unavailable: {e}"
    return None


def _page_bits(pages, x: jax.Array) -> tuple[jax.Array, int]:
    """``x`` (pages.k or pages.v) as the kernel reads it, and its page kind."""
    dtype = jnp.dtype(pages.dtype)
    if dtype.name not in PAGE_KINDS:
        raise ValueError(f"the native CPU kernel reads float32, bfloat16 and float16 pages, not {dtype.name}")
    if dtype.itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating):  # floats, not stored bits
        x = jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x, PAGE_KINDS[dtype.name]


def paged_attention(
    q: jax.Array,
    pages,
    block_tables: jax.Array,
    lengths: jax.Array,
    q_lens: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Paged attention by the native CPU kernel (the padded contract of ``contract``).

    q [B, T, Hq, D] float; pages leaves [L, Hkv, N, bs, D] with ``layer`` or [Hkv, N, bs, D]
    with None (fp32, bf16 or fp16 values); int32 block_tables [B, P], lengths and q_lens [B]
    -> [B, T, Hq, D] in q.dtype. ValueError for quantised pages. Runs on the CPU backend only.
    The padded batch is the ragged kernel's special case ``q_starts[b] = b * T``.
    """
    shapes = contract.check(q, pages, block_tables, lengths, q_lens, layer)
    b, t, hq, d = q.shape
    starts = jnp.arange(b, dtype=jnp.int32) * t
    out = _call(q.reshape(b * t, hq, d), pages, block_tables, lengths, starts,
                jnp.clip(q_lens.astype(jnp.int32), 0, t), layer, contract.default_scale(shapes.head_dim, scale))
    return out.reshape(b, t, hq, d).astype(q.dtype)


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
) -> jax.Array:
    """Paged attention by the native CPU kernel over packed queries (the ragged contract of
    ``contract``): q [N, Hq, D], int32 block_tables [B, P], lengths, q_starts, q_lens [B]
    -> [N, Hq, D] in q.dtype."""
    shapes = contract.check_ragged(q, pages, block_tables, lengths, q_starts, q_lens, layer)
    out = _call(q, pages, block_tables, lengths, q_starts, q_lens, layer,
                contract.default_scale(shapes.head_dim, scale))
    return out.astype(q.dtype)


def _call(q, pages, block_tables, lengths, q_starts, q_lens, layer, scale: float) -> jax.Array:
    """The custom call: q [N, Hq, D] -> f32[N, Hq, D]."""
    if getattr(pages, "k_scale", None) is not None:
        raise ValueError(f"the native CPU kernel does not read quantised ({pages.kv_format}) pages; use impl='xla'")
    if (why := missing()) is not None:
        raise ValueError(why)
    k, kind = _page_bits(pages, pages.k)
    v, _ = _page_bits(pages, pages.v)
    if k.ndim == 4:  # one layer's pages: the kernel's L = 1 (a free reshape)
        k, v, layer = k[None], v[None], 0
    layer = jnp.asarray(layer, jnp.int32).reshape(())
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    i32 = lambda x: x.astype(jnp.int32)  # noqa: E731
    return call(q.astype(jnp.float32), k, v, i32(block_tables), i32(lengths), i32(q_starts), i32(q_lens), layer,
                scale=np.float32(scale), page_kind=np.int64(kind))
