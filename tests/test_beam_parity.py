"""Beam search equals Hugging Face transformers' on the committed fixtures
(``tests/fixtures/<name>/beam.json``, written by ``scripts/make_hf_fixtures.py --beam``
with the versions in ``metadata.json``): the same hypotheses, token for token, best
first, and the same ``sequences_scores`` within 1e-4 (fp32)."""

import collections
import functools
import json
import os

import numpy as np
import pytest

from paged_jax.engine import LLM, BeamSearchParams

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
# Every fixture with transformers' beam hypotheses (a new one is tested without editing a list).
MODELS = tuple(sorted(n for n in os.listdir(FIXTURES) if os.path.exists(os.path.join(FIXTURES, n, "beam.json"))))


@functools.cache
def _cases(name):
    with open(os.path.join(FIXTURES, name, "beam.json")) as f:
        return json.load(f)


@functools.cache
def _llm(name):
    # The prompts of one setting run in one call; at 8 rows wider searches queue (one decode shape).
    # 16 batched tokens: one prompt per prefill, so one prefill shape (2 step programs per model,
    # not 4: about half the test's cold time).
    return LLM(os.path.join(FIXTURES, name), dtype="float32", block_size=8, max_num_seqs=8,
               num_gpu_blocks=96, max_model_len=32, attention_impl="xla", max_num_batched_tokens=16)


def _settings(name):
    """Fixture cases grouped by their search settings (several prompts per call)."""
    groups = collections.defaultdict(list)
    for case in _cases(name)["cases"]:
        key = (case["beam_width"], case["max_new_tokens"], case["length_penalty"], case["early_stopping"],
               case["eos_token_id"])
        groups[key].append(case)
    return sorted(groups.items(), key=lambda kv: repr(kv[0]))


def test_the_fixtures_record_their_versions_and_cover_the_rules():
    with open(os.path.join(FIXTURES, "metadata.json")) as f:
        meta = json.load(f)["beam"]
    assert meta["transformers"] and meta["torch"] and set(meta["models"]) == set(MODELS)
    assert {"llama", "qwen2", "qwen3"} <= set(MODELS)
    for name in MODELS:
        cases = _cases(name)["cases"]
        assert {c["beam_width"] for c in cases} == {1, 2, 4, 8}
        assert {c["length_penalty"] for c in cases} == {0.5, 1.0, 2.0}
        assert {repr(c["early_stopping"]) for c in cases} == {"True", "False", "'never'"}
        eos = _cases(name)["eos_token_id"]
        ended = [s for c in cases if c["eos_token_id"] is not None for s in c["sequences"] if s[-1] == eos]
        assert ended, "the EOS cases must contain hypotheses the EOS ended"


@pytest.mark.parametrize("name", MODELS)
def test_beam_search_equals_transformers(name):
    llm = _llm(name)
    mismatches = []
    for (width, max_new, lp, es, eos), cases in _settings(name):
        params = BeamSearchParams(beam_width=width, max_tokens=max_new, length_penalty=lp, early_stopping=es,
                                  eos_token_id=eos, ignore_eos=eos is None)
        outs = llm.beam_search([c["prompt"] for c in cases], params)
        for case, out in zip(cases, outs, strict=True):
            got = [s.tokens for s in out.sequences]
            if got != case["sequences"]:
                mismatches.append((width, lp, es, eos, case["prompt"], got, case["sequences"]))
                continue
            np.testing.assert_allclose([s.score for s in out.sequences], case["scores"], atol=1e-4, rtol=0)
            for s in out.sequences:
                ended = eos is not None and s.tokens[-1] == eos
                assert s.finish_reason == ("stop" if ended else "length")
    assert not mismatches, mismatches[:3]
    assert llm.inspect().num_free == llm.num_gpu_blocks
