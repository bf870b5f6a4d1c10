
"""The GPU readiness run (``experiments/gpu.py``) on the CPU: the smoke of every part, its
JSON, and the pieces that keep a failing or hanging part from losing the others. The
figures come from a GPU machine; here only the code path is checked (kernels in Pallas
interpret mode, a tiny model)."""

import json
import sys

import pytest

from experiments import gpu, kernel_bench, kernel_check
from paged_jax.cache import set_debug_checks
from paged_jax.model import ModelConfig

# Studies and multi-process runs: minutes on 2 cores; `make test-fast` skips them.
pytestmark = pytest.mark.slow


def _tiny_model(quick: bool, max_model_len: int) -> ModelConfig:
    return ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=max_model_len)


def test_without_a_gpu_it_says_so_and_runs_the_smoke_of_every_part(tmp_path, monkeypatch, capsys):
    # Trimmed parts (the smoke's own sizes take ~1 min on 2 cores): one kernel case, the
    # bench without its slowest baselines, a tiny model. The wiring is what is tested.
    cases = kernel_check.contract_cases(quick=True)
    monkeypatch.setattr(kernel_check, "contract_cases", lambda quick: [cases[-1]])  # int8 pages: scales too
    monkeypatch.setattr(kernel_bench, "contiguous_pallas_fn", lambda context, interpret: None)
    monkeypatch.setattr(kernel_bench, "quantized_decode", lambda env, shape: [])
    monkeypatch.setattr(gpu, "throughput_model", _tiny_model)
    monkeypatch.setattr(gpu, "SMOKE_THROUGHPUT", dict(gpu.SMOKE_THROUGHPUT, max_model_len=64, num_requests=8,
                                                      max_num_seqs=8, decode_buckets=(8,),
                                                      curve_batches=()))
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # main sets it for GPU runs; keep it local
    set_debug_checks(False)
    result = gpu.main(["--out", str(tmp_path)])  # no --quick: on a CPU it runs the smoke anyway

    assert "No GPU here" in capsys.readouterr().out
    saved = json.loads((tmp_path / "gpu.json").read_text())
    head = saved["headline"]
    assert saved["quick"] and result["quick"] and not saved["isolated"] and saved["note"]
    assert head["parts_completed"] == head["parts_total"] == 3
    assert head["kernel_checks_run"] == head["kernel_checks_ok"] == 1
    assert head["pallas_backend"] == "interpret" and head["jax"] == saved["environment"]["jax"]
    assert head["copy_bandwidth_gbps"] > 0 and head["throughput_ratio"] > 0 and head["batch_ratio"] > 1
    env = saved["environment"]
    assert env["backend"] == "cpu" and env["jaxlib_version"]
    assert {"triton", "mosaic_gpu", "shipped_paged_attention", "pallas_kernels_compiler_params"} <= set(env["pallas"])
    for name in ("gpu_kernels.json", "kernel_bench.json", "gpu_throughput.json", "gpu_throughput.png"):
        assert (tmp_path / name).stat().st_size > 0
    kernels = json.loads((tmp_path / "gpu_kernels.json").read_text())
    assert kernels["all_ok"] and not kernels["partial"] and kernels["impl"] == "pallas_interpret"
    assert [(r["kernel"], r["kv_format"]) for r in kernels["rows"]] == [("decode", "int8")]
    assert kernels["rows"][0]["err"] < 2e-2 and kernels["rows"][0]["padding_exact_zero"]
    # The Mosaic GPU kernel: one case in Mosaic GPU interpret mode; the bench says why it is not timed.
    assert [(r["ok"], r["backend"]) for r in kernels["mosaic"]["rows"]] == [(True, "interpret")]
    assert head["mosaic_checks_ok"] == head["mosaic_checks_run"] == 1 and head["mosaic_backend"] == "interpret"
    bench = json.loads((tmp_path / "kernel_bench.json").read_text())
    assert "interpret" in bench["mosaic_gpu"] and bench["triton_kernels"] == "available"
    tput = json.loads((tmp_path / "gpu_throughput.json").read_text())
    assert not tput["partial"] and tput["outputs_identical"] and tput["attention_impl"] == "xla"
    assert tput["paged"]["generated_tokens"] == tput["static"]["generated_tokens"] > 0


def test_a_part_past_its_budget_stops_and_says_so(tmp_path, monkeypatch):
    cases = kernel_check.contract_cases(quick=True)
    result = kernel_check.contract_checks("pallas_interpret", True, deadline=0.0)  # already past
    assert result["rows"] == [] and len(result["skipped"]) == len(cases) and not result["all_ok"]
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    out = gpu.main(["--quick", "--out", str(tmp_path), "--budget-s", "1"])  # no time for any part
    assert all("skipped_part" in p for p in out["parts"].values()) and out["headline"]["parts_completed"] == 0
    assert (tmp_path / "gpu.json").exists()


def test_a_hanging_child_is_killed_and_its_output_kept():
    code, tail = gpu.run_child([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                               timeout=1)
    assert code is None and "started" in tail
    code, tail = gpu.run_child([sys.executable, "-c", "print('done')"], timeout=30)
    assert code == 0 and tail == "done\n"


def test_the_throughput_part_uses_the_kernels_only_where_they_passed_on_the_gpu():
    def row(kernel, ok=True, backend="triton", dtype="bfloat16", head_dim=64):
        return {"kernel": kernel, "ok": ok, "backend": backend, "dtype": dtype, "kv_format": "auto",
                "head_dim": head_dim}

    assert gpu.choose_attention({"rows": [row("decode"), row("chunk"), row("decode", ok=False, head_dim=128)]}) \
        == "pallas"
    assert gpu.choose_attention({"rows": [row("decode"), row("chunk", ok=False)]}) == "xla"
    assert gpu.choose_attention({"rows": [row("decode"), row("chunk", backend="interpret")]}) == "xla"
    assert gpu.choose_attention({"error": "killed"}) == "xla"
