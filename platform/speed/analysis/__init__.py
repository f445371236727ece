"""Reading result files for the analysis notebooks: discovery, loading, joins and statistics.

The notebooks in ``analysis/`` call these functions and draw; every number they
show is computed here from Parquet/JSON written by ``jobs/evaluate.py``,
``jobs/bench_decode.py``, ``jobs/sweep.py``, ``jobs/compare_families.py``, ``jobs/budget_curve.py``,
``jobs/bench_payoff.py`` and the Serve
application and its load generator.
"""

from speed.analysis.budget import budget_loops, format_budget, load_budget
from speed.analysis.families import Families, latency_plane, load_families, loop_table, quality_difference
from speed.analysis.flips import flip_rates, flip_rates_by_position
from speed.analysis.payoff import load_payoff, payoff_curves, payoff_traces
from speed.analysis.results import Evaluation, Results, discover, load_evaluation
from speed.analysis.serving import acceptance, acceptance_by_position, load_summary, rows_per_step
from speed.analysis.sweep import Sweep, launch_costs, load_sweep, loop_flips, trials
from speed.analysis.tradeoff import benchmark_latency, model_identity, tradeoff

__all__ = [
    "acceptance",
    "acceptance_by_position",
    "Evaluation",
    "Families",
    "Results",
    "Sweep",
    "benchmark_latency",
    "budget_loops",
    "discover",
    "flip_rates",
    "format_budget",
    "flip_rates_by_position",
    "latency_plane",
    "launch_costs",
    "load_budget",
    "load_evaluation",
    "load_families",
    "load_payoff",
    "load_summary",
    "load_sweep",
    "loop_flips",
    "loop_table",
    "model_identity",
    "payoff_curves",
    "payoff_traces",
    "quality_difference",
    "rows_per_step",
    "tradeoff",
    "trials",
]
