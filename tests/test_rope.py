"""RoPE against Hugging Face's, for every scaling type implemented (default, linear,
llama3, yarn with its options): ``tests/fixtures/rope.json`` holds transformers' inverse
frequencies, attention scaling and rotated queries (``scripts/make_rope_fixture.py``)."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.model import ModelConfig
from paged_jax.model.llama import apply_rope, rope_tables

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "rope.json")
with open(FIXTURE) as f:
    CASES = json.load(f)["cases"]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("keys", ["config", "config_v4"])  # transformers 5 / 4 config.json keys
def test_rope_equals_transformers(name, keys):
    case = CASES[name]
    config = ModelConfig.from_hf(case[keys])
    assert (config.rope_scaling.rope_type if config.rope_scaling else "default") == case["rope_type"]
    rope = rope_tables(config)
    np.testing.assert_allclose(rope.inv_freq, case["inv_freq"], rtol=1e-6, atol=0)
    assert rope.scaling == pytest.approx(case["attention_scaling"], rel=1e-12)
    q = np.asarray(case["q"], np.float32)[None]  # [1, T, H, D]
    positions = jnp.asarray(case["positions"], jnp.int32)[None]
    got = np.asarray(apply_rope(jnp.asarray(q), positions, *rope))[0]
    # fp32 angles up to position 4095: HF's and ours round alike but not bit for bit (2.4e-7 seen).
    np.testing.assert_allclose(got, np.asarray(case["rotated"], np.float32), rtol=0, atol=2e-6)


def test_the_fixture_covers_every_scaling_and_yarn_changes_the_logit_scale():
    kinds = {c["rope_type"] for c in CASES.values()}
    assert kinds == {"default", "linear", "llama3", "yarn"}
    assert all(c["attention_scaling"] > 1 for c in CASES.values() if c["rope_type"] == "yarn")
