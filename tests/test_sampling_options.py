"""vLLM's sampling options in the jitted sampler, against NumPy references on random
logits (fp32): logit biases, penalties, min-tokens bans, min-p with temperature/top-k/top-p, raw
logprobs and ranks, and one program for greedy, sampled and penalised batches."""

import dataclasses

import jax
import numpy as np
import pytest

from paged_jax.engine import SamplingParams
from paged_jax.engine.sampling import (
    BANNED,
    SEEN,
    History,
    Logprob,
    _keep_mask,
    _sample,
    _uniform,
    apply_history,
    argmax_last,
    draw,
    empty_history,
    sample,
    sampling_probs,
    token_logprobs,
)

B, V, K = 16, 24, 16


def _case(seed=0):
    """Random logits and, per row, a prompt, an output, penalties and a ban list."""
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(B, V)) * 3).astype(np.float32)
    rows = []
    for _ in range(B):
        prompt = rng.integers(0, V, rng.integers(1, 6)).tolist()
        output = rng.integers(0, V, rng.integers(0, 6)).tolist()
        banned = rng.choice(V, rng.integers(0, 3), replace=False).tolist()
        biased = rng.choice(V, rng.integers(0, 4), replace=False).tolist()
        bias = {int(t): float(rng.choice([-100.0, -2.5, 1.5, 6.0])) for t in biased}
        rows.append(dict(prompt=prompt, output=output, banned=banned, bias=bias,
                         presence=float(rng.choice([0.0, 0.5, -1.5])), frequency=float(rng.choice([0.0, 1.0, -0.3])),
                         repetition=float(rng.choice([1.0, 1.3, 0.7]))))
    return logits, rows


def _history(rows, width=K) -> History:
    """What the scheduler builds (``Scheduler._sample_row``), here by hand."""
    h = empty_history(len(rows), width)
    for i, r in enumerate(rows):
        counts = {t: r["output"].count(t) for t in set(r["output"])}
        seen = set(r["prompt"]) | set(r["output"]) if r["repetition"] != 1 else set()
        bias = r.get("bias", {})
        ids = sorted(seen | set(counts) | set(r["banned"]) | set(bias))
        for j, t in enumerate(ids):
            h.ids[i, j] = t
            h.counts[i, j] = counts.get(t, 0)
            h.flags[i, j] = (SEEN if t in seen else 0) | (BANNED if t in r["banned"] else 0)
            h.bias[i, j] = bias.get(t, 0.0)
    return h._replace(presence=np.array([r["presence"] for r in rows], np.float32),
                      frequency=np.array([r["frequency"] for r in rows], np.float32),
                      repetition=np.array([r["repetition"] for r in rows], np.float32))


def _processed_reference(logits, rows):
    """vLLM v1's formulas: the logit bias added, then repetition on prompt|output tokens,
    frequency and presence on output counts; banned ids -inf."""
    out = logits.astype(np.float32).copy()
    for i, r in enumerate(rows):
        x = out[i]
        for t, b in r.get("bias", {}).items():
            x[t] += np.float32(b)
        counts = np.bincount(np.asarray(r["output"], np.int64), minlength=V).astype(np.float32)
        seen = np.zeros(V, bool)
        seen[r["prompt"]] = True
        seen[r["output"]] = True
        rep = np.float32(r["repetition"])
        x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
        x = x - np.float32(r["frequency"]) * counts - np.float32(r["presence"]) * (counts > 0)
        x[r["banned"]] = -np.inf
        out[i] = x
    return out


