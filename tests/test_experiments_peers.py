"""The peer study with the side venvs absent: the peers are skipped and say so; the
workload, summaries and agreement are checked on their own (no engine runs here)."""

from __future__ import annotations

import json
import os

import pytest

from experiments import peers

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "llama_text")


def test_absent_side_venvs_are_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_JAX_SIDE_VENVS", str(tmp_path / "no_venvs"))
    out = peers.main(["--quick", "--model", FIXTURE, "--peers", "vllm,transformers", "--num-prompts", "3",
                      "--out", str(tmp_path)])
    assert set(out["skipped"]) == {"vllm/float32", "transformers/float32"}
    assert all("side venv" in why and "scripts/side_venv.sh" in why for why in out["skipped"].values())
    assert out["rows"] == [] and out["headline"]["fp32_tokens_per_s_ratio_vs_vllm"] is None
    assert out["headline"]["greedy_identical_share_vs_vllm"] is None
    assert (tmp_path / "peers.json").exists()
    assert out["workload"]["num_prompts"] == 3 and out["workload"]["max_len"] <= 470


def test_prompts_are_real_text_with_bounded_lengths():
    from paged_jax.text import Tokenizer

    tok = Tokenizer.from_dir(FIXTURE)
    prompts, info = peers.make_prompts(tok, 16, seed=0)
    again, _ = peers.make_prompts(tok, 16, seed=0)
    assert prompts == again  # deterministic
    assert all(16 <= len(p) <= 470 for p in prompts) and len(prompts) == 16
    assert "license" in tok.decode(sum(prompts, [])).lower() or info["total_prompt_tokens"] > 0


def test_summary_and_agreement_arithmetic():
    result = {"first_token_s": [1.0, 2.0], "finish_s": [4.0, 5.0], "tokens": [[1, 2, 3, 4], [5, 6, 7, 8]],
              "run_s": 8.0, "first_call_s": 9.0, "load_s": 1.0, "peak_rss_bytes": 2**30}
    s = peers.summarize(result, max_tokens=4)
    assert s["tokens_per_s"] == 1.0 and s["tpot_p50_ms"] == pytest.approx(1000.0)
    assert s["ttft_p50_ms"] == pytest.approx(1500.0) and s["peak_rss_gib"] == 1.0
    a = peers.identical_share([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 0, 6]])
    assert (a["identical"], a["of"], a["identical_share"]) == (1, 2, 0.5)
    assert a["mean_common_prefix_share"] == pytest.approx((1 + 1 / 3) / 2)
    assert a["differing"] == [{"prompt": 1, "first_difference": 1}]
    assert peers.first_difference([1, 2], [1, 2]) is None and peers.first_difference([1, 2], [1, 2, 3]) == 2


def test_recheck_runs_transformers_unbatched_on_the_differing_prompts_only(monkeypatch, tmp_path):
    calls = []

    def fake_run_peer(name, workload_path, out_path, timeout, env_extra=None):
        with open(workload_path) as f:
            w = json.load(f)
        calls.append((name, w["prompts"], env_extra))
        return {"tokens": [[7, 8], [0, 0]]}  # prompt 1 now agrees, prompt 3 still differs

    monkeypatch.setattr(peers, "run_peer", fake_run_peer)
    ours = [[1, 2], [7, 8], [3, 4], [5, 6]]
    assert peers.recheck_unbatched(str(tmp_path), {"prompts": [[10], [11], [12], [13]]}, ours, ours, 60) is None
    theirs = [[1, 2], [7, 9], [3, 4], [5, 5]]
    r = peers.recheck_unbatched(str(tmp_path), {"prompts": [[10], [11], [12], [13]]}, ours, theirs, 60)
    assert calls == [("transformers", [[11], [13]], {"PEERS_HF_BATCH": "1"})]
    assert (r["now_identical"], r["of"], r["still_differing"]) == (1, 2, [3])


def test_margins_measure_our_logprob_gap_where_a_peer_left_us():
    """A peer that took our second choice at token 3 of prompt 1: the margin is our top-2
    logprob gap there, on the prefix we share; identical prompts are not re-run."""
    from paged_jax import LLM, SamplingParams

    prompts = [[5, 9, 14, 3], [7, 7, 2, 30, 11]]
    llm = LLM(FIXTURE, dtype="float32", seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2), use_tqdm=False)
    ours = [list(o.outputs[0].token_ids) for o in outs]
    step = outs[1].outputs[0].logprobs[3]
    (first, lp1), (second, lp2) = sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda x: -x[1])
    assert first == ours[1][3]
    theirs = [list(ours[0]), ours[1][:3] + [second] + ours[1][4:]]
    assert peers.margins_at_differences(FIXTURE, prompts, ours, [list(x) for x in ours]) == []
    (m,) = peers.margins_at_differences(FIXTURE, prompts, ours, theirs)
    assert (m["prompt"], m["position"], m["reproduced"], m["ours"], m["theirs"]) == (1, 3, True, first, second)
    assert m["gap_nats"] == pytest.approx(lp1 - lp2, abs=1e-5) and m["gap_nats"] >= 0


def test_unknown_peer_is_refused():
    with pytest.raises(SystemExit):
        peers.main(["--peers", "llama.cpp"])


