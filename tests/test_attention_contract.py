"""Every implementation of the paged-attention contract, through the same cases, against
the one oracle (``paged_jax.attention.reference.paged_attention``); the oracle itself
against a brute-force NumPy loop.

A case is a pool whose physical blocks are handed out in a random order; rows have ragged
lengths (0, 1, a block, a block + 1, the table's capacity, ...), some rows hold keys but
no query (padding rows), one row may share its first blocks with another (a fork), table
entries past a row's blocks hold garbage (-1, other rows' blocks, ids past the pool), and
every slot no row owns (free blocks, the stale tail of last blocks) is NaN, in every
layer. Shapes are ones every implementation takes (the Pallas kernels need head_dim in
{64, 128, 256} and block_size in {8..128}; interpret mode runs them on CPU), and each
configuration keeps its shapes across cases, so an implementation compiles once per
configuration.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention import blocked, dispatch, reference
from paged_jax.attention import contract as contract_module
from paged_jax.kv import KVPages, quant

D = 64  # the smallest head_dim the kernels take
LAYERS = 3


class Config(NamedTuple):
    name: str
    hq: int
    hkv: int
    bs: int
    t: int  # queries per row: 1 is decode
    b: int = 6
    p: int = 4  # table columns

    @property
    def n(self) -> int:  # physical blocks: every row's, plus a few always free
        return self.b * self.p + 3


MHA_DECODE = Config("mha-bs8-decode", hq=2, hkv=2, bs=8, t=1, p=5)
GQA_DECODE = Config("gqa4-bs16-decode", hq=8, hkv=2, bs=16, t=1)
GQA_CHUNK = Config("gqa4-bs16-chunk5", hq=8, hkv=2, bs=16, t=5)
MQA_CHUNK = Config("mqa-bs32-chunk8", hq=4, hkv=1, bs=32, t=8, p=3)
CONFIGS = [MHA_DECODE, GQA_DECODE, GQA_CHUNK, MQA_CHUNK]


class Case(NamedTuple):
    q: jax.Array  # [B, T, Hq, D]
    pages: KVPages  # leaves [Hkv, N, bs, D], or [L, Hkv, N, bs, D]
    block_tables: jax.Array  # int32[B, P]
    lengths: jax.Array  # int32[B]
    q_lens: jax.Array  # int32[B]


def make_case(cfg: Config, seed: int, *, fork: bool, layers: int | None = None, dtype=jnp.float32) -> Case:
    """A case of ``cfg``'s shapes (see the module doc); 5-D pages when ``layers`` is given,
    every layer with its own data and the same NaN slots; ``fork`` shares a prefix block."""
    rng = np.random.default_rng(seed)
    cap = cfg.p * cfg.bs
    fixed = [0, cap, 1, cfg.bs, min(cfg.t, cap), cfg.bs + 1]
    lengths = np.array((fixed + list(rng.integers(1, cap + 1, cfg.b)))[: cfg.b], np.int32)
    q_lens = np.minimum(rng.integers(1, cfg.t + 1, cfg.b), lengths)
    q_lens[1] = min(cfg.t, cap)  # a whole chunk at the end of the longest row
    q_lens[4] = lengths[4]  # a chunk that is the whole sequence (prefill from empty)
    q_lens[5] = 0  # keys but no query: a padding row
    order = rng.permutation(cfg.b)
    lengths, q_lens = lengths[order], q_lens[order]

    free = list(rng.permutation(cfg.n))
    tables = np.full((cfg.b, cfg.p), -1, np.int32)
    for i, length in enumerate(lengths):
        for j in range(-(-int(length) // cfg.bs)):
            tables[i, j] = free.pop()
    if fork:  # the longest row's first full blocks are also another row's first blocks
        src, dst = int(np.argmax(lengths)), int(np.flatnonzero(order == 3)[0])  # the bs-long row
        shared = min(lengths[src], lengths[dst]) // cfg.bs
        tables[dst, :shared] = tables[src, :shared]
    owned = np.zeros((cfg.n, cfg.bs), bool)
    for i, length in enumerate(lengths):
        pos = np.arange(length)
        owned[tables[i, pos // cfg.bs], pos % cfg.bs] = True
        past = np.arange(cfg.p) >= -(-int(length) // cfg.bs)
        tables[i, past] = rng.choice([-1, *rng.integers(0, cfg.n + 4, 3)], past.sum())

    shape = (cfg.hkv, cfg.n, cfg.bs, D) if layers is None else (layers, cfg.hkv, cfg.n, cfg.bs, D)
    k, v = rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)
    k[..., ~owned, :] = np.nan
    v[..., ~owned, :] = np.nan
    q = rng.standard_normal((cfg.b, cfg.t, cfg.hq, D), np.float32)
    return Case(
        jnp.asarray(q, dtype),
        KVPages(jnp.asarray(k, dtype), jnp.asarray(v, dtype)),
        jnp.asarray(tables),
        jnp.asarray(lengths),
        jnp.asarray(q_lens.astype(np.int32)),
    )


def layer_case(case: Case, layer: int) -> Case:
    """The same case on one layer's 4-D pages (sliced here, for the oracle only)."""
    return case._replace(pages=KVPages(case.pages.k[layer], case.pages.v[layer]))


