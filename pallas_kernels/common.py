"""What the decode and chunk kernels share: validation, the page layout they read, and the
online-softmax arithmetic.

Page layout.  The caller's pages are one layer's ``[num_kv_heads, num_blocks, block_size,
head_dim]`` or every layer's ``[num_layers, num_kv_heads, num_blocks, block_size,
head_dim]``.  Both reach the kernel as one flat ``[num_layers * num_kv_heads * num_blocks,
block_size, head_dim]`` array (a free reshape of a contiguous array; one layer counts as
``num_layers = 1``) plus the layer as an int32[1] operand, and the kernel reads block
``b`` of kv head ``h`` at flat index ``(layer * num_kv_heads + h) * num_blocks + b``.  So
the layer may be a traced value (a model scanning over its layers): a BlockSpec index map
cannot depend on an operand under the Triton backend, and slicing ``pages[layer]`` before
the call would make XLA copy that layer's whole pool, because a slice cannot fuse into a
custom call's operand.  The Triton lowering switches to 64-bit offsets for arrays over
4 GiB, so the flat view is safe for pools of any size.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LOG2E = math.log2(math.e)
# The smallest M/N/K of a Triton tensor-core dot: the q-row tile and the KV tile of one
# loop step must both be at least this large.
MIN_DOT_DIM = 16
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Quantised page values (read with their scales, dequantised per loaded tile).
QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64, 128)
MAX_GROUP = 64  # q heads per kv head; the [group, head_dim] f32 accumulator lives in registers
MAX_BLOCK_K = 256  # tokens per loop step (register/shared-memory budget)

# `None` marks a squeezed block dimension in every JAX we support; newer versions also
# spell it `pl.squeezed`.
SQUEEZED = getattr(pl, "squeezed", None)


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ------------------------------------------------------------------ kernel arithmetic
def _dot(a: jax.Array, b: jax.Array, *, trans_b: bool = False) -> jax.Array:
    """a @ b (or a @ b.T) with float32 accumulation.

    float32 operands ask for HIGHEST precision so that Triton uses IEEE fp32 instead of
    TF32 (its default for f32 dots); bf16/fp16 operands go to the tensor cores as they are.
    """
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    contract_b = 1 if trans_b else 0
    return lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def online_softmax_step(
    q: jax.Array,  # [rows, head_dim] q dtype
    k: jax.Array,  # [block_k, head_dim] kv dtype
    v: jax.Array,  # [block_k, head_dim] kv dtype
    mask: jax.Array,  # bool[rows, block_k] or bool[1, block_k]; True = attend
    kv_valid: jax.Array,  # bool[block_k]; True where the KV slot is visible to any row
    carry: tuple[jax.Array, jax.Array, jax.Array],  # o [rows, head_dim], m [rows], l [rows] f32
    *,
    qk_scale: float,  # softmax scale * log2(e): logits are kept in base 2
    mask_value: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One flash-attention update of (unnormalised output, running max, running sum)."""
    o_prev, m_prev, l_prev = carry
    # Slots no row may see can hold anything (stale data, other blocks, NaN): zero V there so
    # that 0 * garbage cannot appear in the p @ v product.  K needs no cleaning because its
    # logits are replaced below.
    v = jnp.where(kv_valid[:, None], v, jnp.zeros_like(v))
    s = _dot(q, k, trans_b=True) * qk_scale  # [rows, block_k] f32, base-2 logits
    s = jnp.where(mask, s, mask_value)
    m_next = jnp.maximum(m_prev, s.max(axis=-1))
    correction = jnp.exp2(m_prev - m_next)
    # Force masked probabilities to exactly 0: with a finite mask value a fully masked row
    # would otherwise get exp2(0) = 1 for every masked slot.
    p = jnp.where(mask, jnp.exp2(s - m_next[:, None]), 0.0)
    l_next = l_prev * correction + p.sum(axis=-1)
    o_next = o_prev * correction[:, None] + _dot(p.astype(v.dtype), v)
    return o_next, m_next, l_next


