"""Paged attention (decode and multi-query chunks) as a Mosaic GPU kernel for Hopper (sm_90a).

  q:               [batch, T, num_q_heads, head_dim] (T = 1 decode, T > 1 a chunk)
  k_pages/v_pages: [num_kv_heads, num_blocks, block_size, head_dim], or every layer's pool
                   [num_layers, num_kv_heads, ...] with ``layer`` (int or traced int32)
  block_tables:    int32[batch, max_blocks_per_seq]; entries past a row's blocks: anything
  lengths:         int32[batch] KV length including the chunk's own tokens
  q_lens:          int32[batch] real queries per row (query t sits at lengths - q_lens + t)

Design (``docs/DESIGN.md``, "The Mosaic GPU kernel"):

* One CTA = one warpgroup per (sequence, kv head, row block, split). A row block is 64
  rows r = t * group + g (query token t, q head g of this kv head): the GQA group, and for
  a chunk its queries, share one [64, head_dim] tile, the M of a warpgroup MMA (wgmma).
* KV is walked in steps of ``block_k = blocks_per_step * block_size`` tokens (a multiple of
  64). A step's pages are gathered by ``blocks_per_step`` TMA copies (``copy_gmem_to_smem``,
  one per physical page, the page id read from the block table in global memory) into one
  slot of a ``num_stages``-deep ring of shared-memory buffers; each slot has one barrier for
  K and one for V that expects ``blocks_per_step`` arrivals. The loop waits on slot
  ``i % num_stages``, computes, then issues step ``i + num_stages`` into the freed slot, so
  ``num_stages - 1`` steps of copies are in flight behind the compute.
* S = Q K^T and O += P V are wgmmas (bf16 operands, fp32 accumulators; K^T is a transposed
  view of the K slot). Operands that are not bf16 are split into bf16 terms, x = x0 + x1
  (+ x2), and the products of terms i, j with i + j < n are summed in fp32: fp32 (3 terms)
  keeps fp32 accuracy (XLA's BF16_BF16_F32_X6 algorithm), fp16 takes 2, bf16 1. Hopper's
  fp32 wgmma is TF32 (10-bit mantissa), which would miss fp32 accuracy, and a TF32 B operand
  must be K-major, which V is not. int8 / float8_e4m3fn pages (per-token scales) are
  dequantised in registers (values x scale, in fp32) and split like fp32 values.
* Pages a direct bf16 copy cannot feed (fp32, fp16, quantised) land in a staging ring in
  their own dtype and are converted into single-buffered bf16 MMA tiles by the warpgroup.
* Online softmax in fp32, base 2. Masked logits are replaced (never added to), masked
  probabilities are exactly 0, and V rows past the row's end are zeroed before the PV
  product (they may hold NaN), so no masked memory reaches the result.
* Split-K (flash-decoding): ``num_splits`` programs share a row block's steps; each writes
  its unnormalised O and its (max, sum), merged by a log-sum-exp combine in XLA
  (``pallas_kernels.common.combine_splits``). One split normalises in the kernel.

Interpret mode (CPU): with ``interpret=True`` the kernel runs in Mosaic GPU's interpreter
(``InterpretGPUParams``), which simulates shared memory, the TMA copies and the barriers.
Its wgmma takes neither a transposed nor a register operand (jax 0.10), so there the two
products are ``lax.dot_general`` over the same shared-memory tiles and bf16 terms, and
layout casts are left out; everything else is the code the GPU runs. ``lowering_text``
lowers the GPU form for sm_90a without a GPU (tests/test_mosaic_gpu.py).

Shared memory is checked against Hopper's 227 KB before anything is traced
(``smem_bytes``); head_dim 256 with fp32 or quantised pages does not fit and is refused.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import DEFAULT_MASK_VALUE, LOG2E, combine_splits, flat_pages, is_pow2

try:  # Mosaic GPU's Pallas API (jax >= 0.5); its interpreter (jax >= 0.10)
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError as e:  # pragma: no cover - depends on the installed jax
    plgpu = None
    _PLGPU_ERROR: Exception | None = e
else:
    _PLGPU_ERROR = None

ROWS = 64  # rows of one tile: the M of a Hopper warpgroup MMA
MIN_BLOCK_K = 64  # tokens per step: a multiple of the WGMMA layout's 64 rows
MAX_BLOCK_K = 256
SMEM_LIMIT = 227 * 1024  # Hopper's per-block shared memory (opt-in maximum)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64, 128)
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
MAX_GROUP = ROWS  # q heads per kv head: one tile holds the group
READS_FORMATS = ("int8", "fp8_e4m3")  # quantised kv_cache_dtypes read (per-token scales)
_TERMS = {jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2, jnp.dtype(jnp.float32): 3}


def interpret_params():
    """An ``InterpretGPUParams()`` (Mosaic GPU interpret mode), or ImportError saying why."""
    if plgpu is None:
        raise ImportError(f"jax has no Mosaic GPU Pallas API ({_PLGPU_ERROR})")
    cls = getattr(plgpu, "InterpretParams", None) or getattr(plgpu, "InterpretGPUParams", None)
    if cls is None:
        try:
            from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
        except ImportError as e:
            raise ImportError(f"this jax ({jax.__version__}) has no Mosaic GPU interpret mode ({e})") from e
    return cls()


def reset_interpreter() -> None:
    """Clears the interpreter's state after a kernel raised inside it (its docs ask for it)."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    except ImportError:
        return
    interpret_pallas_call.reset_gpu_interpret_mode_state()


