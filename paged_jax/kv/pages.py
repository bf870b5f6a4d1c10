"""The KV page store: everything stored per physical block, as one pytree of arrays.

Layout. ``KVPages.k`` and ``KVPages.v`` are ``[num_layers, num_kv_heads, num_blocks,
block_size, head_dim]``. One layer's slice ``[num_kv_heads, num_blocks, block_size,
head_dim]`` is the layout the Pallas kernel reads: one (kv head, block) pair is a
contiguous ``block_size x head_dim`` tile, and the kv-head axis stays in front so that
tensor parallelism can shard it without touching the block axis.

"A block" is every leaf's slice at the block axis. Every leaf shares the leading axes
``[(L,) Hkv, N]`` and may differ after them: ``[bs, D]`` for K and V, ``[bs]`` (one
scale per slot) or ``[D]`` (one per channel) for quantised pages' scales. So the block
axis is the third axis of a whole store's leaves and the second of one layer's
(``block_axis``); all block helpers below (copy, read, write, poison) tree-map over
leaves with that convention and accept any such pytree, not just ``KVPages``, so
copy-on-write, swap and poisoning carry whatever a block holds, and every helper works
on the whole store as well as on a single layer.

Every function is pure and jittable. Indices that must not be written are sent out of
bounds and dropped (``mode="drop"``), never clipped or set to -1 (a -1 index would wrap
to the last element), so that with the store donated XLA updates it in place.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from paged_jax.cache.sentinels import NO_BLOCK
from paged_jax.dtypes import float_dtype
from paged_jax.kv import quant

BLOCK_AXIS = -3  # block axis of K and V, counted from the end (scales: see block_axis)
OFFSET_AXIS = -2  # in-block token offset axis of K and V


def block_axis(pages) -> int:
    """The block axis of every leaf of ``pages``, counted from the front: K's rank - 3
    (2 for a store ``[L, Hkv, N, bs, D]``, 1 for one layer)."""
    return jax.tree.leaves(pages)[0].ndim + BLOCK_AXIS

@struct.dataclass
class KVPages:
    """K and V pages of every layer (or of one layer: drop the leading axis).

    Quantised formats (``kv.quant``) store int8 or float8 values and add the scale
    leaves (bfloat16, held as uint16 bits: ``quant.scale_bits``): ``[L, Hkv, N, bs]``
    per token or ``[L, Hkv, N, D]`` per channel,
    the same leading axes as K and V so the helpers carry scales with the values.
    ``kv_format`` (static: part of the treedef) names the format.
    """

    k: jax.Array  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]; float or quantised
    v: jax.Array  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]; float or quantised
    k_scale: jax.Array | None = None  # bf16 bits (uint16) [L, Hkv, N, bs] or [L, Hkv, N, D]; None: float pages
    v_scale: jax.Array | None = None  # like k_scale
    kv_format: str = struct.field(pytree_node=False, default="auto")
    # "bfloat16" / "float16": k and v hold that float's uint16 bits (``init_pages``' default
    # for 16-bit floats, see there); None: k and v are their own dtype.
    bits_of: str | None = struct.field(pytree_node=False, default=None)

    BLOCK_AXIS: ClassVar[int] = BLOCK_AXIS

    @property
    def format(self) -> quant.KVFormat:
        return quant.kv_format(self.kv_format)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[BLOCK_AXIS]

    @property
    def block_size(self) -> int:
        return self.k.shape[OFFSET_AXIS]

    @property
    def num_layers(self) -> int:
        """Layers in the store; raises on a single-layer slice."""
        if self.k.ndim != 5:
            raise ValueError(f"a single-layer KVPages (k.shape={self.k.shape}) has no layer axis")
        return self.k.shape[0]

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the values K and V hold (``bits_of`` when they are stored as bits)."""
        return jnp.dtype(self.bits_of) if self.bits_of else self.k.dtype

    def values(self, x: jax.Array) -> jax.Array:
        """``x`` (a gathered tile of ``k`` or ``v``, or the whole leaf) as the values it holds:
        a free bitcast of stored bits to ``bits_of``; unchanged otherwise."""
        if self.bits_of and not jnp.issubdtype(x.dtype, jnp.floating):
            return jax.lax.bitcast_convert_type(x, jnp.dtype(self.bits_of))
        return x

    def stored(self, x: jax.Array) -> jax.Array:
        """Values ``x`` (any float) as ``k``/``v`` store them: cast to ``dtype``, then its bits
        when the pages hold bits (the inverse of ``values``)."""
        x = jnp.asarray(x)
        if self.bits_of and not jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(self.k.dtype)  # already bits (e.g. from read_blocks)
        x = x.astype(self.dtype)
        return jax.lax.bitcast_convert_type(x, self.k.dtype) if self.bits_of else x


