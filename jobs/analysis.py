"""Run every notebook in analysis/ on a results folder; figures land as PNG beside the files they read.

    .venv/bin/python jobs/analysis.py --results results      # what `make analysis RESULTS=results` runs
    .venv/bin/python jobs/analysis.py --results s3://bucket/stats --copy-to results/stats   # copied, then read

The executed notebooks (with their outputs) are written to <results>/notebooks/ (a URI's: under --copy-to).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's speed, not an installed one

import nbformat

from speed.analysis.notebooks import notebook_paths, run_notebooks
from speed.analysis.results import discover, local_results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", required=True, help="a folder of result files (searched recursively), or its URI")
    p.add_argument("--copy-to", type=Path, default=None, help="where a URI's files go (default: results/<name>)")
    args = p.parse_args(argv)
    name = args.results.rstrip("/").rsplit("/", 1)[-1]
    args.results = local_results(args.results, args.copy_to or Path("results") / name)
    found = discover(args.results)
    print(
        f"{args.results}: {len(found.evaluations)} evaluation(s), {len(found.bench)} benchmark file(s), "
        f"{len(found.load)} load file(s), {len(found.requests)} request-statistics file(s), "
        f"{len(found.sweeps)} sweep(s), {len(found.families)} family comparison(s), "
        f"{len(found.budgets)} budget curve(s), {len(found.payoff)} payoff map(s)"
    )
    started = time.time()
    executed = run_notebooks(args.results)
    out = args.results / "notebooks"
    out.mkdir(exist_ok=True)
    for path, notebook in zip(notebook_paths(), executed):
        nbformat.write(notebook, out / path.name)
    for figure in sorted(f for f in args.results.rglob("*.png") if f.stat().st_mtime >= started):
        print(f"figure: {figure}")
    print(f"executed notebooks: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
