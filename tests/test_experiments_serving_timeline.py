"""The serving timeline: phases computed from known timestamps, and a quick run against our
server (its sitecustomize really logs in both server processes)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments import serving_timeline as T  # noqa: E402


def _request(t0: float, steps: int, step: float = 2.0, gap: float = 0.25):
    """Events of one request (times in any unit): received +0.5, submit +1.3, add +1.8, steps from
    +2.2, each report 0.2 after its step, the client's last event 0.7 after the last step."""
    ev = [(t0 + 0.5, "received"), (t0 + 1.3, "submit"), (t0 + 1.8, "apply_add"), (t0 + 1.9, "polled")]
    t = t0 + 2.2
    for _ in range(steps):
        ev += [(t, "step_start"), (t + step, "step_end"), (t + step + 0.2, "reports")]
        t += step + gap
    last_end = t - gap
    return ev, (t0, [t0 + 4.0 + i for i in range(steps - 1)] + [last_end + 0.7])


def test_phases_from_known_timestamps():
    events, requests = [], []
    for i, n in enumerate((3, 5)):
        ev, req = _request(100.0 * i, n)
        events += ev
        requests.append(req)
    got = T.phases(sorted(events), requests)
    assert got["client_to_server"] == pytest.approx([0.5, 0.5])
    assert got["http_to_submit"] == pytest.approx([0.8, 0.8])
    assert got["submit_to_engine"] == pytest.approx([0.5, 0.5])
    assert got["add_to_first_step"] == pytest.approx([0.4, 0.4])
    assert got["step"] == pytest.approx([2.0] * 8)
    assert got["between_steps"] == pytest.approx([0.25] * 6)  # 2 + 4: none across requests
    assert got["report_to_http"] == pytest.approx([0.2] * 8)
    assert got["last_step_to_client"] == pytest.approx([0.7, 0.7])
    assert got["e2e"] == pytest.approx([2.2 + 3 * 2.25 - 0.25 + 0.7, 2.2 + 5 * 2.25 - 0.25 + 0.7])


def test_a_request_the_server_never_logged_is_left_out():
    ev, req = _request(0.0, 2)
    got = T.phases(sorted(e for e in ev if e[1] != "submit"), [req])
    assert all(v == [] for v in got.values())


@pytest.mark.slow
def test_quick_run_logs_both_server_processes(tmp_path):
    result = T.main(["--quick", "--engine", "process", "--out", str(tmp_path)])
    assert result["requests"] == 4
    ms = result["ms_p50"]
    assert all(ms[k] is not None and ms[k] > 0 for k in T.PHASES), ms
    assert ms["e2e"] > ms["step"] and set(result["wake_latency"]) == {
        f"after_{i}ms_idle_round_trip_us_p50" for i in (0, 1, 20)}
    assert json.loads((tmp_path / "serving_timeline.json").read_text())["headline"]["e2e_ms_p50"] == ms["e2e"]
