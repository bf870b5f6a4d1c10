
"""Smoke test of the headline study's code path (the figures themselves come from full
runs; see the README): a tiny model through ``experiments.throughput.main``."""

import json

import pytest
from engine_fakes import VOCAB as FAKE_VOCAB
from engine_fakes import fake_backend

from experiments import throughput
from experiments.lib import models, sharing
from paged_jax.cache import set_debug_checks
from paged_jax.model import ModelConfig

# Studies and multi-process runs: minutes on 2 cores; `make test-fast` skips them.
pytestmark = pytest.mark.slow


def _tiny_model(max_model_len: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8, max_position_embeddings=max_model_len,
    )


def _fake(block_size: int):
    """The engine tests' fake model (tests/engine_fakes.py): real block manager and KV
    pages, a trivial step, so a study's wiring runs without compiling a transformer."""
    return fake_backend(block_size, max_position=None)


def test_throughput_study_runs_and_writes_its_json(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "llama_33m", _tiny_model)
    monkeypatch.setattr(throughput, "CURVE_BATCHES", (8,))
    set_debug_checks(False)  # invariants are checked by the engine tests; this is the study's wiring
    result = throughput.main(["--quick", "--alpaca", "--num-requests", "12", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "throughput.json").read_text())
    assert (tmp_path / "throughput.png").stat().st_size > 0
    headline = saved["headline"]
    assert set(headline) == {"throughput_ratio", "batch_ratio", "paged_kv_utilization", "static_kv_utilization",
                             "alpaca_throughput_ratio", "alpaca_batch_ratio"}
    alpaca = saved["alpaca_like"]
    assert alpaca["workload"]["mean_prompt"] < saved["workload"]["mean_prompt"] and alpaca["outputs_identical"]
    assert alpaca["static_mean_running_batch"] <= throughput.STATIC_SEQS < alpaca["paged_mean_running_batch"] * 2
    (c8,) = throughput.claims(saved)
    assert c8["claim"] == "C8" and "Alpaca-like" in c8["ours"]
    assert saved["outputs_identical"] and result["outputs_identical"]
    assert saved["workload"]["num_requests"] == 12 and saved["attention_impl"] == "xla"
    paged, static = saved["paged"], saved["static"]
    assert paged["generated_tokens"] == static["generated_tokens"] > 0
    # The static engine is capped at 8 reservations; the paged one holds more sequences.
    assert static["peak_running_batch"] <= throughput.STATIC_SEQS < paged["peak_running_batch"]
    assert headline["batch_ratio"] > 1 and headline["paged_kv_utilization"] > headline["static_kv_utilization"]
    for engine in (paged, static):
        assert sum(engine["timeline"]["generated"]) == engine["generated_tokens"]
        assert engine["saturated_generated_tokens"] + engine["drain_generated_tokens"] == engine["generated_tokens"]
    assert 0 < saved["phases"]["static_drain_share"] < 1


def test_beam_and_parallel_studies_run_and_write_their_json(tmp_path, monkeypatch):
    from experiments import beam, parallel

    # The fake model (cheap to compile) and width 4 only: this is the studies' wiring.
    monkeypatch.setattr(models, "memory_model", lambda max_model_len: _fake(sharing.BLOCK_SIZE))
    monkeypatch.setattr(models, "llama_33m", lambda max_model_len: _fake(sharing.BLOCK_SIZE))
    monkeypatch.setattr(beam, "QUICK_WIDTHS", (4,))
    monkeypatch.setattr(parallel, "QUICK_NS", (4,))
    monkeypatch.setattr(sharing, "LENGTH_CONTEXTS", {"alpaca_like": 512, "sharegpt_like": 256})
    monkeypatch.setattr(beam, "QUICK_PREFIX_FRACTIONS", (0.1, 0.5))
    monkeypatch.setattr(models, "VOCAB", FAKE_VOCAB)
    set_debug_checks(False)
    result = beam.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "beam.json").read_text())
    assert (tmp_path / "beam.png").stat().st_size > 0
    assert set(saved["headline"]) == {"beam4_memory_saving", "beam_step_overhead", "min_saving_prefix_over_15pct",
                                      "beam4_throughput_vs_unshared"}
    assert saved["equal_budget"]["tokens_per_s_unshared"] > 0 and "outputs_identical" in saved["equal_budget"]
    assert saved["headline"] == result["headline"]
    for row in saved["memory_by_width"] + saved["prefix_sweep"]:
        # Beams share their prompt's full blocks at least: physical never above unshared.
        assert 0 < row["mean_physical_blocks"] <= row["mean_unshared_blocks"] and 0 <= row["saving"] < 1
    assert saved["step_cost"]["steps_measured"]["beam"] > 0 and saved["headline"]["beam_step_overhead"] > 0
    result = parallel.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "parallel.json").read_text())
    assert (tmp_path / "parallel.png").stat().st_size > 0 and set(saved["headline"]) >= {"n4_memory_saving"}
    assert {r["n"] for r in saved["rows"]} == {4}
    assert all(0 <= r["saving"] < 1 and r["throughput_ratio_vs_separate"] > 0 for r in saved["rows"])


