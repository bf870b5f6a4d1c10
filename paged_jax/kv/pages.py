"""The KV page store: everything stored per physical block, as one pytree of arrays.

Layout. ``KVPages.k`` and ``KVPages.v`` are ``[num_layers, num_kv_heads, num_blocks,
block_size, head_dim]``. One layer's slice ``[num_kv_heads, num_blocks, block_size,
head_dim]`` is the layout the Pallas kernel reads: one (kv head, block) pair is a
contiguous ``block_size x head_dim`` tile, and the kv-head axis stays in front so that
tensor parallelism can shard it without touching the block axis.

"A block" is every leaf's slice at the block axis. Every leaf has the shape
``[..., num_blocks, block_size, F]``: the block axis is the third from last, the
in-block token offset the second from last, and ``F`` a per-token feature (``head_dim``
for K and V; a scale or a group of scales for quantised pages, which are added as
extra leaves). All block helpers below (copy, read, write, poison) tree-map over leaves with that
convention and accept any such pytree, not just ``KVPages``, so
copy-on-write, swap and poisoning carry whatever a block holds, and every helper works
on the whole store ``[L, Hkv, N, bs, F]`` as well as on a single layer ``[Hkv, N, bs, F]``.

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

BLOCK_AXIS = -3  # block axis of every leaf, counted from the end
OFFSET_AXIS = -2  # in-block token offset axis of every leaf

@struct.dataclass
class KVPages:
    """K and V pages of every layer (or of one layer: drop the leading axis).

    Later waves add leaves (e.g. ``k_scale: [L, Hkv, N, bs, 1]``); every leaf keeps the
    block axis at ``BLOCK_AXIS`` so that the helpers carry it with the data.
    """

    k: jax.Array  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]; float
    v: jax.Array  # [num_layers, num_kv_heads, num_blocks, block_size, head_dim]; float

    BLOCK_AXIS: ClassVar[int] = BLOCK_AXIS

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
        return self.k.dtype


def init_pages(
    num_layers: int,
    num_kv_heads: int,
    num_blocks: int,
    block_size: int,
    head_dim: int,
    dtype: Any = jnp.float32,
) -> KVPages:
    """A zero-filled store: ``k, v: dtype[num_layers, num_kv_heads, num_blocks, block_size, head_dim]``."""
    dtype = float_dtype(dtype)
    shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
    for name, value in zip(("num_layers", "num_kv_heads", "num_blocks", "block_size", "head_dim"), shape):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive int")
    return KVPages(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


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
    """Scatter new tokens' K and V into their physical slots.

    Args:
      pages: the whole store (leaves ``[L, Hkv, N, bs, D]``) or one layer
        (``[Hkv, N, bs, D]``).
      slot_mapping: int32 of any shape ``S`` (e.g. ``[B, T]``): ``block * block_size +
        offset`` per token, ``NO_SLOT`` (-1) for padding tokens, which are dropped. Slots
        must be distinct among non-padding tokens.
      k_new, v_new: ``[*S, Hkv, D]`` when writing one layer (``layer`` given, or a
        single-layer store), ``[L, *S, Hkv, D]`` when writing every layer of the store at
        once. Cast to the page dtype.
      layer: layer index into a whole store, a Python int or a traced int32 scalar (the
        model's layer scan); writes only that layer, in place.

    Returns the updated store (same shapes and dtypes).
    """
    num_slots = pages.num_blocks * pages.block_size
    slots = slot_mapping.reshape(-1)
    idx = _drop_index(slots, (slots >= 0) & (slots < num_slots), num_slots)

    def scatter(leaf, new):
        heads, feat = leaf.shape[-4], leaf.shape[-1]
        if layer is not None:
            flat = leaf.reshape(leaf.shape[0], heads, num_slots, feat)
            # An int and an index array split by a slice: NumPy puts the indexed axis
            # first, so the update is [M, Hkv, D], the natural layout of k_new.
            ix, vals = _pad_single(idx, new.reshape(-1, heads, feat), num_slots, axis=0)
            out = flat.at[layer, :, ix].set(vals.astype(leaf.dtype), mode="drop")
        else:
            lead = leaf.shape[:-4]
            flat = leaf.reshape(*lead, heads, num_slots, feat)
            vals = new.reshape(*lead, -1, heads, feat)  # [(L,) M, Hkv, D]
            vals = jnp.moveaxis(vals, -2, -3)  # [(L,) Hkv, M, D]
            ix, vals = _pad_single(idx, vals, num_slots, axis=-2)
            out = flat.at[..., ix, :].set(vals.astype(leaf.dtype), mode="drop")
        return out.reshape(leaf.shape)

    return pages.replace(k=scatter(pages.k, k_new), v=scatter(pages.v, v_new))


# --------------------------------------------------------------------------- whole blocks


def _take_blocks(leaf: jax.Array, ids: jax.Array) -> jax.Array:
    """``leaf[..., ids, :, :]`` with ids clipped in range (callers mask invalid ones)."""
    safe = jnp.clip(ids, 0, leaf.shape[BLOCK_AXIS] - 1)
    return jnp.take(leaf, safe, axis=leaf.ndim + BLOCK_AXIS)


def _put_blocks(leaf: jax.Array, ids: jax.Array, data: jax.Array) -> jax.Array:
    """``leaf[..., ids, :, :] = data``; ids outside ``[0, N)`` (NO_BLOCK) are dropped."""
    n = leaf.shape[BLOCK_AXIS]
    idx = _drop_index(ids, (ids >= 0) & (ids < n), n)
    idx, data = _pad_single(idx, data.astype(leaf.dtype), n, axis=BLOCK_AXIS)
    return leaf.at[..., idx, :, :].set(data, mode="drop")


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
    n = _num_blocks(pages)
    valid = (src >= 0) & (src < n) & (dst >= 0) & (dst < n)
    dst = jnp.where(valid, dst, NO_BLOCK)
    return jax.tree.map(lambda leaf: _put_blocks(leaf, dst, _take_blocks(leaf, src)), pages)


def read_blocks(pages: KVPages, ids: jax.Array) -> KVPages:
    """Gather whole blocks, e.g. to swap them out to host memory.

    Args:
      ids: int32[M] block ids. ``NO_BLOCK`` entries read block 0 (padding: ignore them).

    Returns a ``KVPages`` whose every leaf has ``M`` in place of ``num_blocks`` at the
    block axis (``k: [L, Hkv, M, bs, D]``): everything stored for those blocks, scales
    included once they exist. Pass it (or a host copy, ``jax.device_get``) back to
    ``write_blocks`` to restore the blocks, possibly under other ids.
    """
    return jax.tree.map(lambda leaf: _take_blocks(leaf, ids), pages)


def write_blocks(pages: KVPages, ids: jax.Array, data: KVPages) -> KVPages:
    """Scatter whole blocks, e.g. to swap them back in from host memory.

    Args:
      ids: int32[M] destination block ids, distinct; ``NO_BLOCK`` entries are skipped.
      data: what ``read_blocks`` returned for ``M`` blocks (same tree structure, leaves
        ``[..., M, bs, F]``); cast to the page dtype.

    Returns the store with ``block ids[i] := data block i`` in every leaf and layer.
    """
    return jax.tree.map(lambda leaf, d: _put_blocks(leaf, ids, d), pages, data)


def poison_free_blocks(pages: KVPages, free_mask: jax.Array, value: float = float("nan")) -> KVPages:
    """Fill every block with ``free_mask[block]`` True with ``value`` (NaN by default).

    For tests: attention that reads a block it does not own then returns NaN instead of a
    plausible wrong number. O(pool) per call: never on the hot path.

    Args:
      free_mask: bool[num_blocks].
    """

    def poison(leaf):
        mask = free_mask.reshape((-1, 1, 1))  # broadcasts over [..., N, bs, F]
        return jnp.where(mask, jnp.asarray(value, leaf.dtype), leaf)

    return jax.tree.map(poison, pages)