def terms_of(dtype) -> int:
    """bf16 terms an operand of ``dtype`` is split into (quantised values count as fp32
    after dequantisation)."""
    return _TERMS.get(jnp.dtype(dtype), 3)


def split_terms(x: jax.Array, n: int) -> list[jax.Array]:
    """x (any float) as n bf16 arrays whose fp32 sum approximates x (n = 1: a cast)."""
    x = x.astype(jnp.float32)
    out = []
    for _ in range(n):
        t = x.astype(jnp.bfloat16)
        out.append(t)
        x = x - t.astype(jnp.float32)
    return out


def _pairs(na: int, nb: int) -> list[tuple[int, int]]:
    """Term products kept: i + j < max(na, nb) (the rest are below fp32 rounding)."""
    n = max(na, nb)
    return [(i, j) for i in range(na) for j in range(nb) if i + j < n]


def _swizzled(shape: tuple[int, ...], dtype) -> Any:
    """An SMEM buffer tiled and swizzled for wgmma / TMA (minor dim of 32..128 bytes)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, shape[-1] * itemsize)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // itemsize)),
                                                plgpu.SwizzleTransform(swizzle)))


class Plan:
    """The static tiling of one call (everything the kernel is specialised on)."""

    def __init__(self, *, q_dtype, kv_dtype, head_dim: int, block_size: int, blocks_per_step: int,
                 num_stages: int, num_splits: int, group: int, quantized: bool):
        self.q_dtype, self.kv_dtype = jnp.dtype(q_dtype), jnp.dtype(kv_dtype)
        self.head_dim, self.block_size, self.bps = head_dim, block_size, blocks_per_step
        self.block_k = blocks_per_step * block_size
        self.stages, self.splits, self.group, self.quantized = num_stages, num_splits, group, quantized
        self.nq = terms_of(self.q_dtype)
        # Quantised values are dequantised to fp32 and split as the queries are.
        self.nk = self.nq if quantized else terms_of(self.kv_dtype)
        self.direct = self.kv_dtype == jnp.dtype(jnp.bfloat16)  # TMA straight into the MMA tiles
        self.np = self.nq  # P's terms: the queries' precision

    def smem_bytes(self) -> int:
        """Shared memory the kernel allocates (buffers only; barriers are bytes)."""
        d, bk, s = self.head_dim, self.block_k, self.stages
        loop = self.nq * ROWS * d * 2  # the query terms
        if self.direct:
            loop += 2 * s * bk * d * 2  # K and V rings, bf16
        else:
            loop += 2 * s * bk * d * self.kv_dtype.itemsize  # K and V staging rings
            loop += self.nk * bk * d * 2  # bf16 terms of K, then of V (one tile, single-buffered)
        if self.quantized:
            loop += 2 * s * bk * 4  # per-token scales, fp32
        out = ROWS * d * 4 + 2 * ROWS * 4  # output tile, m and l: after the loop, in its space
        return max(loop, out)


def check_plan(plan: Plan) -> None:
    """ValueError naming the limit when the plan cannot run on Hopper."""
    if plan.block_k % MIN_BLOCK_K or not MIN_BLOCK_K <= plan.block_k <= MAX_BLOCK_K:
        raise ValueError(
            f"blocks_per_step * block_size = {plan.block_k} tokens per step must be a multiple of "
            f"{MIN_BLOCK_K} in [{MIN_BLOCK_K}, {MAX_BLOCK_K}] (the WGMMA tile's rows)"
        )
    if plan.stages < 1:
        raise ValueError(f"num_stages={plan.stages} must be >= 1")
    if plan.splits < 1:
        raise ValueError(f"num_splits={plan.splits} must be >= 1")
    if (need := plan.smem_bytes()) > SMEM_LIMIT:
        raise ValueError(
            f"mosaic_gpu: this tiling needs {need // 1024} KB of shared memory, more than Hopper's "
            f"{SMEM_LIMIT // 1024} KB (head_dim {plan.head_dim}, {plan.block_k} tokens per step, "
            f"{plan.stages} stages, {plan.kv_dtype} pages); use fewer stages or tokens per step"
        )


def default_num_stages(**plan_fields) -> int:
    """The deepest ring (at most 3 stages) whose shared memory fits; 1 if none does (the
    plan's check then names the limit)."""
    for stages in (3, 2):
        if Plan(**plan_fields, num_stages=stages).smem_bytes() <= SMEM_LIMIT:
            return stages
    return 1


def default_blocks_per_step(block_size: int) -> int:
    """64 tokens per step (one WGMMA tile of keys), or one block when blocks are larger."""
    return max(1, MIN_BLOCK_K // block_size)


def check_call(q, k_pages, v_pages, k_scales, v_scales, per_channel: bool) -> None:
    """ValueError for what this kernel does not take (the contract itself is checked by
    ``paged_jax.attention.contract``)."""
    d, bs = k_pages.shape[-1], k_pages.shape[-2]
    hkv, hq = k_pages.shape[-4], q.shape[2]
    if jnp.dtype(q.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"mosaic_gpu: q dtype {q.dtype} is not supported; use float32, bfloat16 or float16")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"mosaic_gpu: head_dim={d} is not supported; use one of {SUPPORTED_HEAD_DIMS}")
    if bs not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"mosaic_gpu: block_size={bs} is not supported; use one of {SUPPORTED_BLOCK_SIZES}")
    if hq // hkv > MAX_GROUP:
        raise ValueError(f"mosaic_gpu: {hq // hkv} q heads per kv head is more than one {ROWS}-row tile")
    kv = jnp.dtype(k_pages.dtype)
    if kv in QUANTIZED_DTYPES:
        if per_channel:
            raise ValueError(
                "mosaic_gpu reads per-token quantised pages only (kv_cache_dtype in "
                f"{READS_FORMATS}), not per-channel scales (int8_channel); use 'pallas' or 'xla'"
            )
        if k_scales is None or v_scales is None:
            raise ValueError(f"quantised k_pages ({kv}) need k_scales and v_scales")
    elif kv not in FLOAT_DTYPES:
        raise ValueError(
            f"mosaic_gpu: page dtype {kv} is not supported; use float32, bfloat16, float16, or "
            f"per-token int8 / float8_e4m3fn ({READS_FORMATS})"
        )


