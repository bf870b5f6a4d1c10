"""Compile the Triton-backend kernels for a GPU without one, and read their resources.

    export -> TTIR -> (make_ttir) -> TTGIR -> LLVM -> PTX -> cubin, for sm_80 or sm_90a

``jax.export(..., platforms=["cuda"])`` runs the Pallas Triton lowering on any machine; each
``__gpu$xla.gpu.triton`` custom call carries its kernel's TTIR (MLIR bytecode, the ``ir``
field of its backend config) and launch parameters (``num_warps``, ``num_stages``). The
``triton`` package (pinned in the test extra: 3.8.0 reads jaxlib 0.10's bytecode) parses
it, runs ``make_ttir`` (inlining and canonicalisation: without it the register counts are
inflated), and compiles it for ``GPUTarget("cuda", arch, 32)``. ``cuobjdump
--dump-resource-usage`` (Triton's own) on the cubin gives registers and the stack frame;
a kernel with a stack frame gets ``ptxas -v`` on its PTX for the spill bytes. The shared
memory is what Triton allocates for the launch (``metadata.shared``, dynamic).

This approximates what XLA compiles on a GPU (XLA bundles its own Triton, and may differ
in version and passes), not equal it. Results are cached per process, and Triton caches
its compiles on disk (``~/.triton/cache``).

  resources(fn, *abstract_args, arch=90) -> [KernelResources] (one per Triton call)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import re
import subprocess
import tempfile
from typing import NamedTuple

import jax

TRITON_CALL = "__gpu$xla.gpu.triton"
SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # per-block shared memory (opt-in maximum)
MAX_REGISTERS = 255  # per thread
ARCH_NAME = {80: "sm_80", 90: "sm_90a"}


@dataclasses.dataclass(frozen=True)
class TritonCall:
    """One Triton kernel of a lowered program: its TTIR (MLIR bytecode) and launch."""

    name: str
    ir: bytes
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """What one kernel needs on one arch."""

    name: str
    arch: int
    registers: int  # per thread
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack_bytes: int
    shared_bytes: int  # dynamic shared memory of the launch
    num_warps: int
    num_stages: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    def problems(self) -> list[str]:
        """What breaks a limit (empty when the kernel fits the arch)."""
        out = []
        if self.spills:
            out.append(f"spills ({self.spill_stores} B stored, {self.spill_loads} B loaded)")
        if self.registers > MAX_REGISTERS:
            out.append(f"{self.registers} registers > {MAX_REGISTERS}")
        if self.shared_bytes > SMEM_LIMIT[self.arch]:
            out.append(f"{self.shared_bytes // 1024} KB shared > {SMEM_LIMIT[self.arch] // 1024} KB")
        return out

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"spills": self.spills}


def missing() -> str | None:
    """Why offline compiles cannot run here (no ``triton`` package, or one without the
    NVIDIA backend), or None."""
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception as e:  # ImportError, or a backend failing to load
        return f"needs the triton package with its NVIDIA backend (pip install triton==3.8.0): {e}"
    return None


def triton_calls(fn, *args, **kwargs) -> list[TritonCall]:
    """The Triton custom calls of ``jax.jit(fn)`` exported for CUDA on ``args``
    (``jax.ShapeDtypeStruct``s are enough)."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir

    disabled = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    exported = jax.export.export(jax.jit(functools.partial(fn, **kwargs)), platforms=["cuda"],
                                 disabled_checks=disabled)(*args)
    calls: list[TritonCall] = []
    with jax_mlir.make_ir_context():
        module = ir.Module.parse(exported.mlir_module())

        def walk(op) -> None:
            for region in op.regions:
                for block in region:
                    for inner in block:
                        if (inner.name == "stablehlo.custom_call"
                                and ir.StringAttr(inner.attributes["call_target_name"]).value == TRITON_CALL):
                            cfg = ir.DictAttr(inner.attributes["mhlo.backend_config"])
                            ints = {k: ir.IntegerAttr(cfg[k]).value
                                    for k in ("num_warps", "num_stages", "grid_x", "grid_y", "grid_z")}
                            calls.append(TritonCall(ir.StringAttr(cfg["name"]).value,
                                                    ir.StringAttr(cfg["ir"]).value_bytes, ints["num_warps"],
                                                    ints["num_stages"],
                                                    (ints["grid_x"], ints["grid_y"], ints["grid_z"])))
                        walk(inner)

        walk(module.operation)
    return calls


