"""The serving study in quick mode: our server in a subprocess under gamma arrivals, the
async client's figures, the paired server-overhead measurement; vLLM skipped."""

import json
import math

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from experiments import serving  # noqa: E402


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
    assert s["errors"] == ["x"] and "errors" not in serving.summarise(ok, 2.0, 0.25, 0.05)  # why some failed
    assert s["output_tokens_per_s"] == 20 and s["normalized_latency_mean_s"] == pytest.approx(0.1)


def test_overhead_split_recovers_fixed_and_per_token_costs():
    tokens = [8, 16, 24, 32, 40, 8, 16]
    diff = [(2.0 + 0.25 * t) / 1e3 for t in tokens]
    diff[3] += 0.05  # one pair a busy machine delayed by 50 ms
    got = serving.overhead_split(tokens, diff)
    assert got["fixed_ms"] == pytest.approx(2.0) and got["per_token_ms"] == pytest.approx(0.25)
    assert serving.overhead_split([8, 8], [0.001, 0.002]) == {"fixed_ms": None, "per_token_ms": None}


def _by_rate(*rows):
    """{rate: {"summary": ...}} from (rate, ttft p50 s, output tok/s, requests/s) rows."""
    return {str(r): {"summary": {"completed": 8, "failed": 0, "ttft_p50_s": t, "output_tokens_per_s": tok,
                                 "request_throughput": req}} for r, t, tok, req in rows}


def test_capacity_is_what_an_overloaded_server_completed_at_the_top_rate():
    ours = _by_rate((1.0, 0.1, 30.0, 0.95), (32.0, 5.0, 300.0, 9.0))
    vllm = _by_rate((1.0, 0.08, 31.0, 0.95), (32.0, 2.0, 450.0, 13.5))
    h = serving.capacity_headline(ours, vllm)
    assert h["capacity_ratio_vs_vllm"] == pytest.approx(300 / 450)
    assert (h["capacity_requests_per_s"], h["vllm_capacity_requests_per_s"]) == (9.0, 13.5)
    assert h["capacity_overloaded"] == {"ours": True, "vllm": True}
    keeps_up = _by_rate((1.0, 0.08, 31.0, 0.95), (32.0, 0.3, 900.0, 28.0))  # TTFT < 5x unloaded: no queue
    h = serving.capacity_headline(ours, keeps_up)
    assert h["capacity_overloaded"]["vllm"] is False and h["capacity_ratio_vs_vllm"] is None
    assert serving.capacity_headline(ours, None)["vllm_capacity_output_tokens_per_s"] is None


def test_vllm_gets_our_prefix_caching_setting():
    """vLLM turns prefix caching on by default; the study repeats its prompts at every rate."""
    for caching, flag in ((False, "--no-enable-prefix-caching"), (True, "--enable-prefix-caching")):
        options = {**serving.engine_options(quick=False), "enable_prefix_caching": caching}
        cmd = serving.vllm_command("python", "m", 8000, options)
        assert flag in cmd and cmd[cmd.index("--max-num-seqs") + 1] == str(options["max_num_seqs"])
        ours = serving.ours_command("m", 8000, options)
        assert ("--enable-prefix-caching" in ours and "--no-enable-prefix-caching" not in ours) == caching


def _saved(ratio):
    h = {"sustained_rate_ratio_vs_vllm": ratio, "sustained_rate": 2.0, "vllm_sustained_rate": 2.0 / ratio if ratio
         else None, "latency_bound_s_per_token": 0.2, "sustained_rate_ratio_reason": None if ratio else "skipped"}
    return {"headline": h, "config": {"model": "m"}, "machine": {"date": "2026-12-03"}}