# --------------------------------------------------------------------------- the kernel
def _kernel(*refs, plan: Plan, interpret: bool, scale: float, num_kv_heads: int, num_blocks: int,
            mask_value: float):
    p = plan
    n_in = 7 + (2 if p.quantized else 0)
    lengths_ref, q_lens_ref, layer_ref, tables_ref, q_ref, k_ref, v_ref, *scale_refs = refs[:n_in]
    outs = refs[n_in:n_in + (1 if p.splits == 1 else 3)]
    q_bar, k_bar, v_bar = refs[n_in + len(outs):]
    ks_ref, vs_ref = scale_refs if p.quantized else (None, None)
    group, bk, d, bps, stages = p.group, p.block_k, p.head_dim, p.bps, p.stages

    def layout(x, kind):  # layouts are for the GPU lowering; the interpreter has none
        if interpret:
            return x
        lay = plgpu.Layout.WGMMA
        return plgpu.layout_cast(x, lay if kind is None else lay.reduce(kind))

    def iota(shape, dim):
        if interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

    def load_vec(ref, kind):
        if interpret:
            return ref[...]
        return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(kind))

    b, h = lax.axis_index("b"), lax.axis_index("h")
    rb, split = lax.axis_index("r"), lax.axis_index("s")
    length, q_len, layer = lengths_ref[b], q_lens_ref[b], layer_ref[0]
    first_pos = length - q_len
    # KV this row block sees: up to the position of its last real query.
    t_lo = (rb * ROWS) // group
    t_hi = ((rb + 1) * ROWS - 1) // group
    kv_end = jnp.where(t_lo < q_len, first_pos + jnp.minimum(q_len, t_hi + 1), 0)
    total = pl.cdiv(kv_end, bk)
    per_split = pl.cdiv(total, p.splits)
    first = split * per_split
    count = jnp.clip(total - first, 0, per_split)
    base = (layer * num_kv_heads + h) * num_blocks

    def attend(q_smem, k_ring, v_ring, terms, sk_ring, sv_ring):
        """The pipelined loop over this program's steps -> (o, m, l) in registers."""
        k_in, v_in = (k_ring, v_ring)  # TMA targets: the MMA tiles themselves when direct
        for i in range(p.nq):
            plgpu.copy_gmem_to_smem(q_ref.at[i, b, h, pl.ds(rb * ROWS, ROWS)], q_smem.at[i], q_bar.at[0])

        def issue(step, slot):
            """Starts the copies of step ``step`` (pages, then scales) into ring slot ``slot``."""
            for j in range(bps):
                page = base + jnp.clip(tables_ref[b, step * bps + j], 0, num_blocks - 1)
                rows = pl.ds(j * p.block_size, p.block_size)
                plgpu.copy_gmem_to_smem(k_ref.at[page], k_in.at[slot, rows], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[page], v_in.at[slot, rows], v_bar.at[slot])
            if p.quantized:
                cols = pl.ds(step * bk, bk)
                plgpu.copy_gmem_to_smem(ks_ref.at[b, h, cols], sk_ring.at[slot], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(vs_ref.at[b, h, cols], sv_ring.at[slot], v_bar.at[slot])

        def prologue(s, carry):  # the first stages' copies in flight (one copy site, a loop)
            issue(first + s, s)
            return carry

        lax.fori_loop(0, jnp.minimum(count, stages), prologue, 0)

        plgpu.barrier_wait(q_bar.at[0])
        rows_t = (iota((ROWS, bk), 0) + rb * ROWS) // group  # the query index of each row
        q_pos = first_pos + rows_t  # [ROWS, bk]: the position each row's query sits at
        row_ok = rows_t < q_len

        def convert(src, slot, tok_ok, scales_ring):
            """Staged pages (fp32 / fp16 / int8 / fp8) of ``slot`` -> bf16 terms; rows past
            the end zeroed (they may hold NaN); quantised values times their scales."""
            x = src[slot].astype(jnp.float32)
            if scales_ring is not None:
                x = x * lax.broadcast_in_dim(load_vec(scales_ring.at[slot], 1), (bk, d), [0])
            x = jnp.where(tok_ok, x, 0.0)
            for t, part in enumerate(split_terms(x, p.nk)):
                terms[t] = part
            plgpu.commit_smem()

        def operand(ring, slot):  # term t of this step's K or V tile
            return (lambda t: ring.at[slot]) if p.direct else (lambda t: terms.at[t])

        def qk(slot):
            kt = operand(k_ring, slot)
            pairs = _pairs(p.nq, p.nk)
            if interpret:
                s = None
                for i, j in pairs:
                    part = lax.dot_general(q_smem[i], kt(j)[...], (((1,), (1,)), ((), ())),
                                           preferred_element_type=jnp.float32)
                    s = part if s is None else s + part
                return s

            def body(acc):
                for i, j in pairs:
                    plgpu.wgmma(acc, q_smem.at[i], plgpu.transpose_ref(kt(j), (1, 0)))
                return acc[...]

            return pl.run_scoped(body, plgpu.ACC((ROWS, bk), jnp.float32))

        def pv(o, probs, slot):
            vt = operand(v_ring, slot)
            p_terms = split_terms(probs, p.np)
            pairs = _pairs(p.np, p.nk)
            if interpret:
                for i, j in pairs:
                    o = o + lax.dot_general(p_terms[i], vt(j)[...], (((1,), (0,)), ((), ())),
                                            preferred_element_type=jnp.float32)
                return o

            def body(acc):
                for i, j in pairs:
                    plgpu.wgmma(acc, p_terms[i], vt(j))

            return pl.run_state(body)(plgpu.ACC.init(o))

        def step_body(i, carry):
            o, m, l_sum = carry
            step = first + i
            slot = lax.rem(i, stages)
            kv_pos = step * bk + iota((ROWS, bk), 1)
            tok_ok = step * bk + iota((bk, d), 0) < kv_end  # [bk, d]: slots some row may see
            plgpu.barrier_wait(k_bar.at[slot])
            if not p.direct:
                convert(k_ring, slot, tok_ok, sk_ring)
            s = qk(slot) * (scale * LOG2E)  # the QK wgmmas have completed: terms are free
            mask = (kv_pos <= q_pos) & row_ok
            s = jnp.where(mask, s, mask_value)
            m_next = jnp.maximum(m, s.max(axis=1))
            corr = jnp.exp2(m - m_next)
            probs = jnp.where(mask, jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0])), 0.0)
            l_sum = l_sum * corr + probs.sum(axis=1)
            o = o * lax.broadcast_in_dim(corr, o.shape, [0])
            plgpu.barrier_wait(v_bar.at[slot])
            if p.direct:
                @pl.when((step + 1) * bk > kv_end)  # the tail step: V past the end may be NaN
                def _():
                    v_ring[slot] = jnp.where(tok_ok, v_ring[slot], jnp.zeros((bk, d), v_ring.dtype))
                    plgpu.commit_smem()
            else:
                convert(v_ring, slot, tok_ok, sv_ring)
            o = pv(o, probs, slot)

            @pl.when(i + stages < count)
            def _():
                issue(step + stages, slot)

            return o, m_next, l_sum

        init = (layout(jnp.zeros((ROWS, d), jnp.float32), None),
                layout(jnp.full((ROWS,), mask_value, jnp.float32), 1),
                layout(jnp.zeros((ROWS,), jnp.float32), 1))
        return lax.fori_loop(0, count, step_body, init)

    o, m, l_sum = pl.run_scoped(attend, *_main_buffers(p))

    dst = (b, h, rb) if p.splits == 1 else (b, h, split, rb)

    def write(o_smem, m_smem, l_smem):  # reuses the shared memory the loop's buffers held
        if p.splits == 1:
            o_ref, = outs
            denom = jnp.where(l_sum == 0.0, 1.0, l_sum)
            o_smem[...] = (o / lax.broadcast_in_dim(denom, o.shape, [0])).astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[dst])
        else:
            o_ref, m_ref, l_ref = outs
            o_smem[...] = o
            m_smem[...] = m
            l_smem[...] = l_sum
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[dst])
            plgpu.copy_smem_to_gmem(m_smem, m_ref.at[dst])
            plgpu.copy_smem_to_gmem(l_smem, l_ref.at[dst])
        plgpu.wait_smem_to_gmem(0)

    o_dtype = p.q_dtype if p.splits == 1 else jnp.float32
    pl.run_scoped(write, _swizzled((ROWS, d), o_dtype), plgpu.SMEM((ROWS,), jnp.float32),
                  plgpu.SMEM((ROWS,), jnp.float32))


