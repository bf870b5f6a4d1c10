"""What is specific to the plain-XLA implementations: the blocked one's cost follows the
lengths (not the table's width) in one compiled program, its tuning is validated, and
neither XLA path materialises a layer of the pool when the layer is traced.

Numerical agreement with the oracle (every shape, tuning and layer mode) is
``test_attention_contract.py``'s.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention import blocked, reference
from paged_jax.kv import KVPages

S = jax.ShapeDtypeStruct


def _case(seed, *, b, t, hq, hkv, bs, d, p, n):
    """Random queries and pages; rows own random disjoint blocks."""
    rng = np.random.default_rng(seed)
    pages = KVPages(*(jnp.asarray(rng.standard_normal((hkv, n, bs, d)), jnp.float32) for _ in range(2)))
    lengths = rng.integers(1, p * bs + 1, b).astype(np.int32)
    tables = rng.permutation(n)[: b * p].reshape(b, p).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32)
    return q, pages, jnp.asarray(tables), jnp.asarray(lengths), jnp.ones(b, jnp.int32)


def test_blocked_rejects_bad_tuning():
    q, pages, tables, lens, qls = _case(15, b=2, t=1, hq=4, hkv=2, bs=4, d=8, p=3, n=8)
    for tuning, match in [
        (dict(blocks_per_chunk=0), "must be >= 1"),
        (dict(tail_blocks=0), "tail_blocks=0"),
        (dict(min_groups=0), "min_groups=0"),
        (dict(query_tile=0), "query_tile=0"),
        (dict(products="matmul"), "products='matmul'"),
    ]:
        with pytest.raises(ValueError, match=match):
            blocked.paged_attention(q, pages, tables, lens, qls, **tuning)


def test_blocked_cost_follows_lengths_not_table_width():
    """One compiled program serves every length, and its inner loop runs as many chunks
    as the longest row of each group needs: the trip count is computed from the lengths
    (a while loop with a data-dependent bound), not from the table's width."""
    q, pages, tables, lens, qls = _case(16, b=4, t=1, hq=4, hkv=2, bs=4, d=8, p=64, n=300)
    fn = jax.jit(blocked.paged_attention)
    hlo = fn.lower(q, pages, tables, lens, qls).as_text()
    # Loops over groups, then whole chunks, then tail chunks: none unrolled over the width.
    assert hlo.count("stablehlo.while") == 3
    before = fn._cache_size()
    fn(q, pages, tables, jnp.minimum(lens, 4), qls)
    fn(q, pages, tables, lens, qls)
    assert fn._cache_size() - before <= 1  # no retrace per length


# Distinctive sizes: the pool's shapes cannot be mistaken for any other tensor.
L, HKV, N, BS, D = 3, 2, 37, 4, 16
LAYER_SHAPE = f"f32[{HKV},{N},{BS},{D}]"  # one layer's pool: must never exist
ALL_SHAPE = f"f32[{L},{HKV},{N},{BS},{D}]"


def _compiled_hlo(fn) -> str:
    """Optimised HLO of ``fn`` on 5-D pages with the layer a traced argument."""
    pages = KVPages(S((L, HKV, N, BS, D), jnp.float32), S((L, HKV, N, BS, D), jnp.float32))
    run = jax.jit(lambda q, pages, bt, lengths, q_lens, layer: fn(q, pages, bt, lengths, q_lens, layer=layer))
    args = (S((5, 2, 4, D), jnp.float32), pages, S((5, 9), jnp.int32), S((5,), jnp.int32), S((5,), jnp.int32))
    return run.lower(*args, S((), jnp.int32)).compile().as_text()


def _layer_slices(hlo: str) -> list[str]:
    return [line.strip()[:160] for line in hlo.splitlines() if LAYER_SHAPE in line]


@pytest.mark.parametrize(
    "fn", [blocked.paged_attention, reference.paged_attention], ids=["blocked", "reference"]
)
def test_xla_paths_read_a_traced_layer_in_place(fn):
    """The layer is a coordinate of the gathers: no one-layer pool ``[Hkv, N, bs, D]`` is
    materialised inside or outside the loops, and the loops carry the whole 5-D pages."""
    hlo = _compiled_hlo(fn)
    assert _layer_slices(hlo) == []
    loops = [line for line in hlo.splitlines() if re.search(r"\swhile\(", line)]
    assert all(ALL_SHAPE in line for line in loops)
    assert bool(loops) == (fn is blocked.paged_attention)


def test_layer_slice_check_is_not_vacuous():
    """``pages.k[layer]`` then a gather inside a loop (the pattern ruled out) is caught."""

    def sliced(q, pages, bt, lengths, q_lens, *, layer):
        def body(i, acc):
            cols = bt[:, i]
            return acc + pages.k[layer][:, cols].sum() + pages.v[layer][:, cols].sum()

        return q * jax.lax.fori_loop(0, lengths[0], body, 0.0)

    assert _layer_slices(_compiled_hlo(sliced))


@pytest.mark.parametrize(
    "fn", [blocked.paged_attention, reference.paged_attention], ids=["blocked", "reference"]
)
def test_bf16_pages_are_never_converted_whole(fn):
    """Under a scan over layers (the pages loop-invariant), no f32 copy of the bf16 pool,
    or of a layer of it, exists: XLA:CPU would otherwise convert the gather's whole
    operand and hoist that convert out of the loop, paying it on every call."""
    pages = KVPages(S((L, HKV, N, BS, D), jnp.bfloat16), S((L, HKV, N, BS, D), jnp.bfloat16))

    def run(q, pages, bt, lengths, q_lens):
        def body(carry, layer):
            return carry, fn(q, pages, bt, lengths, q_lens, layer=layer)

        return jax.lax.scan(body, None, jnp.arange(L, dtype=jnp.int32))[1]

    args = (
        S((5, 1, 4, D), jnp.bfloat16),
        pages,
        S((5, 9), jnp.int32),
        S((5,), jnp.int32),
        S((5,), jnp.int32),
    )
    hlo = jax.jit(run).lower(*args).compile().as_text()
    assert ALL_SHAPE not in hlo and LAYER_SHAPE not in hlo
