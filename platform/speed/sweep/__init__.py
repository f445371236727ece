"""Ray Tune sweeps over sharing patterns, loss-weight schemes and settle terms, and the trade-off they answer.

``run_sweep(SweepConfig(...), job)`` trains one Ray Train job per trial, measures
each finished trial's accuracy, flip rates and SPEED cost on the validation split,
and writes ``results.parquet`` / ``frontier.parquet`` / ``latency.parquet``
(schemas in ``speed.sweep.results``).
"""

from speed.sweep.results import FRONTIER_SCHEMA, LATENCY_SCHEMA, RESULTS_SCHEMA, frontier, pareto_front
from speed.sweep.space import SweepConfig, expand_patterns

__all__ = [
    "FRONTIER_SCHEMA",
    "LATENCY_SCHEMA",
    "RESULTS_SCHEMA",
    "SweepConfig",
    "SweepOutcome",
    "expand_patterns",
    "frontier",
    "pareto_front",
    "run_sweep",
]


def __getattr__(name: str):
    # run_sweep needs Ray Tune: imported on first use, so that reading a sweep's tables (speed.analysis) does not
    if name in ("SweepOutcome", "run_sweep"):
        from speed.sweep import run

        return getattr(run, name)
    raise AttributeError(f"module 'speed.sweep' has no attribute {name!r}")
