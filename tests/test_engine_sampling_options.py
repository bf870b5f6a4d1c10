"""vLLM's sampling options through the engine, on the fake model (``engine_fakes``):
penalties and min_tokens against a NumPy decoding loop, reproducibility under
preemption, logprobs and prompt logprobs against the fake's logits computed directly,
prompt logprobs under chunking, recompute and prefix caching, one program per shape,
and the rows that must not speculate."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fakes import VOCAB, assert_drained, fake_backend

from paged_jax.engine import LLM, SamplingParams
from paged_jax.engine.sequence import FinishReason

BS = 4
MAX_LEN = 48
# Too few blocks for four sequences of up to ~40 tokens (preemption), enough for any one
# request. Every engine here uses it: the pool's size is part of every program's shapes.
SMALL = 26
EOS = 7


def _llm(num_blocks=SMALL, **kw):
    # One shape family for every engine here (pool, decode 4 rows, prefill chunks of 16):
    # the jitted programs are shared across tests, so the file compiles few.
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 16)
    return LLM(fake_backend(BS, eos_token_id=kw.pop("eos", None)), block_size=BS, num_gpu_blocks=num_blocks,
               max_model_len=MAX_LEN, debug_checks=True, **kw)


def _run(llm, prompts, params):
    groups = llm.add_requests(prompts, params)
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.flush()
    return groups


def _prompts(n, seed=0, lo=2, hi=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, rng.integers(lo, hi)).tolist() for _ in range(n)]


@functools.partial(jax.jit, static_argnames="width")
def _readout(tokens, n, *, width):
    idx = jnp.arange(width)
    held = idx < n
    weight = jnp.cos(idx * 0.37) + 1.5
    feat = jnp.where(held, (tokens + 1) * weight, 0.0).sum() + n * 0.1
    v = jnp.arange(VOCAB, dtype=jnp.float32)
    return jnp.sin(feat * (v + 1) * 0.0137 + 0.5 * v) * 4.0


def _fake_logits(llm, tokens):
    """The fake model's logits after ``tokens`` (``engine_fakes._readout``, directly)."""
    width = llm.config.cache.max_blocks_per_seq * BS
    padded = np.zeros(width, np.float32)
    padded[: len(tokens)] = tokens
    return np.asarray(_readout(padded, np.float32(len(tokens)), width=width), np.float64)


def _log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def _penalised(x, prompt, output, p, eos):
    counts = np.bincount(np.asarray(output, np.int64), minlength=VOCAB)
    seen = np.zeros(VOCAB, bool)
    seen[list(prompt)] = True
    seen[list(output)] = True
    r = p.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    if len(output) < p.min_tokens:
        x[list(p.stop_token_ids) + ([] if p.ignore_eos else [eos])] = -np.inf
    return x


GREEDY_OPTIONS = [
    SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.4),
    SamplingParams(temperature=0, max_tokens=10, presence_penalty=1.5, frequency_penalty=0.8),
    SamplingParams(temperature=0, max_tokens=10, repetition_penalty=0.8, frequency_penalty=-0.5),
    SamplingParams(temperature=0, max_tokens=10, min_tokens=5, stop_token_ids=tuple(range(8, 40))),
    SamplingParams(temperature=0, max_tokens=10),
    SamplingParams(temperature=0, max_tokens=10, min_tokens=3, ignore_eos=True, stop_token_ids=(1, 2)),
]


def test_greedy_penalties_and_min_tokens_match_a_numpy_loop():
    prompts = _prompts(6, seed=1, hi=12)
    llm = _llm(eos=EOS)
    groups = _run(llm, prompts, GREEDY_OPTIONS)
    for g, prompt, p in zip(groups, prompts, GREEDY_OPTIONS, strict=True):
        out = []
        while len(out) < p.max_tokens:
            tok = int(np.argmax(_penalised(_fake_logits(llm, prompt + out), prompt, out, p, EOS)))
            out.append(tok)
            if len(out) >= p.min_tokens and ((tok == EOS and not p.ignore_eos) or tok in p.stop_token_ids):
                break
        seq = g.seqs[0]
        assert seq.output_token_ids == out, p
        last = out[-1]
        if last in p.stop_token_ids and last != EOS:
            assert seq.finish_reason == FinishReason.STOP and seq.stop_reason == last
        else:
            assert seq.stop_reason is None
    # The stop ids really were wanted before min_tokens: the ban changed the output.
    banned = [s.output_token_ids for s in groups[3].seqs][0]
    assert not set(banned[:5]) & set(GREEDY_OPTIONS[3].stop_token_ids)
    assert groups[3].seqs[0].finish_reason == FinishReason.STOP
    assert_drained(llm)


