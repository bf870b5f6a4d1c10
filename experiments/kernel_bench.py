"""Benchmark of the Pallas paged-attention decode kernel on one GPU.

    python experiments/kernel_bench.py [--quick] [--out DIR] [--budget-s S]

1. Correctness first: our decode kernel vs the one oracle,
   ``paged_jax.attention.reference.paged_attention`` (gather + fp32 softmax; random
   permuted tables, mixed lengths incl. 0 and block multiples), vs JAX's shipped
   ``jax.experimental.pallas.ops.gpu.paged_attention`` where it imports, a float32 run,
   and the chunk (multi-query) kernel vs the oracle.  Which Pallas backend compiled each
   kernel (Triton or Mosaic GPU; "interpret" off the GPU) is read off the lowered program
   and reported.
2. Device copy bandwidth (a large on-device copy), the yardstick for a memory-bound kernel.
3. Timing (median over repetitions of back-to-back calls after warm-up, with
   ``block_until_ready`` and ``time.perf_counter``) of
     ours       - pallas_kernels.paged_attention_decode (small tuning sweep, auto num_splits),
     shipped    - jax.experimental.pallas.ops.gpu.paged_attention (small sweep too),
     mosaic     - pallas_kernels.mosaic (the Mosaic GPU kernel, Hopper only; not timed in
                  interpret mode); where this jax has no Triton backend, "ours" and
                  "shipped" are skipped with the reason and the rest still runs,
     xla_ref    - the oracle (gather + fp32 softmax, plain XLA),
     contiguous - the same attention on contiguous [batch, kv, ctx, D] K/V: XLA einsum
                  and JAX's Triton decode_attention kernel; the faster one counts,
   for bf16, head_dim 128, 32 q heads over 4 kv heads, every row at full context.  The
   sweep is batch {1, 8, 64, 256} x context {512, 4096, 32768} at block size 16, then
   block sizes {8, 32, 64, 128} at a few (batch, context) points, in priority order under
   a wall-clock budget; configs that do not fit memory or time are listed as skipped.
4. Quantised pages: the decode kernel over int8 / int8_channel / fp8_e4m3 pages (scales
   loaded with each tile) vs the oracle on the same pages, and its time vs bf16 pages
   (batch 64, context 4096).
5. A table (us, GB/s of KV bytes read, % of copy bandwidth, speedup vs shipped,
   paged/contiguous) and DIR/kernel_bench.json with a "headline" object.

``--quick`` (and any run without a GPU) runs a tiny interpret-mode smoke of the same code
path (< 30 s on CPU).  Importable: ``main(argv) -> dict`` (the report; run as a script, the
exit status is 1 when a correctness check failed).

The contract checks at model shapes (``experiments/gpu.py`` runs them first) live in
``experiments/kernel_check.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

# Runnable as a plain script from a checkout without an install: put the repo root first.
_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels  # noqa: E402
from experiments.common import machine_info  # noqa: E402
from experiments.kernel_check import backend_of, max_rel_err  # noqa: E402
from paged_jax.attention import reference  # noqa: E402
from paged_jax.kv import KVPages, quant  # noqa: E402
from pallas_kernels import default_blocks_per_step, default_num_splits  # noqa: E402

# The Triton-backend kernels; None where this jax has no Pallas Triton backend (removed
# after its 0.11 deprecation): the bench then times the Mosaic GPU kernel and the oracle.
paged_attention_decode = getattr(pallas_kernels, "paged_attention_decode", None)
paged_attention_chunk = getattr(pallas_kernels, "paged_attention_chunk", None)
TRITON_MISSING = None if paged_attention_decode else f"pallas_kernels' Triton kernels: {pallas_kernels.TRITON_ERROR}"

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 4, 128
DTYPE = jnp.bfloat16


# ----------------------------------------------------------------------------- setup
@dataclasses.dataclass
class Env:
    interpret: bool  # no GPU: run every Pallas kernel in the interpreter
    num_sms: int
    mem_limit: int  # bytes we allow ourselves on the device
    device: str
    reps: int = 7  # timing repetitions (median taken)
    target_s: float = 0.02  # length of one repetition


def detect_env() -> Env:
    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    mem = 0
    try:
        mem = int((dev.memory_stats() or {}).get("bytes_limit", 0))
    except Exception:  # memory_stats is optional per backend
        mem = 0
    if not mem:
        mem = 8 << 30
    return Env(
        interpret=not gpu,
        num_sms=int(getattr(dev, "core_count", 0) or 132),
        mem_limit=int(mem * 0.8),
        device=f"{dev.platform}:{getattr(dev, 'device_kind', '?')}",
    )


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    context: int
    block_size: int

    @property
    def pages_per_seq(self) -> int:
        return self.context // self.block_size

    @property
    def kv_bytes(self) -> int:
        """K + V bytes one call must read (every row at full context)."""
        return 2 * self.batch * self.context * NUM_KV_HEADS * HEAD_DIM * jnp.dtype(DTYPE).itemsize


def make_inputs(key, shape: Shape, *, lengths=None, free_blocks: int = 8, dtype=DTYPE):
    """Random pool with a randomly permuted block table (the worst case for locality).

    Tables are full (no -1) because JAX's shipped kernel does not clamp ids.
    """
    kq, kk, kv, kp = jax.random.split(key, 4)
    nb = shape.batch * shape.pages_per_seq + free_blocks
    pages = (NUM_KV_HEADS, nb, shape.block_size, HEAD_DIM)
    k_pages = jax.random.normal(kk, pages, dtype)
    v_pages = jax.random.normal(kv, pages, dtype)
    perm = jax.random.permutation(kp, nb)[: shape.batch * shape.pages_per_seq]
    tables = perm.reshape(shape.batch, shape.pages_per_seq).astype(jnp.int32)
    q = jax.random.normal(kq, (shape.batch, NUM_Q_HEADS, HEAD_DIM), dtype)
    if lengths is None:
        lengths = jnp.full((shape.batch,), shape.context, jnp.int32)
    return q, k_pages, v_pages, tables, jnp.asarray(lengths, jnp.int32)


@jax.jit
def oracle_chunk(q, k_pages, v_pages, tables, lengths, q_lens):
    """The one oracle on raw arrays: q [b, T, Hq, D] over 4-D pages -> [b, T, Hq, D]."""
    return reference.paged_attention(q, KVPages(k_pages, v_pages), tables, lengths, q_lens)


@jax.jit
def oracle_decode(q, k_pages, v_pages, tables, lengths):
    """Decode as a chunk of one query per row (none in length-0 rows): q [b, Hq, D]."""
    q_lens = (lengths > 0).astype(jnp.int32)
    return oracle_chunk(q[:, None], k_pages, v_pages, tables, lengths, q_lens)[:, 0]


def pallas_backend(fn, *args) -> str:
    """Which Pallas backend ``fn(*args)`` compiles to here (``kernel_check.backend_of``), or
    "error: ..." when it does not lower."""
    try:
        text = jax.jit(fn).lower(*args).as_text()
    except Exception as e:  # a baseline that does not lower is reported, not fatal
        return f"error: {type(e).__name__}: {str(e)[:120]}"
    return backend_of(text)


@jax.jit
def to_contiguous(pages, tables):
    """[kv, nb, bs, D] x [b, W] -> [b, kv, W*bs, D] (the contiguous baseline's layout)."""
    g = pages[:, tables]  # [kv, b, W, bs, D]
    kvh, b, w, bs, d = g.shape
    return jnp.moveaxis(g, 0, 1).reshape(b, kvh, w * bs, d)


@jax.jit
def contiguous_xla(q, k, v):
    """Plain XLA decode attention over contiguous K/V [b, kv, S, D] (bf16 in, f32 acc)."""
    b, hq, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(b, kvh, hq // kvh, d)
    s = jnp.einsum("bkgd,bksd->bkgs", qg, k, preferred_element_type=jnp.float32) * d**-0.5
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgs,bksd->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, hq, d).astype(q.dtype)


def contiguous_pallas_fn(context: int, interpret: bool):
    """JAX's Triton decode_attention kernel on [b, kv, S, D] (no transpose), or None.

    ``decode_attention.gqa`` wants [b, S, kv, D] and would transpose inside the timed
    call, so vmap its per-(sequence, kv head) function directly; that is internal API, so
    any failure just drops this baseline.
    """
    try:
        from jax.experimental.pallas.ops.gpu import decode_attention as da
    except Exception:
        return None
    k_splits = max(1, min(16, context // 256))
    block_k = min(128, context // k_splits)
    inner = functools.partial(
        da.decode_attn_unbatched,
        sm_scale=HEAD_DIM**-0.5,
        block_h=16,
        block_k=block_k,
        k_splits=k_splits,
        num_warps=4,
        num_stages=2,
        grid=None,
        interpret=interpret,
        debug=False,
        return_residuals=False,
        normalize_output=True,
    )

    @jax.jit
    def fn(q, k, v):
        b, hq, d = q.shape
        kvh = k.shape[1]
        qg = q.reshape(b, kvh, hq // kvh, d)
        o = jax.vmap(jax.vmap(inner))(qg, k, v, None, None)
        return o.reshape(b, hq, d)

    return fn


def shipped_fn():
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as shipped
    except Exception:
        return None
    return shipped.paged_attention


def mosaic_missing(env: Env) -> str | None:
    """Why the Mosaic GPU kernel is not checked or timed here (None: it is): it runs on
    Hopper only; in interpret mode (no GPU) the contract suite and ``gpu``'s kernels part
    check it, and a time there would mean nothing."""
    if env.interpret:
        return "interpret mode: checked by the contract suite and gpu's kernels part, not timed"
    from paged_jax.attention import mosaic

    return mosaic.missing()


def mosaic_decode(q, k_pages, v_pages, block_tables, lengths, **tuning):
    """The Mosaic GPU kernel (``pallas_kernels.mosaic``) with the decode kernel's arguments:
    q [B, Hq, D] -> [B, Hq, D]."""
    from pallas_kernels import mosaic

    q_lens = (lengths > 0).astype(jnp.int32)
    return mosaic.paged_attention(q[:, None], k_pages, v_pages, block_tables, lengths, q_lens, **tuning)[:, 0]


def mosaic_candidates(shape: Shape, env: Env, tune: bool) -> list[dict]:
    auto_splits = default_num_splits(shape.batch, NUM_KV_HEADS, shape.context, env.num_sms)
    cands = [dict(num_splits=auto_splits)]
    if tune and shape.context >= 4096:
        cands.append(dict(num_splits=min(64, 2 * auto_splits)))
    return cands


# ---------------------------------------------------------------------------- timing
def time_fn(fn, *args, target_s: float = 0.02, reps: int = 7) -> float:
    """Median seconds per call: `reps` repetitions of n back-to-back calls after warm-up.

    n is chosen so one repetition lasts ~target_s, which amortises Python dispatch for
    the microsecond-scale configs (the result still includes dispatch when it dominates).
    """
    jax.block_until_ready(fn(*args))  # compile
    t0 = time.perf_counter()
    for _ in range(3):
        out = fn(*args)
    jax.block_until_ready(out)
    one = (time.perf_counter() - t0) / 3
    n = int(min(200, max(1, target_s / max(one, 1e-7))))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def copy_bandwidth(env: Env, nbytes: int) -> float:
    """Bytes moved per second (read + write) by a large on-device copy."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)  # a real elementwise pass, not an alias
    t = time_fn(copy, x, target_s=max(env.target_s, 0.05 if not env.interpret else 0.0), reps=env.reps)
    del x
    return 2 * nbytes / t


# ---------------------------------------------------------------------- correctness
def check_correctness(env: Env, shape: Shape, quick: bool) -> list[dict]:
    """Each check: name, max error relative to the output's max |value|, tolerance, ok.

    Uses the same shapes and static settings as the first timed config, so in --quick mode
    the compilations are shared with the timing run.
    """
    results = []
    cap = shape.context
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, cap + 1, size=shape.batch)
    lengths[:4] = [0, 1, shape.block_size, cap][: shape.batch]
    args = make_inputs(jax.random.PRNGKey(0), shape, lengths=lengths)
    q, kp, vp, bt, ln = args
    ref = oracle_decode(*args)
    if mosaic_missing(env) is None:
        om = mosaic_decode(*args, num_splits=2)
        results.append(dict(name="mosaic_gpu (2 splits) vs reference bf16", err=max_rel_err(om, ref), tol=2e-2))
        if not quick:
            f32 = [x.astype(jnp.float32) for x in (q, kp, vp)]
            om32 = mosaic_decode(*f32, bt, ln)
            results.append(dict(name="mosaic_gpu vs reference fp32 (bf16x3 terms)",
                                err=max_rel_err(om32, oracle_decode(*f32, bt, ln)), tol=1e-4))
    if TRITON_MISSING:
        for r in results:
            r["ok"] = bool(r["err"] <= r["tol"])
        return results
    cfg = our_candidates(shape, env, tune=False)[0]
    ours = paged_attention_decode(*args, interpret=env.interpret, **cfg)
    results.append(dict(name=f"ours {cfg} vs reference bf16", err=max_rel_err(ours, ref), tol=2e-2))
    if not quick:
        o3 = paged_attention_decode(*args, num_splits=3, blocks_per_step=2, interpret=env.interpret)
        results.append(
            dict(name="ours (3 splits, 2 blocks/step) vs reference bf16", err=max_rel_err(o3, ref), tol=2e-2)
        )
    shipped = shipped_fn()
    if shipped is not None:
        try:
            # The shipped kernel applies no softmax scale (so pre-scale q) and gives garbage
            # for length-0 rows (so compare rows with length >= 1 only).
            q_scaled = (q.astype(jnp.float32) * HEAD_DIM**-0.5).astype(q.dtype)
            o_s = shipped(
                q_scaled,
                kp,
                vp,
                bt,
                ln,
                interpret=env.interpret,
                **shipped_candidates(shape, env, tune=False)[0],
            )
            nz = np.asarray(ln) > 0
            results.append(
                dict(
                    name="ours vs shipped bf16 (rows with length >= 1)",
                    err=max_rel_err(np.asarray(ours)[nz], np.asarray(o_s)[nz]),
                    tol=2e-2,
                )
            )
        except Exception as e:  # report, do not die: the shipped kernel is only a baseline
            results.append(dict(name="ours vs shipped", err=float("nan"), tol=0.0, error=repr(e)[:300]))
    if not quick:
        f32 = [x.astype(jnp.float32) for x in (q, kp, vp)]
        o32 = paged_attention_decode(*f32, bt, ln, num_splits=2, interpret=env.interpret)
        r32 = oracle_decode(*f32, bt, ln)
        results.append(dict(name="ours vs reference fp32 (IEEE dots)", err=max_rel_err(o32, r32), tol=1e-4))
    chunk = 4
    qc = jax.random.normal(jax.random.PRNGKey(1), (shape.batch, chunk, NUM_Q_HEADS, HEAD_DIM), DTYPE)
    q_lens = jnp.minimum(ln, jnp.asarray(np.resize([4, 1, 3, 0], shape.batch), jnp.int32))
    oc = paged_attention_chunk(qc, kp, vp, bt, ln, q_lens, num_splits=2, interpret=env.interpret)
    rc = oracle_chunk(qc, kp, vp, bt, ln, q_lens)
    results.append(dict(name="chunk kernel vs reference bf16", err=max_rel_err(oc, rc), tol=2e-2))
    for r in results:
        r["ok"] = bool(r["err"] <= r["tol"])
    return results


@jax.jit
def oracle_decode_quantized(q, pages: KVPages, tables, lengths):
    """The oracle over quantised pages (values x scales, fp32 softmax): q [b, Hq, D]."""
    q_lens = (lengths > 0).astype(jnp.int32)
    return reference.paged_attention(q[:, None], pages, tables, lengths, q_lens)[:, 0]


def quantized_decode(env: Env, shape: Shape) -> list[dict]:
    """The decode kernel over int8 / int8_channel / fp8_e4m3 pages (bf16 scales, loaded
    with each tile) vs the oracle on the same pages, and its time vs bf16 pages."""
    if TRITON_MISSING:
        return []
    args = make_inputs(jax.random.PRNGKey(2), shape)
    q, kp, vp, bt, ln = args
    cfg = our_candidates(shape, env, tune=False)[0]
    base = functools.partial(paged_attention_decode, interpret=env.interpret, **cfg)
    t_bf16 = time_fn(jax.jit(base), *args, target_s=env.target_s, reps=env.reps)
    rows = []
    for name in quant.QUANTIZED_KV_CACHE_DTYPES:
        fmt = quant.kv_format(name)
        (k, ks), (v, vs) = quant.quantize_blocks(fmt, kp), quant.quantize_blocks(fmt, vp)
        pages = KVPages(k, v, ks, vs, kv_format=name)
        run = jax.jit(lambda q, k, v, ks, vs, bt, ln, pc=fmt.per_channel: base(
            q, k, v, bt, ln, k_scales=ks, v_scales=vs, per_channel_scales=pc))
        out = run(q, k, v, ks, vs, bt, ln)
        err = max_rel_err(out, oracle_decode_quantized(q, pages, bt, ln))
        t = time_fn(run, q, k, v, ks, vs, bt, ln, target_s=env.target_s, reps=env.reps)
        rows.append(dict(format=name, err=err, tol=2e-2, ok=bool(err <= 2e-2), us=t * 1e6,
                         over_bf16=t / t_bf16, kv_bytes_over_bf16=sum(x.nbytes for x in (k, v, ks, vs)) /
                         (kp.nbytes + vp.nbytes)))
    return rows


def report_backends(env: Env, shape: Shape) -> dict:
    """The Pallas backend each kernel compiles to on this device (see ``pallas_backend``)."""
    args = make_inputs(jax.random.PRNGKey(2), shape)
    q, kp, vp, bt, ln = args
    qc = jnp.zeros((shape.batch, 4, NUM_Q_HEADS, HEAD_DIM), DTYPE)
    out = {}
    if mosaic_missing(env) is None:
        out["mosaic_decode"] = pallas_backend(mosaic_decode, *args)
    else:
        out["mosaic_decode"] = f"not run: {mosaic_missing(env)}"
    if TRITON_MISSING:
        return out | {"ours_decode": f"unavailable: {TRITON_MISSING}"}
    out |= {
        "ours_decode": pallas_backend(
            functools.partial(paged_attention_decode, interpret=env.interpret), *args
        ),
        "ours_chunk": pallas_backend(
            functools.partial(paged_attention_chunk, interpret=env.interpret),
            qc,
            kp,
            vp,
            bt,
            ln,
            jnp.minimum(ln, 4),
        ),
    }
    shipped = shipped_fn()
    if shipped is not None:
        tuning = shipped_candidates(shape, env, tune=False)[0]
        out["shipped"] = pallas_backend(functools.partial(shipped, interpret=env.interpret, **tuning), *args)
    return out


# --------------------------------------------------------------------------- sweep
def sweep_shapes(quick: bool) -> list[Shape]:
    """Priority order: main grid at block size 16, then block-size sweeps."""
    if quick:
        return [Shape(4, 64, 16)]
    main = [Shape(b, c, 16) for c in (4096, 32768, 512) for b in (1, 8, 64, 256)]
    block_sweep = [
        Shape(b, c, bs)
        for (b, c) in ((8, 4096), (64, 32768), (1, 32768), (256, 4096), (8, 512))
        for bs in (8, 32, 64, 128)
    ]
    return main + block_sweep


def our_candidates(shape: Shape, env: Env, tune: bool) -> list[dict]:
    auto_splits = default_num_splits(shape.batch, NUM_KV_HEADS, shape.context, env.num_sms)
    bps = default_blocks_per_step(shape.block_size, HEAD_DIM)
    cands = [dict(num_splits=auto_splits, blocks_per_step=bps)]
    if tune:
        if 2 * bps * shape.block_size <= 256:
            cands.append(dict(num_splits=auto_splits, blocks_per_step=2 * bps))
        if shape.context >= 4096:
            cands.append(dict(num_splits=min(64, 2 * auto_splits), blocks_per_step=bps))
        if auto_splits > 1:
            cands.append(dict(num_splits=max(1, auto_splits // 2), blocks_per_step=bps))
    unique = []
    for c in cands:
        if c not in unique:
            unique.append(c)
    return unique[:3]


def shipped_candidates(shape: Shape, env: Env, tune: bool) -> list[dict]:
    """Valid (k_splits | pages, ppcb | pages per split) settings near its defaults."""
    pages = shape.pages_per_seq

    def fit(ks, ppcb):
        ks = max(1, min(ks, pages))
        while pages % ks:
            ks //= 2
        ppcb = max(1, min(ppcb, pages // ks))
        while (pages // ks) % ppcb:
            ppcb //= 2
        return dict(k_splits=ks, pages_per_compute_block=ppcb)

    cands = [fit(16, 8)]  # its defaults
    if tune:
        auto = default_num_splits(shape.batch, NUM_KV_HEADS, shape.context, env.num_sms)
        cands.append(fit(auto, max(1, 128 // shape.block_size)))
    out = []
    for c in cands:
        if c not in out:
            out.append(c)
    return out


def best_of(candidates, make_fn, args, env: Env) -> tuple[float, dict | None, list]:
    """Fastest candidate: (seconds, its settings, errors of candidates that failed)."""
    best_t, best_c, errors = math.inf, None, []
    for c in candidates:
        try:
            t = time_fn(make_fn(c), *args, target_s=env.target_s, reps=env.reps)
        except Exception as e:  # e.g. a tuning point that does not compile
            errors.append(f"{c}: {type(e).__name__}: {str(e)[:200]}")
            continue
        if t < best_t:
            best_t, best_c = t, c
    return best_t, best_c, errors


def bench_shape(shape: Shape, env: Env, copy_bw: float, tune: bool, shipped) -> dict:
    row: dict = dict(dataclasses.asdict(shape), kv_bytes=shape.kv_bytes)
    args = make_inputs(jax.random.PRNGKey(shape.batch * 7 + shape.context + shape.block_size), shape)
    q, kp, vp, bt, ln = args

    t = None
    if not TRITON_MISSING:
        t, cfg, errs = best_of(
            our_candidates(shape, env, tune),
            lambda c: functools.partial(paged_attention_decode, interpret=env.interpret, **c),
            args,
            env,
        )
        if cfg is None:
            raise RuntimeError(f"no setting of our kernel ran: {errs}")
        row.update(ours_us=t * 1e6, ours_cfg=cfg)
        if errs:
            row["ours_errors"] = errs
    else:
        row.update(ours_us=None, ours_skipped=TRITON_MISSING)
    if mosaic_missing(env) is None:
        tm, cfg_m, errs = best_of(mosaic_candidates(shape, env, tune),
                                  lambda c: jax.jit(functools.partial(mosaic_decode, **c)), args, env)
        row.update(mosaic_us=tm * 1e6 if math.isfinite(tm) else None, mosaic_cfg=cfg_m)
        if errs:
            row["mosaic_errors"] = errs
    else:
        row.update(mosaic_us=None, mosaic_skipped=mosaic_missing(env))
    if shipped is not None:
        ts, cfg_s, errs = best_of(
            shipped_candidates(shape, env, tune),
            lambda c: functools.partial(shipped, interpret=env.interpret, **c),
            args,
            env,
        )
        row.update(shipped_us=ts * 1e6 if math.isfinite(ts) else None, shipped_cfg=cfg_s)
        if errs:
            row["shipped_errors"] = errs
    # The fp32 reference materialises fp32 copies of the gathered K/V: only when small.
    if 3 * shape.kv_bytes <= env.mem_limit // 4:
        row["xla_ref_us"] = time_fn(oracle_decode, *args, target_s=env.target_s, reps=env.reps) * 1e6
    else:
        row["xla_ref_us"] = None
        row["xla_ref_skipped"] = "memory (fp32 gathered K/V)"

    kc = to_contiguous(kp, bt)
    vc = to_contiguous(vp, bt)
    del kp, vp, args
    contig = {"xla": time_fn(contiguous_xla, q, kc, vc, target_s=env.target_s, reps=env.reps)}
    fn = contiguous_pallas_fn(shape.context, env.interpret)
    if fn is not None:
        try:
            contig["pallas_decode_attention"] = time_fn(fn, q, kc, vc, target_s=env.target_s, reps=env.reps)
        except Exception as e:
            row["contig_pallas_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    del kc, vc
    name, tc = min(contig.items(), key=lambda kv: kv[1])
    row.update(
        contiguous_us=tc * 1e6,
        contiguous_impl=name,
        contiguous_all_us={k: v * 1e6 for k, v in contig.items()},
    )

    # The headline kernel: ours (Triton) where it runs, else the Mosaic GPU one.
    t_main = t if t is not None else (row["mosaic_us"] / 1e6 if row.get("mosaic_us") else None)
    row["ours_gbps"] = shape.kv_bytes / t_main / 1e9 if t_main else None
    row["pct_copy_bw"] = 100.0 * (shape.kv_bytes / t_main) / copy_bw if t_main else None
    row["speedup_vs_shipped"] = (row["shipped_us"] / row["ours_us"]) if row.get("shipped_us") and t else None
    row["paged_over_contiguous"] = t_main * 1e6 / row["contiguous_us"] if t_main else None
    if row.get("mosaic_us"):
        row["mosaic_pct_copy_bw"] = 100.0 * (shape.kv_bytes / (row["mosaic_us"] / 1e6)) / copy_bw
        row["mosaic_over_ours"] = row["mosaic_us"] / row["ours_us"] if t else None
        row["mosaic_speedup_vs_shipped"] = row["shipped_us"] / row["mosaic_us"] if row.get("shipped_us") else None
    return row


def fits(shape: Shape, env: Env) -> bool:
    # paged pool + contiguous copy + generation temporaries (fp32 normals for one of K/V).
    return 4 * shape.kv_bytes <= env.mem_limit


# ---------------------------------------------------------------------------- report
def format_table(rows: list[dict]) -> str:
    head = (
        f"{'batch':>5} {'ctx':>6} {'bs':>4} | {'ours us':>9} {'GB/s':>7} {'%copy':>6} "
        f"{'shipped us':>10} {'speedup':>7} {'mosaic us':>9} {'xla_ref us':>10} {'contig us':>9} "
        f"{'paged/contig':>12} | ours cfg"
    )
    lines = [head, "-" * len(head)]

    def f(x, fmt):
        return format(x, fmt) if isinstance(x, (int, float)) and x is not None else "-"

    for r in rows:
        cfg = r.get("ours_cfg") or {}
        lines.append(
            f"{r['batch']:>5} {r['context']:>6} {r['block_size']:>4} | {f(r['ours_us'], '9.1f')} "
            f"{f(r['ours_gbps'], '7.0f')} {f(r['pct_copy_bw'], '6.1f')} "
            f"{f(r.get('shipped_us'), '10.1f'):>10} {f(r.get('speedup_vs_shipped'), '7.2f'):>7} "
            f"{f(r.get('mosaic_us'), '9.1f'):>9} {f(r.get('xla_ref_us'), '10.1f'):>10} {f(r['contiguous_us'], '9.1f')} "
            f"{f(r['paged_over_contiguous'], '12.2f')} | splits={cfg.get('num_splits')} "
            f"bps={cfg.get('blocks_per_step')}"
        )
    return "\n".join(lines)


def headline(rows: list[dict]) -> dict:
    long_ctx = [r["pct_copy_bw"] for r in rows if r["context"] >= 4096 and r.get("pct_copy_bw") is not None]
    speed = [r["speedup_vs_shipped"] for r in rows if r.get("speedup_vs_shipped")]
    slow = [r["paged_over_contiguous"] for r in rows if r["block_size"] >= 16 and r.get("paged_over_contiguous")]
    mosaic = [r["mosaic_over_ours"] for r in rows if r.get("mosaic_over_ours")]
    mosaic_bw = [r["mosaic_pct_copy_bw"] for r in rows if r.get("mosaic_pct_copy_bw") and r["context"] >= 4096]
    return {
        "max_mosaic_over_ours": max(mosaic) if mosaic else None,
        "min_mosaic_over_ours": min(mosaic) if mosaic else None,
        "min_mosaic_pct_copy_bw_ctx_ge_4096": min(mosaic_bw) if mosaic_bw else None,
        "min_pct_copy_bw_ctx_ge_4096": min(long_ctx) if long_ctx else None,
        "min_speedup_vs_shipped": min(speed) if speed else None,
        "max_paged_over_contiguous_bs_ge_16": max(slow) if slow else None,
        "configs_measured": len(rows),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (interpret mode on CPU)")
    ap.add_argument("--out", default="out", help="directory for kernel_bench.json")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=220.0,
        help="wall-clock budget for the timing sweep (configs past it are skipped)",
    )
    ap.add_argument("--no-tune", action="store_true", help="time only the auto-chosen settings")
    args = ap.parse_args(argv)

    start = time.perf_counter()
    env = detect_env()
    quick = args.quick or env.interpret
    if quick:  # a smoke run: exercise the code path, do not measure carefully
        env.reps, env.target_s = 2, 0.0
    if env.interpret and not args.quick:
        print("no GPU backend: running the --quick interpret-mode smoke instead")
    print(
        f"device {env.device}, jax {jax.__version__}, SMs {env.num_sms}, "
        f"memory budget {env.mem_limit / 2**30:.1f} GiB, interpret={env.interpret}"
    )

    shapes = sweep_shapes(quick)
    checks = check_correctness(env, Shape(16, 2048, 16) if not quick else shapes[0], quick)
    for c in checks:
        print(
            f"  [{'ok' if c['ok'] else 'FAIL'}] {c['name']}: err {c['err']:.2e} (tol {c['tol']:.0e})"
            + (f" {c['error']}" if "error" in c else "")
        )
    all_ok = all(c["ok"] for c in checks if "error" not in c)
    backends = report_backends(env, shapes[0])
    print("pallas backends: " + ", ".join(f"{k}={v}" for k, v in backends.items()))

    copy_bytes = (1 << 20) if quick else (4 << 30)
    copy_bw = copy_bandwidth(env, copy_bytes)
    print(f"device copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write of {copy_bytes >> 20} MiB)")

    shipped = shipped_fn()
    rows, skipped = [], []
    for shape in shapes:
        elapsed = time.perf_counter() - start
        if not fits(shape, env):
            skipped.append(dict(dataclasses.asdict(shape), reason="does not fit device memory"))
            continue
        if elapsed > args.budget_s:
            skipped.append(dict(dataclasses.asdict(shape), reason="time budget"))
            continue
        tune = not (quick or args.no_tune)
        try:
            row = bench_shape(shape, env, copy_bw, tune, shipped)
        except Exception as e:  # one failing config must not lose the others
            skipped.append(
                dict(dataclasses.asdict(shape), reason=f"error: {type(e).__name__}: {str(e)[:300]}")
            )
            continue
        finally:
            gc.collect()
        rows.append(row)
        fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
        print(
            f"  b={shape.batch:<4} ctx={shape.context:<6} bs={shape.block_size:<4} ours "
            f"{fmt(row['ours_us'], '.1f')} us ({fmt(row['pct_copy_bw'], '.0f')}% copy bw), mosaic_gpu "
            f"{fmt(row.get('mosaic_us'), '.1f')} us  [{time.perf_counter() - start:.0f} s]"
        )

    quantized = quantized_decode(env, shapes[0] if quick else Shape(64, 4096, 16))
    for r in quantized:
        print(f"  [{'ok' if r['ok'] else 'FAIL'}] decode over {r['format']} pages: err {r['err']:.2e}, "
              f"{r['us']:.1f} us = {r['over_bf16']:.2f}x bf16 pages, KV bytes {r['kv_bytes_over_bf16']:.2f}x")
    all_ok = all_ok and all(r["ok"] for r in quantized)

    print()
    print(format_table(rows))
    for s in skipped:
        print(f"skipped b={s['batch']} ctx={s['context']} bs={s['block_size']}: {s['reason']}")
    head = headline(rows)
    print("headline:", json.dumps(head))

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = dict(
        headline=head,
        correctness=checks,
        correctness_ok=all_ok,
        copy_bandwidth_gbps=copy_bw / 1e9,
        device=env.device,
        jax_version=jax.__version__,
        interpret=env.interpret,
        pallas_backends=backends,
        triton_kernels=TRITON_MISSING or "available",
        mosaic_gpu=mosaic_missing(env) or "checked and timed",
        quick=quick,
        shapes=dict(
            num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=jnp.dtype(DTYPE).name
        ),
        rows=rows,
        quantized=quantized,
        skipped=skipped,
        wall_s=time.perf_counter() - start,
        machine=machine_info(),
    )
    path = out_dir / "kernel_bench.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {path} in {report['wall_s']:.0f} s")
    return report


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(0 if main(sys.argv[1:])["correctness_ok"] else 1)
