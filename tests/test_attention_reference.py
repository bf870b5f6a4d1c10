"""What is specific to ``reference``: dense attention equals paged attention on a
contiguous layout, and ``gather_blocks`` reads a layer's blocks through one gather.

The oracle against a brute-force loop, and every implementation against the oracle, are
``test_attention_contract.py``'s.
"""

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.attention import dense_causal_attention, gather_blocks, reference
from paged_jax.kv import KVPages

BS, D = 4, 8


def test_dense_equals_paged_on_contiguous_layout():
    rng = np.random.default_rng(3)
    b, s, hq, hkv = 2, 8, 4, 2
    k = rng.standard_normal((b, s, hkv, D)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, D)).astype(np.float32)
    q = rng.standard_normal((b, 3, hq, D)).astype(np.float32)
    dense = dense_causal_attention(q, k, v)  # queries at positions 5, 6, 7
    heads_first = dense_causal_attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2), heads_first=True)
    np.testing.assert_array_equal(np.asarray(dense), np.asarray(heads_first))
    # The same keys laid out block by block: row b owns blocks [2b, 2b+1].
    kp = k.reshape(b, 2, BS, hkv, D).transpose(3, 0, 1, 2, 4).reshape(hkv, 2 * b, BS, D)
    vp = v.reshape(b, 2, BS, hkv, D).transpose(3, 0, 1, 2, 4).reshape(hkv, 2 * b, BS, D)
    tables = jnp.array([[0, 1], [2, 3]], jnp.int32)
    paged = reference.paged_attention(q, KVPages(kp, vp), tables, jnp.array([8, 8]), jnp.array([3, 3]))
    np.testing.assert_allclose(np.asarray(dense), np.asarray(paged), rtol=1e-6, atol=1e-6)
    # Shorter rows of a contiguous cache: lengths / q_lens as in the contract.
    lengths, q_lens = jnp.array([5, 8]), jnp.array([2, 3])
    dense = dense_causal_attention(q, k, v, lengths=lengths, q_lens=q_lens)
    paged = reference.paged_attention(q, KVPages(kp, vp), tables, lengths, q_lens)
    np.testing.assert_allclose(np.asarray(dense), np.asarray(paged), rtol=1e-6, atol=1e-6)


def test_gather_blocks_reads_one_layer_with_ids_clamped():
    rng = np.random.default_rng(4)
    leaf = rng.standard_normal((3, 2, 6, BS, D)).astype(np.float32)  # [L, Hkv, N, bs, D]
    ids = np.array([[4, 0, -1], [5, 9, 2]], np.int32)  # -1 and 9 are out of range
    clamped = np.clip(ids, 0, 5)
    for layer in (0, 2, jnp.int32(1), jnp.int32(7)):
        got = np.asarray(jax.jit(gather_blocks)(leaf, ids, layer))
        want = leaf[min(int(layer), 2)][:, clamped]  # [Hkv, 2, 3, bs, D]
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(gather_blocks(leaf[1], ids)), leaf[1][:, clamped])
