"""Quantised KV pages (``kv.quant``): every format against a NumPy reference, written
through ``write_tokens`` and carried (values *and* scales) by every block helper."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from paged_jax.kv import (
    KVPages,
    bytes_per_block,
    copy_blocks,
    init_pages,
    poison_free_blocks,
    quant,
    read_blocks,
    write_blocks,
    write_tokens,
)

L, H, N, BS, D = 2, 2, 10, 4, 6
QUANTIZED = ["int8", "int8_channel", "fp8_e4m3"]
PER_TOKEN = ["int8", "fp8_e4m3"]


# ---------------------------------------------------------------- the NumPy reference
def np_scale(amax: np.ndarray, qmax: float) -> np.ndarray:
    """amax / qmax with the documented 2^-8 margin, rounded to bfloat16."""
    return (amax.astype(np.float32) / np.float32(qmax) * np.float32(1 + 2**-8)).astype(ml_dtypes.bfloat16)


def np_encode(name: str, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    fmt = quant.kv_format(name)
    s = scale.astype(np.float32)
    y = np.where(s > 0, x.astype(np.float32) / np.where(s > 0, s, 1), 0).astype(np.float32)
    if fmt.integer:
        return np.clip(np.round(y), -fmt.qmax, fmt.qmax).astype(np.int8)
    return np.clip(y, -fmt.qmax, fmt.qmax).astype(ml_dtypes.float8_e4m3fn)


def np_dequant(values, scale) -> np.ndarray:
    return values.astype(np.float32) * scale.astype(np.float32)


def stored(scales) -> np.ndarray:
    """Stored scales (uint16 bits) as the bfloat16 values they are."""
    return np.asarray(quant.scale_values(jnp.asarray(scales))).astype(ml_dtypes.bfloat16)


class ChannelReference:
    """The per-channel format of one layer, appends applied as the module doc says."""

    def __init__(self, n: int, heads: int):
        self.values = np.zeros((heads, n, BS, D), np.int8)
        self.scales = np.zeros((heads, n, D), ml_dtypes.bfloat16)

    def append(self, table: list[int], start: int, x: np.ndarray) -> None:
        """``x [n, Hkv, D]`` at positions ``start..start+n`` of the row whose blocks are ``table``."""
        pos = start + np.arange(len(x))
        for j in np.unique(pos // BS):
            mine = pos // BS == j
            offs = pos[mine] % BS
            blk, first = table[j], int(offs.min())
            old_s = self.scales[:, blk].astype(np.float32) if first > 0 else np.zeros((x.shape[1], D), np.float32)
            amax = np.abs(x[mine]).max(axis=0)  # [Hkv, D]
            new_s = np.maximum(old_s, np_scale(amax, 127).astype(np.float32)).astype(ml_dtypes.bfloat16)
            tile = np.zeros((x.shape[1], BS, D), np.float32)
            tile[:, :first] = np_dequant(self.values[:, blk, :first], self.scales[:, blk, None, :])
            tile[:, offs] = np.moveaxis(x[mine], 0, 1)
            self.values[:, blk] = np_encode("int8_channel", tile, new_s[:, None, :])
            self.scales[:, blk] = new_s


# ---------------------------------------------------------------------------- formats
def test_formats_and_bad_names():
    assert quant.KV_CACHE_DTYPES == ("auto", "float32", "bfloat16", "float16", "int8", "int8_channel", "fp8_e4m3")
    assert quant.QUANTIZED_KV_CACHE_DTYPES == tuple(QUANTIZED)
    assert quant.kv_format("fp8") is quant.kv_format("fp8_e4m3")  # vLLM's alias
    for bad in ("int4", "fp8_e5m2", None, 8):
        with pytest.raises(ValueError, match=r"kv_cache_dtype=.*choose one of \['auto', 'float32'"):
            quant.kv_format(bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        init_pages(L, H, N, BS, D, jnp.float32, "int4")
    # A float cache dtype overrides the model dtype and carries no scales.
    pages = init_pages(L, H, N, BS, D, jnp.float32, "bfloat16")
    assert pages.dtype == jnp.bfloat16 and pages.k_scale is None and pages.kv_format == "auto"
    assert pages.k.dtype == jnp.uint16 and pages.bits_of == "bfloat16"  # 16-bit floats held as bits
    assert init_pages(L, H, N, BS, D, jnp.float16, "auto").dtype == jnp.float16


@pytest.mark.parametrize("name", PER_TOKEN)
def test_per_token_quantisation_matches_numpy_and_its_error_bound(name):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 3, D)).astype(np.float32) * rng.choice([1e-3, 1.0, 300.0], (7, 3, 1))
    x[0, 0] = 0.0  # an all-zero token: scale 0, values 0
    fmt = quant.kv_format(name)
    values, scale = quant.quantize_tokens(fmt, jnp.asarray(x))
    want_s = np_scale(np.abs(x).max(-1), fmt.qmax)
    np.testing.assert_array_equal(np.asarray(scale), want_s)
    np.testing.assert_array_equal(np.asarray(values), np_encode(name, x, want_s[..., None]))
    s = want_s.astype(np.float32)[..., None]
    err = np.abs(np_dequant(np.asarray(values), s) - x)
    if fmt.integer:  # half a step, nothing clipped
        assert (err <= 0.5 * s * (1 + 1e-6)).all()
    else:  # e4m3: 3 mantissa bits (relative 2^-4), subnormal spacing 2^-9 steps
        assert (err <= np.abs(x) * 2**-4 + s * 2**-9).all()
    assert not np.asarray(values)[0, 0].astype(np.float32).any() and float(scale[0, 0]) == 0.0


def test_int8_channel_appends_match_the_reference():
    """Random appends (prefill chunks, single decode tokens, a write that starts inside a
    block) of two rows, every write checked against the reference bit for bit."""
    rng = np.random.default_rng(1)
    pages = init_pages(L, H, N, BS, D, jnp.float32, "int8_channel")
    pages = poison_free_blocks(pages, jnp.ones(N, bool))  # stale NaN scales must be ignored
    ref = ChannelReference(N, H)
    tables = [[7, 2, 9, 4], [0, 5, 3, 8]]
    lens = [0, 0]
    write = jax.jit(lambda p, s, k: write_tokens(p, s, k, k, layer=1))
    for step in range(9):
        t = int(rng.choice([1, 3, 6]))
        slots = np.full((2, t), -1, np.int32)
        x = (rng.standard_normal((2, t, H, D)) * rng.uniform(0.1, 3.0)).astype(np.float32)
        for row in range(2):
            n = min(int(rng.integers(0, t + 1)), 4 * BS - lens[row])
            pos = lens[row] + np.arange(n)
            slots[row, :n] = [tables[row][p // BS] * BS + p % BS for p in pos]
            if n:
                ref.append(tables[row], lens[row], x[row, :n])
            lens[row] += n
        pages = write(pages, jnp.asarray(slots), jnp.asarray(x))
        used = sorted({b for row in range(2) for b in tables[row][: -(-lens[row] // BS)]})
        np.testing.assert_array_equal(np.asarray(pages.k[1][:, used]), ref.values[:, used], err_msg=f"step {step}")
        np.testing.assert_array_equal(stored(pages.k_scale[1][:, used]), ref.scales[:, used])
    assert not np.asarray(pages.k[0]).any()  # the other layer untouched


def test_int8_channel_every_layer_and_one_layer_stores():
    """The whole-store write (k_new [L, B, T, Hkv, D]) equals layer-by-layer writes, and a
    single-layer store equals that layer of a whole store."""
    rng = np.random.default_rng(2)
    slots = jnp.array([[9, 10, 11, 12, 13], [1, 2, -1, -1, -1]], jnp.int32)
    x = jnp.asarray(rng.standard_normal((L, 2, 5, H, D)), jnp.float32)
    empty = init_pages(L, H, N, BS, D, jnp.float32, "int8_channel")
    whole = write_tokens(empty, slots, x, x)
    by_layer = empty
    for layer in range(L):
        by_layer = write_tokens(by_layer, slots, x[layer], x[layer], layer=layer)
    one = write_tokens(jax.tree.map(lambda a: a[1], empty), slots, x[1], x[1])
    for leaf_a, leaf_b, leaf_c in zip(jax.tree.leaves(whole), jax.tree.leaves(by_layer), jax.tree.leaves(one)):
        np.testing.assert_array_equal(np.asarray(leaf_a), np.asarray(leaf_b))
        np.testing.assert_array_equal(np.asarray(leaf_a[1]), np.asarray(leaf_c))
    with pytest.raises(ValueError, match=r"slot_mapping \[B, T\]"):
        write_tokens(empty, slots.reshape(-1), x[0].reshape(-1, H, D), x[0].reshape(-1, H, D), layer=0)


@pytest.mark.parametrize("name", PER_TOKEN)
def test_per_token_writes_store_values_and_scales(name):
    rng = np.random.default_rng(3)
    pages = init_pages(L, H, N, BS, D, jnp.float32, name)
    slots = jnp.array([[5, 0, -1]], jnp.int32)
    x = rng.standard_normal((1, 3, H, D)).astype(np.float32)
    out = write_tokens(pages, slots, jnp.asarray(x), jnp.asarray(2 * x), layer=0)
    fmt = quant.kv_format(name)
    for slot, t in ((5, 0), (0, 1)):
        b, o = divmod(slot, BS)
        want_s = np_scale(np.abs(x[0, t]).max(-1), fmt.qmax)  # [Hkv]
        np.testing.assert_array_equal(stored(out.k_scale[0, :, b, o]), want_s)
        np.testing.assert_array_equal(np.asarray(out.k[0, :, b, o]), np_encode(name, x[0, t], want_s[:, None]))
    written = np.zeros((N, BS), bool)
    written[1, 1] = written[0, 0] = True
    assert not np.asarray(out.k_scale[0][:, ~written]).any() and not np.asarray(out.k[1]).any()


# ------------------------------------------------------------------ pages and helpers
@pytest.mark.parametrize("name", QUANTIZED)
def test_init_and_bytes_count_the_scales(name):
    pages = init_pages(L, H, N, BS, D, jnp.bfloat16, name)
    fmt = quant.kv_format(name)
    assert pages.kv_format == name and pages.k.dtype == fmt.storage
    scale_shape = (L, H, N, D) if fmt.per_channel else (L, H, N, BS)
    assert pages.k_scale.shape == pages.v_scale.shape == scale_shape
    assert pages.k_scale.dtype == quant.SCALE_STORAGE  # bf16 bits
    scale_elems = D if fmt.per_channel else BS
    assert bytes_per_block(pages) == 2 * L * H * (BS * D * 1 + scale_elems * 2)
    abstract = jax.eval_shape(lambda: init_pages(L, H, 1, BS, D, jnp.bfloat16, name))
    assert bytes_per_block(abstract) == bytes_per_block(pages)
    assert bytes_per_block(init_pages(L, H, N, BS, D, jnp.bfloat16)) == 2 * L * H * BS * D * 2


def _random_quantized(name: str, seed: int = 0) -> KVPages:
    rng = np.random.default_rng(seed)
    fmt = quant.kv_format(name)
    k, ks = quant.quantize_blocks(fmt, jnp.asarray(rng.standard_normal((L, H, N, BS, D)), jnp.float32))
    v, vs = quant.quantize_blocks(fmt, jnp.asarray(rng.standard_normal((L, H, N, BS, D)), jnp.float32))
    return KVPages(k, v, ks, vs, kv_format=name)


@pytest.mark.parametrize("name", QUANTIZED)
def test_block_helpers_move_scales_with_values(name):
    pages = _random_quantized(name)
    copied = copy_blocks(pages, jnp.array([2, 3]), jnp.array([6, 7]))
    host = jax.device_get(read_blocks(pages, jnp.array([1, 4])))
    assert isinstance(host, KVPages) and host.kv_format == name
    restored = write_blocks(init_pages(L, H, N, BS, D, jnp.float32, name), jnp.array([0, 9]), host)
    for field in ("k", "v", "k_scale", "v_scale"):
        a = np.asarray(getattr(pages, field))
        np.testing.assert_array_equal(np.asarray(getattr(copied, field))[:, :, [6, 7]], a[:, :, [2, 3]])
        np.testing.assert_array_equal(np.asarray(getattr(restored, field))[:, :, [0, 9]], a[:, :, [1, 4]])
    poisoned = poison_free_blocks(pages, jnp.arange(N) == 5)
    assert np.isnan(np.asarray(quant.scale_values(poisoned.k_scale[:, :, 5]))).all()
    deq = quant.dequantize(poisoned.k, poisoned.k_scale, quant.kv_format(name).per_channel)
    assert np.isnan(np.asarray(deq[:, :, 5])).all() and np.isfinite(np.asarray(deq[:, :, :5])).all()