def _probs_reference(x, temperature, top_k, top_p, min_p):
    """The distribution the sampler draws from: temperature, min-p (vs the most likely),
    top-k, then top-p on what is left; ties ranked by id."""
    if temperature == 0:
        return np.eye(V)[np.argmax(x)]
    s = x.astype(np.float64) / temperature
    order = np.argsort(-s, kind="stable")
    ss = s[order]
    full = np.exp(ss - ss[0])
    full /= full.sum()
    keep = np.arange(V) < (top_k if top_k > 0 else V)
    keep &= full >= min_p * full[0]
    p = np.where(keep, np.exp(ss - ss[0]), 0.0)
    p /= p.sum()
    keep &= (np.cumsum(p) - p) < top_p
    kept = np.where(keep, p, 0.0)
    out = np.zeros(V)
    out[order] = kept / kept.sum()
    return out


def test_new_params_are_validated_like_vllm():
    p = SamplingParams(min_p=0.1, presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.2, min_tokens=3,
                       logprobs=0, prompt_logprobs=5)
    assert p.uses_penalties and hash(p) == hash(dataclasses.replace(p))
    assert not SamplingParams().uses_penalties
    for kwargs, words in [(dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"),
                          (dict(presence_penalty=2.5), "presence_penalty"),
                          (dict(frequency_penalty=-2.1), "frequency_penalty"),
                          (dict(repetition_penalty=0.0), "repetition_penalty"),
                          (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=5, max_tokens=4), "min_tokens"),
                          (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=1.5), "prompt_logprobs")]:
        with pytest.raises(ValueError, match=words):
            SamplingParams(**kwargs)
    assert Logprob(-0.5, 1) == Logprob(logprob=-0.5, rank=1, decoded_token=None)


def test_logit_bias_is_a_read_only_hashable_mapping():
    import pickle

    p = SamplingParams(logit_bias={5: 2, np.int64(7): -100.0})
    assert dict(p.logit_bias) == {5: 2.0, 7: -100.0} and p.logit_bias[7] == -100.0
    assert p.logit_bias == {5: 2.0, 7: -100.0} and hash(p) == hash(SamplingParams(logit_bias={7: -100, 5: 2.0}))
    assert pickle.loads(pickle.dumps(p)) == p
    assert SamplingParams(logit_bias={}).logit_bias is None
    with pytest.raises(TypeError):
        p.logit_bias[5] = 1.0  # noqa: the mapping is read-only
    for bias in ({-1: 1.0}, {"5": 1.0}, {5: float("inf")}, {5: "x"}, [(5, 1.0)], {True: 1.0}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bias)
    with pytest.raises(ValueError, match="MAX_LOGIT_BIAS=1024"):
        SamplingParams(logit_bias={t: 1.0 for t in range(1025)})


def test_penalties_and_bans_match_numpy():
    logits, rows = _case(0)
    got = np.asarray(apply_history(logits, _history(rows)))
    want = _processed_reference(logits, rows)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6, atol=1e-6)
    # Nothing listed: nothing changes (also past-the-vocabulary ids are dropped).
    h = empty_history(B, K)
    h.ids[:, 0] = V + 3
    h.flags[:, 0] = BANNED
    np.testing.assert_array_equal(np.asarray(apply_history(logits, h)), logits)