oracle = jax.jit(reference.paged_attention, static_argnames=("layer", "scale"))

# Every registered implementation that obeys the contract and runs on this backend (a new
# ``dispatch.register`` entry joins these tests by being registered), plus tuning variants
# of the blocked loops that exercise its edge paths.
REGISTERED = [name for name, entry in dispatch.IMPLS.items()
              if entry.obeys_contract and entry.runs_on(jax.default_backend())]
IMPLS = {name: dispatch.IMPLS[name].fn for name in REGISTERED} | {
    "blocked": blocked.paged_attention,
    "blocked-tile1-chunk1": functools.partial(
        blocked.paged_attention, query_tile=1, blocks_per_chunk=1, tail_blocks=1
    ),
    "blocked-one-group": functools.partial(
        blocked.paged_attention, query_tile=16, min_groups=1, blocks_per_chunk=3, tail_blocks=3
    ),
    "blocked-tail-not-dividing": functools.partial(
        blocked.paged_attention, query_tile=4, min_groups=2, blocks_per_chunk=4, tail_blocks=3
    ),
    # "auto" runs decode's products as fused sums and chunks' as dots: each form on the other too.
    "blocked-dot-products": functools.partial(blocked.paged_attention, products="dot"),
    "blocked-sum-products": functools.partial(blocked.paged_attention, products="sum", blocks_per_chunk=3),
}
# fp32 "xla" is the blocked implementation with default tuning, so "blocked" joins only
# where "xla" may be something else (bf16).
FP32_IMPLS = [name for name in IMPLS if name != "blocked"]
BF16_IMPLS = [*REGISTERED, "blocked"]
LAYER_IMPLS = REGISTERED
QUANT_IMPLS = [name for name in REGISTERED if dispatch.IMPLS[name].reads_quantized and name != "reference"]


def slow_here(impl: str) -> bool:
    """A registered entry that runs slowly on this backend (``slow_on``: an interpreter)."""
    entry = dispatch.IMPLS.get(impl)
    return entry is not None and jax.default_backend() in entry.slow_on


def grid(impls, cfgs, *extra, quick=None):
    """(impl, cfg[, extra...]) parameters; for an entry slow here, every case but the ones
    ``quick(cfg, *extra)`` accepts (default: the first cfg and first extras) is marked slow."""
    first = (cfgs[0], *(e[0] for e in extra))
    extra = extra or [(None,)]
    quick = quick or (lambda *key: key == first)
    out = []
    for impl in impls:
        for cfg in cfgs:
            for rest in itertools.product(*extra):
                rest = tuple(r for r in rest if r is not None)
                slow = slow_here(impl) and not quick(cfg, *rest)
                ids = "-".join([impl, cfg.name, *map(str, rest)])
                out.append(pytest.param(impl, cfg, *rest, id=ids, marks=[pytest.mark.slow] if slow else []))
    return out


def skip_untileable(impl: str, cfg) -> None:
    """Skip a registered entry on shapes it says it cannot tile (its ``tiling_problem``)."""
    entry = dispatch.IMPLS.get(impl)
    why = entry and entry.problem(head_dim=D, block_size=cfg.bs, num_heads=cfg.hq, num_kv_heads=cfg.hkv)
    if why:
        pytest.skip(why)