def test_prefix_caching_studies_run_and_write_their_json(tmp_path, monkeypatch):
    """prefix, multiturn and eviction in quick mode on the fake model."""
    from experiments import eviction, multiturn, prefix

    monkeypatch.setattr(models, "memory_model", lambda max_model_len: _fake(sharing.BLOCK_SIZE))
    monkeypatch.setattr(models, "VOCAB", FAKE_VOCAB)
    monkeypatch.setattr(prefix, "QUICK", dict(num_requests=8, system_lens=(64,), repeats=1))
    monkeypatch.setattr(multiturn, "QUICK", (2, 3))
    monkeypatch.setattr(eviction, "QUICK_TRACE", dict(num_waves=3, per_wave=8, num_prefixes=4))
    monkeypatch.setattr(eviction, "QUICK_POOL_FRACTIONS", (0.5,))
    set_debug_checks(False)
    out = ["--quick", "--out", str(tmp_path)]
    p = prefix.main(out)["headline"]
    assert 0.5 < p["prefill_tokens_saved"] < 1 and p["hit_ttft_over_cold"] > 0
    m = multiturn.main(out)["headline"]
    assert m["turn3_physical_over_naive"] < 0.7 and 1 <= m["prefill_over_new_tokens"] < 1.2
    e = eviction.main(out)
    assert {r["policy"] for r in e["runs"]} == {"fifo", "leaf_first", "lfu", "lru"}
    assert all(r["hit_rate"] > 0 for r in e["runs"]) and e["headline"]["best_policy"] in {"fifo", "leaf_first", "lfu", "lru"}
    for name in ("prefix", "multiturn", "eviction"):
        assert json.loads((tmp_path / f"{name}.json").read_text())["headline"]
        assert (tmp_path / f"{name}.png").stat().st_size > 0


def test_quantized_study_runs_and_writes_its_json(tmp_path):
    """The quantised-KV study in quick mode (tiny real models: quantisation needs real pages)."""
    from experiments import quantized

    set_debug_checks(False)
    h = quantized.main(["--quick", "--out", str(tmp_path)])["headline"]
    assert 1.5 < h["int8_capacity_gain"] < 2 and h["int8_channel_capacity_gain"] < h["int8_capacity_gain"]
    assert 0 <= h["int8_greedy_agreement"] <= 1 and h["bf16_greedy_agreement"] > 0.5
    assert h["fp8_greedy_agreement"] is None  # not measured in quick mode
    assert json.loads((tmp_path / "quantized.json").read_text())["headline"]
    assert (tmp_path / "quantized.png").stat().st_size > 0


def test_speculative_study_runs_and_writes_its_json(tmp_path, monkeypatch):
    """The speculative study's wiring in quick mode on tiny random models (its greedy
    outputs must equal plain decoding's in every run)."""
    from experiments import speculative

    monkeypatch.setattr(models, "llama_33m", _tiny_model)
    monkeypatch.setattr(speculative, "small_draft", lambda config: config.replace(num_layers=1))
    monkeypatch.setattr(speculative, "QUICK", dict(speculative.QUICK, max_tokens=12, ks_batch1=(4,)))
    set_debug_checks(False)
    result = speculative.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "speculative.json").read_text())
    assert (tmp_path / "speculative.png").stat().st_size > 0
    h = saved["headline"]
    assert h == result["headline"] and h["all_outputs_identical"]
    assert set(h) >= {"ngram_speedup_batch1", "verify_step_cost_k4", "draft_self_speedup_batch1",
                      "random_ngram_speedup_batch1", "random_verify_step_cost_k4", "copy_acceptance_k4"}
    rows = {(r["workload"], r["method"], r["k"]): r for r in saved["rows"]}
    assert rows[("random", "draft_model:self", 4)]["acceptance_rate"] == 1.0  # the draft is the target
    # The trained copy model continues a document by copying it: prompt lookup is nearly always right.
    assert rows[("copy", "ngram", 4)]["acceptance_rate"] > 0.8
    assert all(r["tokens_per_s"] > 0 and r["steps_per_output_token"] <= 1.0 + 1e-9 for r in saved["rows"])
