"""Quantised KV pages (M10): the formats, quantise-on-write and dequantise-on-read.

``kv_cache_dtype`` names a format (vLLM's option name):

| name | values | scales (bfloat16) | scale leaf shape |
|---|---|---|---|
| ``"auto"`` | the model dtype | none | none |
| ``"float32"``, ``"bfloat16"``, ``"float16"`` | that float dtype | none | none |
| ``"int8"`` | int8, symmetric | one per (layer, kv head, block, slot) | ``[L, Hkv, N, bs]`` |
| ``"fp8_e4m3"`` (alias ``"fp8"``) | float8_e4m3fn | one per (layer, kv head, block, slot) | ``[L, Hkv, N, bs]`` |
| ``"int8_channel"`` | int8, symmetric | one per (layer, kv head, block, channel) | ``[L, Hkv, N, D]`` |

The scales are leaves of ``KVPages`` (``k_scale``, ``v_scale``) sharing the values'
leading ``[L, Hkv, N]`` axes, so copy-on-write, swap, prefix-cache reuse and poisoning
carry them with the values: a block is its values *and* its scales. (No size-1 axis: a
``[.., bs, 1]`` scale leaf made XLA:CPU's layout assignment copy the whole scale pool
around every scatter; ``tests/test_model_hlo.py`` guards this.)

Per-token formats: ``scale = max |x| / qmax`` over the token's head_dim, rounded to
bfloat16 after a 2^-8 margin (so ``|x / scale|`` exceeds qmax by rounding at most, and
is clipped), values ``x / scale`` rounded (int8) or cast (fp8). The scale the values
were divided by is the one stored.

Per-channel (``int8_channel``): a block's scale per channel is the running max of
``|x| / 127`` over the tokens written into it so far. When a write raises a channel's
scale, the tokens already in the block are requantised to the new scale (dequantise with
the old, round with the new) in the same jitted step, so a block's values always match
its scales; a block whose first write starts at offset 0 starts from scale 0 (whatever a
free block held before is ignored). The price is extra rounding of the block's early
tokens each time a later token raises a channel's max, and a read-modify-write of every
block a step writes into; ``experiments/quantized.py`` measures the error. A block is
only written while private (copy-on-write first), so requantising never changes what
another row reads.

Scales are bfloat16 (8 exponent bits cover any activation; rounding the scale up costs
at most 2^-8 of relative step size, below int8's own rounding), held in the pages as
their uint16 bits (``scale_bits``): 2 bytes per token and head (int8 at head_dim 128:
130 bytes vs bf16's 256, 1.97x).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SCALE_DTYPE = jnp.dtype(jnp.bfloat16)  # what a scale is
SCALE_STORAGE = jnp.dtype(jnp.uint16)  # how the pages hold it: its bits (see scale_bits)


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """How one ``kv_cache_dtype`` stores K and V.

    ``storage``: the values' dtype (None: the model dtype). ``qmax``: the largest
    magnitude a quantised value takes (0: unquantised, no scales). ``per_channel``:
    scales per (block, channel) rather than per (block, slot).
    """

    name: str
    storage: jnp.dtype | None
    qmax: float = 0.0
    per_channel: bool = False

    @property
    def quantized(self) -> bool:
        return self.qmax > 0

    @property
    def integer(self) -> bool:
        return self.quantized and jnp.issubdtype(self.storage, jnp.integer)

    def scale_shape(self, block_size: int, head_dim: int) -> tuple[int]:
        """The trailing axis of a scale leaf (after ``[L, Hkv, N]``)."""
        return (head_dim,) if self.per_channel else (block_size,)


KV_FORMATS: dict[str, KVFormat] = {
    "auto": KVFormat("auto", None),
    "float32": KVFormat("float32", jnp.dtype(jnp.float32)),
    "bfloat16": KVFormat("bfloat16", jnp.dtype(jnp.bfloat16)),
    "float16": KVFormat("float16", jnp.dtype(jnp.float16)),
    "int8": KVFormat("int8", jnp.dtype(jnp.int8), 127.0),
    "int8_channel": KVFormat("int8_channel", jnp.dtype(jnp.int8), 127.0, per_channel=True),
    "fp8_e4m3": KVFormat("fp8_e4m3", jnp.dtype(jnp.float8_e4m3fn), float(jnp.finfo(jnp.float8_e4m3fn).max)),
}
KV_CACHE_DTYPES = tuple(KV_FORMATS)
QUANTIZED_KV_CACHE_DTYPES = tuple(name for name, f in KV_FORMATS.items() if f.quantized)
_ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's "fp8" is e4m3


def kv_format(name: str) -> KVFormat:
    """The format ``name`` (a ``kv_cache_dtype``); ValueError listing the valid names."""
    if not isinstance(name, str) or _ALIASES.get(name, name) not in KV_FORMATS:
        raise ValueError(f"kv_cache_dtype={name!r}: choose one of {list(KV_CACHE_DTYPES)} (or 'fp8')")
    return KV_FORMATS[_ALIASES.get(name, name)]


def _round_up_bf16(x: jax.Array) -> jax.Array:
    """``x`` (f32, >= 0) as the smallest-or-next bfloat16 >= x (relative cost <= 2^-8)."""
    return (x * (1.0 + 2.0**-8)).astype(SCALE_DTYPE)


def encode(fmt: KVFormat, x: jax.Array, scale: jax.Array) -> jax.Array:
    """Values of ``x`` (f32) divided by ``scale`` (f32 or bf16, broadcastable to x), in
    ``fmt.storage``; a zero scale gives zeros."""
    s = scale.astype(jnp.float32)
    y = jnp.where(s > 0, x.astype(jnp.float32) / jnp.where(s > 0, s, 1.0), 0.0)
    if fmt.integer:
        return jnp.clip(jnp.round(y), -fmt.qmax, fmt.qmax).astype(fmt.storage)
    return jnp.clip(y, -fmt.qmax, fmt.qmax).astype(fmt.storage)


def quantize_tokens(fmt: KVFormat, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token quantisation of ``x [..., D]`` -> (values ``fmt.storage[..., D]``,
    scales ``bfloat16[...]``)."""
    scale = _round_up_bf16(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1) / fmt.qmax)
    return encode(fmt, x, scale[..., None]), scale