def test_sampling_follows_the_reference_distribution_and_draw():
    """Per row: the processed distribution (penalties, bans, temperature, min-p, top-k,
    top-p) equals NumPy's, and each drawn token is NumPy's inverse-CDF pick (token-id
    order) with the same uniform; greedy rows are the argmax of the processed logits."""
    logits, rows = _case(1)
    rng = np.random.default_rng(2)
    temperature = rng.choice([0.0, 0.6, 1.0, 1.8], B).astype(np.float32)
    top_k = rng.choice([-1, 2, 5], B).astype(np.int32)
    top_p = rng.choice([1.0, 0.8, 0.4], B).astype(np.float32)
    min_p = rng.choice([0.0, 0.05, 0.3], B).astype(np.float32)
    history = _history(rows)
    processed = _processed_reference(logits, rows)
    want = np.stack([_probs_reference(processed[i], temperature[i], top_k[i], top_p[i], min_p[i]) for i in range(B)])
    got = np.asarray(sampling_probs(np.asarray(apply_history(logits, history)), temperature, top_k, top_p, min_p))
    np.testing.assert_allclose(got, want, atol=2e-6)
    raw = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    seeds = np.arange(B, dtype=np.uint32) * 7 + 3
    for step in range(6):
        steps = np.full(B, step, np.int32)
        tok, lp = sample(logits, temperature, top_k, top_p, seeds, steps, min_p=min_p, history=history)
        tok = np.asarray(tok)
        u = np.asarray(_uniform(seeds, steps))
        for i in range(B):
            if temperature[i] == 0:
                assert tok[i] == np.argmax(processed[i])
                continue
            cdf = np.cumsum(want[i])  # inverse CDF in token-id order, as ``draw``
            pick = min(int((cdf <= u[i] * cdf[-1]).sum()), int(np.flatnonzero(want[i])[-1]))
            assert tok[i] == pick, (i, step)
            assert want[i][tok[i]] > 0 and tok[i] not in rows[i]["banned"]
        np.testing.assert_allclose(np.asarray(lp), raw[np.arange(B), tok], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("candidates", [(), (1,), (2,), (3, 9), (5, 12), (128,)])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_kept_set_is_exact_whichever_path_decides_it(candidates, seed):
    """``_keep_mask`` decides a row from its top-k candidates, elementwise, from more
    candidates, or by binary searches over the values (``candidates=()``: every row
    there): every path gives NumPy's set (ties ranked by id), for
    rows of every kind (min-p, top-k below and above the candidates, top-p inside and past
    them, nothing at all) and logits with ties."""
    rng = np.random.default_rng(seed)
    n = 96
    scaled = np.round(rng.normal(size=(n, V)) * 2, 1).astype(np.float32)  # rounded: ties
    scaled[:8] = np.round(scaled[:8])  # many ties
    scaled[8:16, :5] = -np.inf  # banned tokens
    top_k = rng.choice([-1, 0, 1, 2, 4, 7, 13, V, V + 5], n).astype(np.int32)
    top_p = rng.choice([1.0, 0.93, 0.71, 0.37, 0.05], n).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.02, 0.3], n).astype(np.float32)
    got = np.asarray(jax.jit(_keep_mask, static_argnums=4)(scaled, top_k, top_p, min_p, candidates))
    for i in range(n):
        want = _probs_reference(scaled[i], 1.0, top_k[i] if top_k[i] < V else -1, top_p[i], min_p[i]) > 0
        # A banned token (-inf) may sit in the mask: its weight is 0, so never drawn.
        np.testing.assert_array_equal(got[i] & np.isfinite(scaled[i]), want, err_msg=f"row {i}: k={top_k[i]} p={top_p[i]} min_p={min_p[i]}")


