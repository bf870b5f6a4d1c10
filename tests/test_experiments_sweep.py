"""The ablation runner (``experiments/sweep.py``): grid parsing, keyword validation before
anything runs, a quick 2 x 2 sweep through the CLI and the Python API."""

import csv
import json

import pytest

from experiments import sweep
from paged_jax.cache import set_debug_checks

# Studies and multi-process runs: minutes on 2 cores; `make test-fast` skips them.
pytestmark = pytest.mark.slow



def test_grid_values_parse_as_python_values():
    values = ["8", "0.5", "true", "False", "None", "lifo", "1e-3", " swap "]
    assert [sweep.parse_value(v) for v in values] == [8, 0.5, True, False, None, "lifo", 1e-3, "swap"]
    grid = sweep.parse_grid(["block_size=8,16", "preemption_mode=recompute,swap"])
    assert grid == {"block_size": [8, 16], "preemption_mode": ["recompute", "swap"]}
    combos = sweep.combinations(grid)
    assert combos[:2] == [{"block_size": 8, "preemption_mode": "recompute"},
                          {"block_size": 8, "preemption_mode": "swap"}]  # the first axis varies slowest
    assert len(combos) == 4


def test_unknown_or_malformed_axes_are_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(ValueError, match="'blok_size' is not a keyword of LLM; did you mean 'block_size'"):
        sweep.parse_grid(["blok_size=8"])
    with pytest.raises(ValueError, match="'nope' is not a keyword of LLM"):
        sweep.sweep({"nope": [1]})
    with pytest.raises(ValueError, match="given twice"):
        sweep.parse_grid(["block_size=8", "block_size=16"])
    for argv in (["--grid", "blok_size=8,16"], ["--grid", "block_size"], ["--grid", "block_size=8", "--set", "max_seqs=4"]):
        with pytest.raises(SystemExit):
            sweep.main([*argv, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "'blok_size' is not a keyword of LLM" in err and "'max_seqs' is not a keyword of LLM" in err
    assert "expected KEY=VALUE" in err
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_quick_sweep_writes_a_tidy_table_and_a_plot_per_metric(tmp_path):
    set_debug_checks(False)  # invariants are checked by the engine tests; this is the tool's wiring
    result = sweep.main(["--quick", "--grid", "block_size=8,16", "preemption_mode=recompute,swap",
                         "--num-requests", "8", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "sweep.json").read_text())
    with open(tmp_path / "sweep.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(saved["rows"]) == len(result["rows"]) == 4
    for metric in sweep.PLOTTED:
        assert (tmp_path / f"sweep_{metric}.png").stat().st_size > 0
    head = saved["headline"]
    assert set(head) >= {"best_config", "best_tokens_per_s", "worst_config", "best_over_worst"}
    assert head["best_over_worst"] >= 1 and head["configs"] == 4 and head["runs"] == 4
    rows = saved["rows"]
    required = {"block_size", "preemption_mode", "seed", "tokens_per_s", "kv_utilization", "peak_blocks",
                "preemptions", "compile_seconds", "wall_seconds"}
    assert all(required <= set(r) for r in rows) and required <= set(table[0])
    # One byte budget: blocks twice the size, half as many; every run generates the same tokens.
    assert len({r["budget_bytes"] for r in rows}) == 1
    blocks = {r["block_size"]: r["num_blocks"] for r in rows}
    assert blocks[8] == 2 * blocks[16]
    assert all(r["num_blocks"] * r["bytes_per_block"] <= r["budget_bytes"] for r in rows)
    assert len({r["generated_tokens"] for r in rows}) == 1
    assert all(0 < r["kv_utilization"] <= 1 and r["tokens_per_s"] > 0 for r in rows)
    # Each config compiled in its warm-up run, before its clock started.
    assert all(r["warmup_seconds"] > 0 for r in rows)


def test_the_python_api_returns_one_row_per_config_and_seed():
    set_debug_checks(False)
    rows = sweep.sweep({"allocation_policy": ["lifo", "fifo"]}, "alpaca_like", seeds=2, num_requests=6,
                       max_model_len=128, base=sweep.QUICK_BASE, verbose=False)
    assert [(r["allocation_policy"], r["seed"]) for r in rows] == [("lifo", 0), ("lifo", 1), ("fifo", 0), ("fifo", 1)]
    by = {(r["allocation_policy"], r["seed"]): r for r in rows}
    # Seeds draw different workloads; the same draw generates the same tokens under either policy.
    assert by["lifo", 0]["generated_tokens"] != by["lifo", 1]["generated_tokens"]
    assert by["lifo", 0]["generated_tokens"] == by["fifo", 0]["generated_tokens"]
    means = sweep.summarize(rows, "kv_utilization")
    assert [m["allocation_policy"] for m in means] == ["lifo", "fifo"] and all(m["n"] == 2 for m in means)
    assert "allocation_policy" in sweep.format_table(rows).splitlines()[0]
    assert sweep.headline(rows)["configs"] == 2