def channel_scale(fmt: KVFormat, x: jax.Array) -> jax.Array:
    """The per-channel scale of blocks ``x [..., bs, D]``: ``max |x| / qmax`` over the
    slots -> ``bfloat16[..., D]``."""
    return _round_up_bf16(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-2) / fmt.qmax)


def quantize_blocks(fmt: KVFormat, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Whole blocks ``x [..., N, bs, D]`` quantised at once -> (values, stored scales
    ``scale_bits``): per token, or per channel over each block's ``bs`` slots (what a
    block written in one piece holds). For building quantised pages from float ones
    (tests, studies)."""
    if fmt.per_channel:
        scale = channel_scale(fmt, x)
        return encode(fmt, x, scale[..., None, :]), scale_bits(scale)
    values, scale = quantize_tokens(fmt, x)
    return values, scale_bits(scale)


def scale_bits(scale: jax.Array) -> jax.Array:
    """Scales as the pages store them: the uint16 bits of their bfloat16 value.

    Integers, because XLA:CPU has no bf16 scatter or gather: around each one it
    converted, or bitcast in a materialised copy, the whole scale pool per layer per
    step (``tests/test_model_hlo.py`` guards it). ``scale_values`` reads them back, in
    gathered tiles only."""
    return jax.lax.bitcast_convert_type(scale.astype(SCALE_DTYPE), SCALE_STORAGE)


def scale_values(stored: jax.Array) -> jax.Array:
    """Stored scales (``SCALE_STORAGE``, or any float) as float32."""
    if stored.dtype == SCALE_STORAGE:
        stored = jax.lax.bitcast_convert_type(stored, SCALE_DTYPE)
    return stored.astype(jnp.float32)


def dequantize(values: jax.Array, scale: jax.Array | None, per_channel: bool = False) -> jax.Array:
    """Blocks ``values [..., bs, D]`` times their scales in f32: ``scale [..., bs]`` per
    token or ``[..., D]`` per channel (stored uint16 bits or floats); None: unquantised,
    just the f32 values."""
    if scale is None:
        return values.astype(jnp.float32)
    scale = scale_values(scale)
    return values.astype(jnp.float32) * (scale[..., None, :] if per_channel else scale[..., None])


def round_trip(fmt: KVFormat, x: jax.Array) -> jax.Array:
    """What a per-token cache gives back for ``x [..., D]`` (f32): for error studies."""
    if not fmt.quantized:
        return x.astype(jnp.float32)
    if fmt.per_channel:
        raise ValueError("round_trip is per token; per-channel error depends on the write order")
    values, scale = quantize_tokens(fmt, x)
    return values.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


def storage_dtype(fmt: KVFormat, model_dtype) -> jnp.dtype:
    """The dtype K and V values are stored in under ``fmt`` for a model in ``model_dtype``."""
    return jnp.dtype(model_dtype if fmt.storage is None else fmt.storage)