def load_kv(pages_ref, scales_ref, ids: jax.Array, block_k: int, head_dim: int, dtype, per_channel: bool) -> jax.Array:
    """The ``[block_k, head_dim]`` tile of blocks ``ids``, dequantised when the pages are
    (``scales_ref`` not None: ``[.., bs]`` per token or ``[.., D]`` per channel, bf16
    values or their uint16 bits, loaded for the same blocks and multiplied in f32), in
    ``dtype`` for the dot."""
    tile = pages_ref[ids]  # [blocks_per_step, bs, D]
    if scales_ref is not None:
        scales = scales_ref[ids]  # [blocks_per_step, bs] or [blocks_per_step, D]
        if scales.dtype == jnp.uint16:  # bfloat16 scales stored as their bits
            scales = lax.bitcast_convert_type(scales, jnp.bfloat16)
        scales = scales.astype(jnp.float32)
        scales = scales[:, None, :] if per_channel else scales[:, :, None]
        tile = (tile.astype(jnp.float32) * scales).astype(dtype)
    return tile.reshape(block_k, head_dim)


def split_refs(refs, quantized: bool):
    """(k_scale_ref, v_scale_ref, outputs...) from a kernel's trailing refs."""
    if quantized:
        return refs[0], refs[1], refs[2:]
    return None, None, refs


def init_carry(rows: int, head_dim: int, mask_value: float):
    """Empty online-softmax state: o = 0, m = mask_value (finite, so no inf - inf), l = 0."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), mask_value, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def split_range(num_steps_total: jax.Array, split: jax.Array, num_splits: int):
    """(first step, number of steps) of ``split`` when steps are shared evenly by splits."""
    steps_per_split = pl.cdiv(num_steps_total, num_splits)
    first = split * steps_per_split
    count = jnp.clip(num_steps_total - first, 0, steps_per_split)
    return first, count


def block_ids(
    block_tables_ref,  # [padded_blocks_per_seq] int32: this sequence's physical block ids
    step: jax.Array,
    blocks_per_step: int,
    layer: jax.Array,  # int32 scalar
    head: jax.Array,  # int32 scalar: this program's kv head
    num_kv_heads: int,
    num_blocks: int,
) -> jax.Array:
    """Flat page indices of the ``blocks_per_step`` blocks of loop step ``step``.

    Columns past a sequence's blocks may hold anything (-1, stale ids): clamped into
    ``[0, num_blocks)`` they stay inside this layer's and head's pool, and the slots they
    name are masked by length.
    """
    ids = block_tables_ref[pl.ds(step * blocks_per_step, blocks_per_step)]
    ids = jnp.clip(ids, 0, num_blocks - 1)
    return (layer * num_kv_heads + head) * num_blocks + ids


def combine_splits(
    o: jax.Array,  # [..., num_splits, rows, head_dim] f32, unnormalised
    m: jax.Array,  # [..., num_splits, rows] f32, running max (base 2)
    l_sum: jax.Array,  # [..., num_splits, rows] f32, running sum
) -> jax.Array:
    """Log-sum-exp merge of flash-decoding partials -> [..., rows, head_dim] f32.

    Empty splits have l = 0 and o = 0 and contribute nothing; a row that is empty in every
    split (length 0, or a padded query row) gets 0 rather than 0 / 0.
    """
    m_max = m.max(axis=-2, keepdims=True)
    w = jnp.exp2(m - m_max)  # [..., splits, rows]
    num = (o * w[..., None]).sum(axis=-3)
    den = (l_sum * w).sum(axis=-2)
    return num / jnp.where(den == 0.0, 1.0, den)[..., None]


def finalize(o: jax.Array, l_sum: jax.Array) -> jax.Array:
    """o / l_sum with empty rows (l_sum = 0) giving 0."""
    return o / jnp.where(l_sum == 0.0, 1.0, l_sum)[:, None]


# ---------------------------------------------------------------------- tuning defaults
def default_blocks_per_step(block_size: int, head_dim: int) -> int:
    """Blocks gathered per loop step: ~128 KV tokens (64 for head_dim 256), >= 16 tokens."""
    target = 64 if head_dim > 128 else 128
    return max(1, target // block_size, MIN_DOT_DIM // block_size)


def device_arch() -> int | None:
    """The GPU's compute capability as an int (90 for sm_90), or None off the GPU."""
    if jax.default_backend() != "gpu":
        return None
    cc = getattr(jax.devices()[0], "compute_capability", None)
    if cc is None:
        return None
    major, minor = (int(x) for x in str(cc).split(".")[:2])
    return 10 * major + minor


