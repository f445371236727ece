"""Find and load result files under a folder, by what they hold rather than by their names.

A results folder may hold evaluation folders (``summary.json`` beside
``trace.parquet`` and ``predictions.parquet``), decode benchmark Parquet
(``speed.bench.BENCH_SCHEMA``), load-generator Parquet and the Serve
application's statistics (request rows), in any layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from speed.bench import BENCH_SCHEMA
from speed.config import SharingPattern
from speed.evaluate import PREDICTIONS_FILE, SUMMARY_FILE, TRACE_FILE

# The columns the serving analysis reads: the load generator's per-request rows and the replicas'
# per-request statistics (speed.serve.stats LOADGEN_SCHEMA and REQUEST_SCHEMA hold at least these).
LOAD_COLUMNS = frozenset({"run", "status", "start_s", "scheduled_s", "latency_ms", "ttft_ms", "completion_tokens"})
REQUEST_COLUMNS = frozenset({"request_id", "replica", "method", "arrived", "total_ms", "steps", "rows", "flushes"})


@dataclass(frozen=True)
class Evaluation:
    """One evaluation folder: its summary and its per-example and per-token tables."""

    path: Path
    summary: dict[str, Any]
    predictions: pa.Table  # speed.evaluate.PREDICTIONS_SCHEMA
    trace: pa.Table  # speed.evaluate.EVAL_TRACE_SCHEMA

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


def load_evaluation(path: str | Path) -> Evaluation:
    """Read the three files ``jobs/evaluate.py`` wrote into ``path``."""
    path = Path(path)
    summary = json.loads((path / SUMMARY_FILE).read_text())
    return Evaluation(path, summary, pq.read_table(path / PREDICTIONS_FILE), pq.read_table(path / TRACE_FILE))


def discover(root: str | Path) -> Results:
    """Every evaluation folder and benchmark, load and request Parquet file under ``root``."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"results folder {root} does not exist")
    evaluations = sorted(p.parent for p in root.rglob(SUMMARY_FILE) if (p.parent / TRACE_FILE).is_file())
    kinds: dict[str, list[Path]] = {"bench": [], "load": [], "requests": []}
    for path in sorted(root.rglob("*.parquet")):
        names = set(pq.read_schema(path).names)
        if set(BENCH_SCHEMA.names) <= names:
            kinds["bench"].append(path)
        elif LOAD_COLUMNS <= names:
            kinds["load"].append(path)
        elif REQUEST_COLUMNS <= names:
            kinds["requests"].append(path)
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
