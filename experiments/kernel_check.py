"""Correctness of every Pallas kernel at the shapes real models use, through the contract.

``contract_checks(impl, quick)`` runs each ``contract_cases(quick)`` case through
``paged_jax.attention``'s ``impl`` ("pallas" on a GPU, "pallas_interpret" elsewhere) against
its "reference": bf16 and fp32, head_dim 64 and 128, GQA 4:1 and 8:1, block sizes 16-64,
contexts up to 32k, decode and chunk, quantised pages, on layer-stacked pages with the layer
traced, as the model calls them. ``experiments/gpu.py`` runs it first; ``kernel_bench.py``
(the timing half) shares ``max_rel_err`` and ``backend_of``.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.config import blocks_for
from paged_jax.kv import KVPages, quant


def max_rel_err(out, ref) -> float:
    """max |out - ref| / max |ref|; inf for non-finite output or an all-zero reference."""
    out = np.asarray(jnp.asarray(out, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    if not np.isfinite(out).all() or not np.abs(ref).max(initial=0) > 0:
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(1e-6, float(np.max(np.abs(ref)))))


@dataclasses.dataclass(frozen=True)
class ContractCase:
    """One call of ``paged_jax.attention.paged_attention`` at a model's shape.

    Rows of the batch hold: the full ``context``, one token, exactly three blocks, a
    random length, and nothing (a keyless row); table entries past a row's blocks are -1.
    ``queries`` > 1 is a chunk (the chunk kernel; rows take T, 1, 5, T/2 and 0 queries).
    """

    queries: int  # T: 1 = decode kernel, > 1 = chunk kernel
    dtype: str  # q and float pages: "bfloat16" | "float32"
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    block_size: int
    context: int  # the longest row, tokens
    kv_format: str = "auto"  # "auto" (pages in ``dtype``) or a quantised kv_cache_dtype
    num_layers: int = 2  # layer-stacked pages; the case reads the last layer, a traced index

    @property
    def kernel(self) -> str:
        return "decode" if self.queries == 1 else "chunk"

    @property
    def tolerance(self) -> float:
        """max |out - ref| / max |ref|: fp32 with IEEE dots is tight; bf16 (the kernel
        feeds bf16 tiles to the tensor cores) and dequantised tiles are loose."""
        return 1e-4 if self.dtype == "float32" and self.kv_format == "auto" else 2e-2

    @property
    def name(self) -> str:
        fmt = "" if self.kv_format == "auto" else f" {self.kv_format} pages"
        return (f"{self.kernel} {self.dtype}{fmt} D={self.head_dim} GQA {self.num_q_heads}:{self.num_kv_heads} "
                f"bs={self.block_size} ctx={self.context}")


def contract_cases(quick: bool) -> list[ContractCase]:
    """The checks, most important first (a time budget may cut the tail).

    Full (22 cases, decode and chunk each): Llama-3.2-1B's attention shape (head_dim 64,
    32 q heads over 8 kv heads: GQA 4:1) and an 8:1 head_dim-128 shape (the 70B Llamas'
    ratio) in bf16 at block size 16 with rows up to 32k tokens; fp32 at the 1B shape
    (tight tolerance); int8, int8_channel and fp8_e4m3 pages; then block sizes 32 and 64
    for both bf16 shapes and fp32 at head_dim 128. Quick: tiny contexts for the
    interpreter (seconds on a CPU).
    """
    if quick:
        return [
            ContractCase(1, "bfloat16", 64, 8, 2, 16, 64),
            ContractCase(8, "bfloat16", 64, 8, 2, 16, 64),
            ContractCase(1, "float32", 64, 8, 2, 16, 64),
            ContractCase(1, "bfloat16", 64, 8, 2, 16, 64, kv_format="int8"),
        ]
    one_b, big = (64, 32, 8), (128, 32, 4)  # (head_dim, q heads, kv heads): GQA 4:1 and 8:1
    both = (1, 16)  # decode, a 16-query chunk
    # First one case of every kind, then the other block sizes: a time cut loses repeats only.
    cases = [ContractCase(t, "bfloat16", *shape, 16, 32768) for shape in (one_b, big) for t in both]
    cases += [ContractCase(t, "float32", *one_b, 16, 8192) for t in both]
    cases += [ContractCase(t, "bfloat16", *one_b, 16, 8192, kv_format=fmt)
              for fmt in quant.QUANTIZED_KV_CACHE_DTYPES for t in both]
    cases += [ContractCase(t, "bfloat16", *shape, bs, 32768) for bs in (32, 64) for shape in (one_b, big) for t in both]
    cases += [ContractCase(t, "float32", *big, 32, 8192) for t in both]
    return cases


def contract_inputs(case: ContractCase, seed: int = 0):
    """(q [B, T, Hq, D], KVPages [L, Hkv, N, bs, D], tables int32[B, P], lengths, q_lens)."""
    rng = np.random.default_rng(seed)
    bs, ctx = case.block_size, case.context
    lengths = np.array([ctx, 1, 3 * bs, int(rng.integers(1, ctx + 1)), 0], np.int32)
    wanted = np.minimum([case.queries, 1, 5, max(1, case.queries // 2), 0], case.queries)
    q_lens = np.minimum(lengths, wanted).astype(np.int32)
    width = blocks_for(ctx, bs)
    held = blocks_for(lengths, bs)
    num_blocks = int(held.sum()) + 8  # a few blocks no row names
    order = rng.permutation(num_blocks).astype(np.int32)
    tables = np.full((len(lengths), width), -1, np.int32)
    start = 0
    for row, n in enumerate(held):
        tables[row, :n] = order[start:start + n]
        start += n
    dtype = jnp.dtype(case.dtype)
    key_q, key_k, key_v = jax.random.split(jax.random.PRNGKey(seed), 3)
    shape = (case.num_layers, case.num_kv_heads, num_blocks, bs, case.head_dim)
    k = jax.random.normal(key_k, shape, dtype)
    v = jax.random.normal(key_v, shape, dtype)
    if case.kv_format == "auto":
        pages = KVPages(k, v)
    else:
        fmt = quant.kv_format(case.kv_format)
        (kq, ks), (vq, vs) = quant.quantize_blocks(fmt, k), quant.quantize_blocks(fmt, v)
        pages = KVPages(kq, vq, ks, vs, kv_format=fmt.name)
    q = jax.random.normal(key_q, (len(lengths), case.queries, case.num_q_heads, case.head_dim), dtype)
    return q, pages, jnp.asarray(tables), jnp.asarray(lengths), jnp.asarray(q_lens)


@functools.cache
def _attention(impl: str):
    """The contract's entry point for ``impl``, jitted with the layer a traced argument."""
    from paged_jax.attention import dispatch

    @jax.jit
    def run(q, pages, tables, lengths, q_lens, layer):
        return dispatch.paged_attention(q, pages, tables, lengths, q_lens, layer=layer, impl=impl)

    return run


