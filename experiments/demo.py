"""What ``make demo`` runs: the seed's claims, measured here in quick mode, in one table.

    python -m experiments demo [--out DIR] [--studies a,b,...]

Runs the quick version of each claim study that fits a few minutes on a 2-core CPU into
DIR (default ``out``) and prints the claims table (``experiments.report``): the claims
measured by this run, and, marked "(committed run)", the others from the full runs in
``docs/results`` (``make bench`` or ``python -m experiments NAME`` measures those too).
"""

from __future__ import annotations

import argparse
import os
import time

from experiments import report

# Claim studies whose --quick run takes about a minute or less on 2 cores with nothing
# compiled (~1.2 min together, 2026-12-02); the others' figures come from the committed full runs.
DEMO_STUDIES = ("worked_example", "memory", "allocation_order", "table_growth", "small_kv")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="out")
    parser.add_argument("--quick", action="store_true", help="accepted for symmetry: the demo is always quick")
    parser.add_argument("--studies", default=",".join(DEMO_STUDIES), help="claim studies to run (comma-separated)")
    args = parser.parse_args(argv)
    import importlib

    timings = {}
    for name in [s for s in args.studies.split(",") if s]:
        start = time.perf_counter()
        importlib.import_module(f"experiments.{name}").main(["--quick", "--out", args.out])
        timings[name] = time.perf_counter() - start
    fresh = report.load_results(args.out)
    committed = report.load_results(report.RESULTS_DIR)
    results = {name: fresh.get(name, committed.get(name)) for name in report.study_order()
               if name in fresh or name in committed}
    rows = report.claim_rows(results)
    for row in rows.values():
        if row["study"] not in fresh and row["verdict"] in report.VERDICTS:
            row["source"] = "committed run"
    print()
    print(report.claims_table(rows))
    print("\n" + ", ".join(f"{name} {s:.0f} s" for name, s in timings.items()))
    print(f"this run's JSON: {os.path.abspath(args.out)}; every claim's reasoning: docs/RESULTS.md")
    return {"claims": rows, "seconds": timings}


if __name__ == "__main__":
    main()
