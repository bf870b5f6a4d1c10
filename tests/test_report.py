"""The results report: generated from the studies' JSON, and the committed copy current."""

import json
import types

import pytest

from experiments import report


def test_committed_results_and_readme_are_what_the_committed_json_gives():
    """docs/RESULTS.md and the README's claims table are regenerated, never edited: they
    must equal `python -m experiments report` over docs/results."""
    assert report.main(["--check"]) == {"stale": []}


def test_every_claim_of_the_seed_has_a_study_and_a_verdict_in_the_committed_runs():
    rows = report.claim_rows(report.load_results(report.RESULTS_DIR))
    assert list(rows) == [f"C{i}" for i in range(1, 12)]
    assert {cid for ids in report.CLAIM_STUDIES.values() for cid in ids} == set(rows)
    for cid, row in rows.items():
        assert row["verdict"] in report.VERDICTS, (cid, row["verdict"])
        assert row["seed"] and row["ours"] and row["why"] and row["machine"]["date"]


def test_a_missing_study_is_reported_as_not_measured(tmp_path):
    rows = report.claim_rows({})
    assert rows["C3"]["verdict"] == "not measured" and "worked_example" in rows["C3"]["why"]
    text = report.render({}, str(tmp_path))
    assert "0 of 11 claims have a verdict" in text and "| C11 |" in text


def test_claims_are_checked_against_the_study_map(monkeypatch):
    fake = types.SimpleNamespace(claims=lambda result: [{"claim": "C9", "seed": "s", "ours": "o",
                                                         "verdict": "reproduced", "why": "w"}])
    monkeypatch.setattr(report.importlib, "import_module", lambda name: fake)
    with pytest.raises(ValueError, match="returned \\['C9'\\], expected \\['C3'\\]"):
        report.claim_rows({"worked_example": {}})
    fake.claims = lambda result: [{"claim": "C3", "seed": "s", "ours": "o", "verdict": "true-ish", "why": "w"}]
    with pytest.raises(ValueError, match="verdict 'true-ish'"):
        report.claim_rows({"worked_example": {}})


def test_report_writes_beside_other_json_and_keeps_notes(tmp_path):
    with open(f"{report.RESULTS_DIR}/multiturn.json") as f:
        result = json.load(f)
    (tmp_path / "multiturn.json").write_text(json.dumps(result))
    out = report.main(["--out", str(tmp_path)])
    text = (tmp_path / "RESULTS.md").read_text()
    assert out["path"] == str(tmp_path / "RESULTS.md") and out["claims"]["C5"]["verdict"] in report.VERDICTS
    assert "### `multiturn`" in text and "`turn5_physical_over_naive`" in text
    assert "1 of 11 claims have a verdict" in text


def test_readme_table_is_replaced_between_its_markers():
    readme = f"intro\n{report.README_BEGIN}\nold\n{report.README_END}\nrest\n"
    assert report.readme_with_claims(readme, "NEW") == f"intro\n{report.README_BEGIN}\nNEW\n{report.README_END}\nrest\n"
    assert report.readme_with_claims("no markers", "NEW") == "no markers"


def test_demo_prints_the_claims_table_from_this_run_and_the_committed_ones(tmp_path, capsys):
    """The demo's wiring, with no study run: every claim comes from the committed runs."""
    from experiments import demo

    (tmp_path / "multiturn.json").write_text(open(f"{report.RESULTS_DIR}/multiturn.json").read())
    out = demo.main(["--out", str(tmp_path), "--studies", "", "--no-real-model"])
    printed = capsys.readouterr().out
    assert "| C11 |" in printed and "(committed run, 20" in printed
    assert "source" not in out["claims"]["C5"]  # this run's JSON, not marked committed
    assert out["claims"]["C3"]["source"] == "committed run" and "`worked_example` (committed run, 20" in printed
