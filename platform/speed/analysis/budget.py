"""The budget curve: quality and SPEED's cost against training steps, per run.

``jobs/budget_curve.py`` evaluates a run's checkpoints and writes ``budget.parquet``
(``speed.eval.budget.BUDGET_SCHEMA``, one row per budget). ``load_budget`` reads one; ``loop_flips`` lays its flip
rates out one row per (budget, loop), which the budget notebook draws beside the rows themselves; ``format_budget``
prints them.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from speed.eval.budget import BUDGET_FILE, BUDGET_SCHEMA


def load_budget(path: str | Path) -> pa.Table:
    """``budget.parquet`` in the folder ``path``, by step (``BUDGET_SCHEMA``)."""
    file = Path(path) / BUDGET_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path} holds no {BUDGET_FILE}: not a budget curve")
    return pq.read_table(file, schema=BUDGET_SCHEMA).sort_by("step")


BUDGET_LOOPS_SCHEMA = pa.schema(
    [
        pa.field("family", pa.string()),
        pa.field("task", pa.string()),
        pa.field("step", pa.int64()),
        pa.field("loop", pa.int32()),  # 1..M
        pa.field("flip_rate_prev", pa.float64()),
        pa.field("flip_rate_final", pa.float64()),
    ]
)


def budget_loops(table: pa.Table) -> pa.Table:
    """One row per (budget, loop) of a ``BUDGET_SCHEMA`` table: the decoded tokens' flip rates."""
    rows = [
        {
            "family": r["family"],
            "task": r["task"],
            "step": r["step"],
            "loop": i + 1,
            "flip_rate_prev": prev,
            "flip_rate_final": final,
        }
        for r in table.to_pylist()
        for i, (prev, final) in enumerate(zip(r["flip_rate_prev"], r["flip_rate_final"]))
    ]
    return pa.Table.from_pylist(rows, schema=BUDGET_LOOPS_SCHEMA)


def format_budget(table: pa.Table) -> str:
    """The rows as a fixed-width text table (what docs/training.md shows)."""
    head = (
        f"{'step':>7}{'tokens':>10}{'metric':>8}{'score':>7}{'95% interval':>16}{'vs previous':>24}"
        f"{'steps/tok':>10}{'oracle':>8}  flip rate per loop"
    )
    lines = [head, "-" * (len(head) + 20)]
    for r in table.to_pylist():
        tokens = "-" if r["train_tokens"] is None else str(r["train_tokens"])
        interval = "-" if r["score_low"] is None else f"[{r['score_low']:.2f}, {r['score_high']:.2f}]"
        delta = "-" if r["delta"] is None else f"{r['delta']:+.2f} [{r['delta_low']:+.2f}, {r['delta_high']:+.2f}]"
        oracle = "-" if r["oracle_steps_per_token"] is None else f"{r['oracle_steps_per_token']:.3f}"
        flips = " ".join(f"{x:.3f}" for x in r["flip_rate_final"])
        lines.append(
            f"{r['step']:>7}{tokens:>10}{r['metric']:>8}{r['score']:>7.2f}{interval:>16}{delta:>24}"
            f"{r['steps_per_token']:>10.3f}{oracle:>8}  {flips}"
        )
    return "\n".join(lines)