def test_logit_bias_matches_a_numpy_loop_and_is_checked_against_the_vocabulary():
    """The bias is added before the penalties (vLLM v1's order); +100 all but forces a token,
    -100 bans one; reported logprobs stay raw; ids past the vocabulary are refused up front."""
    prompts = _prompts(3, seed=5, lo=3, hi=10)
    params = [SamplingParams(temperature=0, max_tokens=8, logit_bias={3: 100.0}, logprobs=0),
              SamplingParams(temperature=0, max_tokens=8, logit_bias={1: 2.5, 9: -1.0, 20: 4.0},
                             repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=8, logit_bias={t: -100.0 for t in range(0, VOCAB, 2)})]
    llm = _llm()
    groups = _run(llm, prompts, params)
    for g, prompt, p in zip(groups, prompts, params, strict=True):
        out = []
        bias = np.zeros(VOCAB)
        for t, b in p.logit_bias.items():
            bias[t] = b
        while len(out) < p.max_tokens:
            out.append(int(np.argmax(_penalised(_fake_logits(llm, prompt + out) + bias, prompt, out, p, EOS))))
        assert g.seqs[0].output_token_ids == out, p
    assert groups[0].seqs[0].output_token_ids == [3] * 8
    raw = [_log_softmax(_fake_logits(llm, prompts[0] + [3] * i))[3] for i in range(8)]
    assert [lp[3].logprob for lp in groups[0].seqs[0].output_logprobs] == pytest.approx(raw, abs=1e-4)
    assert all(t % 2 == 1 for t in groups[2].seqs[0].output_token_ids)
    with pytest.raises(ValueError, match=rf"logit_bias: token ids outside the vocabulary \[0, {VOCAB}\)"):
        llm.generate([prompts[0]], SamplingParams(max_tokens=2, logit_bias={VOCAB: 1.0}), use_tqdm=False)
    assert_drained(llm)


SAMPLED = [
    SamplingParams(temperature=0.9, max_tokens=12, seed=3, repetition_penalty=1.3, presence_penalty=0.4,
                   frequency_penalty=0.4, min_p=0.05, logprobs=2),
    SamplingParams(temperature=1.2, max_tokens=12, seed=4, top_k=8, top_p=0.9, min_p=0.1, min_tokens=6,
                   stop_token_ids=(5, 6, 9)),
    SamplingParams(temperature=0, max_tokens=12, frequency_penalty=1.0, logprobs=0),
    SamplingParams(temperature=0.7, max_tokens=12, seed=5, n=2, presence_penalty=-1.0),
]


@pytest.fixture(scope="module")
def sampled_reference():
    """Each request alone: no memory pressure."""
    llm = _llm(eos=EOS)
    groups = [_run(llm, [prompt], p)[0] for prompt, p in zip(_prompts(8, seed=2, lo=16, hi=34), SAMPLED * 2,
                                                              strict=True)]
    assert llm.stats()["num_preemptions"] == 0
    return [[(s.output_token_ids, s.output_logprobs) for s in g.seqs] for g in groups]


@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.slow)])
def test_seeded_options_are_identical_under_preemption(sampled_reference, mode):
    llm = _llm(preemption_mode=mode, eos=EOS)
    groups = _run(llm, _prompts(8, seed=2, lo=16, hi=34), SAMPLED * 2)
    assert llm.stats()["preemptions"][mode] > 0
    got = [[(s.output_token_ids, s.output_logprobs) for s in g.seqs] for g in groups]
    for g_got, g_want in zip(got, sampled_reference, strict=True):
        for (toks, lps), (want_toks, want_lps) in zip(g_got, g_want, strict=True):
            assert toks == want_toks
            if want_lps is None:
                assert lps is None
                continue
            assert [list(d) for d in lps] == [list(d) for d in want_lps]
            for d, w in zip(lps, want_lps, strict=True):
                for t in d:
                    assert d[t].rank == w[t].rank
                    np.testing.assert_allclose(d[t].logprob, w[t].logprob, atol=1e-5)
    assert_drained(llm)