def _main_buffers(p: Plan) -> tuple:
    """The loop's shared memory: query terms, the K/V rings, the bf16 term tile (staged
    pages), the scale rings (quantised pages); None where the plan has none."""
    bf16, d, bk, s = jnp.bfloat16, p.head_dim, p.block_k, p.stages
    ring_dtype = bf16 if p.direct else p.kv_dtype
    terms = None if p.direct else _swizzled((p.nk, bk, d), bf16)
    scales = (plgpu.SMEM((s, bk), jnp.float32),) * 2 if p.quantized else (None, None)
    return (_swizzled((p.nq, ROWS, d), bf16), _swizzled((s, bk, d), ring_dtype), _swizzled((s, bk, d), ring_dtype),
            terms, *scales)


def _build(plan: Plan, *, batch: int, num_kv_heads: int, row_blocks: int, num_blocks: int, scale: float,
           interpret: bool, mask_value: float):
    """The ``plgpu.kernel`` callable for ``plan``."""
    p, d, s = plan, plan.head_dim, plan.stages
    out_dtype = p.q_dtype
    if p.splits == 1:
        out_type = jax.ShapeDtypeStruct((batch, num_kv_heads, row_blocks, ROWS, d), out_dtype)
    else:
        part = (batch, num_kv_heads, p.splits, row_blocks, ROWS)
        out_type = (jax.ShapeDtypeStruct((*part, d), jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32),
                    jax.ShapeDtypeStruct(part, jnp.float32))
    arrivals = p.bps + (1 if p.quantized else 0)
    scratch = (
        plgpu.Barrier(num_arrivals=p.nq),
        plgpu.Barrier(num_arrivals=arrivals, num_barriers=s),
        plgpu.Barrier(num_arrivals=arrivals, num_barriers=s),
    )
    kernel = functools.partial(_kernel, plan=p, interpret=interpret, scale=scale, num_kv_heads=num_kv_heads,
                               num_blocks=num_blocks, mask_value=mask_value)
    kwargs = dict(grid=(batch, num_kv_heads, row_blocks, p.splits), grid_names=("b", "h", "r", "s"))
    if interpret:
        kwargs["interpret"] = interpret_params()
    return plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch, **kwargs)


