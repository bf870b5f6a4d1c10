"""The serving study in quick mode: our server in a subprocess under gamma arrivals, the
async client's figures, the paired server-overhead measurement; vLLM skipped."""

import json
import math

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from experiments import serving  # noqa: E402

# Studies and multi-process runs: minutes on 2 cores; `make test-fast` skips them.
pytestmark = pytest.mark.slow



def test_gamma_arrivals_are_seeded_with_the_requested_rate():
    t = serving.arrival_times(4000, rate=5.0, burstiness=1.0, seed=3)
    assert np.array_equal(t, serving.arrival_times(4000, rate=5.0, burstiness=1.0, seed=3))
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    assert 4000 / t[-1] == pytest.approx(5.0, rel=0.05)
    bursty = np.diff(serving.arrival_times(4000, rate=5.0, burstiness=0.25, seed=3))
    assert np.std(bursty) > 1.5 * np.std(np.diff(t))  # shape < 1: burstier at the same mean
    assert not serving.arrival_times(3, math.inf, 1.0).any()


def test_summary_figures():
    ok = [{"ok": True, "ttft": 0.1 * i, "tpot": 0.01, "e2e": 1.0, "tokens": 10, "itl": [0.01] * 9,
           "normalized": 0.1, "sent": 0.0} for i in range(1, 5)]
    s = serving.summarise([*ok, {"ok": False, "error": "x", "sent": 0.0}], duration=2.0, slo_ttft=0.25, slo_tpot=0.05)
    assert (s["completed"], s["failed"]) == (4, 1) and s["goodput"] == 1.0 and s["slo_attainment"] == 0.4
    assert s["output_tokens_per_s"] == 20 and s["normalized_latency_mean_s"] == pytest.approx(0.1)


@pytest.mark.slow
def test_quick_run_writes_its_headline(tmp_path):
    result = serving.main(["--quick", "--skip-vllm", "--num-prompts", "4", "--request-rate", "4",
                           "--out", str(tmp_path)])
    h = result["headline"]
    assert h["sustained_rate_ratio_vs_vllm"] is None and "skip" in h["sustained_rate_ratio_reason"]
    assert all(v["summary"]["completed"] == 4 for v in result["ours"].values())
    assert h["ttft_p50_s_at_rate_1"] > 0 and result["server_overhead"]["pairs"] == 4
    assert json.loads((tmp_path / "serving.json").read_text())["headline"] == json.loads(json.dumps(h))