def init_pages(
    num_layers: int,
    num_kv_heads: int,
    num_blocks: int,
    block_size: int,
    head_dim: int,
    dtype: Any = jnp.float32,
    kv_cache_dtype: str = "auto",
) -> KVPages:
    """A zero-filled store: ``k, v: [num_layers, num_kv_heads, num_blocks, block_size,
    head_dim]`` in ``dtype`` (the model's) or in ``kv_cache_dtype``'s storage dtype, with
    zero bfloat16 scales when it is quantised (``kv.quant`` lists the formats).

    16-bit float values (bfloat16, float16) are stored as their uint16 bits (``bits_of``):
    XLA:CPU has no 16-bit float scatter, and a bitcast between the float pool and its bits
    inside the layer scan is materialised (a whole-pool copy per layer per step: a
    SmolLM2-shaped decode step at 64 rows took 4.1 s with bf16 pages vs 0.46 s with f32
    ones, 2-core CPU, 2026-12-03). As bits, every scatter, gather and copy is an integer
    move and only gathered tiles are bitcast back (``KVPages.values``)."""
    dtype = float_dtype(dtype)
    fmt = quant.kv_format(kv_cache_dtype)
    shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
    for name, value in zip(("num_layers", "num_kv_heads", "num_blocks", "block_size", "head_dim"), shape):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive int")
    if not fmt.quantized:
        dtype = quant.storage_dtype(fmt, dtype)
        if dtype.itemsize == 2:
            return KVPages(k=jnp.zeros(shape, jnp.uint16), v=jnp.zeros(shape, jnp.uint16), bits_of=dtype.name)
        return KVPages(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
    scale_shape = shape[:3] + fmt.scale_shape(block_size, head_dim)
    return KVPages(
        k=jnp.zeros(shape, fmt.storage),
        v=jnp.zeros(shape, fmt.storage),
        k_scale=jnp.zeros(scale_shape, quant.SCALE_STORAGE),
        v_scale=jnp.zeros(scale_shape, quant.SCALE_STORAGE),
        kv_format=fmt.name,
    )


# --------------------------------------------------------------------------- sizes


def bytes_per_block(pages) -> int:
    """Bytes of one block over every leaf and layer: what the pool spends per block and
    what a swap moves (K + V, and scales once pages are quantised).

    The one place block bytes are computed. ``pages`` is any page-store pytree (every
    leaf ``[..., N, bs, F]``), concrete or abstract (``jax.eval_shape`` of an init).
    """
    leaves = jax.tree.leaves(pages)
    num_blocks = leaves[0].shape[BLOCK_AXIS]
    total = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves)
    return total // num_blocks


def bytes_per_token(pages) -> int:
    """Bytes per token slot over every leaf and layer (``bytes_per_block / block_size``)."""
    return bytes_per_block(pages) // jax.tree.leaves(pages)[0].shape[OFFSET_AXIS]


# --------------------------------------------------------------------------- token writes


def _bits(x: jax.Array) -> jax.Array:
    """Sub-fp32 floats (bf16, f16, fp8) as unsigned integers of their width (a free
    bitcast); anything else unchanged. Scatters and gathers go through this: XLA:CPU
    has neither for those floats and converts the *whole operand* to f32 (or f16) and
    back around each one, i.e. the pool converted per layer per step."""
    if _narrow_float(x):
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * jnp.dtype(x.dtype).itemsize}"))
    return x


def _narrow_float(x: jax.Array) -> bool:
    """Whether ``_bits`` reinterprets ``x`` (sub-fp32 floats)."""
    dtype = jnp.dtype(x.dtype)
    return bool(jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4)