def _rows(q: jax.Array, num_kv_heads: int, padded_rows: int) -> jax.Array:
    """[B, T, Hq, D] -> [B, Hkv, padded_rows, D], row r = t * group + g, zero padding rows."""
    b, t, hq, d = q.shape
    group = hq // num_kv_heads
    q = q.reshape(b, t, num_kv_heads, group, d).transpose(0, 2, 1, 3, 4).reshape(b, num_kv_heads, t * group, d)
    return jnp.pad(q, ((0, 0), (0, 0), (0, padded_rows - t * group), (0, 0)))


def _row_scales(scales: jax.Array, block_tables: jax.Array, layer, width: int) -> jax.Array:
    """Per-token scales of every row's table, [B, Hkv, width * bs] fp32: the rows' scales only
    (2 bytes per token and head), read by the kernel one step at a time beside the values."""
    from paged_jax.attention.reference import gather_blocks  # the paged gather the oracle uses

    if scales.dtype == jnp.uint16:
        scales = lax.bitcast_convert_type(scales, jnp.bfloat16)
    g = gather_blocks(scales, jnp.clip(block_tables, 0, scales.shape[-2] - 1), layer)  # [Hkv, B, W, bs]
    g = jnp.swapaxes(g, 0, 1).astype(jnp.float32)
    return g.reshape(g.shape[0], g.shape[1], width * g.shape[-1])


