"""Speculative decoding through the engine: greedy outputs equal plain greedy decoding
token for token (fake model under every kind of pressure and sharing; the real Llama
fixture with n-gram and draft-model proposals, a draft equal to the target and a
smaller one), sampled outputs keep plain sampling's distribution, invariants hold after
every step (debug_checks), and the verification compiles once."""

import os

import numpy as np
import pytest

from paged_jax.engine import LLM, SamplingParams
from paged_jax.model import ModelConfig
from tests.engine_fakes import assert_drained, fake_backend

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "llama")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _repetitive(rng, n, vocab, lo=6, hi=30):
    """Prompts that repeat a short phrase (prompt lookup finds continuations) with noise."""
    prompts = []
    for _ in range(n):
        phrase = rng.integers(0, vocab, rng.integers(2, 6)).tolist()
        p = (phrase * 10)[: rng.integers(lo, hi)]
        if rng.random() < 0.5:
            p[rng.integers(len(p))] = int(rng.integers(vocab))
        prompts.append(p)
    return prompts


# ------------------------------------------------------------------ the fake model: every schedule


FAKE = dict(block_size=4, max_num_seqs=6, max_model_len=64, max_num_batched_tokens=24, debug_checks=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "setting",
    ["stop", "recompute", "swap", "n2", "prefix", "static"],  # "stop" runs without pressure
)
def test_greedy_outputs_equal_plain_decoding_on_the_fake(setting):
    rng = np.random.default_rng(11)
    prompts = _repetitive(rng, 8, 48)
    params = SamplingParams(temperature=0, max_tokens=16, n=2 if setting == "n2" else 1, ignore_eos=True)
    kw = dict(FAKE, num_gpu_blocks=200)
    if setting in ("recompute", "swap", "n2"):
        kw.update(num_gpu_blocks=24, preemption_mode="swap" if setting == "swap" else "recompute")
    if setting == "prefix":
        kw.update(enable_prefix_caching=True, num_gpu_blocks=40)
        prompts = [prompts[0] + p for p in prompts]  # a shared head
    if setting == "static":
        kw.update(kv_cache="static", num_gpu_blocks=60)
    if setting == "stop":  # the commonest output token stops every request: outputs cut mid-round
        plain = LLM(fake_backend(), **kw).generate(prompts, params, use_tqdm=False)
        common = np.bincount(np.concatenate([o.outputs[0].token_ids[1:] for o in plain])).argmax()
        params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=(int(common),))
    want = _tokens(LLM(fake_backend(), **kw).generate(prompts, params, use_tqdm=False))
    llm = LLM(fake_backend(), speculative_config=NGRAM, **kw)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    stats = llm.stats()
    assert stats["spec_rounds"] > 0 and stats["spec_proposed_tokens"] > 0
    # One compile per rows bucket (1, 2, 4, 6) at most, and none when the same work runs again.
    assert stats["traces"].get("verify", 0) <= 4  # 0: an earlier engine compiled the shapes
    again = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(again) == want and llm.stats()["traces"] == stats["traces"]
    assert stats["spec_mean_tokens_per_round"] == pytest.approx(
        1 + stats["spec_accepted_tokens"] / stats["spec_rounds"], abs=0.5)
    if setting in ("recompute", "swap", "n2"):
        assert stats["num_preemptions"] > 0
    if setting == "prefix":
        assert stats["prefix_cache_hit_tokens"] > 0
    if setting == "stop":
        assert sum(len(t[0]) < 16 for t in want) >= 2
    assert_drained(llm)


@pytest.mark.slow
def test_sampled_outputs_follow_the_plain_sampling_distribution():
    """Two-sample test on the fake (vocab 48): 1000 seeded requests of one prompt that
    holds every token once (so prompt lookup always proposes the token that followed
    the first output token in the prompt), temperature 1.3, through
    plain sampling and through n-gram speculation; the laws of output tokens 2 and 3
    agree (chi-square on the cells both runs visit often, p ~ 1e-4). Token 2 is always
    decided by a round (an accepted proposal or, mostly here, the residual draw
    ``max(p - q, 0)``); tests/test_speculative.py tests acceptance-heavy laws."""
    prompt = list(range(48))
    n = 1000
    kw = dict(block_size=4, max_num_seqs=64, max_model_len=64, max_num_batched_tokens=512, num_gpu_blocks=1200)
    params = [SamplingParams(temperature=1.3, max_tokens=3, seed=i, ignore_eos=True) for i in range(n)]
    plain = np.array(_tokens(LLM(fake_backend(), **kw).generate([prompt] * n, params, use_tqdm=False)))[:, 0]
    llm = LLM(fake_backend(), speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **kw)
    spec = np.array(_tokens(llm.generate([prompt] * n, params, use_tqdm=False)))[:, 0]
    stats = llm.stats()
    assert stats["spec_rounds"] >= n and stats["spec_proposed_tokens"] >= n, stats
    for col in (1, 2):
        a = np.bincount(plain[:, col], minlength=48)
        b = np.bincount(spec[:, col], minlength=48)
        cells = (a + b) >= 20
        a_, b_ = a[cells], b[cells]
        chi2 = (((a_ - b_) ** 2) / (a_ + b_)).sum()
        dof = cells.sum() - 1
        assert chi2 < dof + 4.5 * np.sqrt(2 * dof) + 10, (col, chi2, dof)
    # the first output token comes from the prompt's prefill: same sampler, same draws
    np.testing.assert_array_equal(plain[:, 0], spec[:, 0])


# ------------------------------------------------------------------ the real model


REAL = dict(block_size=8, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32, debug_checks=True)


@pytest.fixture(scope="module")
def real_prompts():
    return _repetitive(np.random.default_rng(5), 3, 256, lo=8, hi=30)


@pytest.fixture(scope="module")
def real_plain(real_prompts):
    llm = LLM(FIXTURE, num_gpu_blocks=48, **REAL)
    return _tokens(llm.generate(real_prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False))


SMALL_DRAFT = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=16, max_position_embeddings=2048)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_self", "draft_small"])
def test_real_model_greedy_equals_plain_under_pressure(real_prompts, real_plain, method):
    spec = {"ngram": dict(NGRAM),
            "draft_self": {"method": "draft_model", "model": FIXTURE, "num_speculative_tokens": 3},
            "draft_small": {"method": "draft_model", "model": SMALL_DRAFT, "num_speculative_tokens": 2}}[method]
    # 8 blocks of 8 tokens for 3 rows growing to ~40 tokens: preemption happens.
    llm = LLM(FIXTURE, num_gpu_blocks=8, speculative_config=spec, **REAL)
    outs = llm.generate(real_prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert _tokens(outs) == real_plain
    s = llm.stats()
    assert s["num_preemptions"] > 0 and s["spec_rounds"] > 0
    assert s["traces"].get("verify", 0) <= 3  # rows buckets 1, 2, 4 (jit caches are shared per process)
    if method == "draft_self":  # the draft is the target: every proposal is the target's argmax
        assert s["spec_acceptance_rate"] == 1.0
        # bytes per block count the draft's KV too (it lives in the same blocks)
        assert s["bytes_per_block"] == 2 * LLM(FIXTURE, num_gpu_blocks=8, **REAL).stats()["bytes_per_block"]
    assert_drained(llm)
