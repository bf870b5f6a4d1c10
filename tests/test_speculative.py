"""Speculative decoding, the parts: prompt lookup, the sampling distribution, the
acceptance rule (exact for greedy rows, distribution-preserving for sampled ones, by a
statistical test over many seeded draws), the rollback as a block-manager transition,
and the configuration's errors. The engine end to end is tests/test_engine_speculative.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_jax.cache import check_invariants, fork, init_state, open_sequences
from paged_jax.config import CacheConfig
from paged_jax.engine import LLM, SamplingParams
from paged_jax.engine.beam import BeamSearchParams
from paged_jax.engine.programs import fused_verify
from paged_jax.engine.sampling import sample, sampling_probs
from paged_jax.engine.speculative import SpeculativeConfig, ngram_propose, verify
from tests.engine_fakes import VOCAB, fake_backend

# ------------------------------------------------------------------ prompt lookup


def _ngram_reference(tokens, k, max_n, min_n):
    """Brute force: for n from max_n down, the latest start j < len - n with
    tokens[j:j+n] == the last n tokens; propose what follows it."""
    t = list(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= len(t):
            continue
        suffix = t[-n:]
        for j in range(len(t) - n - 1, -1, -1):
            if t[j: j + n] == suffix:
                return t[j + n: j + n + k]
    return []


def test_ngram_examples():
    assert ngram_propose([1, 2, 3, 4, 1, 2], 3, 3, 1) == [3, 4, 1]
    assert ngram_propose([1, 2, 3, 4, 1, 2], 1, 3, 1) == [3]
    assert ngram_propose([5, 6, 7], 4, 3, 1) == []  # nothing repeats
    assert ngram_propose([9, 9], 4, 3, 1) == [9]  # the match may run into the suffix
    assert ngram_propose([1, 2, 1, 3, 1, 2, 1], 2, 3, 1) == [3, 1]  # longest n first: "1 2 1"
    assert ngram_propose([1, 2, 1, 3, 1], 2, 1, 1) == [3, 1]  # n = 1: the latest earlier "1"
    assert ngram_propose([4, 1, 2, 3, 1, 2], 2, 4, 3) == []  # min_n = 3: "1 2" is too short


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(1, 5), st.integers(1, 4),
       st.integers(1, 4))
def test_ngram_matches_brute_force(tokens, k, a, b):
    lo, hi = min(a, b), max(a, b)
    assert ngram_propose(tokens, k, hi, lo) == _ngram_reference(tokens, k, hi, lo)


# ------------------------------------------------------------------ the sampling distribution


def _probs_reference(logits, temperature, top_k, top_p):
    """NumPy: softmax(logits / T) over the top-k, then the smallest top-p prefix; one-hot
    argmax for T = 0."""
    v = len(logits)
    if temperature == 0:
        out = np.zeros(v)
        out[int(np.argmax(logits))] = 1
        return out
    order = sorted(range(v), key=lambda i: (-logits[i] / temperature, i))
    kept = order[: top_k if top_k > 0 else v]
    z = np.array([logits[i] / temperature for i in kept], np.float64)
    p = np.exp(z - z.max())
    p /= p.sum()
    n = 0
    while n < len(kept) and (n == 0 or p[:n].sum() < top_p):
        n += 1
    out = np.zeros(v)
    out[kept[:n]] = p[:n] / p[:n].sum()
    return out


def test_sampling_probs_match_reference_and_sample():
    rng = np.random.default_rng(0)
    b, v = 64, 12
    logits = rng.normal(size=(b, v)).astype(np.float32) * 2
    temperature = rng.choice([0.0, 0.5, 1.0, 1.7], b).astype(np.float32)
    top_k = rng.choice([-1, 1, 3, 7], b).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5, 0.2], b).astype(np.float32)
    got = np.asarray(sampling_probs(logits, temperature, top_k, top_p))
    for i in range(b):
        np.testing.assert_allclose(got[i], _probs_reference(logits[i], temperature[i], top_k[i], top_p[i]),
                                   atol=1e-5)
    # sample draws only from that support, for many seeds
    for step in range(20):
        toks, _ = sample(logits, temperature, top_k, top_p, np.arange(b, dtype=np.uint32) + 7, np.full(b, step))
        assert (got[np.arange(b), np.asarray(toks)] > 0).all()


# ------------------------------------------------------------------ the acceptance rule


@pytest.mark.slow
def test_greedy_rows_keep_the_leading_argmax_matches():
    rng = np.random.default_rng(1)
    b, k, v = 6, 4, 10
    logits = rng.normal(size=(b, k + 1, v)).astype(np.float32)
    argmax = logits.argmax(-1)
    proposals = argmax[:, :k].copy()
    proposals[1, 0] = (proposals[1, 0] + 1) % v  # rejects the first
    proposals[2, 2] = (proposals[2, 2] + 1) % v  # keeps two
    num = np.array([4, 4, 4, 2, 0, 3], np.int32)
    zeros = np.zeros(b, np.float32)
    for greedy_only in (True, False):
        out = verify(logits, proposals, num, None, zeros, np.full(b, -1, np.int32), np.ones(b, np.float32),
                     np.zeros(b, np.uint32), np.zeros(b, np.int32), greedy_only=greedy_only)
        accepted = np.asarray(out.accepted)
        np.testing.assert_array_equal(accepted, [4, 0, 2, 2, 0, 3])
        tokens = np.asarray(out.tokens)
        for r in range(b):
            a = accepted[r]
            assert tokens[r, :a].tolist() == proposals[r, :a].tolist()
            assert tokens[r, a] == argmax[r, a]  # the bonus or the correction: the target's argmax
        lsm = np.asarray(jax.nn.log_softmax(logits, -1))
        np.testing.assert_allclose(np.asarray(out.logprobs)[0], lsm[0, np.arange(k + 1), tokens[0]], rtol=1e-6)


def _emitted_pairs(logits, proposals_fn, temperature, draws):
    """Empirical distribution of a round's first two output tokens over ``draws`` seeds,
    rounds whose first proposal was rejected (one token) recorded as (t1, -1)."""
    b = draws
    k, v = logits.shape[0] - 1, logits.shape[1]
    seeds = np.arange(b, dtype=np.uint32) * 7919 + 1
    proposals, q = proposals_fn(seeds)
    out = jax.jit(verify)(np.broadcast_to(logits, (b, k + 1, v)), proposals, np.full(b, k, np.int32), q,
                          np.full(b, temperature, np.float32), np.full(b, -1, np.int32), np.ones(b, np.float32),
                          seeds, np.zeros(b, np.int32))
    return np.asarray(out.accepted), np.asarray(out.tokens)


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_sampled_rows_keep_the_target_distribution(proposer):
    """Target logits fixed per position (so the true output law is p_0 x p_1): with a
    draft distribution q far from p, or a fixed n-gram guess, the first two emitted
    tokens follow p_0 x p_1 within the sampling error (chi-square over 80k draws)."""
    rng = np.random.default_rng(2)
    v, k, temperature, draws = 4, 2, 1.0, 80_000
    logits = rng.normal(size=(k + 1, v)).astype(np.float32) * 1.5
    p = np.asarray(jax.nn.softmax(logits, -1), np.float64)
    q_rows = np.asarray(jax.nn.softmax(rng.normal(size=(k, v)) * 2, -1), np.float32)

    def proposals_fn(seeds):
        if proposer == "ngram":  # always the same guess: q one-hot
            return np.tile(np.array([[1, 2]], np.int32), (len(seeds), 1)), None
        # d_i ~ q_i, drawn on the host with an independent generator
        draft_rng = np.random.default_rng(3)
        d = np.stack([draft_rng.choice(v, len(seeds), p=q_rows[i] / q_rows[i].sum()) for i in range(k)], 1)
        return d.astype(np.int32), np.broadcast_to(q_rows, (len(seeds), k, v)).copy()

    accepted, tokens = _emitted_pairs(logits, proposals_fn, temperature, draws)
    # Every round emits t1; it emits t2 too unless the first proposal was rejected. The
    # law of t1 is p_0; the law of t2 given that it was emitted is p_1 (independent).
    t1 = tokens[:, 0]
    counts = np.bincount(t1, minlength=v)
    chi2 = ((counts - draws * p[0]) ** 2 / (draws * p[0])).sum()
    assert chi2 < 21.1, (chi2, counts / draws, p[0])  # chi-square, 3 dof, p = 1e-4
    both = accepted >= 1
    t2 = tokens[both, 1]
    pair = np.bincount(t1[both] * v + t2, minlength=v * v).reshape(v, v)
    for a in range(v):  # t2 | t1 = a follows p_1 for each a
        n = pair[a].sum()
        if n < 500:
            continue
        chi2 = ((pair[a] - n * p[1]) ** 2 / (n * p[1])).sum()
        assert chi2 < 21.1, (a, chi2, pair[a] / n, p[1])
    if proposer == "draft":
        # the acceptance rate is the overlap sum(min(p, q)) at the first position
        overlap = np.minimum(p[0], q_rows[0]).sum()
        assert abs(both.mean() - overlap) < 0.01


# ------------------------------------------------------------------ rollback is a state transition


@pytest.mark.slow
def test_verification_rolls_back_without_touching_shared_blocks():
    """Row 1 is forked from row 0 (blocks shared, the last one partly filled); row 0
    speculates 5 tokens through the fake model's verification program. Afterwards row 0
    holds its old tokens + 1 + accepted, its rejected tail's blocks are back in the pool,
    and every block row 1 names is bit for bit what it was."""
    backend = fake_backend(block_size=4)
    cfg = CacheConfig(num_blocks=12, block_size=4, max_seqs=8, max_blocks_per_seq=6)
    state = init_state(cfg, "lifo", debug=True)
    pages = backend.init_pages(12)
    step = backend.step
    state, _ = open_sequences(state, jnp.array([0]))
    prompt = np.array([[5, 6, 7, 8, 9, 10]], np.int32)
    _, state, pages, status = step({}, state, pages, prompt, jnp.array([0]), jnp.array([6]))
    assert int(status[0]) == 0
    state, _ = fork(state, jnp.array([0]), jnp.array([1]))
    shared = np.asarray(state.block_tables[1])
    before = jax.tree.map(np.asarray, pages)
    free_before = int(state.ref_counts.size - (np.asarray(state.ref_counts) > 0).sum())

    verify_fn = fused_verify(step, None)
    k = 5
    tokens = np.zeros((8, k + 1), np.int32)
    tokens[0] = [11, 1, 2, 3, 4, 5]
    seq_ids = np.array([0] + [-1] * 7, np.int32)
    num = np.array([k + 1] + [0] * 7, np.int32)
    out, state, pages = verify_fn({}, state, pages, tokens, seq_ids, num, np.zeros(8, np.float32),
                                  np.full(8, -1, np.int32), np.ones(8, np.float32), np.zeros(8, np.uint32),
                                  np.zeros(8, np.int32), greedy_only=True)
    check_invariants(state)
    assert int(out.status[0]) == 0
    a = int(out.accepted[0])
    assert int(state.seq_lens[0]) == 6 + 1 + a
    assert int(state.seq_lens[1]) == 6
    table = np.asarray(state.block_tables[0])
    assert (table[: -(-(7 + a) // 4)] >= 0).all() and (table[-(-(7 + a) // 4):] < 0).all()
    free_after = int(state.ref_counts.size - (np.asarray(state.ref_counts) > 0).sum())
    assert free_before - free_after == -(-(7 + a) // 4) - 1  # its private blocks only: the full one stays shared
    for b in shared[shared >= 0]:
        np.testing.assert_array_equal(np.asarray(pages.k)[:, :, b], before.k[:, :, b])
        np.testing.assert_array_equal(np.asarray(pages.v)[:, :, b], before.v[:, :, b])
    assert np.asarray(out.tokens)[0, :a].tolist() == [1, 2, 3, 4, 5][:a]


# ------------------------------------------------------------------ configuration errors


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "unknown; choose one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens=2.5"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"num_speculative_tokens": 2}, "needs 'method'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
         "prompt_lookup_min=3"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 2}, "unknown keys ['lookahead']"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ("ngram", "expected a dict"),
    ],
)
def test_bad_speculative_config(spec, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        LLM(fake_backend(), num_gpu_blocks=16, max_num_seqs=2, max_model_len=32, speculative_config=spec)


def test_k_above_a_table_row_and_draft_vocabulary_and_beam_search():
    with pytest.raises(ValueError, match="more than a block-table row holds"):
        LLM(fake_backend(), block_size=4, num_gpu_blocks=16, max_num_seqs=2, max_model_len=8,
            speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    with pytest.raises(ValueError, match="needs the target as a checkpoint or ModelConfig"):
        LLM(fake_backend(), num_gpu_blocks=16, max_num_seqs=2, max_model_len=32,
            speculative_config={"method": "draft_model", "model": "x", "num_speculative_tokens": 2})
    from paged_jax.model import ModelConfig

    target = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=16, max_position_embeddings=64)
    with pytest.raises(ValueError, match="draft model vocabulary 65 differs from the target's 64"):
        LLM(target, num_gpu_blocks=16, max_num_seqs=2,
            speculative_config={"method": "draft_model", "model": target.replace(vocab_size=65),
                                "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="max_model_len=48 exceeds the model's maximum length 32"):
        LLM(target, num_gpu_blocks=16, max_num_seqs=2, max_model_len=48,  # the draft must fit the sequences too
            speculative_config={"method": "draft_model", "model": target.replace(max_position_embeddings=32),
                                "num_speculative_tokens": 2})
    llm = LLM(fake_backend(), num_gpu_blocks=16, max_num_seqs=2, max_model_len=32,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="beam search with speculative decoding is not supported"):
        llm.generate([[1, 2]], [BeamSearchParams(beam_width=2, max_tokens=4)], use_tqdm=False)
    assert VOCAB == llm.backend.vocab_size
    assert isinstance(SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 1}),
                      SpeculativeConfig)
    assert SamplingParams(temperature=0).greedy