def default_num_splits(batch: int, num_kv_heads: int, max_len: int, num_sms: int = 132) -> int:
    """Flash-decoding splits so that batch * kv_heads * splits roughly fills the GPU.

    A split should still own a useful amount of context (>= 512 tokens), so short contexts
    stay unsplit however small the batch.
    """
    programs = max(1, batch * num_kv_heads)
    want = max(1, num_sms // programs)
    cap = max(1, max_len // 512)
    return int(min(next_pow2(want) if want > 1 else 1, next_pow2(cap) if cap > 1 else 1, 64))


# -------------------------------------------------------------------------- validation
def check_layer(k_pages, layer):
    """Validates ``layer`` against the rank of the pages; returns it as an int, an int32
    scalar array, or None.

    ``layer=None`` needs 4-D pages [num_kv_heads, num_blocks, block_size, head_dim]; a
    layer needs 5-D pages [num_layers, ...].  A Python int must lie in [0, num_layers); an
    integer scalar array (traced, e.g. a scan's layer index) cannot be checked here and is
    clamped into range by the caller.
    """
    if layer is None:
        if k_pages.ndim == 5:
            raise ValueError(
                f"k_pages of shape {k_pages.shape} is 5-D [num_layers, num_kv_heads, num_blocks, "
                "block_size, head_dim]: pass layer=i to choose the layer"
            )
        if k_pages.ndim != 4:
            raise ValueError(
                "k_pages must be [num_kv_heads, num_blocks, block_size, head_dim] (or 5-D "
                f"[num_layers, ...] with layer=i), got shape {k_pages.shape}"
            )
        return None
    is_int = isinstance(layer, (int, np.integer)) and not isinstance(layer, (bool, np.bool_))
    is_index_array = (
        isinstance(layer, (jax.Array, np.ndarray))
        and layer.shape == ()
        and jnp.issubdtype(layer.dtype, jnp.integer)
    )
    if not (is_int or is_index_array):
        raise ValueError(
            f"layer must be an int, an integer scalar array (may be traced) or None, got {layer!r}"
        )
    if k_pages.ndim != 5:
        raise ValueError(
            f"layer={layer} needs 5-D pages [num_layers, num_kv_heads, num_blocks, block_size, "
            f"head_dim], got shape {k_pages.shape}; pass layer=None for one layer's 4-D pages"
        )
    if is_int:
        num_layers = k_pages.shape[0]
        if not 0 <= layer < num_layers:
            raise ValueError(
                f"layer={layer} is out of range [0, {num_layers}) for pages of shape {k_pages.shape}"
            )
        return int(layer)
    return layer


def page_shape(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(num_kv_heads, num_blocks, block_size, head_dim) of one layer's pool, from the shape
    of 4-D pages or of 5-D layer-stacked pages."""
    return tuple(shape[-4:])


def check_common(
    q_heads: int,
    head_dim: int,
    q_dtype,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    batch: int,
    blocks_per_step: int | None,
    num_splits: int,
    num_warps: int,
    num_stages: int,
    layer,
    k_scales=None,
    v_scales=None,
    per_channel_scales: bool = False,
) -> tuple[int, int, int | jax.Array | None]:
    """Validates what both kernels share; returns (group, blocks_per_step, layer)."""
    layer = check_layer(k_pages, layer)
    if k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages and v_pages must have the same shape, got {k_pages.shape} and {v_pages.shape}"
        )
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(
            f"k_pages and v_pages must have the same dtype, got {k_pages.dtype} and {v_pages.dtype}"
        )
    num_kv_heads, _, block_size, head_dim_k = page_shape(k_pages.shape)
    if head_dim_k != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and of the pages ({head_dim_k}) differ")
    if jnp.dtype(q_dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q_dtype} is not supported; use float32, bfloat16 or float16")
    check_scales(k_pages, k_scales, v_scales, per_channel_scales)
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported; use one of {SUPPORTED_HEAD_DIMS}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size={block_size} is not supported; use one of {SUPPORTED_BLOCK_SIZES}")
    if q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    group = q_heads // num_kv_heads
    if group > MAX_GROUP:
        raise ValueError(f"{group} q heads per kv head is more than the supported {MAX_GROUP}")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be int32[batch={batch}, max_blocks_per_seq], got shape {block_tables.shape}"
        )
    if block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    if lengths.shape != (batch,) or lengths.dtype != jnp.int32:
        raise ValueError(f"lengths must be int32[{batch}], got {lengths.dtype}{list(lengths.shape)}")
    if blocks_per_step is None:
        blocks_per_step = default_blocks_per_step(block_size, head_dim)
    if not is_pow2(blocks_per_step):
        raise ValueError(f"blocks_per_step={blocks_per_step} must be a power of two")
    block_k = blocks_per_step * block_size
    if not MIN_DOT_DIM <= block_k <= MAX_BLOCK_K:
        raise ValueError(
            f"blocks_per_step * block_size = {block_k} tokens per step must be in "
            f"[{MIN_DOT_DIM}, {MAX_BLOCK_K}] (tensor-core minimum / register budget)"
        )
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be a positive int")
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps={num_warps} must be a power of two <= 16")
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    return group, blocks_per_step, layer


def check_scales(k_pages, k_scales, v_scales, per_channel: bool) -> None:
    """Float pages take no scales; int8 / float8 pages need both, shaped per token
    ``[.., N, bs]`` or, with ``per_channel``, ``[.., N, D]``. On a GPU, float8 needs
    compute capability 8.9 (Ada / Hopper) for Triton to load it."""
    dtype = jnp.dtype(k_pages.dtype)
    if dtype in SUPPORTED_DTYPES:
        if k_scales is not None or v_scales is not None:
            raise ValueError(f"k_pages of dtype {dtype} are not quantised: pass no scales")
        return
    if dtype not in QUANTIZED_DTYPES:
        raise ValueError(
            f"k_pages dtype {dtype} is not supported; use float32, bfloat16, float16, or int8 / "
            "float8_e4m3fn with scales"
        )
    if k_scales is None or v_scales is None:
        raise ValueError(f"quantised k_pages ({dtype}) need k_scales and v_scales")
    *lead, bs, d = k_pages.shape
    want = (*lead, d) if per_channel else (*lead, bs)
    if tuple(k_scales.shape) != want or tuple(v_scales.shape) != want:
        raise ValueError(
            f"scales {k_scales.shape} / {v_scales.shape} do not fit pages {k_pages.shape}: want {want} "
            f"({'per channel' if per_channel else 'per token'})"
        )
    if dtype == jnp.dtype(jnp.float8_e4m3fn) and jax.default_backend() == "gpu":
        cc = getattr(jax.devices()[0], "compute_capability", None)
        if cc is not None and tuple(int(x) for x in str(cc).split(".")) < (8, 9):
            raise ValueError(
                f"pallas kernels cannot read kv_cache_dtype fp8_e4m3 on this GPU (compute capability {cc} "
                "< 8.9); use attention_impl='xla' or kv_cache_dtype='int8'"
            )


def flat_scales(scales: jax.Array | None) -> jax.Array | None:
    """Scale leaves ``[(L,) Hkv, N, F]`` as ``[L * Hkv * N, F]``, indexed like the flat pages."""
    return None if scales is None else scales.reshape(-1, scales.shape[-1])


# ----------------------------------------------------------------------- page operands
def flat_pages(pages: jax.Array, layer) -> tuple[jax.Array, jax.Array]:
    """(pages as [num_layers * num_kv_heads * num_blocks, block_size, head_dim], the
    layer as int32[1]) for validated ``pages`` / ``layer`` (see the module doc).

    A traced layer outside [0, num_layers) is clamped, as XLA clamps a dynamic index.
    """
    block_size, head_dim = pages.shape[-2:]
    if layer is None:
        index = jnp.zeros((1,), jnp.int32)
    else:
        index = jnp.clip(jnp.asarray(layer, jnp.int32), 0, pages.shape[0] - 1).reshape(1)
    return pages.reshape(-1, block_size, head_dim), index


def whole_spec(shape: tuple[int, ...]) -> pl.BlockSpec:
    """BlockSpec handing every program the whole array (the kernel indexes it itself)."""
    return pl.BlockSpec(tuple(shape), lambda *grid: (0,) * len(shape))


def prepare_table(
    block_tables: jax.Array, lengths: jax.Array, block_size: int, blocks_per_step: int
) -> tuple[jax.Array, jax.Array]:
    """Pads the table so every loop step reads in bounds; clamps lengths to the table.

    A step reads ``blocks_per_step`` consecutive columns starting at a multiple of
    ``blocks_per_step``, so the last one may run past the table width: pad with -1 (clamped
    to a valid block in the kernel, then masked).  Lengths beyond what the table can
    describe are cut so no step ever reads past the padding.
    """
    width = block_tables.shape[1]
    padded = pl.cdiv(width, blocks_per_step) * blocks_per_step
    if padded != width:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, padded - width)), constant_values=-1)
    lengths = jnp.clip(lengths, 0, width * block_size)
    return block_tables, lengths
