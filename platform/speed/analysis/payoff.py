"""The payoff map: SPEED's speed-up at a real shape against its early exits' agreement (``jobs/bench_payoff.py``,
``jobs/predict_payoff.py``; ``speed.benchmarks.payoff.PAYOFF_SCHEMA``). ``load_payoff`` reads every map found;
``payoff_curves`` keeps the loop-1-agreement cells in the order a curve draws them, ``payoff_traces`` the replayed
traces' cells."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from speed.benchmarks.payoff import PAYOFF_SCHEMA

PAYOFF_COLUMNS = frozenset(PAYOFF_SCHEMA.names)
AGREEMENT_PREFIX = "agree="  # a loop-1 agreement's pattern name (the others are traces)


def load_payoff(paths: list[Path]) -> pa.Table:
    """Every payoff map's rows (``PAYOFF_SCHEMA``) of ``paths``, together."""
    if not paths:
        return PAYOFF_SCHEMA.empty_table()
    return pa.concat_tables([pq.read_table(path, schema=PAYOFF_SCHEMA) for path in paths])


def _agreements(table: pa.Table) -> pa.Array:
    return pc.starts_with(table["pattern"], AGREEMENT_PREFIX)


def payoff_curves(table: pa.Table) -> pa.Table:
    """The loop-1-agreement cells, by (shape, dtype, batch, cost model) and then agreement: one curve each."""
    curves = table.filter(_agreements(table))
    order = [(k, "ascending") for k in ("shape", "dtype", "batch", "cost_model", "loop1_agreement")]
    return curves.sort_by(order)


def payoff_traces(table: pa.Table) -> pa.Table:
    """The replayed traces' cells (every pattern that is not a loop-1 agreement), by trace, dtype and batch."""
    traces = table.filter(pc.invert(_agreements(table)))
    return traces.sort_by([(k, "ascending") for k in ("pattern", "shape", "dtype", "batch", "cost_model")])
