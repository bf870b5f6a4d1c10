"""The engine end to end on the real tiny Llama checkpoint (tests/fixtures/llama: 2
layers, hidden 64, vocab 256): it reproduces Hugging Face's greedy generation, and its
greedy outputs do not change under memory pressure (recompute, swap) or with the static
baseline. Engines share one configuration so they share compiled shapes."""

import os

import numpy as np
import pytest

from paged_jax.engine import LLM, SamplingParams

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "llama")
CONFIG = dict(block_size=8, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16, debug_checks=True)
SMALL = 18  # blocks: two static reservations of 8; four growing sequences need up to 32
GREEDY = SamplingParams(temperature=0, max_tokens=16)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, rng.integers(1, 44)).tolist() for _ in range(10)]


@pytest.fixture(scope="module")
def alone(prompts):
    """Each prompt on its own: a lone sequence never meets memory pressure."""
    llm = LLM(FIXTURE, num_gpu_blocks=SMALL, **CONFIG)
    outs = [_tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    assert llm.stats()["num_preemptions"] == 0 and llm.stats()["peak_running_batch"] == 1
    return outs


@pytest.mark.slow
def test_greedy_generation_matches_transformers():
    expected = np.load(os.path.join(FIXTURE, "expected.npz"))
    llm = LLM(FIXTURE, num_gpu_blocks=SMALL, **CONFIG)
    prompts = [expected[f"prompt_{i}"].tolist() for i in range(2)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == expected[f"greedy_{i}"].tolist()
        logits = expected[f"greedy_logits_{i}"].astype(np.float64)
        logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        want = logprobs[np.arange(8), expected[f"greedy_{i}"]].sum()
        np.testing.assert_allclose(out.outputs[0].cumulative_logprob, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["recompute", "swap", "static"])
def test_outputs_do_not_depend_on_memory_pressure(prompts, alone, mode):
    if mode == "static":
        llm = LLM(FIXTURE, num_gpu_blocks=SMALL, kv_cache="static", **CONFIG)
    else:
        llm = LLM(FIXTURE, num_gpu_blocks=SMALL, preemption_mode=mode, **CONFIG)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == alone
    stats = llm.stats()
    if mode == "static":
        assert stats["peak_running_batch"] == 2 and stats["num_preemptions"] == 0
    else:
        assert stats["preemptions"][mode] > 0 and stats["peak_running_batch"] >= 3
    # Nothing leaked: every block back in the pool, no live row.
    cache = llm.inspect()  # checks the invariants
    assert cache.num_free == SMALL and cache.idle


def test_prefix_cache_hits_reproduce_cold_runs_and_transformers(prompts, alone):
    """With the cache on, a second pass over the same prompts starts on cached blocks
    (where eviction under this small pool left them): the same tokens as each prompt run
    alone, log-probabilities equal to the cold pass's (fp32), and HF's greedy output."""
    llm = LLM(FIXTURE, num_gpu_blocks=SMALL, enable_prefix_caching=True, **CONFIG)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    hits = llm.stats()["prefix_cache_hit_tokens"]
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert _tokens(first) == alone == _tokens(second)
    assert stats["prefix_cache_hit_tokens"] > hits and stats["prefix_cache_evictions"] > 0
    np.testing.assert_allclose([o.outputs[0].cumulative_logprob for o in second],
                               [o.outputs[0].cumulative_logprob for o in first], rtol=1e-5, atol=1e-5)
    expected = np.load(os.path.join(FIXTURE, "expected.npz"))
    hf = [expected[f"prompt_{i}"].tolist() for i in range(2)]
    for _ in range(2):  # cold, then on the cached blocks
        outs = llm.generate(hf, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [expected[f"greedy_{i}"].tolist() for i in range(2)]
