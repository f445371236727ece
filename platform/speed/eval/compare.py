"""Two evaluations of the same examples side by side: accuracy differences with paired-bootstrap intervals.

``compare_evaluations(baseline, system)`` reads two folders (local paths or URIs) ``jobs/evaluate.py``
wrote (``predictions.parquet``, ``summary.json``) over the same examples and
references, and returns, for BLEU and ROUGE-L, the system's score minus the
baseline's with a 95% paired-bootstrap interval (``speed.eval.metrics.paired_bootstrap``:
the same resampled examples for both systems and both metrics), plus each side's
SPEED cost: pipeline steps per token and the flip cost of its decoded tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from speed.eval.evaluate import PREDICTIONS_FILE, SUMMARY_FILE
from speed.eval.metrics import paired_bootstrap
from speed.losses import flip_cost
from speed.storage import Location, locate


def decode_cost(summary: dict[str, Any]) -> dict[str, float]:
    """An evaluation summary's SPEED cost: steps per token, its flip cost, and the flip rate per loop."""
    speed = summary["decode"]["speed"]
    flips = sorted(summary["flip_rates"], key=lambda r: r["loop"])
    prev = [r["flip_rate_prev"] for r in flips]
    return {
        "steps_per_token": speed["steps"] / speed["tokens"],
        "flip_cost": flip_cost(prev),
        "flip_rate_prev": prev,
        "tokens": speed["tokens"],
    }


def compare_evaluations(
    baseline: str | Path, system: str | Path, samples: int = 1000, seed: int = 12345
) -> dict[str, Any]:
    """``system`` against ``baseline`` (two evaluation folders of the same examples); see the module docstring."""
    folders = [locate(d) for d in (baseline, system)]
    tables = [_read_table(f / PREDICTIONS_FILE).sort_by("example").to_pydict() for f in folders]
    for column in ("source", "reference"):
        if tables[0][column] != tables[1][column]:
            raise ValueError(f"{baseline} and {system} did not evaluate the same examples (their {column}s differ)")
    summaries = [json.loads((f / SUMMARY_FILE).read_text()) for f in folders]
    refs = tables[0]["reference"]
    return {
        "baseline": str(baseline),
        "system": str(system),
        "examples": len(refs),
        "accuracy": paired_bootstrap(tables[0]["hypothesis"], tables[1]["hypothesis"], refs, samples, seed),
        "cost": {"baseline": decode_cost(summaries[0]), "system": decode_cost(summaries[1])},
    }


def _read_table(file: Location) -> pa.Table:
    return pq.read_table(file.path, filesystem=file.fs)


def format_comparison(c: dict[str, Any]) -> str:
    """A few lines: each metric's difference with its interval, and each side's steps per token and flip cost."""
    lines = [f"{c['system']} vs {c['baseline']} on {c['examples']} examples (paired bootstrap, 95%)"]
    for name, r in c["accuracy"].items():
        lines.append(
            f"  {name}: {r['system']:.2f} vs {r['baseline']:.2f}: {r['delta']:+.2f} [{r['low']:+.2f}, {r['high']:+.2f}]"
        )
    for side in ("baseline", "system"):
        cost = c["cost"][side]
        lines.append(
            f"  {side}: {cost['steps_per_token']:.3f} steps/token, flip cost {cost['flip_cost']:.3f} "
            f"({cost['tokens']} tokens)"
        )
    return "\n".join(lines)