_USAGE = re.compile(r"REG:(?P<regs>\d+) STACK:(?P<stack>\d+)")
_PTXAS = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<st>\d+) bytes spill stores, (?P<ld>\d+) bytes spill loads.*?"
    r"Used (?P<regs>\d+) registers", re.S)


@functools.cache
def _compile(ir_bytes: bytes, name: str, num_warps: int, num_stages: int, arch: int) -> KernelResources:
    import triton
    from triton import knobs
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    target = GPUTarget("cuda", arch, 32)
    backend = CUDABackend(target)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "kernel_bytecode.ttir")
        with open(raw, "wb") as f:
            f.write(ir_bytes)
        module = ir.parse_mlir_module(raw, context)
        module.context = context
        # IRSource starts after the "ttir" stage: run it here, as a Python-source kernel gets.
        module = backend.make_ttir(module, {}, backend.parse_options(options), arch)
        ttir = os.path.join(tmp, "kernel.ttir")
        with open(ttir, "w") as f:
            f.write(str(module))
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            compiled = triton.compile(ttir, target=target, options=options)
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", cubin], capture_output=True,
                               text=True, check=True).stdout
        found = _USAGE.search(usage)
        if found is None:
            raise RuntimeError(f"could not read cuobjdump's resource usage for {name} on {ARCH_NAME[arch]}:\n{usage}")
        regs, stack = int(found["regs"]), int(found["stack"])
        stores = loads = 0
        if stack:  # a stack frame: ptxas -v on the PTX says how much of it is spills
            ptx = os.path.join(tmp, "kernel.ptx")
            with open(ptx, "w") as f:
                f.write(compiled.asm["ptx"])
            log = subprocess.run([knobs.nvidia.ptxas.path, "-v", f"--gpu-name={ARCH_NAME[arch]}", ptx, "-o",
                                  os.path.join(tmp, "again.cubin")], capture_output=True, text=True, check=True).stderr
            match = _PTXAS.search(log)
            if match is None:
                raise RuntimeError(f"could not read ptxas -v output for {name} on {ARCH_NAME[arch]}:\n{log}")
            stores, loads = int(match["st"]), int(match["ld"])
    return KernelResources(name, arch, regs, stores, loads, stack, int(compiled.metadata.shared), num_warps,
                           num_stages)


def compile_call(call: TritonCall, arch: int) -> KernelResources:
    """``call`` compiled for ``arch`` (80 or 90) -> its resources (cached per process)."""
    if arch not in SMEM_LIMIT:
        raise ValueError(f"arch={arch}: choose one of {sorted(SMEM_LIMIT)}")
    return _compile(call.ir, call.name, call.num_warps, call.num_stages, arch)


def resources(fn, *args, arch: int = 90, **kwargs) -> list[KernelResources]:
    """Every Triton kernel of ``fn(*args, **kwargs)`` compiled for ``arch``."""
    if (why := missing()) is not None:
        raise ImportError(why)
    return [compile_call(call, arch) for call in triton_calls(fn, *args, **kwargs)]


def ttir_digest(call: TritonCall) -> str:
    """A short hash of the kernel's TTIR (tells configurations that compile alike apart)."""
    return hashlib.sha256(call.ir).hexdigest()[:12]


# ------------------------------------------------------------------ the configuration grid
class Config(NamedTuple):
    """One kernel configuration of the grid (a real model's shapes, the default tuning)."""

    kernel: str  # "decode" or "chunk" (16 queries)
    dtype: str  # q and float pages: "bfloat16" / "float32"
    head_dim: int
    block_size: int
    group: int  # q heads per kv head
    kv: str = "auto"  # kv_cache_dtype: "auto" (= dtype), "int8", "int8_channel", "fp8_e4m3"

    @property
    def name(self) -> str:
        kv = "" if self.kv == "auto" else f"-{self.kv}"
        return f"{self.kernel}-{self.dtype}{kv}-d{self.head_dim}-bs{self.block_size}-g{self.group}"