@pytest.mark.parametrize("vocab", [7, 24, 50, 1000, 4096, 49152])
def test_draw_is_the_inverse_cdf_pick_in_token_id_order(vocab):
    """``draw`` (two levels where the vocabulary splits into chunks) picks NumPy's first
    token whose float64 cumulative weight passes ``u`` times the total, never one of weight
    0; a row of zeros gives the last token. Picks whose target lies within rounding of a
    boundary are not compared."""
    rng = np.random.default_rng(vocab)
    rows = 40
    probs = rng.random((rows, vocab)).astype(np.float32) ** 4
    probs[rng.random((rows, vocab)) < 0.6] = 0.0  # dropped tokens, runs of them
    probs[0] = 0.0
    probs[1, :] = 0.0
    probs[1, vocab // 2] = 1.0  # one token
    probs[2, :] = 0.0
    probs[2, 0] = 1e-3  # only the first
    probs[3, :-1] = 0.0  # only the last
    probs[3, -1] = 2.0
    seeds = np.arange(rows, dtype=np.uint32) * 13 + 1
    for step in range(4):
        steps = np.full(rows, step, np.int32)
        got = np.asarray(jax.jit(draw)(probs, seeds, steps))
        u = np.asarray(_uniform(seeds, steps)).astype(np.float64)
        for i in range(rows):
            if not probs[i].any():
                assert got[i] == vocab - 1
                continue
            assert probs[i, got[i]] > 0, (i, step)
            cdf = np.cumsum(probs[i].astype(np.float64))
            target = u[i] * cdf[-1]
            if np.min(np.abs(cdf - target)) > 1e-5 * cdf[-1]:
                assert got[i] == int((cdf <= target).sum()), (i, step)
    # Leading axes and broadcast seeds, as speculative decoding calls it.
    cube = probs[:6].reshape(2, 3, vocab)
    flat = np.asarray(draw(probs[:6], np.repeat(seeds[:2], 3), np.tile(np.arange(3), 2)))
    np.testing.assert_array_equal(np.asarray(draw(cube, seeds[:2, None], np.arange(3)[None])).reshape(-1), flat)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's rewrite of top-k into a sort")
def test_the_compiled_sampler_holds_no_sort():
    """XLA:CPU sorts a [32, 49152] batch in ~600 ms. The sampler ranks with top-k custom
    calls only; a static slice of their values would make XLA turn one back into a sort."""
    b, vocab = 8, 4096
    fn = jax.jit(lambda x, t, k, p, s, st, m: sample(x, t, k, p, s, st, min_p=m))
    args = (np.zeros((b, vocab), np.float32), np.ones(b, np.float32), np.full(b, -1, np.int32),
            np.ones(b, np.float32), np.zeros(b, np.uint32), np.zeros(b, np.int32), np.zeros(b, np.float32))
    hlo = fn.lower(*args).compile().as_text()
    assert "sort(" not in hlo
    assert hlo.count('custom_call_target="TopK"') == 2  # the two candidate counts


def test_min_tokens_ban_beats_a_dominant_token():
    logits = np.zeros((4, V), np.float32)
    logits[:, 5] = 50.0  # EOS-like: would win every time
    rows = [dict(prompt=[1], output=[], banned=[5], presence=0.0, frequency=0.0, repetition=1.0)] * 4
    temperature = np.array([0.0, 1.0, 0.5, 2.0], np.float32)
    for step in range(8):
        tok, _ = sample(logits, temperature, np.full(4, -1, np.int32), np.ones(4, np.float32),
                        np.arange(4, dtype=np.uint32), np.full(4, step, np.int32), history=_history(rows))
        assert 5 not in np.asarray(tok).tolist()


def test_logprobs_values_and_ranks_match_numpy():
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=(B, V)) * 2).astype(np.float32)
    logits[0, [3, 7]] = logits[0].max() + 1  # a tie at the top: ranks count ">="
    tokens = rng.integers(0, V, B).astype(np.int32)
    tokens[0] = 7
    lp, rank, top_lp, top_ids = (np.asarray(x) for x in token_logprobs(logits, tokens, 4))
    ref = logits.astype(np.float64)
    ref = ref - ref.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    np.testing.assert_allclose(lp, ref[np.arange(B), tokens], atol=1e-5)
    np.testing.assert_array_equal(rank, (ref >= ref[np.arange(B), tokens][:, None] - 1e-7).sum(-1))
    assert rank[0] == 2
    order = np.argsort(-ref, axis=-1, kind="stable")[:, :4]
    np.testing.assert_array_equal(top_ids, order)
    np.testing.assert_allclose(top_lp, np.take_along_axis(ref, order, -1), atol=1e-5)