def _set(leaf: jax.Array, index, values: jax.Array) -> jax.Array:
    """``leaf.at[index].set(values cast to leaf's dtype, mode="drop")`` through ``_bits``
    (``values`` already in the leaf's stored form: see ``KVPages.stored``)."""
    out = _bits(leaf).at[index].set(_bits(values.astype(leaf.dtype)), mode="drop")
    return jax.lax.bitcast_convert_type(out, leaf.dtype) if out.dtype != leaf.dtype else out


def _get(leaf: jax.Array, index) -> jax.Array:
    """``leaf[index]`` through ``_bits`` (see there)."""
    out = _bits(leaf)[index]
    return jax.lax.bitcast_convert_type(out, leaf.dtype) if out.dtype != leaf.dtype else out


def _drop_index(ids: jax.Array, valid: jax.Array, bound: int) -> jax.Array:
    """``ids`` where ``valid``, else ``bound`` (out of range: the scatter drops it)."""
    return jnp.where(valid, ids, bound).astype(jnp.int32)


def _pad_single(idx: jax.Array, vals: jax.Array, bound: int, axis: int) -> tuple[jax.Array, jax.Array]:
    """Give a one-index scatter a second, dropped index.

    XLA rewrites a scatter with a single index into a dynamic-update-slice guarded by a
    select, which on a donated pool is *not* done in place: a decode step at batch 1 then
    copied the whole KV store (measured 276 ms vs 5 ms at batch 2 on a 370 MB store).
    Two indices keep it a scatter. ``vals`` gets a zero entry along ``axis``.
    """
    if idx.shape[0] != 1:
        return idx, vals
    idx = jnp.concatenate([idx, jnp.full((1,), bound, idx.dtype)])
    return idx, jnp.concatenate([vals, jnp.zeros_like(vals)], axis=axis)


