"""The jitted steps: paged decoding equals the no-cache forward, whatever the layout.

Every check compares paged logits with ``dense_forward`` on the sequence each row holds
(fp32, rtol 1e-5). Compiled shapes are kept few: steps run at batch 4 x chunk 16, the
dense oracle at batch 4 x length 80.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import CacheConfig
from paged_jax.buckets import bucket, pad_batch, pad_decode
from paged_jax.cache import (
    CacheOpError,
    Status,
    append_slots,
    fork,
    init_state,
    open_sequences,
    raise_for_status,
    release,
)
from paged_jax.kv import poison_free_blocks
from paged_jax.model import ModelConfig, dense_forward, init_params
from paged_jax.steps import init_pages_for, make_step_fns, validate_prompt

CFG = ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=256,
)
B, T, DENSE_LEN = 4, 16, 80
# One pool for most tests, so that they share compiled steps (block_size and policy are
# static: each new pair means new programs).
SHARED = CacheConfig(num_blocks=48, block_size=4, max_seqs=8, max_blocks_per_seq=18)


@functools.cache
def _model(dtype="float32"):
    return init_params(CFG.replace(dtype=dtype), seed=0)


@functools.cache
def _fns(dtype="float32"):
    return make_step_fns(CFG.replace(dtype=dtype), attention_impl="xla")


@functools.cache
def _dense_fn():
    graphdef, _ = _model()
    return jax.jit(lambda params, tokens: dense_forward(graphdef, params, tokens))


def dense_last_logits(seqs) -> np.ndarray:
    """float32[len(seqs), vocab]: no-cache logits at each sequence's last token.

    Sequences are right-padded to DENSE_LEN: causal attention makes the padding invisible.
    """
    out = []
    for i in range(0, len(seqs), B):
        chunk = seqs[i : i + B]
        tokens = np.zeros((B, DENSE_LEN), np.int32)
        for j, s in enumerate(chunk):
            tokens[j, : len(s)] = s
        logits = np.asarray(_dense_fn()(_model()[1], tokens))
        out.extend(logits[j, len(s) - 1] for j, s in enumerate(chunk))
    return np.stack(out)


class Harness:
    """Drives the steps at fixed shapes and remembers every sequence's tokens."""

    def __init__(self, cache_config, policy="lifo", *, poison=False, dtype="float32"):
        self.fns, (_, self.params) = _fns(dtype), _model(dtype)
        self.state = init_state(cache_config, policy)
        self.pages = init_pages_for(CFG.replace(dtype=dtype), cache_config)
        self.poison = poison
        self.tokens: dict[int, list[int]] = {}

    def fragment(self, rng, rounds=4):
        """Scatter the free pool: every row takes a few blocks per round (so rows
        interleave in address order), then all rows are released in a random order."""
        rows = self.state.max_seqs
        ids = jnp.arange(rows, dtype=jnp.int32)
        self.state, status = open_sequences(self.state, ids)
        per_row = min(self.state.num_blocks // rows, self.state.max_blocks_per_seq)
        step = -(-per_row // rounds) * self.state.block_size
        for r in range(rounds):
            n = max(0, min(step, per_row * self.state.block_size - r * step))
            self.state, res = append_slots(self.state, ids, jnp.full((rows,), n, jnp.int32), max_tokens=step)
            raise_for_status("fragment", ids, res.status)
        self.state, status = release(self.state, jnp.asarray(rng.permutation(rows), jnp.int32))
        raise_for_status("fragment", ids, status)

    def open(self, ids):
        self.state, status = open_sequences(self.state, jnp.asarray(ids, jnp.int32))
        raise_for_status("open", ids, status)
        for i in ids:
            self.tokens[i] = []

    def _before_step(self):
        if self.poison:
            self.pages = poison_free_blocks(self.pages, self.state.ref_counts == 0)

    def prefill(self, ids, chunks):
        self._before_step()
        batch = pad_batch(ids, chunks, batch_buckets=[B], length_buckets=[T])
        logits, self.state, self.pages, status = self.fns.prefill(
            self.params, self.state, self.pages, batch.tokens, batch.seq_ids, batch.num_tokens
        )
        raise_for_status("prefill", batch.seq_ids, status)
        for i, c in zip(ids, chunks):
            self.tokens[i].extend(int(x) for x in c)
        return np.asarray(logits)[: len(ids)]

    def prefill_all(self, ids, prompts):
        """Prefill whole prompts in chunks of at most T tokens; last logits per row."""
        last = {}
        offsets = [0] * len(ids)
        while any(o < len(p) for o, p in zip(offsets, prompts)):
            rows = [k for k in range(len(ids)) if offsets[k] < len(prompts[k])][:B]
            chunks = [prompts[k][offsets[k] : offsets[k] + T] for k in rows]
            logits = self.prefill([ids[k] for k in rows], chunks)
            for k, lg in zip(rows, logits):
                offsets[k] += len(chunks[rows.index(k)])
                last[ids[k]] = lg
        return np.stack([last[i] for i in ids])

    def decode(self, ids, toks):
        self._before_step()
        tokens, seq_ids = pad_decode(ids, toks, batch_buckets=[B])
        logits, self.state, self.pages, status = self.fns.decode(self.params, self.state, self.pages, tokens, seq_ids)
        raise_for_status("decode", seq_ids, status)
        for i, t in zip(ids, toks):
            self.tokens[i].append(int(t))
        return np.asarray(logits)[: len(ids)]

    def fork(self, parents, children):
        self.state, status = fork(self.state, jnp.asarray(parents, jnp.int32), jnp.asarray(children, jnp.int32))
        raise_for_status("fork", children, status)
        for p, c in zip(parents, children):
            self.tokens[c] = list(self.tokens[p])

    def check(self, ids, logits, rtol=1e-5, atol=1e-5):
        assert np.isfinite(logits).all()
        want = dense_last_logits([self.tokens[i] for i in ids])
        np.testing.assert_allclose(logits, want, rtol=rtol, atol=atol)


def _prompts(rng, lens):
    return [list(rng.integers(0, CFG.vocab_size, n)) for n in lens]


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 16, 64])  # a token per block, typical, one block past the prompt
def test_paged_equals_dense_across_block_sizes(block_size):
    """Prompts that fill the last block exactly and ones that do not; shuffled pools."""
    rng = np.random.default_rng(block_size)
    per_seq = -(-72 // block_size)
    cc = CacheConfig(num_blocks=4 * per_seq + 4, block_size=block_size, max_seqs=4, max_blocks_per_seq=per_seq)
    if block_size == SHARED.block_size:
        cc = SHARED
    policy = "lifo" if block_size in (1, 64) else "random"  # lifo over a fragmented pool
    h = Harness(cc, policy)
    if policy == "lifo":
        h.fragment(rng)
    lens = [block_size, block_size + 1, 7, 16] if block_size < 64 else [64, 33, 1, 16]
    ids = [3, 0, 2, 1]
    h.open(ids)
    logits = h.prefill_all(ids, _prompts(rng, lens))
    h.check(ids, logits)
    for _ in range(3):
        nxt = logits.argmax(-1)
        logits = h.decode(ids, nxt)
        h.check(ids, logits)


@pytest.mark.slow
def test_forked_prefix_copy_on_write():
    """Children share the parent's partly filled last block; each write copies first."""
    rng = np.random.default_rng(7)
    h = Harness(SHARED, "random")
    h.open([5])
    h.prefill_all([5], _prompts(rng, [10]))  # 2.5 blocks: the last one is shared after fork
    h.fork([5, 5, 5], [1, 2, 6])
    ids = [5, 1, 2, 6]
    for _ in range(5):
        logits = h.decode(ids, rng.integers(0, CFG.vocab_size, len(ids)))
        h.check(ids, logits)
    # All four rows diverged: the shared full blocks are still shared, none of the rest.
    refs = np.asarray(h.state.ref_counts)
    assert (refs[np.asarray(h.state.block_tables[5, :2])] == 4).all()


def test_chunked_prefill_equals_one_shot():
    rng = np.random.default_rng(8)
    prompt = _prompts(rng, [15])[0]
    one = Harness(SHARED, "random")
    one.open([0])
    want = one.prefill([0], [prompt])
    chunked = Harness(SHARED, "random")
    chunked.open([0])
    chunked.prefill([0], [[1, 2, 3]])  # another row first: a different physical layout
    chunked.open([2])
    for a, b in [(0, 3), (3, 4), (4, 12), (12, 15)]:
        got = chunked.prefill([2], [prompt[a:b]])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # ... and the caches hold the same thing: the next decode step agrees too.
    np.testing.assert_allclose(chunked.decode([2], [9]), one.decode([0], [9]), rtol=1e-5, atol=1e-5)


def test_nan_poisoned_free_blocks_change_nothing():
    rng = np.random.default_rng(9)
    prompts = _prompts(rng, [9, 3])
    clean, dirty = Harness(SHARED, "random"), Harness(SHARED, "random", poison=True)
    outs = []
    for h in (clean, dirty):
        h.open([0, 1])
        logits = [h.prefill([0, 1], prompts)]
        h.fork([0], [2])
        for tok in ([4, 5, 6], [7, 8, 9]):
            logits.append(h.decode([0, 1, 2], tok))
        outs.append(np.concatenate(logits))
    assert np.isfinite(outs[1]).all()
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.slow
def test_bf16_close_to_fp32():
    """bf16 weights, compute and pages vs fp32: logits within 0.1 (about 2.5% of their range)."""
    rng = np.random.default_rng(10)
    prompts = _prompts(rng, [9, 14])
    out = {}
    for dtype in ("float32", "bfloat16"):
        h = Harness(SHARED, "random", dtype=dtype)
        if dtype == "bfloat16":  # the same weights, rounded
            h.params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _model()[1])
        h.open([0, 1])
        logits = [h.prefill([0, 1], prompts)]
        for tok in ([4, 5], [7, 8], [1, 2]):
            logits.append(h.decode([0, 1], tok))
        out[dtype] = np.concatenate(logits)
    scale = np.abs(out["float32"]).max()
    err = np.abs(out["bfloat16"] - out["float32"]).max()
    assert err <= 0.1, (err, scale)
    assert (out["bfloat16"].argmax(-1) == out["float32"].argmax(-1)).mean() >= 0.75


