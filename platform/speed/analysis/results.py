"""Find and load result files under a folder, by what they hold rather than by their names.

A results folder may hold evaluation folders (``summary.json`` beside
``trace.parquet`` and ``predictions.parquet``), decode benchmark Parquet
(``speed.benchmarks.decode.BENCH_SCHEMA``), load-generator Parquet
(``speed.serve.schemas.LOADGEN_SCHEMA``), the Serve application's statistics
(``REQUEST_SCHEMA`` rows), sweep folders (``results.parquet``,
``speed.sweep.results.RESULTS_SCHEMA``) and family comparisons (``families.parquet``,
``speed.train.families.FAMILIES_SCHEMA``) and budget curves (``budget.parquet``,
``speed.eval.budget.BUDGET_SCHEMA``) and payoff maps (``speed.benchmarks.payoff.PAYOFF_SCHEMA``), in any layout.
A folder on object storage is copied here first (``local_results``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from speed.benchmarks.decode import BENCH_SCHEMA
from speed.config import SharingPattern
from speed.eval.evaluate import PREDICTIONS_FILE, SUMMARY_FILE, TRACE_FILE
from speed.serve.schemas import LOADGEN_SCHEMA, REQUEST_SCHEMA
from speed.storage import locate
from speed.sweep.results import RESULTS_FILE, RESULTS_SCHEMA
from speed.train.families import FAMILIES_FILE, FAMILIES_SCHEMA

# A file is of a kind when it holds every column of that kind's schema (the writers' own schemas).
LOAD_COLUMNS = frozenset(LOADGEN_SCHEMA.names)
REQUEST_COLUMNS = frozenset(REQUEST_SCHEMA.names)
SWEEP_COLUMNS = frozenset(RESULTS_SCHEMA.names)


@dataclass(frozen=True)
class Evaluation:
    """One evaluation folder: its summary and its per-example and per-token tables."""

    path: Path
    summary: dict[str, Any]
    predictions: pa.Table  # speed.eval.evaluate.PREDICTIONS_SCHEMA
    trace: pa.Table  # speed.eval.evaluate.EVAL_TRACE_SCHEMA

    @property
    def pattern(self) -> str:
        return self.summary["model"]["pattern"]

    @property
    def loops(self) -> int:
        return SharingPattern.parse(self.pattern).n_loops


@dataclass(frozen=True)
class Results:
    """The result files found under one folder, grouped by kind (paths sorted)."""

    root: Path
    evaluations: list[Path] = field(default_factory=list)  # folders
    bench: list[Path] = field(default_factory=list)  # BENCH_SCHEMA files
    load: list[Path] = field(default_factory=list)  # load-generator files
    requests: list[Path] = field(default_factory=list)  # Serve request-statistics files
    sweeps: list[Path] = field(default_factory=list)  # sweep folders (results.parquet and its companions)
    families: list[Path] = field(default_factory=list)  # family comparisons (families.parquet and its evaluations)
    budgets: list[Path] = field(default_factory=list)  # budget curves (budget.parquet and its evaluations)
    payoff: list[Path] = field(default_factory=list)  # payoff maps (PAYOFF_SCHEMA files)


def load_evaluation(path: str | Path) -> Evaluation:
    """Read the three files ``jobs/evaluate.py`` wrote into ``path``."""
    path = Path(path)
    summary = json.loads((path / SUMMARY_FILE).read_text())
    return Evaluation(path, summary, pq.read_table(path / PREDICTIONS_FILE), pq.read_table(path / TRACE_FILE))


def local_results(where: str | Path, copy_to: str | Path) -> Path:
    """A results folder on this machine: ``where`` itself when local, else its files (a URI: Serve statistics on
    ``s3://``, a sweep's folder, ...) copied into ``copy_to``, which the notebooks then read and draw beside."""
    source = locate(where)
    if source.local:
        return Path(source.path)
    if not source.is_dir():
        raise FileNotFoundError(f"results folder {source.uri} does not exist")
    local = Path(copy_to)
    local.mkdir(parents=True, exist_ok=True)
    source.download(local)
    return local


def discover(root: str | Path) -> Results:
    """Every evaluation folder, benchmark, load and request Parquet file, sweep folder, family comparison,
    budget curve and payoff map under ``root``."""
    from speed.analysis.payoff import PAYOFF_COLUMNS
    from speed.eval.budget import BUDGET_FILE, BUDGET_SCHEMA

    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"results folder {root} does not exist")
    evaluations = sorted(p.parent for p in root.rglob(SUMMARY_FILE) if (p.parent / TRACE_FILE).is_file())
    kinds: dict[str, list[Path]] = {
        name: [] for name in ("bench", "load", "requests", "sweeps", "families", "budgets", "payoff")
    }
    for path in sorted(root.rglob("*.parquet")):
        names = set(pq.read_schema(path).names)
        if path.name == RESULTS_FILE and SWEEP_COLUMNS <= names:
            kinds["sweeps"].append(path.parent)
        elif path.name == FAMILIES_FILE and set(FAMILIES_SCHEMA.names) <= names:
            kinds["families"].append(path.parent)
        elif path.name == BUDGET_FILE and set(BUDGET_SCHEMA.names) <= names:
            kinds["budgets"].append(path.parent)
        elif set(BENCH_SCHEMA.names) <= names:
            kinds["bench"].append(path)
        elif LOAD_COLUMNS <= names:
            kinds["load"].append(path)
        elif REQUEST_COLUMNS <= names:
            kinds["requests"].append(path)
        elif PAYOFF_COLUMNS <= names:
            kinds["payoff"].append(path)
    return Results(root, evaluations, **kinds)


def read_tables(paths: list[Path], source_column: str = "file") -> pa.Table:
    """The rows of several Parquet files, with a column naming the file each row came from."""
    if not paths:
        raise ValueError("no files to read")
    tables = []
    for path in paths:
        table = pq.read_table(path)
        tables.append(table.append_column(source_column, pa.array([str(path)] * table.num_rows, pa.string())))
    return pa.concat_tables(tables, promote_options="permissive")
