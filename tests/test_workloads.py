"""Synthetic request streams: seeded, within limits, skewed as documented."""

import numpy as np
import pytest

from paged_jax.workloads import (
    ALPACA,
    PAPER_CONTEXT,
    SHAREGPT,
    alpaca_like,
    describe,
    fixed_length,
    sharegpt_like,
    synthetic,
)


@pytest.mark.parametrize("make", [sharegpt_like, alpaca_like])
def test_streams_are_seeded_and_within_limits(make):
    a = make(300, max_model_len=512, vocab_size=100, seed=3)
    assert a == make(300, max_model_len=512, vocab_size=100, seed=3)
    assert a != make(300, max_model_len=512, vocab_size=100, seed=4)
    assert [r.arrival for r in a] == list(range(300))
    for r in a:
        assert 1 <= len(r.prompt_token_ids) <= 511 and r.max_tokens >= 1
        assert len(r.prompt_token_ids) + r.max_tokens <= 512
        assert all(0 <= t < 100 for t in r.prompt_token_ids)


def test_means_follow_the_paper_scaled_to_the_context():
    # At the paper's context, little clipping: realised means near the paper's.
    s = describe(synthetic(20000, SHAREGPT, max_model_len=PAPER_CONTEXT, vocab_size=10, seed=0))
    assert abs(s["mean_prompt"] - 161.31) / 161.31 < 0.05
    assert abs(s["mean_output"] - 337.99) / 337.99 < 0.08  # clipped at the context
    a = describe(synthetic(20000, ALPACA, max_model_len=PAPER_CONTEXT, vocab_size=10, seed=0))
    assert abs(a["mean_prompt"] - 19.31) / 19.31 < 0.05 and abs(a["mean_output"] - 58.45) / 58.45 < 0.05
    # Scaled to a quarter of the context: a quarter of the lengths.
    q = describe(synthetic(20000, SHAREGPT, max_model_len=PAPER_CONTEXT // 4, vocab_size=10, seed=0))
    assert abs(q["mean_prompt"] - 161.31 / 4) / (161.31 / 4) < 0.06


def test_lengths_are_skewed():
    s = describe(sharegpt_like(5000, max_model_len=2048, vocab_size=10, seed=1))
    assert s["p99_prompt"] > 4 * s["p50_prompt"] and s["mean_output"] > s["p50_output"]


def test_fixed_length_control_and_errors():
    f = fixed_length(5, prompt_len=7, output_len=3, vocab_size=50, seed=0)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in f] == [(7, 3)] * 5
    assert len({r.prompt_token_ids for r in f}) == 5
    with pytest.raises(ValueError, match="max_model_len=1"):
        sharegpt_like(3, max_model_len=1, vocab_size=10)
    with pytest.raises(ValueError, match="prompt_len=0"):
        fixed_length(3, prompt_len=0, output_len=1, vocab_size=10)
    assert describe([]) == {"num_requests": 0}
    assert np.isfinite(describe(f)["mean_prompt"])