def test_logprobs_are_raw_with_ranks(sampled_reference):
    llm = _llm(eos=EOS)
    prompts = _prompts(8, seed=2, lo=16, hi=34)
    for g_want, prompt, p in zip(sampled_reference, prompts, SAMPLED * 2, strict=True):
        for toks, lps in g_want:
            assert not set(toks[: p.min_tokens]) & {*p.stop_token_ids, EOS}  # banned until min_tokens
            if p.logprobs is None:
                assert lps is None
                continue
            assert len(lps) == len(toks)
            for j, (tok, d) in enumerate(zip(toks, lps, strict=True)):
                assert tok in d and len(d) in (p.logprobs, p.logprobs + 1)
                raw = _log_softmax(_fake_logits(llm, prompt + toks[:j]))
                for t, lp in d.items():
                    np.testing.assert_allclose(lp.logprob, raw[t], atol=2e-4)
                assert d[tok].rank == int((raw >= raw[tok] - 1e-6).sum())
                top = sorted((lp.rank, t) for t, lp in d.items() if t != tok or lp.rank <= p.logprobs)
                assert [r for r, _ in top][: p.logprobs] == list(range(1, p.logprobs + 1))
                order = np.argsort(-raw, kind="stable")[: p.logprobs]
                assert [t for r, t in sorted((d[t].rank, t) for t in order)] == order.tolist()


def _check_prompt_logprobs(llm, group, k):
    prompt = list(group.prompt_token_ids)
    pl = group.prompt_logprobs
    assert len(pl) == len(prompt) and pl[0] is None
    for j in range(1, len(prompt)):
        raw = _log_softmax(_fake_logits(llm, prompt[:j]))
        d = pl[j]
        assert prompt[j] in d and len(d) in (k, k + 1)
        for t, lp in d.items():
            np.testing.assert_allclose(lp.logprob, raw[t], atol=2e-4)
        assert d[prompt[j]].rank == int((raw >= raw[prompt[j]] - 1e-6).sum()) or d[prompt[j]].rank <= k
        top = np.argsort(-raw, kind="stable")[:k]
        assert all(d[t].rank == r + 1 for r, t in enumerate(top))


def test_prompt_logprobs_chunked_recomputed_and_with_prefix_caching():
    prompts = _prompts(6, seed=3, lo=20, hi=40)  # chunks of 16: two or three per prompt
    params = [SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=k, n=1 + (k == 2)) for k in (0, 1, 3)] * 2
    llm = _llm(preemption_mode="recompute")
    groups = _run(llm, prompts, params)
    assert llm.stats()["preemptions"]["recompute"] > 0
    for g, p in zip(groups, params, strict=True):
        _check_prompt_logprobs(llm, g, p.prompt_logprobs)
    plain = _run(_llm(), prompts, [SamplingParams(temperature=0, max_tokens=8, n=p.n) for p in params])
    assert [[s.output_token_ids for s in g.seqs] for g in groups] == [[s.output_token_ids for s in g.seqs]
                                                                     for g in plain]
    assert all(g.prompt_logprobs is None for g in plain)
    # With the cache: the second round's prompts are cached, but prompt logprobs need them computed.
    cached = _llm(enable_prefix_caching=True)
    first = _run(cached, prompts[:2], SamplingParams(temperature=0, max_tokens=4))
    again = _run(cached, prompts[:2], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2))
    for g in again:
        _check_prompt_logprobs(cached, g, 2)
    assert [g.seqs[0].output_token_ids for g in again] == [g.seqs[0].output_token_ids for g in first]
    assert_drained(cached)