def backend_of(hlo_text: str) -> str:
    """The Pallas backend a lowered program calls: "triton", "mosaic_gpu", or "interpret"
    (no Pallas custom call: the interpreter's plain HLO, or none at all)."""
    if "triton" in hlo_text:
        return "triton"
    if "mosaic_gpu" in hlo_text:
        return "mosaic_gpu"
    return "interpret"


def run_contract_case(case: ContractCase, impl: str) -> dict:
    """One case: ``impl`` vs "reference" on the same inputs. A failure to lower, compile or
    run is recorded (``error``), not raised. Deprecation and other warnings are kept."""
    import warnings

    row = {"name": case.name, **dataclasses.asdict(case), "kernel": case.kernel, "impl": impl,
           "tol": case.tolerance}
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            args = (*contract_inputs(case), jnp.asarray(case.num_layers - 1, jnp.int32))
            lowered = _attention(impl).lower(*args)
            row["backend"] = backend_of(lowered.as_text())
            out = lowered.compile()(*args)
            ref = _attention("reference")(*args)
            row["err"] = max_rel_err(out, ref)
            # Rows without queries (and query slots past q_lens) must be exactly 0.
            q_lens = np.asarray(args[4])
            slots = np.arange(case.queries)[None, :] >= q_lens[:, None]
            row["padding_exact_zero"] = bool((np.asarray(out, np.float32)[slots] == 0).all())
            row["ok"] = bool(row["err"] <= case.tolerance and row["padding_exact_zero"])
        except Exception as e:  # report and go on: one shape must not hide the others
            row.update(err=None, ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
    row["warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught})
    row["seconds"] = time.perf_counter() - start
    return row


def contract_checks(impl: str, quick: bool, deadline: float | None = None, on_row=None,
                    limit: int | None = None) -> dict:
    """Every ``contract_cases(quick)`` case through ``impl`` ("pallas" on a GPU,
    "pallas_interpret" elsewhere) vs "reference", until ``deadline`` (perf_counter
    seconds). Stops early when the first three cases all fail with one error (the kernels
    cannot run here at all). ``on_row(rows)`` after each case (to save progress).
    ``limit``: the first ``limit`` cases only. Cases whose page format ``impl`` does not
    read (its registry entry's ``reads``) are listed as skipped.
    Returns {"rows", "skipped", "all_ok", "backends"}."""
    from paged_jax.attention import dispatch

    rows, skipped = [], []
    entry = dispatch.IMPLS.get(impl)
    cases = contract_cases(quick)
    if entry is not None:
        skipped = [{"name": c.name, "reason": f"{impl} does not read {c.kv_format} pages"}
                   for c in cases if not entry.reads(c.kv_format)]
        cases = [c for c in cases if entry.reads(c.kv_format)]
    cases = cases[:limit]
    for i, case in enumerate(cases):
        if deadline is not None and time.perf_counter() > deadline:
            skipped += [{"name": c.name, "reason": "time budget"} for c in cases[i:]]
            break
        row = run_contract_case(case, impl)
        rows.append(row)
        status = "ok" if row["ok"] else "FAIL"
        err = "-" if row.get("err") is None else f"{row['err']:.2e}"
        print(f"  [{status}] {row['name']}: err {err} (tol {row['tol']:.0e}), {row.get('backend', '?')}, "
              f"{row['seconds']:.1f} s" + (f"  {row['error']}" if "error" in row else ""), flush=True)
        if on_row is not None:
            on_row(rows)
        errors = {r.get("error") for r in rows}
        if len(rows) == 3 and len(errors) == 1 and None not in errors:
            skipped += [{"name": c.name, "reason": "the first three cases failed alike"} for c in cases[3:]]
            break
    return {
        "rows": rows,
        "skipped": skipped,
        "all_ok": bool(rows) and all(r["ok"] for r in rows),
        "backends": sorted({f"{r['kernel']}: {r['backend']}" for r in rows if "backend" in r}),
    }