CHUNK = 16  # queries of a chunk (a prefill chunk or a speculative verification)
ARCHS = (80, 90)


def grid(full: bool = True) -> list[Config]:
    """head_dim 64/128 x block 16/32/64 x GQA 1/4/8 x bf16/fp32 x both kernels, and the
    quantised formats (bf16 queries) at head_dim 128, GQA 8, blocks 16 and 64. Without
    ``full``: a representative subset (the largest tiles and one of each format)."""
    out = [Config(k, dt, d, bs, g) for k in ("decode", "chunk") for dt in ("bfloat16", "float32")
           for d in (64, 128) for bs in (16, 32, 64) for g in (1, 4, 8)]
    out += [Config(k, "bfloat16", 128, bs, 8, kv) for k in ("decode", "chunk") for bs in (16, 64)
            for kv in ("int8", "int8_channel", "fp8_e4m3")]
    if full:
        return out
    quick = {Config("decode", "bfloat16", 128, 16, 8), Config("chunk", "bfloat16", 128, 16, 8),
             Config("chunk", "float32", 128, 64, 8), Config("decode", "bfloat16", 128, 64, 8, "int8_channel"),
             Config("chunk", "bfloat16", 128, 16, 8, "fp8_e4m3")}
    return [c for c in out if c in quick]


def applies(config: Config, arch: int) -> bool:
    """fp8 pages need sm_89+ (the kernels refuse them on an A100)."""
    return not (config.kv == "fp8_e4m3" and arch < 89)


def config_call(config: Config, arch: int):
    """(fn, abstract args, tuning) of ``config`` with the default tuning for ``arch``
    (``fn(*args, **override)`` replaces some): layer-stacked pages read at a traced layer,
    as the model calls the kernels."""
    import jax.numpy as jnp

    from paged_jax.kv import quant
    from pallas_kernels import chunk, decode

    S = jax.ShapeDtypeStruct
    dtype = jnp.dtype(config.dtype)
    hkv, hq, d, bs = 2, 2 * config.group, config.head_dim, config.block_size
    batch, width, blocks, layers = 4, 2048 // bs, 512, 2
    fmt = quant.kv_format(config.dtype if config.kv == "auto" else config.kv)
    pages = S((layers, hkv, blocks, bs, d), fmt.storage or dtype)
    scales = None
    if fmt.quantized:
        shape = (layers, hkv, blocks, d if fmt.per_channel else bs)
        scales = S(shape, quant.SCALE_STORAGE)
    t = 1 if config.kernel == "decode" else CHUNK
    q = S((batch, hq, d) if t == 1 else (batch, t, hq, d), dtype)
    ints = S((batch,), jnp.int32)
    table = S((batch, width), jnp.int32)
    quant_kw = dict(per_channel_scales=fmt.per_channel)
    if config.kernel == "decode":
        tuning = decode.default_tuning(head_dim=d, block_size=bs, dtype=pages.dtype, arch=arch,
                                       per_channel=fmt.per_channel)

        def fn(q, k, v, bt, lengths, layer, ks=None, vs=None, **override):
            return decode.paged_attention_decode(q, k, v, bt, lengths, layer=layer, k_scales=ks, v_scales=vs,
                                                 **quant_kw, **(tuning | override))

        args = [q, pages, pages, table, ints, S((), jnp.int32)]
    else:
        tuning = chunk.default_tuning(rows=t * config.group, head_dim=d, block_size=bs, dtype=pages.dtype, arch=arch)

        def fn(q, k, v, bt, lengths, q_lens, layer, ks=None, vs=None, **override):
            return chunk.paged_attention_chunk(q, k, v, bt, lengths, q_lens, layer=layer, k_scales=ks, v_scales=vs,
                                               **quant_kw, **(tuning | override))

        args = [q, pages, pages, table, ints, ints, S((), jnp.int32)]
    if scales is not None:
        args += [scales, scales]
    return fn, args, tuning


def check(config: Config, arch: int) -> list[KernelResources]:
    """``config`` compiled for ``arch`` at its default tuning (cached per process)."""
    fn, args, _ = config_call(config, arch)
    return resources(fn, *args, arch=arch)
