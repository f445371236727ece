"""Accuracy against per-token latency (the paper's Figure 3): evaluations joined with benchmark rows.

Every evaluation contributes its score and the decode time it measured itself
(SPEED, and sequential decoding when it ran with ``check_sequential``). A
benchmark row (``BENCH_SCHEMA``, random weights at batch 1) contributes its
median time for a pattern, paired with the score of each evaluation of that
pattern. ``Nx1`` patterns are the baselines: "shallow" when N is the unique-layer
count of a shared pattern present, "deep" when N is its full depth.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from speed.config import SharingPattern
from speed.metrics import ROUGE_TYPES

TRADEOFF_SCHEMA = pa.schema(
    [
        pa.field("pattern", pa.string()),
        pa.field("role", pa.string()),  # shared | shallow | deep | baseline (an Nx1 matching no shared pattern)
        pa.field("method", pa.string()),  # speed | sequential | speed_oracle
        pa.field("timing", pa.string()),  # evaluation | benchmark
        pa.field("metric", pa.string()),
        pa.field("score", pa.float64()),
        pa.field("ms_per_token", pa.float64()),
        pa.field("source", pa.string()),  # the evaluation folder the score came from
    ]
)
# Benchmark variants with a pattern of their own, and the decoding method each one times.
BENCH_METHODS = {
    "sequential": "sequential",
    "speed": "speed",
    "speed_oracle": "speed_oracle",
    "shallow": "sequential",
    "ours_deep": "sequential",
}


def score_of(summary: dict[str, Any], metric: str | None = None) -> tuple[str, float]:
    """(metric name, score) of an evaluation summary: ``metric`` or the task's first one (ROUGE: its first type)."""
    name = metric or next(iter(summary["metrics"]))
    result = summary["metrics"][name]
    if "score" in result:
        return name, result["score"]
    rouge = next(t for t in ROUGE_TYPES if t in result)
    return f"{name}/{rouge}", result[rouge]


def role_of(pattern: str, shared: list[SharingPattern]) -> str:
    """Where a pattern sits in the figure: a shared NxM, or which Nx1 baseline it is to the shared ones."""
    p = SharingPattern.parse(pattern)
    if p.n_loops > 1:
        return "shared"
    if any(p.depth == s.n_unique for s in shared):
        return "shallow"
    if any(p.depth == s.depth for s in shared):
        return "deep"
    return "baseline"


def tradeoff(
    summaries: list[tuple[str, dict[str, Any]]], bench: pa.Table | None, metric: str | None = None
) -> pa.Table:
    """One row per (evaluation, decoding method, timing source) under ``TRADEOFF_SCHEMA``.

    ``summaries``: (source, summary.json contents) pairs; ``bench``: ``BENCH_SCHEMA`` rows or None.
    """
    patterns = {s["model"]["pattern"] for _, s in summaries}
    if bench is not None:
        patterns |= set(bench.column("pattern").to_pylist())
    shared = [p for p in map(SharingPattern.parse, patterns) if p.n_loops > 1]
    rows = []
    for source, summary in summaries:
        pattern = summary["model"]["pattern"]
        name, score = score_of(summary, metric)
        base = {"pattern": pattern, "role": role_of(pattern, shared), "metric": name, "score": score, "source": source}
        decode = summary["decode"]
        timed = {method: decode[method] for method in ("speed", "sequential") if method in decode}
        if SharingPattern.parse(pattern).n_loops == 1:  # one loop: the pipeline is sequential decoding
            timed = {"sequential": timed.get("sequential", timed["speed"])}
        for method, stats in timed.items():
            ms = 1000.0 * stats["seconds"] / stats["tokens"] if stats["tokens"] else None
            rows.append({**base, "method": method, "timing": "evaluation", "ms_per_token": ms})
        for row in bench.to_pylist() if bench is not None else []:
            if row["pattern"] == pattern and row["variant"] in BENCH_METHODS:
                method = BENCH_METHODS[row["variant"]]
                rows.append({**base, "method": method, "timing": "benchmark", "ms_per_token": row["ms_per_token"]})
    return pa.Table.from_pylist(rows, schema=TRADEOFF_SCHEMA)