@functools.partial(jax.jit, static_argnames=("scale", "blocks_per_step", "num_splits", "num_stages", "interpret",
                                             "mask_value"))
def _paged_attention(q, k_pages, v_pages, block_tables, lengths, q_lens, layer, k_scales, v_scales, *, scale,
                     blocks_per_step, num_splits, num_stages, interpret, mask_value):
    b, t, hq, d = q.shape
    hkv, n, bs, _ = k_pages.shape[-4:]
    group = hq // hkv
    quantized = k_scales is not None
    plan = Plan(q_dtype=q.dtype, kv_dtype=k_pages.dtype, head_dim=d, block_size=bs,
                blocks_per_step=blocks_per_step, num_stages=num_stages, num_splits=num_splits, group=group,
                quantized=quantized)
    row_blocks = pl.cdiv(t * group, ROWS)
    width = pl.cdiv(block_tables.shape[1], blocks_per_step) * blocks_per_step
    tables = jnp.pad(block_tables, ((0, 0), (0, width - block_tables.shape[1])), constant_values=-1)
    lengths = jnp.clip(lengths, 0, block_tables.shape[1] * bs)
    q_lens = jnp.clip(q_lens, 0, jnp.minimum(t, lengths))
    q_terms = jnp.stack(split_terms(_rows(q, hkv, row_blocks * ROWS), plan.nq))  # [nq, B, Hkv, R, D] bf16
    k_flat, layer_index = flat_pages(k_pages, layer)
    v_flat, _ = flat_pages(v_pages, layer)
    operands = [lengths, q_lens, layer_index, tables, q_terms, k_flat, v_flat]
    if quantized:
        operands += [_row_scales(x, tables, layer, width) for x in (k_scales, v_scales)]
    call = _build(plan, batch=b, num_kv_heads=hkv, row_blocks=row_blocks, num_blocks=n, scale=scale,
                  interpret=interpret, mask_value=mask_value)
    out = call(*operands)
    if num_splits > 1:
        o, m, l_sum = out  # [B, Hkv, S, RB, 64, (D)]
        out = combine_splits(jnp.moveaxis(o, 2, 3), jnp.moveaxis(m, 2, 3), jnp.moveaxis(l_sum, 2, 3))
    out = out.reshape(b, hkv, row_blocks * ROWS, d)[:, :, : t * group].astype(q.dtype)
    out = out.reshape(b, hkv, t, group, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)
    return out


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    q_lens: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    per_channel_scales: bool = False,
    blocks_per_step: int | None = None,
    num_splits: int = 1,
    num_stages: int | None = None,
    interpret: bool = False,
    mask_value: float = DEFAULT_MASK_VALUE,
) -> jax.Array:
    """Paged causal attention of ``q`` [B, T, Hq, D] (T = 1: decode) on Hopper -> [B, T, Hq, D].

    Args as ``paged_jax.attention.contract`` (validated by the caller) plus:
      k_scales, v_scales: per-token scales of int8 / float8_e4m3fn pages ([.., N, bs],
        bfloat16 or its uint16 bits); per-channel scales are refused.
      blocks_per_step: pages per pipeline step; blocks_per_step * block_size must be a
        multiple of 64 in [64, 256]. Default: 64 tokens.
      num_splits: split-K programs per row block (combined in XLA); 1 normalises in-kernel.
      num_stages: depth of the shared-memory ring (copies of num_stages - 1 steps in flight
        behind the one computed). Default: the deepest of 3, 2, 1 that fits 227 KB.
      interpret: run in Mosaic GPU interpret mode (CPU).

    Raises ValueError for shapes, dtypes or tilings it does not take (head_dim not in
    {64, 128, 256}, shared memory over 227 KB, per-channel scales, ...).
    """
    if plgpu is None:
        raise ImportError(f"mosaic_gpu needs jax's Mosaic GPU Pallas API ({_PLGPU_ERROR})")
    check_call(q, k_pages, v_pages, k_scales, v_scales, per_channel_scales)
    bs = k_pages.shape[-2]
    if blocks_per_step is None:
        blocks_per_step = default_blocks_per_step(bs)
    if not is_pow2(blocks_per_step):
        raise ValueError(f"blocks_per_step={blocks_per_step} must be a power of two")
    hq, hkv = q.shape[2], k_pages.shape[-4]
    fields = dict(q_dtype=q.dtype, kv_dtype=k_pages.dtype, head_dim=q.shape[-1], block_size=bs,
                  blocks_per_step=blocks_per_step, num_splits=num_splits, group=hq // hkv,
                  quantized=k_scales is not None)
    if num_stages is None:
        num_stages = default_num_stages(**fields)
    plan = Plan(**fields, num_stages=num_stages)
    check_plan(plan)
    if layer is not None and not isinstance(layer, int):
        layer = jnp.asarray(layer, jnp.int32)
    return _paged_attention(
        q, k_pages, v_pages, jnp.asarray(block_tables, jnp.int32), jnp.asarray(lengths, jnp.int32),
        jnp.asarray(q_lens, jnp.int32), layer, k_scales, v_scales,
        scale=float(q.shape[-1] ** -0.5 if scale is None else scale), blocks_per_step=blocks_per_step,
        num_splits=num_splits, num_stages=num_stages, interpret=interpret, mask_value=mask_value)


def lowering_text(*args, **kwargs) -> str:
    """The StableHLO text of ``paged_attention(*args, **kwargs)`` lowered for CUDA (sm_90a)
    by ``jax.export``; needs no GPU. ``args`` may be ``jax.ShapeDtypeStruct``s."""
    fn = functools.partial(paged_attention, **kwargs)
    return jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()


def smem_bytes(**plan_fields) -> int:
    """Shared memory of the tiling ``Plan(**plan_fields)`` (tests, the study)."""
    return Plan(**plan_fields).smem_bytes()


__all__ = ["Plan", "check_plan", "interpret_params", "lowering_text", "paged_attention", "smem_bytes",
           "split_terms"]