@pytest.mark.parametrize("vocab", [49152, 1000, 24, 7])  # 128-wide chunks, 8-wide, one chunk, no chunking
def test_argmax_last_is_jnp_argmax_with_ties_to_the_first(vocab):
    rng = np.random.default_rng(vocab)
    x = rng.normal(size=(9, vocab)).astype(np.float32)
    x[0, :] = 1.0  # all tied: index 0
    x[1, [vocab // 3, vocab - 1]] = 50.0  # a tie across chunks: the first
    x[2, -1] = 60.0  # the last entry
    x[3, :] = -np.inf
    x[3, vocab // 2] = -1e30
    np.testing.assert_array_equal(np.asarray(argmax_last(x)), x.argmax(-1))


def test_greedy_logprob_is_the_raw_log_softmax_with_and_without_a_history():
    """The sampler reports log_softmax of the raw logits at the chosen token (computed
    without materialising [B, V] log-probabilities), whether or not penalties changed the
    choice."""
    logits, rows = _case(6)
    b = logits.shape[0]
    zeros, ones, minus = np.zeros(b, np.float32), np.ones(b, np.float32), np.full(b, -1, np.int32)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    for history in (None, empty_history(b, K), _history(rows)):
        tokens, lp = sample(logits, zeros, minus, ones, np.arange(b, dtype=np.uint32), np.zeros(b, np.int32),
                            history=history)
        np.testing.assert_allclose(np.asarray(lp), ref[np.arange(b), np.asarray(tokens)], atol=1e-5)
    want = _processed_reference(logits, rows).argmax(-1)
    np.testing.assert_array_equal(np.asarray(tokens), want)


def test_one_program_for_greedy_sampled_and_penalised_batches():
    """Same shapes, any mix of options: the sampler traces once (run-time conds)."""
    b = 5  # a batch size no other test uses: the first call compiles, the others must not
    logits, rows = _case(4)
    logits, rows = logits[:b], rows[:b]
    ones, minus = np.ones(b, np.float32), np.full(b, -1, np.int32)
    seeds, steps = np.arange(b, dtype=np.uint32), np.zeros(b, np.int32)
    zeros = np.zeros(b, np.float32)
    before = _sample._cache_size()
    greedy, _ = sample(logits, zeros, minus, ones, seeds, steps, min_p=zeros, history=empty_history(b, K))
    mixed_t = np.where(np.arange(b) % 2, 1.0, 0.0).astype(np.float32)
    mixed, _ = sample(logits, mixed_t, minus, ones, seeds, steps, min_p=np.full(b, 0.1, np.float32),
                      history=_history(rows))
    sample(logits, ones, minus, np.full(b, 0.5, np.float32), seeds, steps, min_p=zeros, history=_history(rows))
    assert _sample._cache_size() - before == 1
    np.testing.assert_array_equal(np.asarray(greedy), logits.argmax(-1))
    processed = _processed_reference(logits, rows)
    np.testing.assert_array_equal(np.asarray(mixed)[::2], processed[::2].argmax(-1))


def test_sequence_counts_are_incremental_and_logprob_fields_follow_params():
    from paged_jax.engine.sequence import Sequence, SequenceGroup

    seq = Sequence("0", 0, (3, 3, 5), SamplingParams(logprobs=1), seed=0, max_tokens=8)
    group = SequenceGroup("0", 0, (3, 3, 5), SamplingParams(prompt_logprobs=0), [seq])
    assert seq.output_logprobs == [] and group.prompt_logprobs == [None] and group.needs_prompt_logprobs
    assert seq.stop_reason is None and seq.prompt_ids().tolist() == [3, 5]
    seq.output_token_ids += [4, 4, 9]
    assert seq.output_counts() == {4: 2, 9: 1}
    seq.output_token_ids.append(4)
    assert seq.output_counts() == {4: 3, 9: 1} and seq._counted == 4
    del seq.output_token_ids[1:]  # cut (a stop-string trim): recounted
    assert seq.output_counts() == {4: 1}
    plain = Sequence("1", 0, (1,), SamplingParams(), seed=0, max_tokens=8)
    assert plain.output_logprobs is None
    assert SequenceGroup("1", 0, (1,), SamplingParams(), [plain]).prompt_logprobs is None
