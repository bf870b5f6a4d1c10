"""Length-aware paged attention in plain XLA: the fast path off the GPU.

``reference.py`` gathers every table column of every row and attends over all of it, so a
call costs ``rows x table width`` whatever the rows actually hold. Serving batches are
skewed (a few long sequences among many short ones), and on a CPU that gather and the
score/value matmuls over it are memory-bound: the reference spends most of a decode
step reading padding. This implementation does the same arithmetic on only the live part:

1. Rows are sorted by length (longest first) and cut into groups of ``r`` rows
   (``r * T ~ query_tile`` queries, so a decode group is up to 8 rows; a small batch
   is cut into at least ``min_groups`` groups, as a group runs to its longest row).
2. Each group walks its keys in chunks of ``blocks_per_chunk`` blocks with an online
   softmax (flash-decoding's running max / denominator / accumulator), for as many chunks
   as *its* longest row needs: a ``fori_loop`` whose trip count is a traced value, so one
   compiled program serves every length and the cost follows the sum over groups of
   ``r x group max length``, which for sorted rows is close to the tokens actually held.
3. A chunk's gathered K/V (``r x chunk`` keys) stays in cache between the score and value
   products; nothing table-sized is materialised.

The contract of ``paged_jax.attention.contract``, tested against ``reference``. The layer
of 5-D pages (a Python int or a traced scalar) is a coordinate of each chunk's gather, so
no layer slice of the pool exists inside or outside the loops.

Tuning parameters are keyword-only; the defaults were measured on a 2-core x86 CPU
(``experiments/decode_step.py`` times the step they feed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.attention import contract
from paged_jax.attention.reference import gather_dequantized

_MASKED = -1e30  # finite: exp(_MASKED - max) underflows to 0 without Inf - Inf = NaN
_HIGHEST = jax.lax.Precision.HIGHEST


def paged_attention(
    q: jax.Array,
    pages,
    block_tables: jax.Array,
    lengths: jax.Array,
    q_lens: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    scale: float | None = None,
    query_tile: int = 8,
    min_groups: int = 4,
    blocks_per_chunk: int = 8,
    tail_blocks: int = 2,
    products: str = "auto",
) -> jax.Array:
    """Causal attention of up to T new tokens per row over a paged KV cache.

    Args:
      q, pages, block_tables, lengths, q_lens, layer, scale: as in ``contract`` (q
        [B, T, Hq, D]; pages leaves [L, Hkv, N, bs, D] with ``layer``, or [Hkv, N, bs, D];
        int32 block_tables [B, P], lengths and q_lens [B]).
      query_tile: queries per group: a group holds at most ``query_tile // T`` rows.
      min_groups: and at most ``B // min_groups`` rows (at least 1): every row of a group
        pays for its longest, so a small batch pads less in a few small groups than in
        one. Measured on 2 cores (decode, ShareGPT-like lengths): at batch 8, groups of 2
        rows were ~15-20% faster than one group of 8; from ~32 rows, groups of 8 win.
      blocks_per_chunk: table columns read per step of the main inner loop.
      tail_blocks: table columns per step of the tail loop, which reads what is left
        of a group's longest row after the main loop's whole chunks.
      products: how a chunk's two products run: "dot" (batched ``einsum`` dots), "sum"
        (elementwise products and reductions, which XLA fuses with the masking and the
        exp: no tiny batched dots), or "auto": "sum" for decode (T = 1: a kv head's
        queries are its G heads only, so the products are memory-bound) and "dot" for
        chunks. Measured on 2 cores (SmolLM2 shape, 64 rows x 200 tokens, fp32, 30
        layers): attention alone 247 -> 204 ms CPU; the whole decode step 538 -> 464.

    Returns [B, T, Hq, D] in q.dtype.
    """
    sizes = contract.check(q, pages, block_tables, lengths, q_lens, layer)
    b, t, hq, d = sizes.batch, sizes.queries, sizes.q_heads, sizes.head_dim
    hkv, n, bs, g = sizes.kv_heads, sizes.num_blocks, sizes.block_size, sizes.group
    q = jnp.asarray(q)
    p = block_tables.shape[1]
    if products not in ("auto", "dot", "sum"):
        raise ValueError(f"products={products!r}: choose 'auto', 'dot' or 'sum'")
    use_dot = products == "dot" or (products == "auto" and t > 1)
    if min(query_tile, min_groups, blocks_per_chunk, tail_blocks) < 1:
        raise ValueError(
            f"query_tile={query_tile}, min_groups={min_groups}, blocks_per_chunk={blocks_per_chunk} and "
            f"tail_blocks={tail_blocks} must be >= 1"
        )
    scale = contract.default_scale(d, scale)
    r = max(1, min(query_tile // t, b // min_groups))  # rows per group
    c = min(blocks_per_chunk, p)  # blocks per chunk of the main loop
    ct = min(tail_blocks, c)  # blocks per chunk of the tail loop
    ng = -(-b // r)

    block_tables = jnp.asarray(block_tables, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    q_lens = jnp.asarray(q_lens, jnp.int32)
    # Longest rows first, so each group's trip count is close to each of its rows' needs.
    order = jnp.argsort(-lengths)
    pad_b = ng * r - b
    lens_g = jnp.pad(lengths[order], (0, pad_b)).reshape(ng, r)
    qlens_g = jnp.pad(q_lens[order], (0, pad_b)).reshape(ng, r)
    tables = jnp.clip(block_tables[order], 0, n - 1)
    # Room past the last column for the last tail chunk: dynamic_slice would otherwise
    # clamp its start, silently shifting the window onto the wrong blocks.
    width = -(-p // c) * c + ct
    tables_g = jnp.pad(tables, ((0, pad_b), (0, width - p))).reshape(ng, r, width)
    # [ng, Hkv, r, T*G, D]: a kv head's queries (every token, every head of its group) in
    # one matrix, so each chunk is two matmuls per kv head.
    qf = jnp.pad(q[order].astype(jnp.float32), ((0, pad_b), (0, 0), (0, 0), (0, 0)))
    q_g = qf.reshape(ng, r, t, hkv, g, d).transpose(0, 3, 1, 2, 4, 5).reshape(ng, hkv, r, t * g, d)

    def attend_group(gi, out):
        lens, qlens, table, qq = lens_g[gi], qlens_g[gi], tables_g[gi], q_g[gi]
        q_pos = (lens - qlens)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [r, T]
        row_ok = jnp.arange(t, dtype=jnp.int32)[None, :] < qlens[:, None]  # [r, T]

        def chunk_body(first_block, cb: int):
            """Loop body over chunks of ``cb`` blocks starting at block ``first_block``."""
            ck = cb * bs

            def chunk(i, carry):
                m, denom, acc = carry  # [Hkv, r, TG], [Hkv, r, TG], [Hkv, r, TG, D]
                start = first_block + i * cb
                cols = jax.lax.dynamic_slice_in_dim(table, start, cb, axis=1)  # [r, cb]
                k = gather_dequantized(pages, "k", cols, layer).reshape(hkv, r, ck, d)
                v = gather_dequantized(pages, "v", cols, layer).reshape(hkv, r, ck, d)
                k_pos = start * bs + jnp.arange(ck, dtype=jnp.int32)  # [ck]
                key_ok = k_pos[None, :] < lens[:, None]  # [r, ck]
                if t == 1:
                    # One query per row, at the last key (q_len 1) or none (q_len 0):
                    # causality adds nothing to the length mask.
                    ok = (key_ok & row_ok)[None, :, :, None]  # [1, r, ck, 1], over heads
                else:
                    ok = key_ok[:, :, None] & (k_pos[None, :, None] <= q_pos[:, None, :]) & row_ok[:, None, :]
                    ok = jnp.repeat(ok, g, axis=2)[None]  # [1, r, ck, TG]
                # Keys as the left operand: XLA:CPU's dot is several times faster this
                # way round than with the contraction on the right operand's minor axis.
                if use_dot:
                    s = jnp.einsum("krsd,krqd->krsq", k, qq, precision=_HIGHEST)
                else:
                    s = jnp.sum(k[:, :, :, None, :] * qq[:, :, None, :, :], axis=-1)
                s = jnp.where(ok, s * scale, _MASKED)
                m_new = jnp.maximum(m, s.max(axis=2))
                e = jnp.where(ok, jnp.exp(s - m_new[:, :, None, :]), 0.0)
                alpha = jnp.exp(m - m_new)
                v = jnp.where(key_ok[None, :, :, None], v, 0.0)  # stale/NaN memory stays out
                if use_dot:
                    pv = jnp.einsum("krsq,krsd->krqd", e, v, precision=_HIGHEST)
                else:
                    pv = jnp.sum(e[..., None] * v[:, :, :, None, :], axis=2)
                return m_new, denom * alpha + e.sum(axis=2), acc * alpha[..., None] + pv

            return chunk

        carry = (
            jnp.full((hkv, r, t * g), _MASKED, jnp.float32),
            jnp.zeros((hkv, r, t * g), jnp.float32),
            jnp.zeros((hkv, r, t * g, d), jnp.float32),
        )
        # Whole chunks of c blocks while the group's longest row fills them, then chunks
        # of ct blocks for the rest: the last row's padding read is < ct blocks, not < c.
        # Both trip counts are traced values (0 for a group of padding rows).
        longest = jnp.max(lens)
        main = longest // (c * bs)
        tail = (longest - main * c * bs + ct * bs - 1) // (ct * bs)
        carry = jax.lax.fori_loop(0, main, chunk_body(0, c), carry)
        carry = jax.lax.fori_loop(0, tail, chunk_body(main * c, ct), carry)
        _, denom, acc = carry
        o = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # keyless rows: 0, not NaN
        o = o.reshape(hkv, r, t, g, d).transpose(1, 2, 0, 3, 4).reshape(r, t, hq, d)
        return jax.lax.dynamic_update_slice_in_dim(out, o[None], gi, axis=0)

    out = jax.lax.fori_loop(0, ng, attend_group, jnp.zeros((ng, r, t, hq, d), jnp.float32))
    out = out.reshape(ng * r, t, hq, d)[:b]
    return jnp.zeros_like(out).at[order].set(out).astype(q.dtype)