@pytest.mark.slow
def test_sampler_quick(tmp_path):
    """Every case at every row count: the sampler's kept sets equal the full sort's (the
    replaced sampler), both timed; the headline the JSON's."""
    from experiments import sampler

    got = sampler.main(["--quick", "--rows", "8", "--out", str(tmp_path)])
    assert [r["case"] for r in got["rows"]] == list(sampler.CASES)
    for row in got["rows"]:
        assert row["kept_sets_equal"], row
        assert row["sample_ms"] > 0 and row["sort_ms"] > 0
    flat = next(r for r in got["rows"] if r["case"] == "top_p_0.95_flat")
    assert flat["max_kept"] > 2048  # past the candidates: the binary searches decided it
    assert got["headline"]["kept_sets_equal"] is True
    assert json.loads((tmp_path / "sampler.json").read_text())["headline"] == got["headline"]


@pytest.mark.slow
def test_layer_loop_quick(tmp_path):
    """Scan and unrolled on the same model, timed in turn: every row count and the first
    calls reported, the headline the JSON's (a timing: no bound on the ratio itself)."""
    from experiments import layer_loop

    got = layer_loop.main(["--quick", "--reps", "1", "--rounds", "1", "--out", str(tmp_path)])
    assert [r["rows"] for r in got["by_dtype"]["float32"]] == [1, 8]
    for row in got["by_dtype"]["float32"]:
        assert row["scan_ms"] > 0 and row["unrolled_ms"] > 0 and row["unrolled_first_call_s"] > 0
    assert set(got["headline"]) == {"float32_unrolled_over_scan_1_rows", "float32_unrolled_over_scan_8_rows",
                                    "float32_first_call_unrolled_over_scan"}
    assert json.loads((tmp_path / "layer_loop.json").read_text())["headline"] == got["headline"]


@pytest.mark.slow
def test_step_profile_quick(tmp_path):
    from experiments import step_profile

    out = step_profile.main(["--quick", "--reps", "1", "--out", str(tmp_path)])
    r = out["results"]["float32"]
    assert r["decode"]["flops"] > r["decode"]["matmul_flops"] > 0 and r["matmul_peak"]["mlp"]["gflop_per_s"] > 0
    assert 0 <= r["padding_waste"]["pow2_from_8"] < 1 and r["host"]["decode_steps"] > 0
    assert 0 < r["host"]["host_phase_share"] < 1 and r["cpu_basis"]["share_of_matmul_peak_cpu"] > 0
    b = r["budget"]
    assert r["no_attention"]["wall_s"] > 0 and b["floor_s"] > 0 and out["memory_bandwidth"]["gb_per_s"] > 0
    assert b["kv_read_at_bandwidth_s"] > 0 and b["floor_s"] >= b["matmul_at_peak_s"]
    assert (tmp_path / "step_profile.json").exists()


def test_time_budget_floor_is_the_longer_of_matmuls_and_weights_plus_kv():
    from experiments.step_profile import time_budget

    fb = {"matmul_flops": 100e9, "weight_bytes": 2e9, "kv_read_bytes": 1e9}
    # matmuls at 1e12 FLOP/s: 0.1 s; weights at 10 GB/s: 0.2 s (the longer); KV: 0.1 s
    b = time_budget(fb, step_s=0.6, no_attention_s=0.4, peak_flop_per_s=1e12, bandwidth=10e9)
    assert b["floor_s"] == pytest.approx(0.3) and b["step_over_floor"] == pytest.approx(2.0)
    assert b["attention_s"] == pytest.approx(0.2) and b["attention_share"] == pytest.approx(1 / 3)
    assert b["attention_over_kv_read_at_bandwidth"] == pytest.approx(2.0)
    assert b["no_attention_share_of_matmul_peak"] == pytest.approx(0.25)


def test_startup_ratio_uses_the_cold_run_and_the_warm_rerun():
    ours = {"tokens_per_s": 2.0, "tokens_per_cpu_s": None, "load_s": 1.0, "first_call_s": 9.0,
            "compilation_cache": "cold", "first_call_warm_s": 2.0, "load_warm_s": 2.0}
    vllm = {"tokens_per_s": 1.0, "tokens_per_cpu_s": None, "load_s": 15.0, "first_call_s": 5.0}
    head = peers.headline_of({("paged_jax", "float32"): ours, ("vllm", "float32"): vllm}, ["float32"])
    assert head["fp32_startup_cold_cache_ratio_vs_vllm"] == pytest.approx(10 / 20)
    assert head["fp32_startup_warm_cache_ratio_vs_vllm"] == pytest.approx(4 / 20)
    as_is = {**ours, "compilation_cache": "as-is", "first_call_warm_s": None}
    head = peers.headline_of({("paged_jax", "float32"): as_is, ("vllm", "float32"): vllm}, ["float32"])
    assert head["fp32_startup_cold_cache_ratio_vs_vllm"] is None  # a cache of unknown state is not "cold"


@pytest.mark.slow
def test_paged_jax_peer_runs_cold_then_warm(tmp_path):
    out = peers.main(["--model", FIXTURE, "--peers", "paged_jax", "--dtypes", "float32", "--num-prompts", "2",
                      "--max-tokens", "4", "--out", str(tmp_path)])
    (row,) = out["rows"]
    assert row["compilation_cache"] == "cold" and row["generated_tokens"] == 8 and row["passes_agree"]
    assert 0 < row["first_call_warm_s"] and row["load_warm_s"] > 0