def test_c8_row_gets_the_serving_ratio(monkeypatch):
    from experiments import report

    ev = serving.claim_evidence(_saved(0.8))["C8"]
    assert "0.80x" in ev["ours"] and "2.50 req/s" in ev["ours"] and "below vLLM's" in ev["why"]
    assert "at least vLLM's" in serving.claim_evidence(_saved(1.25))["C8"]["why"]
    censored = _saved(0.8)
    censored["headline"]["vllm_sustained_rate_censored"] = True
    assert "vLLM's >= 2.50 req/s" in serving.claim_evidence(censored)["C8"]["ours"]
    assert "not measured" in serving.claim_evidence(_saved(None))["C8"]["ours"]
    judged = {"claim": "C8", "seed": "s", "ours": "o", "verdict": "partly reproduced", "why": "w"}
    fake = {"throughput": type("M", (), {"claims": staticmethod(lambda r: [judged])}), "serving": serving}
    monkeypatch.setattr(report.importlib, "import_module", lambda name: fake[name.split(".")[1]])
    monkeypatch.setattr(report, "CLAIM_STUDIES", {"throughput": ("C8",)})
    monkeypatch.setattr(report, "CLAIMS", ("C8",))
    row = report.claim_rows({"throughput": {}, "serving": _saved(0.8)})["C8"]
    assert row["verdict"] == "partly reproduced" and row["ours"].startswith("o; `serving`: ")
    assert row["why"].startswith("w Under arrivals")
    assert report.claim_rows({"throughput": {}})["C8"]["ours"] == "o"  # no serving run: unchanged


# A study with a multi-process server: minutes on 2 cores; `make test-fast` skips it.
@pytest.mark.slow
def test_quick_run_writes_its_headline(tmp_path):
    result = serving.main(["--quick", "--skip-vllm", "--num-prompts", "4", "--request-rate", "4",
                           "--out", str(tmp_path)])
    h = result["headline"]
    assert h["sustained_rate_ratio_vs_vllm"] is None and "skip" in h["sustained_rate_ratio_reason"]
    assert all(v["summary"]["completed"] == 4 for v in result["ours"].values())
    assert h["ttft_p50_s_at_rate_1"] > 0 and result["server_overhead"]["pairs"] == 4
    assert json.loads((tmp_path / "serving.json").read_text())["headline"] == json.loads(json.dumps(h))


def test_sweeps_interleave_the_servers_by_rate(monkeypatch):
    """Each rate runs against every server in turn, the order rotating by rate; a server that
    never started is reported, not fatal; the ones without a ``during`` hook stop before it runs."""
    import contextlib
    import os

    events = []

    @contextlib.contextmanager
    def fake_started(command, env=None, start_timeout=600):
        if command[0] == "broken":
            raise serving.ServerFailed("never healthy", {"error_lines": []})
        events.append(("up", command[0]))
        yield command[0], os.getpid()
        events.append(("down", command[0]))

    async def no_requests(url, requests, times):
        return [], 0.0

    monkeypatch.setattr(serving, "started", fake_started)
    monkeypatch.setattr(serving, "_run", no_requests)
    monkeypatch.setattr(serving, "rate_pass", lambda url, rate, *a, **k: events.append((url, rate)) or {"summary": {}})
    servers = {name: {"command": [name, "--port", "1"]} for name in ("ours", "vllm", "broken")}
    got = serving.sweeps(servers, [1.0, 2.0, 4.0], [("p", 8)] * 4, 1.0, (0.5, 0.05),
                         during={"ours": lambda url, pid: events.append(("during", url)) or "measured"})
    passes = [e for e in events if e[0] in ("ours", "vllm")]
    assert passes == [("ours", 1.0), ("vllm", 1.0), ("vllm", 2.0), ("ours", 2.0), ("ours", 4.0), ("vllm", 4.0)]
    assert isinstance(got["broken"], serving.ServerFailed)
    assert events.index(("down", "vllm")) < events.index(("during", "ours")) < events.index(("down", "ours"))
    assert got["ours"]["during"] == "measured" and set(got["vllm"]) == {"1.0", "2.0", "4.0", "loadavg"}
    assert set(got["ours"]["2.0"]["summary"]["idle_cpu_s"]) == {"vllm"}


def test_sustained_rates_agree_on_a_failed_request():
    """A rate with a failed request counts as over the bound in both rules: the grid rate does
    not skip past it to a higher rate that happened to pass."""
    def row(lat, failed=0):
        return {"summary": {"completed": 8, "failed": failed, "normalized_latency_mean_s": lat}}

    clean = {"1.0": row(0.08), "2.0": row(0.10), "4.0": row(0.15), "8.0": row(0.60)}
    assert serving.sustained(clean, 0.2) == 4.0 and 4.0 < serving.sustained_interpolated(clean, 0.2) < 8.0
    failed = {**clean, "2.0": row(0.09, failed=1)}
    assert serving.sustained(failed, 0.2) == 1.0 == serving.sustained_interpolated(failed, 0.2)
    assert serving.sustained({"1.0": row(0.3)}, 0.2) is None is serving.sustained_interpolated({"1.0": row(0.3)}, 0.2)
