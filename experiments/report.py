"""docs/RESULTS.md from the studies' JSON: every claim of the seed with its figure, ours and a
verdict, then each study's headline and notes.

    python -m experiments report [--out DIR] [--write PATH] [--check]

``--out DIR`` is where the studies wrote their JSON (default ``docs/results``, the committed
runs); ``--write`` the Markdown file (default ``docs/RESULTS.md``; with ``--out`` elsewhere
and no ``--write``, ``DIR/RESULTS.md``). ``--check`` writes nothing and exits 1 if the file
differs from what the JSON gives (the suite checks the committed copy this way).

Verdicts live with the studies: a claim study defines ``claims(result) -> list[dict]`` (keys
``claim``, ``seed``, ``ours``, ``verdict``, ``why``), a pure function of its saved JSON, so
this report is regenerated from JSON alone. Prose that needs a person (why a figure is what
it is, the history of a figure) lives in ``docs/results/notes/<study>.md`` and is included
under the study's section. The README's claims table is the same rendering, written
between its ``<!-- claims:begin -->`` / ``<!-- claims:end -->`` markers.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "docs", "results")
RESULTS_MD = os.path.join(ROOT, "docs", "RESULTS.md")
README = os.path.join(ROOT, "README.md")
CLAIMS = tuple(f"C{i}" for i in range(1, 12))
# Which study measures which claim of docs/SEED.md (the study's ``claims`` gives the verdict).
CLAIM_STUDIES = {
    "memory": ("C1", "C2"), "worked_example": ("C3",), "block_size": ("C4", "C7"), "multiturn": ("C5",),
    "beam": ("C6",), "throughput": ("C8",), "allocation_order": ("C9",), "table_growth": ("C10",),
    "small_kv": ("C11",),
}
# Studies that add evidence to a claim another study judges: ``claim_evidence(result) ->
# {claim id: {"ours": str, "why": str}}``, appended to that claim's row (its verdict stays the
# judging study's).
CLAIM_EVIDENCE = {"serving": ("C8",)}
VERDICTS = ("reproduced", "partly reproduced", "refuted", "not applicable")
README_BEGIN, README_END = "<!-- claims:begin -->", "<!-- claims:end -->"


def study_order() -> list[str]:
    """Studies in the order ``python -m experiments`` lists them, then the peer studies
    (run alone: side venvs, minutes of a real model)."""
    from experiments.__main__ import PEER_STUDIES, STUDIES

    return list(STUDIES) + list(PEER_STUDIES)


def load_results(out_dir: str) -> dict[str, dict]:
    """``{study: its JSON}`` for every known study with a DIR/<study>.json."""
    results = {}
    for name in study_order():
        path = os.path.join(out_dir, f"{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[name] = json.load(f)
    return results


def claim_rows(results: dict[str, dict]) -> dict[str, dict]:
    """``{claim id: row}`` for C1..C11; a claim whose study has not run says so."""
    rows = {}
    for study, ids in CLAIM_STUDIES.items():
        if study not in results:
            for cid in ids:
                rows[cid] = {"claim": cid, "seed": seed_claim(cid), "ours": "not measured: no "
                             f"`{study}.json`", "verdict": "not measured", "why": f"run `python -m experiments {study}`",
                             "study": study}
            continue
        module = importlib.import_module(f"experiments.{study}")
        given = module.claims(results[study])
        got = sorted(r["claim"] for r in given)
        if got != sorted(ids):
            raise ValueError(f"experiments.{study}.claims returned {got}, expected {sorted(ids)}")
        for row in given:
            if row["verdict"] not in VERDICTS:
                raise ValueError(f"{study}: {row['claim']} has verdict {row['verdict']!r}, not one of {VERDICTS}")
            rows[row["claim"]] = {**row, "study": study, "machine": results[study].get("machine", {}),
                                  "quick": bool(results[study].get("quick", False))}
    for study, ids in CLAIM_EVIDENCE.items():
        if study in results:
            extra = importlib.import_module(f"experiments.{study}").claim_evidence(results[study])
            for cid in ids:
                if cid in extra and rows[cid]["verdict"] in VERDICTS:
                    rows[cid] = {**rows[cid], "ours": f"{rows[cid]['ours']}; `{study}`: {extra[cid]['ours']}",
                                 "why": f"{rows[cid]['why']} {extra[cid]['why']}"}
    return {cid: rows[cid] for cid in CLAIMS}


def seed_claim(cid: str) -> str:
    """The claim's own words from docs/SEED.md's table (the one home of the seed's text)."""
    with open(os.path.join(ROOT, "docs", "SEED.md")) as f:
        for line in f:
            if line.startswith(f"| {cid} |"):
                return line.split("|")[2].strip()
    raise KeyError(cid)


def machine_line(machine: dict) -> str:
    """``2-core x86_64 cpu, jax 0.10.2, 2026-12-02`` from a study's ``machine``."""
    if not machine:
        return "machine not recorded"
    device = machine.get("device", "?")
    cores = machine.get("cpu_count")
    where = f"{cores}-core {machine.get('processor', '')} {device}".strip() if cores else device
    return f"{where}, jax {machine.get('jax', '?')}, {machine.get('date', '?')}"


def fmt(value) -> str:
    """A headline value for a table: floats to 3 significant figures, the rest as is."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e5 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def claims_table(rows: dict[str, dict]) -> str:
    """The Markdown table of C1..C11: the seed, ours, the verdict, where it was measured."""
    lines = ["| claim | the seed | we measured | verdict | study |", "|---|---|---|---|---|"]
    for cid, row in rows.items():
        where = f"`{row['study']}`"
        if row.get("machine"):
            labels = [row["source"]] if row.get("source") else []
            labels += [row["machine"].get("date", "?")] + (["quick"] if row.get("quick") else [])
            where += f" ({', '.join(labels)})"
        lines.append(f"| {cid} | {cell(row['seed'])} | {cell(row['ours'])} | **{row['verdict']}** | {where} |")
    return "\n".join(lines)


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def study_title(name: str) -> str:
    """The first line of the study module's docstring (read without importing it)."""
    path = os.path.join(ROOT, "experiments", f"{name}.py")
    if not os.path.exists(path):
        return name
    with open(path) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or name
    return doc.split("\n\n")[0].replace("\n", " ").rstrip(".")


def study_section(name: str, result: dict, notes_dir: str) -> str:
    """A study's headline table, where and when it ran, and its notes, if any."""
    quick = " (quick run)" if result.get("quick") else ""
    parts = [f"### `{name}`: {study_title(name)}", "",
             f"`python -m experiments {name}`{quick}; {machine_line(result.get('machine', {}))}; "
             f"`docs/results/{name}.json`.", ""]
    headline = result.get("headline", {})
    if headline:
        parts += ["| headline | value |", "|---|---:|"]
        parts += [f"| `{key}` | {fmt(value)} |" for key, value in headline.items()]
        parts.append("")
    notes = os.path.join(notes_dir, f"{name}.md")
    if os.path.exists(notes):
        with open(notes) as f:
            parts += [f.read().strip(), ""]
    return "\n".join(parts)


def render(results: dict[str, dict], notes_dir: str) -> str:
    """The whole of RESULTS.md."""
    rows = claim_rows(results)
    measured = [r for r in rows.values() if r["verdict"] in VERDICTS]
    parts = [
        "# Results by claim and mechanism",
        "",
        "<!-- Generated by `python -m experiments report` from docs/results/*.json and",
        "     docs/results/notes/*.md: edit those (or a study's `claims`), not this file. -->",
        "",
        "Every claim of the seed ([SEED.md](SEED.md)) beside our figure and a verdict, then each",
        "study's headline. Each figure comes from the study's committed run: its JSON in",
        "`docs/results/` records the machine, the library versions and the configuration.",
        f"{len(measured)} of {len(CLAIMS)} claims have a verdict.",
        "",
        "## The seed's claims",
        "",
        claims_table(rows),
        "",
    ]
    for cid, row in rows.items():
        parts += [f"**{cid} ({row['verdict']}).** {row['why']}", ""]
    parts += ["## Studies", ""]
    for name, result in results.items():
        parts.append(study_section(name, result, notes_dir))
    return "\n".join(parts).rstrip() + "\n"


def readme_with_claims(readme: str, table: str) -> str:
    """``readme`` with the claims table between its markers (unchanged without markers)."""
    if README_BEGIN not in readme:
        return readme
    head, rest = readme.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    return f"{head}{README_BEGIN}\n{table}\n{README_END}{tail}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments report", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=RESULTS_DIR, help="where the studies' JSON is (default docs/results)")
    parser.add_argument("--write", default=None, help="the Markdown file (default docs/RESULTS.md)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is not what the JSON gives")
    args = parser.parse_args(argv)
    committed = os.path.abspath(args.out) == os.path.abspath(RESULTS_DIR)
    path = args.write or (RESULTS_MD if committed else os.path.join(args.out, "RESULTS.md"))
    results = load_results(args.out)
    text = render(results, os.path.join(RESULTS_DIR, "notes"))
    table = claims_table(claim_rows(results))
    stale = []
    if not os.path.exists(path) or open(path).read() != text:
        stale.append(path)
    if committed:  # the README's table renders the committed runs only
        with open(README) as f:
            readme = f.read()
        new_readme = readme_with_claims(readme, table)
        if new_readme != readme:
            stale.append(README)
    if args.check:
        if stale:
            print(f"out of date with {args.out}: {', '.join(stale)} (run `python -m experiments report`)")
            sys.exit(1)
        return {"stale": []}
    with open(path, "w") as f:
        f.write(text)
    if committed and README in stale:
        with open(README, "w") as f:
            f.write(new_readme)
    print(table)
    print(f"wrote {path}" + (" and README.md's claims table" if README in stale else ""))
    return {"path": path, "claims": claim_rows(results), "stale": stale}


if __name__ == "__main__":
    main()