@functools.cache
def jitted(name: str, **static):
    return jax.jit(functools.partial(IMPLS[name], **static))


def check_output(out, case: Case, want, *, rtol: float, atol: float) -> None:
    """``out`` is q-shaped and -typed, finite, close to ``want``, and exactly 0 in every
    row without a query (t >= q_lens, which includes rows of length 0)."""
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all(), "NaN/Inf reached the output"
    np.testing.assert_allclose(out, np.asarray(want.astype(jnp.float32)), rtol=rtol, atol=atol)
    no_query = np.arange(case.q.shape[1])[None, :] >= np.asarray(case.q_lens)[:, None]
    assert no_query.any() and not out[no_query].any()


# ----------------------------------------------------------------------------- the oracle
def brute_force(case: Case, scale: float) -> np.ndarray:
    """Row by row, head by head, query by query, in float64 over contiguous keys."""
    k_pages, v_pages = np.asarray(case.pages.k, np.float64), np.asarray(case.pages.v, np.float64)
    q = np.asarray(case.q, np.float64)
    b, t, hq, _ = q.shape
    hkv, _, bs, _ = k_pages.shape
    out = np.zeros(q.shape)
    for row in range(b):
        length, q_len = int(case.lengths[row]), int(case.q_lens[row])
        ids = [int(case.block_tables[row, j // bs]) for j in range(length)]
        keys = (
            np.stack([k_pages[:, ids[j], j % bs] for j in range(length)], 1) if length else None
        )  # [Hkv, S, D]
        vals = np.stack([v_pages[:, ids[j], j % bs] for j in range(length)], 1) if length else None
        for i in range(q_len):
            pos = length - q_len + i
            for h in range(hq):
                kv = h // (hq // hkv)
                s = keys[kv, : pos + 1] @ q[row, i, h] * scale
                p = np.exp(s - s.max())
                out[row, i, h] = (p / p.sum()) @ vals[kv, : pos + 1]
    return out


@pytest.mark.parametrize("cfg", [GQA_DECODE, MQA_CHUNK], ids=lambda c: c.name)
def test_oracle_matches_brute_force(cfg):
    for seed, scale in ((0, None), (1, 0.3)):
        case = make_case(cfg, seed, fork=bool(seed))
        out = oracle(*case, scale=scale)
        want = brute_force(case, D**-0.5 if scale is None else scale)
        check_output(out, case, jnp.asarray(want, jnp.float32), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------- every implementation
@pytest.mark.parametrize("impl,cfg", grid(FP32_IMPLS, CONFIGS, quick=lambda c: c in (GQA_DECODE, MQA_CHUNK)))
def test_fp32_matches_oracle(impl, cfg):
    skip_untileable(impl, cfg)
    for seed in (0, 1):
        case = make_case(cfg, seed, fork=bool(seed))
        check_output(jitted(impl)(*case), case, oracle(*case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl,cfg", grid(BF16_IMPLS, [GQA_DECODE, GQA_CHUNK]))
def test_bf16_close_to_oracle(impl, cfg):
    """bf16 q and pages; the oracle computes in fp32 from the same bf16 values."""
    skip_untileable(impl, cfg)
    case = make_case(cfg, 2, fork=True, dtype=jnp.bfloat16)
    check_output(jitted(impl)(*case), case, oracle(*case), rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize("impl,cfg,how", grid(LAYER_IMPLS, [GQA_DECODE, GQA_CHUNK], ["int", "traced", "scan"]))
def test_layer_of_stacked_pages(impl, cfg, how):
    """5-D pages [L, Hkv, N, bs, D] with a Python-int layer, a traced layer (a jit
    argument), and a traced layer under ``lax.scan`` over every layer (as a model scanning
    its layers): each layer's output is the oracle's on that layer's 4-D pages."""
    skip_untileable(impl, cfg)
    case = make_case(cfg, 3, fork=True, layers=LAYERS)
    fn = IMPLS[impl]
    if how == "int":  # also a non-default scale, which no other case uses
        layer = LAYERS - 1
        out = jitted(impl, layer=layer, scale=0.7)(*case)
        check_output(out, case, oracle(*layer_case(case, layer), scale=0.7), rtol=1e-5, atol=1e-5)
        return
    if how == "traced":
        run = jax.jit(
            lambda q, pages, bt, lengths, q_lens, layer: fn(q, pages, bt, lengths, q_lens, layer=layer)
        )
        outs = [run(*case, jnp.int32(layer)) for layer in range(LAYERS)]
    else:

        @jax.jit
        def run(q, pages, bt, lengths, q_lens):
            def body(carry, layer):
                return carry, fn(q, pages, bt, lengths, q_lens, layer=layer)

            return jax.lax.scan(body, None, jnp.arange(LAYERS, dtype=jnp.int32))[1]

        outs = list(run(*case))
    wants = [oracle(*layer_case(case, layer)) for layer in range(LAYERS)]
    for out, want in zip(outs, wants):
        check_output(out, case, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(wants[0], wants[1])  # the layers hold different data


# --------------------------------------------------------------------------- the ragged form
RAGGED_IMPLS = REGISTERED  # every registered entry has a ragged form (its own, or one query per row)


def ragged_case(case: Case, seed: int) -> tuple[jax.Array, jax.Array, np.ndarray]:
    """``case``'s queries packed: ``(q [N, Hq, D], q_starts int32[B], where int32[N, 2])``,
    each row's real queries one after another with random gaps between rows (and a tail);
    ``where[i]`` is the (row, t) query i came from, (-1, -1) for gap tokens (NaN there)."""
    rng = np.random.default_rng(seed)
    q = np.asarray(case.q.astype(jnp.float32))
    q_lens = np.asarray(case.q_lens)
    parts, where, starts, at = [], [], [], 0
    for row, n in enumerate(q_lens):
        gap = int(rng.integers(0, 3))
        parts.append(np.full((gap, *q.shape[2:]), np.nan, np.float32))
        where += [(-1, -1)] * gap
        at += gap
        starts.append(at)
        parts.append(q[row, :n])
        where += [(row, t) for t in range(n)]
        at += int(n)
    parts.append(np.full((2, *q.shape[2:]), np.nan, np.float32))  # a tail no row owns
    where += [(-1, -1)] * 2
    packed = jnp.asarray(np.concatenate(parts), case.q.dtype)
    return packed, jnp.asarray(np.asarray(starts, np.int32)), np.asarray(where, np.int32)


def check_ragged(out, packed, where, want, *, rtol, atol):
    """``out`` [N, Hq, D] in q's dtype: the padded answer ``want`` at each packed query, 0
    at every token that belongs to no row (gaps hold NaN queries: they must not leak)."""
    assert out.shape == packed.shape and out.dtype == packed.dtype
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    real = where[:, 0] >= 0
    want = np.asarray(want.astype(jnp.float32))[where[real, 0], where[real, 1]]
    np.testing.assert_allclose(out[real], want, rtol=rtol, atol=atol)
    assert not out[~real].any()


@pytest.mark.parametrize("impl,cfg", grid(RAGGED_IMPLS, CONFIGS, quick=lambda c: c in (GQA_DECODE, GQA_CHUNK)))
def test_ragged_form_matches_the_padded_oracle(impl, cfg):
    """Packed queries (rows one after another, gaps between them) through each entry's
    ragged form, fp32 and 5-D pages with a traced layer: the padded oracle's answer."""
    skip_untileable(impl, cfg)
    case = make_case(cfg, 4, fork=True, layers=LAYERS)
    packed, starts, where = ragged_case(case, 4)
    fn = dispatch.IMPLS[impl].ragged_fn
    run = jax.jit(lambda q, pages, bt, lengths, starts, q_lens, layer: fn(q, pages, bt, lengths, starts, q_lens,
                                                                         layer=layer))
    out = run(packed, case.pages, case.block_tables, case.lengths, starts, case.q_lens, jnp.int32(1))
    check_ragged(out, packed, where, oracle(*layer_case(case, 1)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", RAGGED_IMPLS)
def test_ragged_form_bf16_through_the_dispatcher(impl):
    skip_untileable(impl, GQA_CHUNK)
    if slow_here(impl):
        pytest.skip("an interpreter: the fp32 case covers it")
    case = make_case(GQA_CHUNK, 5, fork=False, dtype=jnp.bfloat16)
    packed, starts, where = ragged_case(case, 5)
    out = jax.jit(functools.partial(dispatch.ragged_paged_attention, impl=impl))(
        packed, case.pages, case.block_tables, case.lengths, starts, case.q_lens)
    check_ragged(out, packed, where, oracle(*case), rtol=2e-2, atol=3e-2)


def test_ragged_as_rows_is_one_query_per_row():
    """The generic ragged form over the oracle equals the padded oracle (decode and chunks)."""
    for cfg in (GQA_DECODE, MQA_CHUNK):
        case = make_case(cfg, 6, fork=True)
        packed, starts, where = ragged_case(case, 6)
        out = contract_module.ragged_as_rows(reference.paged_attention)(
            packed, case.pages, case.block_tables, case.lengths, starts, case.q_lens)
        check_ragged(out, packed, where, oracle(*case), rtol=1e-5, atol=1e-5)


def test_ragged_shapes_are_checked():
    case = make_case(GQA_DECODE, 0, fork=False)
    packed, starts, _ = ragged_case(case, 0)
    with pytest.raises(ValueError, match=r"ragged q must be \[N, Hq, D\]"):
        dispatch.ragged_paged_attention(case.q, case.pages, case.block_tables, case.lengths, starts, case.q_lens)
    with pytest.raises(ValueError, match="q_starts must be int32"):
        dispatch.ragged_paged_attention(packed, case.pages, case.block_tables, case.lengths, starts[:2], case.q_lens)


# ------------------------------------------------------------------------- quantised pages
def quantized_case(case: Case, name: str) -> tuple[Case, Case]:
    """``case`` with its pages quantised to ``name`` (``kv.quant``), and the float case
    that holds exactly what they dequantise to. Unowned slots stay poisoned: per token,
    their scales are NaN; per channel, their values are garbage (127) and the scales of
    blocks nobody owns NaN (int8 holds no NaN)."""
    fmt = quant.kv_format(name)
    owned = ~np.isnan(np.asarray(case.pages.k)[..., 0])  # [(L,) Hkv, N, bs]
    nan = np.asarray(quant.scale_bits(jnp.asarray(np.nan)))

    def one(x):
        vals, scales = quant.quantize_blocks(fmt, jnp.asarray(np.nan_to_num(np.asarray(x))))
        vals, scales = np.array(vals), np.array(scales)  # scales: stored bits
        if fmt.per_channel:
            vals[~owned] = 127
            scales[~owned.any(-1)] = nan
        else:
            scales[~owned] = nan
        deq = np.array(quant.dequantize(jnp.asarray(vals), jnp.asarray(scales), fmt.per_channel))
        deq[~owned] = np.nan
        return jnp.asarray(vals), jnp.asarray(scales), jnp.asarray(deq)

    k, ks, k_deq = one(case.pages.k)
    v, vs, v_deq = one(case.pages.v)
    return case._replace(pages=KVPages(k, v, ks, vs, kv_format=name)), case._replace(pages=KVPages(k_deq, v_deq))


@pytest.mark.parametrize("name", quant.QUANTIZED_KV_CACHE_DTYPES)
def test_quantized_oracle_matches_brute_force_on_the_dequantised_values(name):
    for cfg in (GQA_DECODE, MQA_CHUNK):
        qcase, fcase = quantized_case(make_case(cfg, 4, fork=True), name)
        want = brute_force(fcase, D**-0.5)
        check_output(oracle(*qcase), qcase, jnp.asarray(want, jnp.float32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl,cfg,name", grid([*QUANT_IMPLS, "blocked-one-group"], [GQA_DECODE, GQA_CHUNK],
                                              list(quant.QUANTIZED_KV_CACHE_DTYPES)))
def test_quantized_pages_match_oracle(impl, cfg, name):
    """Every implementation reads values x scales: 5-D quantised pages, a traced layer."""
    skip_untileable(impl, cfg)
    entry = dispatch.IMPLS.get(impl)
    if entry is not None and not entry.reads(name):
        with pytest.raises(ValueError, match=name):
            qcase, _ = quantized_case(make_case(cfg, 5, fork=True, layers=2), name)
            IMPLS[impl](*qcase, layer=1)
        pytest.skip(f"{impl} reads {entry.reads_formats} only (and refuses {name}, checked)")
    qcase, _ = quantized_case(make_case(cfg, 5, fork=True, layers=2), name)
    run = jax.jit(lambda *a: IMPLS[impl](*a[:5], layer=a[5]))
    want = oracle(*qcase, layer=1)
    check_output(run(*qcase, jnp.int32(1)), qcase, want, rtol=1e-5, atol=1e-5)
    if name == "int8":  # bf16 queries over int8 pages (a bf16 model's int8 cache)
        bcase = qcase._replace(q=qcase.q.astype(jnp.bfloat16))
        check_output(run(*bcase, jnp.int32(1)), bcase, oracle(*bcase, layer=1), rtol=2e-2, atol=3e-2)


def test_pages_without_their_scales_are_refused():
    qcase, _ = quantized_case(make_case(GQA_DECODE, 6, fork=False), "int8")
    for impl in [name for name in REGISTERED if dispatch.IMPLS[name].reads_quantized]:
        with pytest.raises(ValueError, match="need scales"):
            IMPLS[impl](*qcase._replace(pages=KVPages(qcase.pages.k, qcase.pages.v)))
        with pytest.raises(ValueError, match="do not fit"):
            bad = qcase.pages.replace(k_scale=qcase.pages.k_scale[..., :1], v_scale=qcase.pages.v_scale[..., :1])
            IMPLS[impl](*qcase._replace(pages=bad))


# ------------------------------------------------------------------------------ validation
S = jax.ShapeDtypeStruct


def _abstract_case(**changes):
    """A contract-valid abstract call (GQA 4:2, 5-D pages, layer 1), with ``changes``."""
    args = dict(
        q=S((2, 3, 4, D), jnp.float32),
        k=S((LAYERS, 2, 10, 8, D), jnp.float32),
        v=None,
        bt=S((2, 4), jnp.int32),
        lengths=S((2,), jnp.int32),
        q_lens=S((2,), jnp.int32),
        layer=1,
    )
    args.update(changes)
    if args["v"] is None:
        args["v"] = args["k"]
    return args


def _eval_shape(impl: str, a: dict):
    """jax.eval_shape of ``impl`` on the abstract call ``a``; an abstract layer is traced."""
    args = [a["q"], a["k"], a["v"], a["bt"], a["lengths"], a["q_lens"]]
    layer = a["layer"]
    if isinstance(layer, S):
        return jax.eval_shape(
            lambda q, k, v, bt, lengths, q_lens, layer: IMPLS[impl](
                q, KVPages(k, v), bt, lengths, q_lens, layer=layer
            ),
            *args,
            layer,
        )
    return jax.eval_shape(
        lambda q, k, v, bt, lengths, q_lens: IMPLS[impl](q, KVPages(k, v), bt, lengths, q_lens, layer=layer),
        *args,
    )


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(layer=None), "layer"),  # 5-D pages without a layer
        (dict(k=S((2, 10, 8, D), jnp.float32)), "layer"),  # 4-D pages with one
        (dict(layer=LAYERS), "out of range"),
        (dict(layer=-1), "out of range"),
        (dict(layer=1.0), "layer must be an int"),
        (dict(layer=True), "layer must be an int"),
        (dict(layer=S((), jnp.float32)), "layer must be an int"),
        (dict(layer=S((2,), jnp.int32)), "layer must be an int"),
        (dict(q=S((2, 3, 3, D), jnp.float32)), "multiple of num_kv_heads"),
        (dict(q=S((2, 4, D), jnp.float32)), r"\[B, T, Hq, D\]"),
        (dict(q=S((2, 3, 4, 2 * D), jnp.float32)), "head_dim"),
        (dict(v=S((LAYERS, 2, 11, 8, D), jnp.float32)), "differ"),
        (dict(bt=S((3, 4), jnp.int32)), "block_tables"),
        (dict(lengths=S((2,), jnp.float32)), "lengths"),
        (dict(q_lens=S((1,), jnp.int32)), "q_lens"),
    ],
)
@pytest.mark.parametrize("impl", [*REGISTERED, "blocked"])
def test_every_implementation_validates_the_contract(impl, changes, match):
    with pytest.raises(ValueError, match=match):
        _eval_shape(impl, _abstract_case(**changes))
    # ... while the unchanged call passes, with an int and with a traced layer.
    for layer in (1, S((), jnp.int32)):
        assert _eval_shape(impl, _abstract_case(layer=layer)).shape == (2, 3, 4, D)