@pytest.mark.slow
def test_decode_compiles_once_per_bucket():
    """24 steps, sequences growing and joining/leaving, batch padded to power-of-two buckets."""
    traces = []
    fns = make_step_fns(CFG, attention_impl="xla", on_trace=lambda name, shape: traces.append((name, shape)))
    _, params = _model()
    cc = CacheConfig(num_blocks=96, block_size=4, max_seqs=8, max_blocks_per_seq=16)
    state, pages = init_state(cc), init_pages_for(CFG, cc)
    rng = np.random.default_rng(11)
    live: list[int] = []
    buckets_used = set()
    for step in range(24):
        want = [2, 3, 5, 7, 6, 4, 3, 2][step // 3]  # live sequences over time: buckets 2, 4, 8
        while len(live) < want:  # admit one: open + prefill (chunk padded to T)
            sid = min(set(range(8)) - set(live))
            state, st = open_sequences(state, jnp.array([sid], jnp.int32))
            batch = pad_batch([sid], [list(rng.integers(0, 128, 5))], length_buckets=[T])
            _, state, pages, st = fns.prefill(params, state, pages, batch.tokens, batch.seq_ids, batch.num_tokens)
            raise_for_status("prefill", batch.seq_ids, st)
            live.append(sid)
        while len(live) > want:
            state, st = release(state, jnp.array([live.pop(0)], jnp.int32))
        tokens, seq_ids = pad_decode(live, list(rng.integers(0, 128, len(live))))
        buckets_used.add(len(seq_ids))
        logits, state, pages, st = fns.decode(params, state, pages, tokens, seq_ids)
        raise_for_status("decode", seq_ids, st)
    decode_traces = [s for n, s in traces if n == "decode"]
    assert buckets_used == {2, 4, 8}
    assert sorted(decode_traces) == sorted((b,) for b in buckets_used)  # once per bucket
    assert [s for n, s in traces if n == "prefill"] == [(1, T)]


def test_rejected_step_leaves_cache_and_pages_unchanged():
    h = Harness(SHARED, "random")
    h.open([0, 1])
    h.prefill([0, 1], [[1, 2, 3], [4, 5, 6, 7, 8]])
    before_state, before_pages = jax.device_get((h.state, h.pages))

    def same():
        for a, b in zip(jax.tree.leaves(before_state), jax.tree.leaves(jax.device_get(h.state))):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(before_pages.k, np.asarray(h.pages.k))
        np.testing.assert_array_equal(before_pages.v, np.asarray(h.pages.v))

    # Row 2 was never opened: the whole call, rows 0 and 1 included, is refused.
    batch = pad_batch([0, 1, 2], [[1, 2], [3, 4, 5, 6], [7]], batch_buckets=[B], length_buckets=[T])
    _, h.state, h.pages, status = h.fns.prefill(h.params, h.state, h.pages, *batch)
    assert list(np.asarray(status)[:3]) == [Status.OK, Status.OK, Status.INACTIVE_SEQ]
    same()
    # An id outside the vocabulary: refused with Status.INVALID_TOKEN, nothing changes.
    batch = pad_batch([0, 1], [[1, 2], [3, CFG.vocab_size]], batch_buckets=[B], length_buckets=[T])
    _, h.state, h.pages, status = h.fns.prefill(h.params, h.state, h.pages, *batch)
    assert list(np.asarray(status)[:2]) == [Status.OK, Status.INVALID_TOKEN]  # row 0 fine, call refused
    same()
    tokens, seq_ids = pad_decode([0, 1], [-1, 3], batch_buckets=[B])
    _, h.state, h.pages, status = h.fns.decode(h.params, h.state, h.pages, tokens, seq_ids)
    assert list(np.asarray(status)[:2]) == [Status.INVALID_TOKEN, Status.OK]
    same()
    with pytest.raises(CacheOpError, match="seq 0: INVALID_TOKEN"):
        raise_for_status("decode", seq_ids, status)


def test_validate_prompt_names_the_limits():
    cc = CacheConfig(num_blocks=64, block_size=16, max_seqs=4, max_blocks_per_seq=8)
    assert validate_prompt([1, 2, 3], model_config=CFG, cache_config=cc).dtype == np.int32
    with pytest.raises(ValueError, match=r"129 tokens.*8 \* 16 = 128"):
        validate_prompt(np.ones(129, int), model_config=CFG, cache_config=cc)
    with pytest.raises(ValueError, match=r"260 tokens \(100 held \+ 100 prompt \+ 60 new\).*max_position_embeddings = 256"):
        validate_prompt(np.ones(100, int), model_config=CFG, start_len=100, max_new_tokens=60)
    with pytest.raises(ValueError, match=r"257 tokens.*max_position_embeddings = 256"):
        validate_prompt(np.ones(257, int), model_config=CFG)
    with pytest.raises(ValueError, match=r"token id 128 at index 1 .*\[0, 128\)"):
        validate_prompt([0, 128, 5], model_config=CFG)
    with pytest.raises(ValueError, match=r"token id -1"):
        validate_prompt([-1], model_config=CFG)
    with pytest.raises(ValueError, match="non-empty"):
        validate_prompt([], model_config=CFG)
    windowed = CFG.replace(sliding_window=64)
    with pytest.raises(ValueError, match="sliding_window = 64"):
        validate_prompt(np.ones(65, int), model_config=windowed)


def test_bucket_and_padding_helpers():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 64, 65)] == [1, 1, 2, 4, 4, 8, 64, 128]
    assert bucket(3, [2, 8, 4]) == 4
    with pytest.raises(ValueError, match="largest bucket 8"):
        bucket(9, [2, 8])
    batch = pad_batch([4, 2, 7], [[1, 2, 3], [5], [6, 6, 6, 6, 6]])
    assert batch.tokens.shape == (4, 8) and batch.tokens.dtype == np.int32
    assert list(batch.seq_ids) == [4, 2, 7, -1] and list(batch.num_tokens) == [3, 1, 5, 0]
    assert list(batch.tokens[1]) == [5, 0, 0, 0, 0, 0, 0, 0]
    tokens, ids = pad_decode([1, 2, 3], [9, 8, 7])
    assert list(tokens) == [9, 8, 7, 0] and list(ids) == [1, 2, 3, -1]
