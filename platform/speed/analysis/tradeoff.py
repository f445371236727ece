"""Accuracy against per-token latency (the paper's Figure 3): evaluations joined with benchmark rows.

Every evaluation contributes its score and the decode time it measured itself
(SPEED, and sequential decoding when it ran with ``check_sequential``). Rows are
joined by the model's identity (``model_identity``: its resolved config), never
by the pattern's name alone: a benchmark row (``BENCH_SCHEMA``, random weights
at batch 1) is paired with the score of each evaluation of the same model, and
only for a decoding whose cost does not depend on the weights (sequential,
oracle SPEED): a random model's own SPEED flushes at nearly every token, which
says nothing of a trained one's. ``benchmark_latency`` lists every benchmark row
on its own, for a figure apart from the trained checkpoints. ``Nx1`` patterns are
the baselines: "shallow" when N is the unique-layer count of a shared pattern
present, "deep" when N is its full depth.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pyarrow as pa

from speed.config import SharingPattern, to_dict
from speed.eval.metrics import ROUGE_TYPES
from speed.models.family import DEFAULT_FAMILY, config_of_any_family, family_of

TRADEOFF_SCHEMA = pa.schema(
    [
        pa.field("pattern", pa.string()),
        pa.field("model", pa.string()),  # model_identity of the evaluated model
        pa.field("label", pa.string()),  # model_label: the pattern and what tells models of that pattern apart
        pa.field("role", pa.string()),  # shared | shallow | deep | baseline (an Nx1 matching no shared pattern)
        pa.field("method", pa.string()),  # speed | sequential | speed_oracle
        pa.field("timing", pa.string()),  # evaluation | benchmark
        pa.field("metric", pa.string()),
        pa.field("score", pa.float64()),
        pa.field("ms_per_token", pa.float64()),
        pa.field("source", pa.string()),  # the evaluation folder the score came from
    ]
)
BENCH_LATENCY_SCHEMA = pa.schema(
    [
        pa.field("model", pa.string()),  # model_identity of the timed (random-weight) model
        pa.field("label", pa.string()),
        pa.field("pattern", pa.string()),
        pa.field("variant", pa.string()),
        pa.field("method", pa.string()),
        pa.field("ms_per_token", pa.float64()),
    ]
)
# Benchmark variants and the decoding method each one times.
BENCH_METHODS = {
    "sequential": "sequential",
    "speed": "speed",
    "speed_oracle": "speed_oracle",
    "speed_exits": "speed",  # SPEED with fresh exit adapters (speed.models.exits): plain SPEED's schedule, their cost
    "shallow": "sequential",
    "ours_deep": "sequential",
}
# Those whose time per token does not depend on the weights: random weights time them as a trained model's.
WEIGHT_FREE = ("sequential", "speed_oracle", "shallow", "ours_deep")
# Fields that leave a model the same at inference (dropout is off when decoding).
_TRAINING_ONLY = ("dropout",)


def model_identity(config: dict[str, Any]) -> str:
    """A short hash of a resolved model config of either family (a summary's ``model``, a benchmark row's
    ``model`` JSON).

    Equal identities: the same family, architecture, sizes and vocabulary, what a decode's time per token
    depends on (not the weights). A pattern name alone is shared by models of any dimensions and vocabulary.
    """
    parsed = config_of_any_family(config)
    resolved = to_dict(parsed)  # defaults filled in, types coerced
    for name in _TRAINING_ONLY:
        resolved.pop(name, None)
    if family_of(parsed).name != DEFAULT_FAMILY:
        resolved["family"] = family_of(parsed).name  # T5 identities stay as they were before the LM
    return hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()[:12]


def model_label(config: dict[str, Any]) -> str:
    """``<pattern> d<d_model> v<vocab> #<identity>``: readable, and distinct for distinct models."""
    c = config_of_any_family(config)
    return f"{c.pattern} d{c.d_model} v{c.vocab_size} #{model_identity(config)[:6]}"


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

    ``summaries``: (source, summary.json contents) pairs; ``bench``: ``BENCH_SCHEMA`` rows or None. A
    benchmark row joins an evaluation of the same ``model_identity``, for the ``WEIGHT_FREE`` variants only.
    """
    patterns = {s["model"]["pattern"] for _, s in summaries}
    shared = [p for p in map(SharingPattern.parse, patterns) if p.n_loops > 1]
    timed_by_model: dict[str, list[dict[str, Any]]] = {}
    for row in bench.to_pylist() if bench is not None else []:
        if row["variant"] in WEIGHT_FREE:
            timed_by_model.setdefault(model_identity(json.loads(row["model"])), []).append(row)
    rows = []
    for source, summary in summaries:
        pattern = summary["model"]["pattern"]
        identity = model_identity(summary["model"])
        name, score = score_of(summary, metric)
        base = {"pattern": pattern, "model": identity, "label": model_label(summary["model"])}
        base |= {"role": role_of(pattern, shared), "metric": name, "score": score, "source": source}
        decode = summary["decode"]
        timed = {method: decode[method] for method in ("speed", "sequential") if method in decode}
        if SharingPattern.parse(pattern).n_loops == 1:  # one loop: the pipeline is sequential decoding
            timed = {"sequential": timed.get("sequential", timed["speed"])}
        for method, stats in timed.items():
            ms = 1000.0 * stats["seconds"] / stats["tokens"] if stats["tokens"] else None
            rows.append({**base, "method": method, "timing": "evaluation", "ms_per_token": ms})
        for row in timed_by_model.get(identity, []):
            method = BENCH_METHODS[row["variant"]]
            rows.append({**base, "method": method, "timing": "benchmark", "ms_per_token": row["ms_per_token"]})
    return pa.Table.from_pylist(rows, schema=TRADEOFF_SCHEMA)


def benchmark_latency(bench: pa.Table | None) -> pa.Table:
    """Every benchmark row (random weights) with its model's identity and label, ``BENCH_LATENCY_SCHEMA``:
    the decode benchmark's own figure, apart from the trained checkpoints' scores."""
    rows = []
    for row in bench.to_pylist() if bench is not None else []:
        if row["variant"] in BENCH_METHODS:
            config = json.loads(row["model"])
            rows.append(
                {"model": model_identity(config), "label": model_label(config), "pattern": row["pattern"]}
                | {
                    "variant": row["variant"],
                    "method": BENCH_METHODS[row["variant"]],
                    "ms_per_token": row["ms_per_token"],
                }
            )
    return pa.Table.from_pylist(rows, schema=BENCH_LATENCY_SCHEMA)
