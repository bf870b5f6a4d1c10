"""The KV page store: token writes through slots, block copies, swap helpers, poisoning."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.kv import (
    KVPages,
    bytes_per_block,
    bytes_per_token,
    copy_blocks,
    init_pages,
    poison_free_blocks,
    read_blocks,
    write_blocks,
    write_tokens,
)

L, H, N, BS, D = 2, 3, 6, 4, 5


def _random_pages(seed=0, dtype=jnp.float32) -> KVPages:
    rng = np.random.default_rng(seed)
    shape = (L, H, N, BS, D)
    return KVPages(
        k=jnp.asarray(rng.standard_normal(shape), dtype), v=jnp.asarray(rng.standard_normal(shape), dtype)
    )


def test_init_pages_shapes_and_dtypes():
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16, "bfloat16"):
        pages = init_pages(L, H, N, BS, D, dtype)
        assert pages.k.shape == pages.v.shape == (L, H, N, BS, D)
        assert pages.dtype == jnp.dtype(dtype)
        assert (pages.num_layers, pages.num_blocks, pages.block_size) == (L, N, BS)
    with pytest.raises(ValueError, match="int8"):
        init_pages(L, H, N, BS, D, jnp.int8)
    with pytest.raises(ValueError, match="block_size"):
        init_pages(L, H, N, 0, D)


def test_bytes_per_token_matches_formula():
    for dtype in (jnp.float32, jnp.bfloat16):
        pages = init_pages(L, H, N, BS, D, dtype)
        assert bytes_per_token(pages) == 2 * L * H * D * jnp.dtype(dtype).itemsize
        abstract = jax.eval_shape(lambda dtype=dtype: init_pages(L, H, N, BS, D, dtype))  # no allocation
        assert bytes_per_block(abstract) == bytes_per_block(pages)
        assert bytes_per_block(pages) == BS * bytes_per_token(pages)


@pytest.mark.parametrize("mode", ["one_layer_of_store", "single_layer_pages", "all_layers"])
def test_write_tokens_scatters_and_drops_padding(mode):
    pages = _random_pages()
    rng = np.random.default_rng(1)
    slots = np.array([[5, 0, -1], [N * BS - 1, -1, 13]], np.int32)  # [B=2, T=3]
    k_all = rng.standard_normal((L, 2, 3, H, D)).astype(np.float32)
    v_all = rng.standard_normal((L, 2, 3, H, D)).astype(np.float32)

    want_k, want_v = np.array(pages.k), np.array(pages.v)
    layers = {"one_layer_of_store": [1], "single_layer_pages": [0], "all_layers": list(range(L))}[mode]
    for layer in layers:
        for b in range(2):
            for t in range(3):
                s = slots[b, t]
                if s >= 0:
                    want_k[layer, :, s // BS, s % BS] = k_all[layer, b, t]
                    want_v[layer, :, s // BS, s % BS] = v_all[layer, b, t]

    if mode == "one_layer_of_store":
        out = jax.jit(lambda p, s, k, v: write_tokens(p, s, k, v, layer=1))(pages, slots, k_all[1], v_all[1])
    elif mode == "single_layer_pages":
        out = write_tokens(jax.tree.map(lambda x: x[0], pages), slots, k_all[0], v_all[0])
        want_k, want_v = want_k[0], want_v[0]
    else:
        out = write_tokens(pages, slots, k_all, v_all)
    np.testing.assert_array_equal(np.asarray(out.k), want_k)
    np.testing.assert_array_equal(np.asarray(out.v), want_v)


def test_write_tokens_casts_to_page_dtype():
    pages = init_pages(1, H, N, BS, D, jnp.bfloat16)
    out = write_tokens(pages, jnp.array([[3]]), jnp.ones((1, 1, H, D), jnp.float32) / 3, jnp.ones((1, 1, H, D)), layer=0)
    # 16-bit float pages hold their values' uint16 bits (init_pages); .values reads them back.
    assert (out.dtype, out.k.dtype, out.bits_of) == (jnp.bfloat16, jnp.uint16, "bfloat16")
    assert out.values(out.k).dtype == jnp.bfloat16
    assert float(out.values(out.k)[0, 0, 0, 3, 0]) == pytest.approx(1 / 3, rel=1e-2)
    assert float(out.values(out.k)[0, 0, 0, 2, 0]) == 0.0


def test_bits_pages_match_native_float_pages():
    """Stored bits and native bf16 / f16 leaves are the same store: writes, copies, block
    reads and poisoning agree bit for bit once read back as values."""
    key = jax.random.PRNGKey(3)
    for dtype in (jnp.bfloat16, jnp.float16):
        bits = init_pages(L, H, N, BS, D, dtype)
        native = KVPages(k=jnp.zeros((L, H, N, BS, D), dtype), v=jnp.zeros((L, H, N, BS, D), dtype))
        k_new = jax.random.normal(key, (2, 3, H, D))
        slots = jnp.array([[0, 1, 17], [5, -1, 9]], jnp.int32)
        outs = []
        for pages in (bits, native):
            pages = write_tokens(pages, slots, k_new, -k_new, layer=1)
            pages = copy_blocks(pages, jnp.array([0, 1], jnp.int32), jnp.array([3, 2], jnp.int32))
            back = read_blocks(pages, jnp.array([3, 1], jnp.int32))
            pages = write_blocks(pages, jnp.array([4, 5], jnp.int32), back)
            pages = poison_free_blocks(pages, jnp.arange(N) == N - 1)
            outs.append((np.asarray(pages.values(pages.k).astype(jnp.float32)),
                         np.asarray(pages.values(pages.v).astype(jnp.float32))))
        np.testing.assert_array_equal(outs[0][0], outs[1][0])
        np.testing.assert_array_equal(outs[0][1], outs[1][1])
        assert np.isnan(outs[0][0][:, :, N - 1]).all() and not np.isnan(outs[0][0][:, :, : N - 1]).any()


def test_copy_blocks_all_layers_and_skips_padding_pairs():
    pages = _random_pages()
    src = jnp.array([1, -1, 4, 2], jnp.int32)
    dst = jnp.array([3, 0, -1, 5], jnp.int32)
    out = jax.jit(copy_blocks, donate_argnums=0)(_random_pages(), src, dst)
    want_k, want_v = np.array(pages.k), np.array(pages.v)
    for s, d in [(1, 3), (2, 5)]:
        want_k[:, :, d], want_v[:, :, d] = want_k[:, :, s], want_v[:, :, s]
    np.testing.assert_array_equal(np.asarray(out.k), want_k)
    np.testing.assert_array_equal(np.asarray(out.v), want_v)


def test_copy_blocks_with_no_valid_pair_leaves_every_block():
    """All-padding pairs (the common step) take the no-copy branch: pages come back equal."""
    pages = _random_pages()
    pad = jnp.array([-1, N, -1], jnp.int32)
    out = jax.jit(copy_blocks, donate_argnums=0)(_random_pages(), pad, jnp.array([0, -1, N], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out.k), np.asarray(pages.k))
    np.testing.assert_array_equal(np.asarray(out.v), np.asarray(pages.v))


def test_read_write_blocks_round_trip_through_host():
    pages = _random_pages()
    ids = jnp.array([4, 1, -1], jnp.int32)
    swapped = jax.device_get(read_blocks(pages, ids))  # "swap out" to host
    assert swapped.k.shape == (L, H, 3, BS, D)
    np.testing.assert_array_equal(swapped.k[:, :, 0], np.asarray(pages.k[:, :, 4]))
    # "swap in" to other blocks of a fresh store; the padding entry writes nothing.
    target = init_pages(L, H, N, BS, D)
    restored = write_blocks(target, jnp.array([0, 5, -1], jnp.int32), swapped)
    np.testing.assert_array_equal(np.asarray(restored.k[:, :, 0]), np.asarray(pages.k[:, :, 4]))
    np.testing.assert_array_equal(np.asarray(restored.v[:, :, 5]), np.asarray(pages.v[:, :, 1]))
    untouched = [1, 2, 3, 4]
    assert not np.asarray(restored.k[:, :, untouched]).any()


def test_block_helpers_carry_every_leaf():
    """A block is everything stored for it: an extra (scale) leaf follows the data."""
    rng = np.random.default_rng(2)
    store = {
        "k": jnp.asarray(rng.standard_normal((L, H, N, BS, D)), jnp.float32),
        "k_scale": jnp.asarray(rng.standard_normal((L, H, N, BS, 1)), jnp.float32),
    }
    out = copy_blocks(store, jnp.array([2]), jnp.array([4]))
    np.testing.assert_array_equal(np.asarray(out["k_scale"][:, :, 4]), np.asarray(store["k_scale"][:, :, 2]))
    got = read_blocks(store, jnp.array([3]))
    assert got["k_scale"].shape == (L, H, 1, BS, 1)
    back = write_blocks(store, jnp.array([0]), got)
    np.testing.assert_array_equal(np.asarray(back["k_scale"][:, :, 0]), np.asarray(store["k_scale"][:, :, 3]))
    poisoned = poison_free_blocks(store, jnp.arange(N) == 1)
    assert np.isnan(np.asarray(poisoned["k_scale"][:, :, 1])).all()


def test_poison_free_blocks_only_touches_free_blocks():
    pages = _random_pages()
    free = jnp.array([True, False, False, True, False, False])
    out = poison_free_blocks(pages, free)
    k = np.asarray(out.k)
    assert np.isnan(k[:, :, [0, 3]]).all() and np.isnan(np.asarray(out.v[:, :, [0, 3]])).all()
    np.testing.assert_array_equal(k[:, :, [1, 2, 4, 5]], np.asarray(pages.k[:, :, [1, 2, 4, 5]]))


def _full_size_copies(hlo: str, num_elements: int) -> list[str]:
    """HLO lines that copy or dynamic-update-slice an array as large as the store."""
    bad = []
    for line in hlo.splitlines():
        if "copy(" in line or "dynamic-update-slice(" in line:
            shape = line.split("=", 1)[1].split("{", 1)[0].strip() if "=" in line else ""
            dims = shape[shape.find("[") + 1 : shape.find("]")]
            if dims and np.prod([int(x) for x in dims.split(",")]) >= num_elements:
                bad.append(line.strip()[:160])
    return bad


@pytest.mark.parametrize("m", [1, 3])
def test_donated_writes_stay_in_place(m):
    """With the store donated, no op copies it whole, even for a single block or token
    (XLA turns a one-index scatter into a select + dynamic-update-slice that copies)."""
    pages = init_pages(L, H, 64, BS, D)
    full = L * H * 64 * BS * D
    ids = jnp.arange(m, dtype=jnp.int32)
    hlo = jax.jit(copy_blocks, donate_argnums=0).lower(pages, ids, ids + 8).compile().as_text()
    assert not _full_size_copies(hlo, full)
    slots = jnp.arange(m, dtype=jnp.int32)[:, None]
    new = jnp.ones((m, 1, H, D))
    write = jax.jit(lambda p, s, k: write_tokens(p, s, k, k, layer=1), donate_argnums=0)
    assert not _full_size_copies(write.lower(pages, slots, new).compile().as_text(), full)
    back = jax.jit(write_blocks, donate_argnums=0)
    assert not _full_size_copies(back.lower(pages, ids, read_blocks(pages, ids)).compile().as_text(), full)