@pytest.mark.slow
def test_one_program_per_shape_whatever_the_options():
    """An all-greedy run, then the same shapes with penalties, min-p, min_tokens and
    sampling mixed in: nothing retraces. (logprobs add the top-K: a variant of its own.)"""
    prompts = _prompts(4, seed=4, lo=3, hi=8)
    llm = _llm(eos=EOS)
    _run(llm, prompts, SamplingParams(temperature=0, max_tokens=6))
    traces = dict(llm.engine.runner.traces)
    mixed = [SamplingParams(temperature=0.8, max_tokens=6, seed=1, repetition_penalty=1.2),
             SamplingParams(temperature=0, max_tokens=6, min_tokens=6, stop_token_ids=(1,)),
             SamplingParams(temperature=1.0, max_tokens=6, seed=2, min_p=0.2, top_k=5),
             SamplingParams(temperature=0, max_tokens=6, presence_penalty=1.0)]
    _run(llm, prompts, mixed)
    assert dict(llm.engine.runner.traces) == traces


@pytest.mark.slow
def test_rows_with_processing_do_not_speculate_and_match_plain_decoding():
    # Phrases that repeat (n-gram hits); one plain row, so verification compiles one shape.
    prompts = [(p[:3] * 10)[: len(p) + 6] for p in _prompts(4, seed=0, lo=4, hi=12)]
    plain = SamplingParams(temperature=0, max_tokens=10)
    special = [SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.5),
               SamplingParams(temperature=0, max_tokens=10, logprobs=1),
               SamplingParams(temperature=0, max_tokens=10, min_tokens=9, stop_token_ids=(3,))]
    params = [plain, *special]
    spec = _llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    plan_rows = []
    schedule = spec.engine.scheduler.schedule

    def spy():
        step = schedule()
        plan_rows.extend((r.seq.params, r.spec) for r in step.rows)
        return step

    spec.engine.scheduler.schedule = spy
    got = _run(spec, prompts, params)
    want = _run(_llm(), prompts, params)
    assert [g.seqs[0].output_token_ids for g in got] == [g.seqs[0].output_token_ids for g in want]
    assert any(n for p, n in plan_rows if p is plain)  # plain greedy rows do speculate
    assert not any(n for p, n in plan_rows if any(p is q for q in special))
    assert len(got[2].seqs[0].output_logprobs) == len(got[2].seqs[0].output_token_ids)


@pytest.mark.slow
def test_llama_logprobs_and_prompt_logprobs_match_transformers():
    """On the tiny Llama checkpoint: prompt logprobs equal Hugging Face's full-prompt
    forward pass (``expected.npz``'s logits at every prompt position), output logprobs
    its logits at each greedy step."""
    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "llama")
    expected = np.load(os.path.join(fixture, "expected.npz"))
    llm = LLM(fixture, num_gpu_blocks=18, block_size=8, max_num_seqs=4, max_model_len=64,
              max_num_batched_tokens=16, debug_checks=True)
    prompts = [expected[f"prompt_{i}"].tolist() for i in range(2)]
    groups = _run(llm, prompts, SamplingParams(temperature=0, max_tokens=8, logprobs=2, prompt_logprobs=3))
    for i, (g, prompt) in enumerate(zip(groups, prompts, strict=True)):
        ref = np.stack([_log_softmax(x) for x in expected[f"logits_{i}"].astype(np.float64)])
        pl = g.prompt_logprobs
        assert len(pl) == len(prompt) and pl[0] is None
        for j in range(1, len(prompt)):
            d = pl[j]
            np.testing.assert_allclose(d[prompt[j]].logprob, ref[j - 1, prompt[j]], atol=2e-4)
            top = np.argsort(-ref[j - 1], kind="stable")[:3]
            assert [d[t].rank for t in top] == [1, 2, 3] and len(d) in (3, 4)
            np.testing.assert_allclose([d[t].logprob for t in top], ref[j - 1, top], atol=2e-4)
        seq = g.seqs[0]
        assert seq.output_token_ids == expected[f"greedy_{i}"].tolist()
        out = np.stack([_log_softmax(x) for x in expected[f"greedy_logits_{i}"].astype(np.float64)])
        assert len(seq.output_logprobs) == 8
        for j, (tok, d) in enumerate(zip(seq.output_token_ids, seq.output_logprobs, strict=True)):
            assert d[tok].rank == 1 and len(d) == 2
            np.testing.assert_allclose([d[t].logprob for t in d], out[j, list(d)], atol=2e-4)