def write_tokens(
    pages: KVPages,
    slot_mapping: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    *,
    layer: int | jax.Array | None = None,
) -> KVPages:
    """Scatter new tokens' K and V into their physical slots, quantising on write.

    Args:
      pages: the whole store (leaves ``[L, Hkv, N, bs, D]``) or one layer
        (``[Hkv, N, bs, D]``), in any ``kv.quant`` format.
      slot_mapping: int32 of any shape ``S`` (e.g. ``[B, T]``): ``block * block_size +
        offset`` per token, ``NO_SLOT`` (-1) for padding tokens, which are dropped. Slots
        must be distinct among non-padding tokens. The per-channel format needs
        ``[B, T]`` with each row's real tokens consecutive, in consecutive slots (an
        append).
      k_new, v_new: ``[*S, Hkv, D]`` when writing one layer (``layer`` given, or a
        single-layer store), ``[L, *S, Hkv, D]`` when writing every layer of the store at
        once. Cast to the page dtype, or quantised (per-token formats: each token's scale
        written beside it; per channel: ``_write_channel``).
      layer: layer index into a whole store, a Python int or a traced int32 scalar (the
        model's layer scan); writes only that layer, in place.

    Returns the updated store (same shapes and dtypes).
    """
    fmt = pages.format
    if fmt.per_channel:
        return _write_channel(pages, slot_mapping, k_new, v_new, layer)
    num_slots = pages.num_blocks * pages.block_size
    slots = slot_mapping.reshape(-1)
    idx = _drop_index(slots, (slots >= 0) & (slots < num_slots), num_slots)

    lead = block_axis(pages) - 1  # the kv-head axis: [(L,) Hkv, N, bs, D] values, [(L,) Hkv, N, bs] scales

    def scatter(leaf, new):
        heads, feat = leaf.shape[lead], leaf.shape[lead + 3:]
        flat = leaf.reshape(*leaf.shape[:lead], heads, num_slots, *feat)
        rest = (slice(None),) * len(feat)
        if layer is not None:
            # An int and index arrays split by a slice: NumPy puts the indexed axes
            # first, so the update is [M, Hkv, (D)], the natural layout of k_new.
            ix, vals = _pad_single(idx, new.reshape(-1, heads, *feat), num_slots, axis=0)
            if heads == 1 and not _narrow_float(leaf):  # no reshape around a size-1 axis (_flat_blocks)
                bs = leaf.shape[lead + 2]
                return _set(leaf, (layer, slice(None), ix // bs, ix % bs, *rest), vals)
            out = _set(flat, (layer, slice(None), ix, *rest), vals)
        else:
            vals = new.reshape(*leaf.shape[:lead], -1, heads, *feat)  # [(L,) M, Hkv, (D)]
            vals = jnp.moveaxis(vals, lead, lead + 1)  # [(L,) Hkv, M, (D)]
            ix, vals = _pad_single(idx, vals, num_slots, axis=lead + 1)
            out = _set(flat, (Ellipsis, ix, *rest), vals)
        return out.reshape(leaf.shape)

    if not fmt.quantized:
        return pages.replace(k=scatter(pages.k, pages.stored(k_new)), v=scatter(pages.v, pages.stored(v_new)))
    kq, ks = quant.quantize_tokens(fmt, k_new)
    vq, vs = quant.quantize_tokens(fmt, v_new)
    ks, vs = quant.scale_bits(ks), quant.scale_bits(vs)
    return pages.replace(
        k=scatter(pages.k, kq), v=scatter(pages.v, vq), k_scale=scatter(pages.k_scale, ks), v_scale=scatter(pages.v_scale, vs)
    )


def _write_channel(pages: KVPages, slot_mapping, k_new, v_new, layer) -> KVPages:
    """``write_tokens`` for per-channel scales: rewrite every block a row writes into.

    For row b, the blocks its tokens land in are visited by their first new token (at
    most ``(T + bs - 2) // bs + 1`` per row). Each block's channel scale becomes the max
    of its old scale (0 if this write starts it at offset 0) and its new tokens'
    ``|x| / 127``; the tokens already there are requantised to that scale, the new ones
    quantised with it, and the whole block (values and scale) is scattered back.
    """
    if slot_mapping.ndim != 2:
        raise ValueError(f"kv_cache_dtype='int8_channel' writes need slot_mapping [B, T], got shape {slot_mapping.shape}")
    fmt = pages.format
    single = pages.k.ndim == 4
    if single:  # one layer's store: a store of one layer
        pages, layer = jax.tree.map(lambda x: x[None], pages), 0
    if layer is None:  # every layer at once: one layer after another (k_new [L, B, T, Hkv, D])
        for i in range(pages.k.shape[0]):
            pages = _write_channel(pages, slot_mapping, k_new[i], v_new[i], i)
        return pages
    b, t = slot_mapping.shape
    bs, n = pages.block_size, pages.num_blocks
    slots = slot_mapping.astype(jnp.int32)
    rows = jnp.arange(b)[:, None]
    first = jnp.argmax(slots >= 0, axis=1)[:, None]  # [B, 1] a row's first real token
    off0 = jnp.maximum(slots[rows, first], 0) % bs  # [B, 1] its offset in its block
    c = (t + bs - 2) // bs + 1
    t_first = first + jnp.maximum(jnp.arange(c)[None, :] * bs - off0, 0)  # [B, C] first new token per block
    first_slot = slots[rows, jnp.clip(t_first, 0, t - 1)]
    visit = (t_first < t) & (first_slot >= 0) & (first_slot < n * bs)
    blocks = jnp.where(visit, first_slot // bs, n)  # [B, C]; n: dropped
    start = jnp.where(visit, first_slot % bs, bs)[..., None]  # [B, C, 1]: offset of the first new token
    offsets = jnp.arange(bs)[None, None, :]
    token = t_first[..., None] + offsets - start  # [B, C, bs]: which new token lands at each offset
    safe_token = jnp.clip(token, 0, t - 1)
    is_new = visit[..., None] & (token >= 0) & (token < t) & (slots[rows[..., None], safe_token] >= 0)
    is_old = offsets < start  # tokens the block already held (start = bs for unvisited: masked anyway)
    ids = jnp.clip(blocks, 0, n - 1).reshape(-1)
    flat_blocks = blocks.reshape(-1)

    def rewrite(values, scales, new):
        # values [L, Hkv, N, bs, D] storage; scales [L, Hkv, N, D]; new [B, T, Hkv, D]
        old_q = _get(values, (layer, slice(None), ids))  # [M, Hkv, bs, D]
        old_s = _get(scales, (layer, slice(None), ids))[..., None, :]  # [M, Hkv, 1, D]
        x = new[rows[..., None], safe_token]  # [B, C, bs, Hkv, D]
        x = jnp.moveaxis(x.reshape(-1, bs, *x.shape[-2:]), 1, 2).astype(jnp.float32)  # [M, Hkv, bs, D]
        new_m = is_new.reshape(-1, 1, bs, 1)
        old_m = is_old.reshape(-1, 1, bs, 1)
        base = jnp.where(start.reshape(-1, 1, 1, 1) > 0, quant.scale_values(old_s), 0.0)
        fresh = quant.scale_values(quant.channel_scale(fmt, jnp.where(new_m, x, 0.0)))[..., None, :]
        scale = jnp.maximum(base, fresh)  # [M, Hkv, 1, D] f32, bf16-exact
        old_x = old_q.astype(jnp.float32) * quant.scale_values(old_s)
        tile = jnp.where(new_m, x, jnp.where(old_m, old_x, 0.0))
        tile_q = quant.encode(fmt, tile, scale)
        ix, tile_q = _pad_single(flat_blocks, tile_q, n, axis=0)
        _, scale = _pad_single(flat_blocks, quant.scale_bits(scale[..., 0, :]), n, axis=0)
        values = _set(values, (layer, slice(None), ix), tile_q)
        scales = _set(scales, (layer, slice(None), ix), scale)
        return values, scales

    k, k_scale = rewrite(pages.k, pages.k_scale, k_new)
    v, v_scale = rewrite(pages.v, pages.v_scale, v_new)
    out = pages.replace(k=k, v=v, k_scale=k_scale, v_scale=v_scale)
    return jax.tree.map(lambda x: x[0], out) if single else out


# --------------------------------------------------------------------------- whole blocks


def _flat_blocks(leaf: jax.Array, axis: int) -> jax.Array:
    """``leaf`` with everything after the block ``axis`` in one axis (a free reshape):
    one gather/scatter shape for values and scales. Not with one kv head (MQA, or one per
    device under tensor parallelism) and 32-bit or integer leaves: around that size-1
    axis XLA:CPU gave the reshaped pool a permuted layout and copied the whole pool
    before and after the layer loop on every step; unflattened it does not (measured;
    bf16/fp8 values keep the flat view, which copies least there)."""
    if leaf.shape[axis - 1 : axis] == (1,) and not _narrow_float(leaf):
        return leaf
    return leaf.reshape(*leaf.shape[: axis + 1], -1)


def _take_blocks(leaf: jax.Array, ids: jax.Array, axis: int) -> jax.Array:
    """``leaf`` at blocks ``ids`` of ``axis``, ids clipped in range (callers mask invalid ones)."""
    safe = jnp.clip(ids, 0, leaf.shape[axis] - 1)
    out = jnp.take(_bits(_flat_blocks(leaf, axis)), safe, axis=axis)
    out = jax.lax.bitcast_convert_type(out, leaf.dtype) if out.dtype != leaf.dtype else out
    return out.reshape(*out.shape[: axis + 1], *leaf.shape[axis + 1 :])


def _put_blocks(leaf: jax.Array, ids: jax.Array, data: jax.Array, axis: int) -> jax.Array:
    """``leaf`` with blocks ``ids`` of ``axis`` set to ``data``; ids outside ``[0, N)``
    (NO_BLOCK) are dropped."""
    n = leaf.shape[axis]
    idx = _drop_index(ids, (ids >= 0) & (ids < n), n)
    idx, data = _pad_single(idx, _flat_blocks(jnp.asarray(data).astype(leaf.dtype), axis), n, axis=axis)
    out = _set(_flat_blocks(leaf, axis), (*(slice(None),) * axis, idx), data)
    return out.reshape(leaf.shape)


def _num_blocks(pages) -> int:
    return jax.tree.leaves(pages)[0].shape[BLOCK_AXIS]


def copy_blocks(pages: KVPages, src: jax.Array, dst: jax.Array) -> KVPages:
    """Copy whole blocks ``src[i] -> dst[i]`` in every leaf and layer (copy-on-write).

    One gather and one scatter per leaf over all layers at once. Pairs with either id
    ``NO_BLOCK`` (or out of range) are skipped. ``dst`` ids must be distinct and must not
    appear in ``src`` (the block manager guarantees both: a destination is a freshly
    allocated block).

    Args:
      src, dst: int32[M].
    """
    n, axis = _num_blocks(pages), block_axis(pages)
    valid = (src >= 0) & (src < n) & (dst >= 0) & (dst < n)
    dst = jnp.where(valid, dst, NO_BLOCK)

    def copy(pages):
        return jax.tree.map(lambda leaf: _put_blocks(leaf, dst, _take_blocks(leaf, src, axis), axis), pages)

    # Most steps copy nothing, but the gather reads M blocks of every layer whatever their
    # ids (64 rows of SmolLM2: 47 MB, ~16 ms of a 300 ms fp32 decode step on 2 cores,
    # profiled 2026-12-04); the cond skips it, and the pages pass through it in place.
    return jax.lax.cond(jnp.any(valid), copy, lambda pages: pages, pages)


def read_blocks(pages: KVPages, ids: jax.Array) -> KVPages:
    """Gather whole blocks, e.g. to swap them out to host memory.

    Args:
      ids: int32[M] block ids. ``NO_BLOCK`` entries read block 0 (padding: ignore them).

    Returns a ``KVPages`` whose every leaf has ``M`` in place of ``num_blocks`` at the
    block axis (``k: [L, Hkv, M, bs, D]``): everything stored for those blocks, scales
    included once they exist. Pass it (or a host copy, ``jax.device_get``) back to
    ``write_blocks`` to restore the blocks, possibly under other ids.
    """
    axis = block_axis(pages)
    return jax.tree.map(lambda leaf: _take_blocks(leaf, ids, axis), pages)


def write_blocks(pages: KVPages, ids: jax.Array, data: KVPages) -> KVPages:
    """Scatter whole blocks, e.g. to swap them back in from host memory.

    Args:
      ids: int32[M] destination block ids, distinct; ``NO_BLOCK`` entries are skipped.
      data: what ``read_blocks`` returned for ``M`` blocks (same tree structure, leaves
        ``[..., M, bs, F]``); cast to the page dtype.

    Returns the store with ``block ids[i] := data block i`` in every leaf and layer.
    """
    axis = block_axis(pages)
    data = jax.tree.map(_as_stored, data, pages, is_leaf=_is_pages)
    return jax.tree.map(lambda leaf, d: _put_blocks(leaf, ids, d, axis), pages, data)


def _is_pages(x) -> bool:
    return isinstance(x, KVPages)


def _as_stored(data, pages):
    """``data`` blocks (floats or stored bits) in ``pages``' stored form (a KVPages node)."""
    if isinstance(pages, KVPages) and pages.bits_of and isinstance(data, KVPages):
        return data.replace(k=pages.stored(data.k), v=pages.stored(data.v), bits_of=pages.bits_of)
    return data


def poison_free_blocks(pages: KVPages, free_mask: jax.Array, value: float = float("nan")) -> KVPages:
    """Fill every block with ``free_mask[block]`` True with ``value`` (NaN by default):
    every float leaf (values, and the scales of quantised pages, so an int8 block reads
    as NaN too).

    For tests: attention that reads a block it does not own then returns NaN instead of a
    plausible wrong number. O(pool) per call: never on the hot path.

    Args:
      free_mask: bool[num_blocks].
    """

    axis = block_axis(pages)

    def poison_node(node):
        if isinstance(node, KVPages) and node.bits_of:  # stored bits: the bits of a NaN of bits_of
            nan = node.stored(jnp.asarray(value, jnp.float32))
            mask = free_mask.reshape((-1,) + (1,) * (node.k.ndim - axis - 1))
            return node.replace(k=jnp.where(mask, nan, node.k), v=jnp.where(mask, nan, node.v))
        return jax.tree.map(poison, node)

    def poison(leaf):
        mask = free_mask.reshape((-1,) + (1,) * (leaf.ndim - axis - 1))  # over [.., N, ...]
        if leaf.dtype == quant.SCALE_STORAGE:  # stored scales: the bits of a bf16 NaN
            return jnp.where(mask, quant.scale_bits(jnp.asarray(value)), leaf)
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf  # int8 values cannot hold NaN: their scales carry the poison
        return jnp.where(mask, jnp.asarray(value, leaf.dtype), leaf)

    return jax.tree.map(poison_node, pages, is_leaf=_is_pages)
